"""One gradient norm and clip for every layout of the mesh.

Ranks may hold different pieces of the gradients: FSDP and tensor parallel shards
(``DTensor`` s), a pipeline stage's own layers. Each rank adds up the squares of its
local pieces, each divided by how many ranks hold an identical copy of that piece, and
one all-reduce of one number over all ranks gives the squared global norm: every
distinct piece is then counted exactly once. A run whose ranks all hold every gradient
(``single``, ``ddp``) needs no collective: :func:`clip_whole_` runs the operations of
torch's ``clip_grad_norm_(foreach=True)`` without its per-call grouping by device and
dtype (every gradient is on the strategy's one device), about half its time on a small
model's CPU step, and keeps the norm of each gradient it measured on the way
(:class:`EachNorm`): the non-finite check reads it instead of measuring again.

Example:
    >>> import torch
    >>> from gpufleet.parallel.dims import ParallelDims
    >>> g = [torch.tensor([3.0]), torch.tensor([4.0])]
    >>> float(grad_norm(g, torch.device("cpu"), ParallelDims()))
    5.0
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple, cast

import torch
import torch.distributed as dist

from gpufleet.core.ring import RING
from gpufleet.parallel.dims import ParallelDims

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def spreads_gradients(dims: ParallelDims) -> bool:
    """True when ranks hold different gradients (sharded or staged), so the norm needs
    one all-reduce."""
    return dims.world_size > 1 and (dims.dp_shard > 1 or dims.tp > 1 or dims.pp > 1)


def grad_norm(grads: Iterable[torch.Tensor], device: torch.device,
              dims: ParallelDims) -> torch.Tensor:
    """The global L2 norm of ``grads`` (this rank's gradients), in float32 on ``device``.

    COLLECTIVE when ``spreads_gradients(dims)``: every rank must call it, also a rank
    without gradients.
    """
    grads = list(grads)
    if not spreads_gradients(dims):  # (DTensors of a one-rank mesh: their whole pieces)
        return _whole_norm([_local_piece(g, None)[0] for g in grads], device)
    by_copies: dict[int, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        local, copies = _local_piece(g, dims)
        by_copies[copies].append(local)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for copies, pieces in sorted(by_copies.items()):
        total = total + _squares(pieces, device) / copies
    n = RING.enter("all_reduce", 4)
    dist.all_reduce(total)  # COLLECTIVE: one number
    RING.leave(n)
    return total.sqrt()


def clip_grads_(grads: Iterable[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale ``grads`` in place so that their global ``norm`` becomes at most
    ``max_norm`` (the coefficient torch's ``clip_grad_norm_`` uses). Each rank scales
    its own pieces."""
    coef = _clip_coef(max_norm, norm)
    with torch.no_grad():
        for local in (_local_piece(g, None)[0] for g in grads):
            local.mul_(coef.to(local.device, local.dtype))


class EachNorm(NamedTuple):
    """The L2 norm of each gradient of ``params`` that exists, as one device vector.

    Attributes:
        values: one norm per parameter with a gradient, in the order of ``params`` (a
            device vector, or a list of 0-dim tensors from :func:`each_norm_unstacked`).
        params: the parameters measured (with and without a gradient).
        present: the indices into ``params`` of the values; None when every parameter
            had a gradient (the common case, found without a second pass).
    """

    values: torch.Tensor | Sequence[torch.Tensor]
    params: Sequence[torch.Tensor]
    present: list[int] | None


def each_norm(params: Sequence[torch.Tensor], device: torch.device,
              local: bool = False) -> tuple[EachNorm, list[torch.Tensor]]:
    """The norm of each existing gradient of ``params`` (one fused kernel per device and
    dtype), and those gradients; with ``local``, of this rank's piece of each (sharded
    gradients). No collective, no host read."""
    grads = [p.grad for p in params if p.grad is not None]
    if local:
        grads = [_local_piece(g, None)[0] for g in grads]
    present = None
    if len(grads) < len(params):
        present = [i for i, p in enumerate(params) if p.grad is not None]
    if not grads:
        return EachNorm(torch.zeros(0, device=device), params, present), grads
    return EachNorm(torch.stack(torch._foreach_norm(grads)), params, present), grads


def each_norm_unstacked(params: Sequence[torch.Tensor], sharded: bool = True) -> EachNorm:
    """:func:`each_norm` of this rank's pieces, its ``values`` left as the list of 0-dim
    norms the fused kernel returns (no stacking: the cheapest form to check every step;
    ``torch.stack`` it when the values are read). ``sharded=False``: no parameter is a
    ``DTensor`` (each gradient is its own local piece; nothing to look up per step)."""
    grads = [g for p in params if (g := p.grad) is not None]
    present = None
    if len(grads) < len(params):
        present = [i for i, p in enumerate(params) if p.grad is not None]
    if sharded:
        grads = [_local_piece(g, None)[0] for g in grads]
    return EachNorm(torch._foreach_norm(grads) if grads else [], params, present)


def clip_whole_(params: Sequence[torch.Tensor], max_norm: float,
                device: torch.device) -> tuple[torch.Tensor, EachNorm]:
    """Clip the gradients of ``params``, all on this rank and on ``device``, to a global
    L2 norm of at most ``max_norm``; returns the norm before clipping and the norm of
    each gradient.

    The same operations, in the same order, as torch's ``clip_grad_norm_`` with
    ``foreach=True`` on one device (so the same numbers, bit for bit). No collective,
    no host read.
    """
    # Local pieces: a one-rank mesh (fsdp or hsdp on one rank, or whole replicas per
    # node) still holds DTensors, each piece the whole gradient.
    each, grads = each_norm(params, device, local=True)
    if not grads:
        return torch.zeros((), device=device), each
    total = torch.linalg.vector_norm(each.values)
    coef = _clip_coef(max_norm, total)
    with torch.no_grad():
        torch._foreach_mul_(grads, coef)
    return total, each


def clip_whole_p_(params: Iterable[torch.Tensor], max_norm: float, norm_type: float,
                  device: torch.device) -> torch.Tensor:
    """Clip the gradients of ``params``, all on this rank, to a global ``norm_type``-norm
    (``inf``: the largest absolute value) of at most ``max_norm``; returns the norm before
    clipping. The operations of torch's ``clip_grad_norm_(norm_type=..., foreach=True)``
    on this rank's pieces. No collective, no host read.

    Example:
        >>> p = torch.nn.Parameter(torch.zeros(2)); p.grad = torch.tensor([3.0, -4.0])
        >>> float(clip_whole_p_([p], 2.0, float("inf"), torch.device("cpu")))
        4.0
        >>> [round(g, 4) for g in p.grad.tolist()]  # scaled by 2 / (4 + 1e-6)
        [1.5, -2.0]
    """
    grads = [_local_piece(p.grad, None)[0] for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), device=device)
    norms = torch._foreach_norm(grads, norm_type)
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
    coef = _clip_coef(max_norm, total)
    with torch.no_grad():
        torch._foreach_mul_(grads, coef)
    return total


