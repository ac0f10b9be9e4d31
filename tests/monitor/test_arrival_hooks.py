"""The clocks around fsdp's collectives and a pipeline stage's micro-batches, with fakes
in place of the transfers (the real ones run in tests/monitor/test_arrival_rules.py)."""

from __future__ import annotations

import doctest

import torch

from gpufleet.core.phases import Phase
from gpufleet.core.ring import RING
from gpufleet.monitor import arrival_hooks, metrics
from gpufleet.monitor.arrival import ARRIVAL, ArrivalTimer
from gpufleet.monitor.arrival_hooks import (
    BACKWARD,
    BYTES,
    CHUNKS,
    COMPUTE,
    FORWARD,
    Waits,
    _TimedAllGather,
    _TimedReduceScatter,
    time_stage,
)

from .marks import marks_of


class _Comm:
    """Stands for FSDP's default collective: records its calls and allocations."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, *args):
        self.calls.append(args)
        return "work"


def test_each_collective_counts_in_the_phase_the_loop_is_in():
    waits = Waits()
    inner = _Comm()
    gather, scatter = _TimedAllGather(inner, waits), _TimedReduceScatter(inner, waits)
    out, inp = torch.zeros(8), torch.zeros(4)
    seq = RING.seq
    waits.marks = marks_of([(Phase.DATA, 1.0), (Phase.FORWARD, 1.1)])
    assert gather(out, inp, "group") == "work"  # the transfer's own result comes back
    after_forward = waits.sums[:]
    assert after_forward[FORWARD] > 0 and after_forward[BACKWARD] == 0
    assert after_forward[BYTES] == 8 * 4
    waits.marks = marks_of([(Phase.FORWARD, 1.1), (Phase.BACKWARD, 1.2)])
    scatter(inp, out, "group", "sum")
    assert waits.sums[FORWARD] == after_forward[FORWARD] and waits.sums[BACKWARD] > 0
    assert waits.sums[BYTES] == 2 * 8 * 4
    assert inner.calls == [(out, inp, "group", False), (inp, out, "group", "sum", False)]
    # Both entered the ring of collectives (hang reports) and returned.
    assert RING.seq == seq + 2 and RING.done == RING.seq
    assert [e["op"] for e in RING.snapshot()["entries"][-2:]] == ["all_gather",
                                                                 "reduce_scatter"]
    # Evaluation all-gathers too: not part of a step, not counted.
    waits.marks = marks_of([(Phase.EVAL, 2.0)])
    before = waits.sums[:]
    gather(out, inp, "group")
    assert waits.sums[:BYTES] == before[:BYTES]
    # Once the marks were handed over (the buffer starts again), the last phase holds.
    waits.marks, waits.phase = marks_of([]), Phase.BACKWARD
    gather(out, inp, "group")
    assert waits.sums[BACKWARD] > before[BACKWARD]
    taken = waits.take()
    assert taken[BACKWARD] > 0 and waits.sums == [0.0] * 5


def test_hsdp_all_reduce_is_timed_from_the_reduce_scatter_to_its_hook():
    waits = Waits()
    scatter = _TimedReduceScatter(_Comm(), waits)
    waits.phase = Phase.BACKWARD
    scatter.allocate((4,), dtype=torch.float32, device=torch.device("cpu"))
    scatter(torch.zeros(2), torch.zeros(4), "group", "sum")
    after_scatter = waits.sums[BACKWARD]
    scatter.all_reduced(torch.zeros(2))  # FSDP calls its hook after the all-reduce
    assert waits.sums[BACKWARD] > after_scatter
    assert RING.snapshot()["entries"][-1]["op"] == "all_reduce"


class _Stage:
    """Stands for a pipelining stage: the schedule calls these once per micro-batch."""

    def forward_one_chunk(self, i, *args):
        return i

    def backward_one_chunk(self, i, **kwargs):
        return None


def test_a_stage_counts_its_micro_batches_and_their_compute():
    waits, stage = Waits(), _Stage()
    assert time_stage(stage, waits)
    for i in range(3):
        assert stage.forward_one_chunk(i, "x") == i
    for i in range(3):
        stage.backward_one_chunk(i, last_backward=i == 2)
    assert waits.sums[CHUNKS] == 3 and waits.sums[COMPUTE] > 0
    waits.take()  # the wrappers hold the same list: still counted after a take
    stage.forward_one_chunk(0)
    assert waits.sums[CHUNKS] == 1
    assert not time_stage(object(), Waits())  # not a stage: nothing timed


def test_a_pipeline_stage_waits_for_what_its_schedule_does_not_compute():
    timer = ArrivalTimer()
    timer.measures, timer._stage = "pipeline", 1
    # Two steps: forward (the schedule) 40 ms and 60 ms, backward (the loss broadcast)
    # 5 ms each; the stage computed 30 ms in all over 8 micro-batches.
    timer.on_phase_marks(None, marks_of([
        (Phase.DATA, 0.0), (Phase.FORWARD, 0.01), (Phase.BACKWARD, 0.05),
        (Phase.OPTIMIZER, 0.055), (Phase.END, 0.06)]))
    timer.on_phase_marks(None, marks_of([
        (Phase.DATA, 0.06), (Phase.FORWARD, 0.07), (Phase.BACKWARD, 0.13)]))
    timer.on_phase_marks(None, marks_of([(Phase.OPTIMIZER, 0.135), (Phase.END, 0.14)]))
    timer._hooks.sums[COMPUTE], timer._hooks.sums[CHUNKS] = 0.03, 8
    row = dict(zip(ARRIVAL, timer.take()))
    assert abs(row["wait_fwd"] - (0.1 - 0.03) / 2) < 1e-9
    assert abs(row["wait"] - 0.005) < 1e-9
    assert row["chunks"] == 4 and row["stage"] == 1


def test_fsdp_waits_come_from_the_hooks_and_nothing_measured_says_so():
    timer = ArrivalTimer()
    timer.on_phase_marks(None, marks_of([(Phase.END, 1.0), (Phase.END, 2.0)]))
    assert dict(zip(ARRIVAL, timer.take()))["wait"] == -1.0  # no ddp, fsdp or pipeline
    timer.measures = "fsdp"
    timer.on_phase_marks(None, marks_of([(Phase.END, 1.0), (Phase.END, 2.0)]))
    timer._hooks.sums[FORWARD], timer._hooks.sums[BACKWARD] = 0.004, 0.010
    row = dict(zip(ARRIVAL, timer.take()))
    assert (row["wait_fwd"], row["wait"], row["stage"]) == (0.002, 0.005, -1.0)


def test_doctests():
    for module in (arrival_hooks, metrics):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__
