"""Tensor parallelism: each layer's matrices split over the ``tp`` ranks of the mesh.

The built-in GPT (:mod:`gpufleet.models.gpt`) splits the Megatron way: in attention,
the fused q/k/v projection by output columns so that every rank holds whole heads
(``n_head / tp`` of them), the output projection by input rows; in the MLP, the first
projection by columns and the second by rows. Each block then does one all-reduce in
forward (after each row-wise projection) and one in backward. Embeddings, layer norms
and the head stay whole on every rank.

Any other model says how to split itself with a method::

    class MyModel(nn.Module):
        def tp_plan(self, tp_mesh):
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
            return {"mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}

It returns a ``parallelize_module`` plan (module name -> style), or None when it has
applied the split itself. The split must leave the model's output whole on every rank.

Example:
    >>> # gpufleet train --nproc 2 --strategy fsdp --parallel.tp 2
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from gpufleet.errors import ConfigError

log = logging.getLogger(__name__)


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any) -> None:
    """Split ``model``'s layers over ``tp_mesh`` in place: the model's own
    ``tp_plan(tp_mesh)`` when it has one, else the built-in GPT's plan.

    Raises:
        ConfigError: a model with neither, or heads that do not divide by ``tp``.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    own = getattr(model, "tp_plan", None)
    if callable(own):
        plan = own(tp_mesh)
        if plan:
            parallelize_module(model, tp_mesh, plan)
        log.info("tensor parallel: the model's own tp_plan over %d rank(s)", tp)
        return
    from gpufleet.models.gpt import MLP, CausalSelfAttention

    attention = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    if not attention:
        raise ConfigError(
            f"parallel.tp = {tp}: {type(model).__name__} has no built-in tensor parallel "
            "plan (only gpufleet's GPT does). Give the model a method tp_plan(self, "
            "tp_mesh) returning {module name: ColwiseParallel() / RowwiseParallel()}, "
            "or set parallel.tp = 1.")
    if attention[0].n_head % tp:
        raise ConfigError(
            f"parallel.tp = {tp} does not divide the model's {attention[0].n_head} "
            "attention heads: each tensor parallel rank holds whole heads. Pick a tp "
            "that divides n_head.")
    col, row = _styles()
    for module in attention:
        parallelize_module(module, tp_mesh, {"c_attn": _head_columns(), "c_proj": row()})
    for mlp in (m for m in model.modules() if isinstance(m, MLP)):
        parallelize_module(mlp, tp_mesh, {"c_fc": col(), "c_proj": row()})
    log.info("tensor parallel: %d attention block(s) split by heads over %d rank(s)",
             len(attention), tp)


def _styles() -> tuple[type, type]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return ColwiseParallel, RowwiseParallel


def _head_columns() -> Any:
    """Column split of a fused q/k/v projection that keeps whole heads on each rank.

    A plain column split of the ``[q; k; v]`` rows would give the first rank all of q
    and half of k. Sharding each of the three thirds separately (a strided shard with
    split factor 3) gives every rank ``[q_i; k_i; v_i]`` for its heads, and the
    output keeps that layout, so attention runs on the local heads.
    """
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.placement_types import _StridedShard

    class HeadColumns(ColwiseParallel):
        @staticmethod
        def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module,
                               outputs: Any, device_mesh: Any) -> Any:
            # Kept strided, not redistributed: the three local thirds side by side.
            return outputs.to_local() if use_local_output else outputs

        def _partition_linear_fn(self, name: str, module: nn.Module, mesh: Any) -> None:
            for pname, param in list(module.named_parameters()):
                sharded = distribute_tensor(param, mesh, [_StridedShard(0, split_factor=3)])
                module.register_parameter(
                    pname, nn.Parameter(sharded, requires_grad=param.requires_grad))

    return HeadColumns()


def without_strided(tree: Any) -> Any:
    """``tree`` (a state dict) with every head-split DTensor made whole over its tensor
    parallel ranks: ``torch.distributed.checkpoint`` cannot describe strided shards.
    The other shardings (FSDP's) stay, so each rank still writes only its part."""
    from gpufleet.core.tree import map_tensors

    return map_tensors(tree, _unstrided)


def restore_strided(loaded: Any, like: Any) -> Any:
    """``loaded`` (from :func:`without_strided` of ``like``, then filled by a load) back
    in ``like``'s shardings."""
    if isinstance(loaded, dict):
        return {k: restore_strided(v, like[k]) for k, v in loaded.items()}
    if _strided(like):
        return loaded.redistribute(placements=like.placements)
    return loaded


def _strided(t: Any) -> bool:
    return any(type(p).__name__ == "_StridedShard" for p in getattr(t, "placements", ()))


def _unstrided(t: Any) -> Any:
    if not _strided(t):
        return t
    from torch.distributed.tensor import Replicate

    with torch.no_grad():
        return t.redistribute(placements=[Replicate() if type(p).__name__ == "_StridedShard"
                                          else p for p in t.placements])