def _clip_coef(max_norm: float, norm: torch.Tensor) -> torch.Tensor:
    """What every gradient is multiplied by so the global ``norm`` becomes at most
    ``max_norm``: torch's ``clip_grad_norm_`` coefficient, with its epsilon."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def local_piece(grad: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``grad`` (a ``DTensor``'s local shard; a plain tensor as is)."""
    return grad.to_local() if hasattr(grad, "to_local") else grad


def _local_piece(grad: torch.Tensor, dims: ParallelDims | None) -> tuple[torch.Tensor, int]:
    """This rank's piece of ``grad`` and how many ranks hold an identical copy of it."""
    if not hasattr(grad, "to_local"):  # a plain tensor: the same on every rank of a stage
        return grad, dims.world_size // dims.pp if dims else 1
    dtensor = cast("DTensor", grad)  # only a DTensor has to_local
    mesh = dtensor.device_mesh
    shards = 1
    for i, placement in enumerate(dtensor.placements):
        if not placement.is_replicate():  # sharded (plain or strided) along mesh dim i
            shards *= mesh.size(i)
    return grad.to_local(), (dims.world_size // dims.pp // shards) if dims else 1


def _whole_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The norm torch's ``clip_grad_norm_`` computes (every gradient is here)."""
    if not grads:
        return torch.zeros((), device=device)
    total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6
    if total_norm is not None:
        return total_norm(grads, foreach=True)
    return torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads]))


def _squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of all elements of ``tensors``, in float32 on ``device``."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(tensors)  # one kernel launch per device and dtype
    return torch.stack([n.float().to(device) for n in norms]).square().sum()
