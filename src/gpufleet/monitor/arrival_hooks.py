"""Clock reads where a rank waits for the others under fsdp, hsdp and pipeline.

Under ``fsdp`` (FSDP2) the parameters are all-gathered before each sharded module's
forward and again before its backward, and the gradients reduce-scattered after it
(``hsdp`` adds an all-reduce across the replicas). Each of those collectives ends at
the same moment on every rank of its group, so the time a rank spends inside them is
the time it waited for the last peer to arrive, plus the transfer: a rank that spends
``x`` ms less in them arrived ``x`` ms later. :func:`time_fsdp` gives every sharded
module FSDP's own hook points (``set_custom_all_gather``,
``set_custom_reduce_scatter`` and, for hsdp, ``set_all_reduce_hook``) with the same
transfers behind two clock reads each, added to the phase the loop is in (forward or
backward, read from its phase marks).

Under ``pipeline`` the schedule waits for the neighbouring stages in its sends and
receives; :func:`time_stage` wraps the stage's ``forward_one_chunk`` and
``backward_one_chunk`` (pure compute, one micro-batch each) with two clock reads, so
the stage's compute is known apart from its waits.

Per step that is two clock reads per collective or micro-batch and a few list slots;
nothing is allocated, nothing waits for the device. On a CPU (gloo) FSDP's collectives
block the calling thread, so the time inside them is the wait; on CUDA (NCCL) they
return at once and the wait happens on the device, which these clocks do not see.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from gpufleet.core.phases import Phase, PhaseMarks
from gpufleet.core.ring import RING

log = logging.getLogger(__name__)

#: Slots of :class:`Waits`: seconds inside collectives begun in forward, in backward,
#: compute of a pipeline stage's micro-batches, how many micro-batches it ran, and the
#: bytes the timed collectives moved.
FORWARD, BACKWARD, COMPUTE, CHUNKS, BYTES = range(5)


class Waits:
    """Running sums the hooks add to (see :data:`FORWARD` ...), and the loop's phase.

    ``marks`` is the loop's phase-mark buffer (the arrival timer hands it over on its
    first read); the newest mark in it is the phase a collective begins in. After the
    buffer was handed over and emptied, ``phase`` holds the last phase it held.
    """

    __slots__ = ("marks", "phase", "sums")

    def __init__(self) -> None:
        self.sums = [0.0] * 5
        self.marks: PhaseMarks | None = None
        self.phase: Phase | None = None

    def slot(self) -> int:
        """The slot of the phase the loop is in now: forward (or anything before
        backward) or backward; -1 outside the step (evaluation, checkpoints, log)."""
        marks, phase = self.marks, self.phase
        if marks is not None and marks.count:
            phase = marks.phases[marks.count - 1]
        if phase is Phase.BACKWARD:
            return BACKWARD
        if phase is Phase.FORWARD:
            return FORWARD
        return -1

    def add(self, started: float, n: int, nbytes: int) -> None:
        """Collective ``n`` (its number in the ring), begun at ``started``, moving
        ``nbytes``, returned now: its time goes to its phase."""
        RING.leave(n)
        slot = self.slot()
        if slot >= 0:
            sums = self.sums
            sums[slot] += time.perf_counter() - started
            sums[BYTES] += nbytes

    def take(self) -> list[float]:
        """The sums since the last call; resets (in place: the hooks hold the list)."""
        sums = self.sums[:]
        self.sums[:] = (0.0,) * 5
        return sums


def _fsdp_comms() -> tuple[type, type] | None:
    """FSDP2's default all-gather and reduce-scatter (None on a torch without them)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            DefaultAllGather,
            DefaultReduceScatter,
        )
    except ImportError:
        return None
    return DefaultAllGather, DefaultReduceScatter


class _TimedAllGather:
    """FSDP2's default all-gather (the same call, the same buffers), timed."""

    def __init__(self, inner: Any, waits: Waits) -> None:
        self._inner, self._waits = inner, waits

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> Any:
        return self._inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: Any, async_op: bool = False) -> Any:
        nbytes = output_tensor.numel() * output_tensor.element_size()
        n = RING.enter("all_gather", nbytes)
        started = time.perf_counter()
        work = self._inner(output_tensor, input_tensor, group, async_op)
        self._waits.add(started, n, nbytes)
        return work


