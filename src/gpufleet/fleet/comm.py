"""What ranks say to each other in your own loop: :class:`FleetComm`, the collectives of
:class:`~gpufleet.fleet.Fleet` (``all_reduce``, ``all_gather``, ``broadcast``,
``barrier``, ``rank_zero_first``), named and shaped as Lightning Fabric's.

Each is a COLLECTIVE: every rank calls it, in the same order. Each is recorded in the
ring of recent collectives that a hang report lists (:mod:`gpufleet.core.ring`), as
the built-in loop's are. In one process they return what a one-rank job would gather.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from gpufleet.core.ring import RING, call_site
from gpufleet.core.tree import to_device
from gpufleet.errors import ConfigError, unknown_choice
from gpufleet.fleet.part import FleetPart
from gpufleet.launch import barrier, job_store
from gpufleet.train.engine.run import Run

_REDUCE = ("mean", "sum", "max", "min")
# rank_zero_first: each use's number, and how often the others look whether rank 0 is
# done (it may download or unpack for longer than the process group's timeout).
_FIRSTS = itertools.count()
_POLL_S = 0.05


def _noted(method: Callable[..., Any]) -> Callable[..., Any]:
    """A collective whose ring entries name the line of your code that called it
    (``train.py:42`` in a crash or hang report), run in the fleet's guard (a lost node
    met there is recovered in process: :mod:`gpufleet.fleet.recovery`)."""

    @functools.wraps(method)
    def call(self: FleetPart, *args: Any, **kwargs: Any) -> Any:
        RING.site = call_site()
        try:
            with self._guard:
                return method(self, *args, **kwargs)
        finally:
            RING.site = ""

    return call


class FleetComm(FleetPart):
    """The collectives of :class:`~gpufleet.fleet.Fleet` (a part of it)."""

    @_noted
    def all_reduce(self, data: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """``data`` (a tensor or a number, or a dict, list or tuple of them) reduced over
        every rank: ``"mean"`` (or ``"avg"``), ``"sum"``, ``"max"`` or ``"min"``, in any
        case, or torch's ``ReduceOp.SUM``, ``AVG``, ``MAX``, ``MIN``, as Fabric takes
        them. COLLECTIVE; a number comes back as a float (SYNC). ``group``: a
        ``torch.distributed`` process group (``dist.new_group(ranks)``) to reduce over
        instead, called by its ranks only. A string in ``group``'s place is the reduce
        op (``all_reduce(x, "sum")``, as Fleet has always taken it)."""
        run = self._rank_run()
        if isinstance(group, str):
            if reduce_op != "mean":
                raise ConfigError(f"all_reduce got the reduce op twice ({group!r} and "
                                  f"reduce_op={reduce_op!r}); pass it once.")
            group, reduce_op = None, group
        reduce_op = _op_name(reduce_op)
        size = run.env.world_size if group is None else _group_size(group, "all_reduce")
        return _each_value(data, lambda v: _reduce(v, run, group, reduce_op, size),
                           "all_reduce")

    @_noted
    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Every rank's ``data``: a tensor or a number, or a dict, list or tuple of them,
        gathered into the same structure. Each tensor comes back on this rank's device
        with a new first dimension of ``world_size``, in rank order (on one rank too,
        where Fabric returns it unchanged). Tensors must have the same shape on every
        rank. ``group``: a ``torch.distributed`` process group to gather from instead
        (its size, in its rank order), called by its ranks only. ``sync_grads=True``:
        gradients flow back through the gathered tensors to each rank's own (the
        contrastive-loss case). COLLECTIVE."""
        run = self._rank_run()
        if isinstance(group, bool):  # Fleet's all_gather(x, True): sync_grads, second
            group, sync_grads = None, group or sync_grads
        if group is not None:
            _group_size(group, "all_gather")
        return _each_value(data, lambda v: _gather(v, run, sync_grads, group), "all_gather")

    @_noted
    def gather_for_metrics(self, data: Any, loader: Any = None) -> Any:
        """Every rank's ``data`` (tensors, also in a dict, list or tuple) concatenated
        along the first dimension, without the items the sampler repeated so that every
        rank reads as many: Accelerate's ``gather_for_metrics``, for an evaluation over
        exactly the data set's samples. ``data`` holds one row per sample of the last
        batch read from ``loader`` (None: the set-up loader read last); a tensor of no
        dimension is gathered as it is (one value per rank). COLLECTIVE."""
        run = self._rank_run()
        if loader is None:
            loader = self._loaders.read_last()
        world = run.env.world_size if run.strategy.reduces() else 1
        real = [None if loader is None else loader.real_items(r) for r in range(world)]

        def gather(value: Any) -> torch.Tensor:
            stacked = _gather(value, run, False, None)  # (world, ...) in rank order
            if stacked.dim() == 1:
                return stacked
            return torch.cat([part if keep is None else part[:keep]
                              for part, keep in zip(stacked, real, strict=True)])

        return _each_value(data, gather, "gather_for_metrics")

    @_noted
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` (anything picklable: a tensor, a dict, a path chosen on
        rank 0) on every rank; tensors in it (also in a dict, list or tuple) come on
        this rank's device. COLLECTIVE."""
        run = self._rank_run()
        if not run.strategy.reduces():
            return obj
        if not 0 <= src < run.env.world_size:
            raise ConfigError(f"broadcast(src={src}): src is a rank, 0 to "
                              f"{run.env.world_size - 1}.")
        box = [obj]
        n = RING.enter("broadcast_object", 0)
        dist.broadcast_object_list(box, src=src)
        RING.leave(n)
        # Unpickled tensors come on the sender's device (cuda:src): bring them here.
        return to_device(box[0], run.device) if run.device.type != "cpu" else box[0]

    @_noted
    def barrier(self, name: str | None = None) -> None:
        """Wait until every rank is here (COLLECTIVE). ``name`` (Fabric's) names the
        barrier in a hang report's list of collectives: ranks waiting at differently
        named barriers show there as a mismatch."""
        self._rank_run()
        barrier(name)

    @contextlib.contextmanager
    def rank_zero_first(self, local: bool = False) -> Iterator[None]:
        """Rank 0 (``local=True``: the first rank of each node) runs the block first,
        the others once it is done: a data set downloaded or unpacked once, then read by
        every rank. The others wait as long as it takes (not the process group's
        timeout), polling the job's store. COLLECTIVE. Use it before training: inside
        the steps, the wait counts as the step's time, and a long one looks to the
        watchdog like a stalled step."""
        run = self._rank_run()
        if not run.strategy.reduces():
            yield
            return
        # The same count on every rank (they call it in the same order): a key of its own.
        key = f"gpufleet/rank_zero_first/{next(_FIRSTS)}" + (
            f"/node{run.env.node_rank}" if local else "")
        first = (run.env.local_rank if local else run.env.rank) == 0
        store = job_store()
        if store is None:  # no store to poll: the process group's barrier
            with _barrier_around(first):
                yield
            return
        if not first:
            n = RING.enter("rank_zero_first", 0)
            while not store.check([key]):  # short calls: the watchdog shares the client
                time.sleep(_POLL_S)
            RING.leave(n)
        yield
        if first:
            store.set(key, "done")


@contextlib.contextmanager
def _barrier_around(first: bool) -> Iterator[None]:
    if not first:
        barrier()
    try:
        yield
    finally:
        if first:
            barrier()


def _each_value(data: Any, fn: Any, name: str) -> Any:
    """``fn`` applied to every tensor and number in a (nested) dict, list or tuple."""
    if isinstance(data, (torch.Tensor, int, float, bool)):
        return fn(data)
    if isinstance(data, Mapping):
        return {k: _each_value(v, fn, name) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        items = [_each_value(v, fn, name) for v in data]
        return type(data)(*items) if hasattr(data, "_fields") else type(data)(items)
    raise ConfigError(f"{name} got {type(data).__name__}: give tensors or numbers, or a "
                      "dict, list or tuple of them; send other objects with broadcast.")


def _group_size(group: Any, name: str) -> int:
    """The size of ``group``, a process group this rank is in; else the error."""
    if not dist.is_initialized():
        raise ConfigError(f"{name}(group=...): this run has no torch.distributed process "
                          "group (one process, or horovod), so there is no group to "
                          "reduce over; leave group=None.")
    # dist.new_group gives a rank outside the group GroupMember.NON_GROUP_MEMBER (-100)
    outside = isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER
    if not isinstance(group, dist.ProcessGroup) and not outside:
        raise ConfigError(f"{name}(group={group!r}): give a torch.distributed process "
                          "group (dist.new_group(ranks)), or None for every rank.")
    size = dist.get_world_size(group)
    if size < 0:  # torch's answer for a rank outside the group
        raise ConfigError(f"{name}(group=...): rank {dist.get_rank()} is not in that group; "
                          "call it on the group's ranks only.")
    return size


def _op_name(op: Any) -> str:
    """``"mean"``, ``"sum"``, ``"max"`` or ``"min"`` for what Fabric's ``reduce_op``
    takes: those names in any case, ``"avg"``, or a ``torch.distributed.ReduceOp``."""
    if isinstance(op, str):
        name = op.lower()
        name = "mean" if name == "avg" else name
    else:
        ops = torch.distributed.ReduceOp
        names = {ops.SUM: "sum", ops.AVG: "mean", ops.MAX: "max", ops.MIN: "min"}
        name = next((n for known, n in names.items() if op == known), repr(op))
    if name not in _REDUCE:
        raise ConfigError(unknown_choice("reduce_op", op, _REDUCE))
    return name


def _reduce(value: Any, run: Run, group: Any, op: str, size: int) -> Any:
    """One tensor or number reduced over the ranks (of ``group``, when given)."""
    number = not isinstance(value, torch.Tensor)
    tensor = torch.tensor(float(value), device=run.device) if number \
        else value.detach().clone()
    how = "sum" if op == "mean" else op
    if group is None:  # (horovod's strategy takes no group; none is given there)
        run.strategy.all_reduce(tensor, how)
    else:
        run.strategy.all_reduce(tensor, how, group=group)
    if op == "mean":
        tensor = tensor / size
    return float(tensor) if number else tensor


def _gather(value: Any, run: Run, sync_grads: bool, group: Any) -> torch.Tensor:
    """One tensor or number from every rank (of ``group``), stacked in rank order."""
    tensor = value.to(run.device) if isinstance(value, torch.Tensor) \
        else torch.tensor(value, device=run.device)
    if group is None and not run.strategy.reduces():
        return tensor.unsqueeze(0)
    tensor = tensor.contiguous()
    world = dist.get_world_size(group)
    n = RING.enter("all_gather", tensor.numel() * tensor.element_size() * world)
    if sync_grads:
        gathered = _GatherWithGrads.apply(tensor, group)
    else:
        parts = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(parts, tensor, group=group)
        gathered = torch.stack(parts)
    RING.leave(n)
    return gathered


class _GatherWithGrads(torch.autograd.Function):
    """All-gather that passes gradients back: each rank's input gets the sum over the
    ranks of the gradient of its row (the gradient of every rank's loss)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, ctx.rank = group, dist.get_rank(group)  # the rank within the group
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # COLLECTIVE in backward: every rank runs it
        return grad[ctx.rank], None
