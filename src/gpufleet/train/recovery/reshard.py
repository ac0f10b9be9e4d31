"""Sharded training state (fsdp, hsdp) put together again at another world size, in
memory, for in-process recovery (:mod:`gpufleet.train.recovery.recovery`).

Under fsdp each rank holds only its shard of every parameter and of the optimizer state,
so the ranks left after a lost node cannot simply keep their modules: the shards were
cut for the old world size, and the module is bound to the old process group. Instead,
for each model:

- at build time a **skeleton** is kept: the model as the user gave it, before any
  wrapping, with every parameter on the ``meta`` device (no memory; buffers are small
  and kept as they are, since some are not in the state dict);
- the snapshots already hold each rank's shards, and each rank's partner holds a second
  copy on another node (:mod:`gpufleet.fault.snapshot`);
- after a loss, every rank gets the shards of every position of the old mesh's shard
  dimension (from whichever rank left holds them, over the new process group),
  :func:`assemble` joins them into whole tensors, a fresh module made from the skeleton
  is parallelized over the new mesh with a new optimizer (:class:`Source`), and the
  whole state is loaded into it the way a checkpoint of another world size is.

FSDP2 cuts a tensor along dim 0 in ``torch.chunk`` pieces, one per position of the
shard dimension, in position order (the last pieces may be short or empty), so the
pieces joined in that order are the tensor. Every rank holds the whole state for a
moment while it loads: host memory of the model and optimizer state, once.
"""

from __future__ import annotations

import copy
import io
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpufleet.core.tree import map_tensors
from gpufleet.fault.host_state import PIECE
from gpufleet.parallel.base import OptimizerSpec, Strategy

log = logging.getLogger(__name__)


@dataclass
class Source:
    """What a model is built from again at a new world size: its skeleton (the user's
    module, parameters on ``meta``) and its optimizer's spec."""

    skeleton: nn.Module
    spec: OptimizerSpec

    def build(self, strategy: Strategy, cfg: Any, world_size: int) -> tuple[nn.Module, Any]:
        """A fresh module from the skeleton (its parameters uninitialized: a whole state
        is loaded next), parallelized over the strategy's new mesh, and its optimizer.
        COLLECTIVE (the mesh, the sharding)."""
        from gpufleet.parallel.parallelize import parallelize

        model = parallelize(materialize(self.skeleton, strategy.device), strategy, cfg,
                            world_size)
        return model, strategy.setup_optimizer(model, self.spec)


def reshardable(strategy: Strategy) -> bool:
    """Whether in-process recovery puts this strategy's state together from shards:
    FSDP2 sharding (fsdp, hsdp) with no tensor or pipeline split."""
    dims = strategy.dims
    return (strategy.traits.data_parallel == "shard" and max(dims.tp, dims.pp) == 1
            and not strategy.traits.pipelined)


def rebuilt_from_sources(parts: list[Any]) -> bool:
    """Whether every model of a run (its ``ModelPart``) keeps a :class:`Source`: its
    state is sharded and recovery builds it again from the shards."""
    return bool(parts) and all(part.source is not None for part in parts)


def source_of(model: nn.Module, spec: OptimizerSpec) -> Source | None:
    """The :class:`Source` of ``model`` (not yet wrapped), or None when it cannot be
    copied (a module holding something ``copy.deepcopy`` refuses)."""
    try:
        return Source(meta_copy(model), spec)
    except Exception as e:  # any refusal: a lost node is then recovered by a restart
        log.info("the model's structure cannot be copied (%s: %s): a lost node is "
                 "recovered by the elastic agent's restart, not in process",
                 type(e).__name__, e)
        return None


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters are on the ``meta`` device (tied
    parameters stay tied); its buffers are copied as they are."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"),
                                   requires_grad=p.requires_grad)
    return copy.deepcopy(model, memo)


def materialize(skeleton: nn.Module, device: torch.device) -> nn.Module:
    """A copy of ``skeleton`` with every parameter made real (uninitialized) on
    ``device``, ties kept."""
    model = copy.deepcopy(skeleton)
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:
                made[id(p)] = nn.Parameter(torch.empty_like(p, device=device),
                                           requires_grad=p.requires_grad)
            module._parameters[name] = made[id(p)]
    return model


def shard_position(rank: int, dims: Any) -> int:
    """The old rank's position along the shard dimension (the mesh is ``(dp_replicate,
    dp_shard)``, the shard dimension innermost)."""
    return rank % dims.dp_shard