class _TimedReduceScatter:
    """FSDP2's default reduce-scatter, timed; with hsdp its all-reduce across the
    replicas follows, and :meth:`all_reduced` (FSDP's all-reduce hook) times that."""

    def __init__(self, inner: Any, waits: Waits) -> None:
        self._inner, self._waits = inner, waits
        # When hsdp's all-reduce may begin: FSDP allocates the reduce-scatter's output
        # right before the reduce-scatter (or, with one shard per replica, the copy that
        # stands for it); the reduce-scatter's return moves it on.
        self._start = 0.0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> Any:
        self._start = time.perf_counter()
        return self._inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: Any, op: Any, async_op: bool = False) -> Any:
        nbytes = input_tensor.numel() * input_tensor.element_size()
        n = RING.enter("reduce_scatter", nbytes)
        started = time.perf_counter()
        work = self._inner(output_tensor, input_tensor, group, op, async_op)
        self._waits.add(started, n, nbytes)
        self._start = time.perf_counter()
        return work

    def all_reduced(self, reduced: torch.Tensor) -> None:
        """FSDP's all-reduce hook: runs right after hsdp's all-reduce across replicas,
        which began when the reduce-scatter returned (see ``_start``). Noted in the
        ring once it returned (a hang inside it shows as the reduce-scatter's)."""
        nbytes = reduced.numel() * reduced.element_size()
        n = RING.enter("all_reduce", nbytes)
        self._waits.add(self._start or time.perf_counter(), n, nbytes)
        self._start = 0.0


def time_fsdp(model: nn.Module, waits: Waits) -> bool:
    """Time every FSDP2 module's collectives in ``model`` into ``waits``; True when any
    is timed (False: no FSDP2 module, or a torch whose FSDP2 lacks the hook points).

    Example:
        >>> from torch import nn
        >>> time_fsdp(nn.Linear(2, 2), Waits())  # not sharded: nothing to time
        False
    """
    comms = _fsdp_comms()
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if comms is None or not sharded:
        return False
    gather_cls, scatter_cls = comms
    for module in sharded:
        gather = _TimedAllGather(gather_cls(), waits)
        scatter = _TimedReduceScatter(scatter_cls(), waits)
        try:
            module.set_custom_all_gather(gather)
            module.set_custom_reduce_scatter(scatter)
            if _is_hsdp(module):
                module.set_all_reduce_hook(scatter.all_reduced)
        except (ValueError, AttributeError) as e:  # several parameter groups per module
            log.debug("fsdp arrival not measured on %s: %s", type(module).__name__, e)
            return False
    return True


def _is_hsdp(module: nn.Module) -> bool:
    """Whether the module's parameters are replicated across a mesh dimension too."""
    for param in module.parameters(recurse=False):
        mesh = getattr(param, "device_mesh", None)
        return mesh is not None and mesh.ndim > 1
    return False


def time_stage(stage: Any, waits: Waits) -> bool:
    """Time each micro-batch's forward and backward of a ``torch.distributed.pipelining``
    stage (its ``forward_one_chunk`` and ``backward_one_chunk``) into ``waits``; True
    when the stage has both.

    Example:
        >>> class Stage:
        ...     def forward_one_chunk(self, i): return i
        ...     def backward_one_chunk(self, i): return None
        >>> waits, stage = Waits(), Stage()
        >>> time_stage(stage, waits), stage.forward_one_chunk(0), waits.sums[CHUNKS]
        (True, 0, 1.0)
    """
    for name, counts in (("forward_one_chunk", True), ("backward_one_chunk", False)):
        method = getattr(stage, name, None)
        if method is None:
            return False
        setattr(stage, name, _timed_chunk(method, waits.sums, counts))
    return True


def _timed_chunk(method: Any, sums: list[float], counts: bool) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        out = method(*args, **kwargs)
        sums[COMPUTE] += time.perf_counter() - started
        if counts:
            sums[CHUNKS] += 1
        return out

    return timed
