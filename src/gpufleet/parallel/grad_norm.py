"""One gradient norm and clip for every layout of the mesh.

Ranks may hold different pieces of the gradients: FSDP and tensor parallel shards
(``DTensor`` s), a pipeline stage's own layers. Each rank adds up the squares of its
local pieces, each divided by how many ranks hold an identical copy of that piece, and
one all-reduce of one number over all ranks gives the squared global norm: every
distinct piece is then counted exactly once. A run whose ranks all hold every gradient
(``single``, ``ddp``) needs no collective, and uses torch's own clip.

Example:
    >>> import torch
    >>> from gpufleet.parallel.dims import ParallelDims
    >>> g = [torch.tensor([3.0]), torch.tensor([4.0])]
    >>> float(grad_norm(g, torch.device("cpu"), ParallelDims()))
    5.0
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist

from gpufleet.parallel.dims import ParallelDims


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
    if not spreads_gradients(dims):
        return _whole_norm(grads, device)
    by_copies: dict[int, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        local, copies = _local_piece(g, dims)
        by_copies[copies].append(local)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for copies, pieces in sorted(by_copies.items()):
        total = total + _squares(pieces, device) / copies
    dist.all_reduce(total)  # COLLECTIVE: one number
    return total.sqrt()


def clip_grads_(grads: Iterable[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale ``grads`` in place so that their global ``norm`` becomes at most
    ``max_norm`` (the coefficient torch's ``clip_grad_norm_`` uses). Each rank scales
    its own pieces."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for local in (_local_piece(g, None)[0] for g in grads):
            local.mul_(coef.to(local.device, local.dtype))


def _local_piece(grad: torch.Tensor, dims: ParallelDims | None) -> tuple[torch.Tensor, int]:
    """This rank's piece of ``grad`` and how many ranks hold an identical copy of it."""
    if not hasattr(grad, "to_local"):  # a plain tensor: the same on every rank of a stage
        return grad, dims.world_size // dims.pp if dims else 1
    mesh = grad.device_mesh
    shards = 1
    for i, placement in enumerate(grad.placements):
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