def assemble(states: list[Any]) -> Any:
    """One whole state from the states of the shard positions, in position order: each
    :data:`PIECE` joined along dim 0, everything else taken from the first (the same on
    every rank: replicated tensors, plain values, the global data position)."""
    first = states[0]
    if isinstance(first, dict):
        if len(first) == 1 and PIECE in first:
            return torch.cat([s[PIECE] for s in states], dim=0)
        return {k: assemble([s[k] for s in states]) for k in first}
    if isinstance(first, (list, tuple)):
        joined = [assemble([s[i] for s in states]) for i in range(len(first))]
        return joined if isinstance(first, list) else tuple(joined)
    return first


def share_states(held: dict[int, Any], sources: dict[int, int], device: torch.device,
                 received: list[tuple[int, int, float]] | None = None) -> dict[int, Any]:
    """Every rank's copy of the states in ``sources`` (``{owner: new rank holding it}``),
    from those in ``held`` (``{owner: state}``, this rank's part); each state this rank
    receives is added to ``received`` as ``(sender, bytes, seconds)``. COLLECTIVE: one
    broadcast per owner, in owner order, over the new process group."""
    out: dict[int, Any] = {}
    me = dist.get_rank()
    for owner in sorted(sources):
        data = None
        if sources[owner] == me:  # (views of one byte buffer: saved as copies)
            buffer = io.BytesIO()
            torch.save(map_tensors(held[owner], torch.clone), buffer)
            data = buffer.getvalue()
        got = broadcast_bytes(data, device, src=sources[owner], received=received)
        out[owner] = held[owner] if data is not None else \
            torch.load(io.BytesIO(got), weights_only=True, map_location="cpu")
    return out


def whole_from_snapshots(sources: dict[int, int], ranks: tuple[int, ...], snapshotter: Any,
                         step: int, me: int, dims: Any, device: torch.device,
                         received: list[tuple[int, int, float]] | None = None) -> Any:
    """The whole training state at snapshot ``step``, joined from the shard positions'
    copies: ``sources`` names, per old rank whose copy is used, the old rank holding it
    (its own, or the lost partner's); ``ranks`` the old ranks in their new order; ``me``
    this rank's old rank; ``dims`` the old mesh's; what this rank receives is added to
    ``received`` (:func:`share_states`). COLLECTIVE over the new group."""
    ours = {copy.owner: copy for copy in (snapshotter.own, snapshotter.partner)
            if copy.step == step}
    held = {owner: ours[owner].state(pieces=True)
            for owner, holder in sources.items() if holder == me}
    where = {owner: ranks.index(holder) for owner, holder in sources.items()}
    states = share_states(held, where, device, received)
    return assemble([states[owner] for owner in
                     sorted(states, key=lambda r: shard_position(r, dims))])


def broadcast_bytes(data: bytes | None, device: torch.device, src: int = 0,
                    received: list[tuple[int, int, float]] | None = None) -> bytes:
    """Rank ``src``'s ``data`` on every rank (COLLECTIVE: its length, then its bytes; on
    the device the backend needs). A rank that receives them adds ``(src, bytes,
    seconds)`` to ``received``: the time of the bytes' broadcast alone (the length's
    broadcast before it is where the ranks meet)."""
    where = device if dist.get_backend() == "nccl" else torch.device("cpu")
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64,
                        device=where)
    dist.broadcast(size, src=src)
    buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(where)
              if data is not None else torch.empty(int(size), dtype=torch.uint8, device=where))
    start = time.perf_counter()
    dist.broadcast(buffer, src=src)
    if data is None and received is not None and int(size):
        if where.type == "cuda":  # SYNC: the broadcast's end, for its time (rare: a recovery)
            torch.cuda.synchronize(where)
        received.append((src, int(size), time.perf_counter() - start))
    return data if data is not None else buffer.cpu().numpy().tobytes()


def as_pieces(state: Any) -> Any:
    """A live state with each DTensor replaced by ``{PIECE: its local shard}`` (as
    :meth:`HostState.state <gpufleet.fault.host_state.HostState.state>` gives a
    snapshot's with ``pieces=True``)."""
    if hasattr(state, "to_local"):
        return {PIECE: state.to_local()}
    if isinstance(state, dict):
        return {k: as_pieces(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(as_pieces(v) for v in state)
    return state

