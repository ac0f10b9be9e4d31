"""What a rank of a real run holds, to check the planner against: a callback that, after
the first step, writes this rank's parameter, gradient, optimizer state and
saved-activation bytes to ``memory-rank<R>.json`` in the run directory.

Example:
    >>> # gpufleet.fit(model, data, overrides={"dist.nproc": 8, ...},
    >>> #              callbacks=[MemoryParts((inputs, targets))])
"""

from __future__ import annotations

import json
from typing import Any

import torch

from gpufleet.core.callbacks import Callback


def local_bytes(tensors: Any) -> int:
    """Bytes of this rank's pieces of ``tensors`` (a DTensor counts its local shard)."""
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.ndim > 0:
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


def saved_activation_bytes(model: torch.nn.Module, inputs: tuple, targets: Any) -> int:
    """Bytes of the tensors autograd saves in one forward of ``model`` (storages counted
    once; parameters are not activations), with the loss from ``targets``."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        # Weights saved for backward are not activations: the module's parameters as
        # registered now (FSDP registers the gathered ones during forward).
        if storage.data_ptr() not in {_storage(p) for p in model.parameters()}:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*inputs, targets)
    loss.backward()  # every rank's collectives in step; leaves the gradients to measure
    return sum(saved.values())


def _storage(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.untyped_storage().data_ptr()


class MemoryParts(Callback):
    """After step 1 (the optimizer state exists), on every rank: one more forward and
    backward of ``batch`` measures the activations and the gradients."""

    def __init__(self, batch: tuple) -> None:
        self.batch = batch

    def on_step_end(self, view: Any, step: int) -> None:
        if step != 1:
            return
        model, optimizer = view.model, view.optimizer
        params = [p for p in model.parameters()]
        parts = {
            "params": local_bytes(params),
            "optimizer": local_bytes(v for state in optimizer.state.values()
                                     for v in state.values()),
        }
        x, y = (t.to(view.device) for t in self.batch)
        parts["activations"] = saved_activation_bytes(model, (x,), y)
        # The loop set the gradients to None after its step; this backward made them.
        parts["grads"] = local_bytes(p.grad for p in params if p.grad is not None)
        model.zero_grad(set_to_none=True)
        (view.run_dir / f"memory-rank{view.env.rank}.json").write_text(json.dumps(parts))
