"""The expected step: what each part of a step should take on this machine, from what
the step does and what the machine measured it can do, and how far the run is from it.

What the step does (per rank, per optimizer step; :class:`StepWork`): its FLOPs (torch's
FLOP counter, the count MFU uses), the operators its forward, backward and optimizer
step dispatch (the op clock's sample, :mod:`gpufleet.monitor.opclock`), the bytes the
optimizer's update reads and writes (parameters, gradients, optimizer state) and the
bytes its gradient collectives send. What the machine can do
(:class:`gpufleet.monitor.peaks.Peaks`): a matmul's FLOP/s in the run's dtype, the
least an operator costs (launch), a copy's bytes per second, and the link between
nodes where one was probed.

Each part of the step accounting (:mod:`gpufleet.monitor.accounting`) is then given
its expected time:

- ``forward`` / ``backward``: a third / two thirds of the FLOPs at the matmul rate, plus
  their operators at the launch cost each;
- ``optimizer``: the update's bytes at the copy rate, plus its operators;
- ``host`` (Python between operators), ``data`` and ``late_ranks``: 0, all of it is
  time a faster input, fewer operators or an even load would save;
- ``exposed_comm``: the bytes sent at the probed link's rate (0 on one rank; not
  modelled where no link was probed: one node);
- ``eval_checkpoint`` and ``other``: not modelled (the run's own choices, judged by
  the rules on time outside steps and on logging).

A part measured far above its expected time is where the run's headroom is; the
``headroom`` finding names the largest (an info: every run has some) with the figures
it rests on and the lever the loop has.

Example:
    >>> from gpufleet.monitor.peaks import Peaks
    >>> peaks = Peaks(matmul_flops=100e9, dtype="fp32", launch_s=2e-6, memory_bps=10e9,
    ...               seconds=0.0)
    >>> row = {"rank": 0, "data": 0.0, "forward": 0.002, "backward": 0.004, "host": 0.001,
    ...        "optimizer": 0.001, "step": 0.008, "ops": {"forward": 10, "backward": 20,
    ...        "optimizer": 5}}
    >>> got = expected_step(row, StepWork(flops=0.3e9, optimizer_bytes=4e6), peaks)
    >>> round(got["parts"]["forward"]["expected"] * 1e3, 2)  # 0.1 GFLOP at 100 GFLOP/s
    1.02
    >>> round(got["compute_share"], 2)  # 3 ms of matmul work done in 6 ms
    0.5
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpufleet.monitor.accounting import describe
from gpufleet.monitor.findings import Finding, RunFacts, Summary, ms
from gpufleet.monitor.peaks import Peaks

#: Parts measured against an expected time, in the accounting's order.
MODELLED = ("data", "forward", "backward", "exposed_comm", "late_ranks", "optimizer",
            "host")
#: An operator whose mean time inside is under this many launch costs does little work:
#: the step is bound by operators, not arithmetic.
TINY_OPERATOR = 20
_LABELS = {"data": "data wait", "forward": "forward", "backward": "backward compute",
           "exposed_comm": "exposed communication", "late_ranks": "waiting for late ranks",
           "optimizer": "optimizer step", "host": "host time between operators"}


@dataclass(frozen=True)
class StepWork:
    """What one rank's optimizer step does (0: not known).

    Attributes:
        flops: FLOPs of forward and backward (torch's FLOP counter).
        optimizer_bytes: bytes the optimizer's update reads and writes.
        comm_bytes: bytes the gradient collectives carry per step.
        link_bps: bytes per second of the slowest node's link (0: not probed).
        world: ranks in the job.
    """

    flops: float = 0.0
    optimizer_bytes: float = 0.0
    comm_bytes: float = 0.0
    link_bps: float = 0.0
    world: int = 1


def expected_step(row: dict[str, Any], work: StepWork, peaks: Peaks) -> dict[str, Any]:
    """Each modelled part of one rank's accounting ``row`` beside its expected time (see
    the module docs), seconds per step.

    Returns:
        ``parts``: per part of :data:`MODELLED`, ``measured``, ``expected`` (None: not
        modelled here) and ``basis`` (the figures, in words); ``measured_step``;
        ``expected_step`` (the modelled parts' sum, with the others as measured);
        ``compute_share`` (the matmul work's time at the measured rate over forward
        and backward as measured; None without FLOPs); ``launch_share`` (the operators
        at the launch cost, over the step); ``host_share`` (host over the step, None
        when not measured); ``peaks`` and ``work`` (the figures used).
    """
    ops = row.get("ops") or {}
    step = float(row.get("step") or 0.0)
    parts: dict[str, dict[str, Any]] = {}
    for part in MODELLED:
        measured = row.get(part)
        expected, basis = _expected(part, row, ops, work, peaks)
        parts[part] = {"measured": measured, "expected": expected, "basis": basis}
    compute = (row.get("forward") or 0.0) + (row.get("backward") or 0.0)
    matmul_s = work.flops / peaks.matmul_flops if work.flops else 0.0
    modelled = sum((p["expected"] if p["expected"] is not None else (p["measured"] or 0.0))
                   for p in parts.values())
    unmodelled = sum(float(row.get(p) or 0.0) for p in ("eval_checkpoint", "other"))
    return {
        "rank": row.get("rank", 0), "parts": parts, "measured_step": step,
        "expected_step": modelled + unmodelled,
        "compute_share": matmul_s / compute if matmul_s and compute > 0 else None,
        "launch_share": (sum(ops.values()) * peaks.launch_s / step) if ops and step else None,
        "host_share": (row["host"] / step) if row.get("host") is not None and step else None,
        "peaks": {"matmul_flops": peaks.matmul_flops, "dtype": peaks.dtype,
                  "launch_s": peaks.launch_s, "memory_bps": peaks.memory_bps},
        "work": {"flops": work.flops, "optimizer_bytes": work.optimizer_bytes,
                 "comm_bytes": work.comm_bytes, "link_bps": work.link_bps,
                 "ops": dict(ops)},
    }


def _expected(part: str, row: dict[str, Any], ops: dict[str, float], work: StepWork,
              peaks: Peaks) -> tuple[float | None, str]:
    """One part's expected seconds per step and the figures it rests on."""
    launch = peaks.launch_s
    if part in ("forward", "backward"):
        if not work.flops:
            return None, "FLOPs not counted (torch.compile, or an own loop)"
        flops = work.flops * (1 / 3 if part == "forward" else 2 / 3)
        n = ops.get(part, 0.0)
        return (flops / peaks.matmul_flops + n * launch,
                f"{flops / 1e9:.3g} GFLOP at {peaks.matmul_flops / 1e9:.3g} GFLOP/s "
                f"({peaks.dtype} matmul) + {n:.0f} operators at {launch * 1e6:.2g} µs")
    if part == "optimizer":
        if not work.optimizer_bytes:
            return None, "the optimizer's state not read"
        n = ops.get("optimizer", 0.0)
        return (work.optimizer_bytes / peaks.memory_bps + n * launch,
                f"{work.optimizer_bytes / 2**20:.3g} MiB read and written at "
                f"{peaks.memory_bps / 1e9:.3g} GB/s + {n:.0f} operators at "
                f"{launch * 1e6:.2g} µs")
    if part == "host":
        if row.get("host") is None:
            return None, "not measured (CUDA, torch.compile, or no sample yet)"
        return 0.0, "no time is needed between operators"
    if part == "exposed_comm":
        if work.world < 2 or not work.comm_bytes:
            return 0.0, "nothing to communicate"
        if not work.link_bps:
            return None, "no link probed (one node)"
        return (work.comm_bytes / work.link_bps,
                f"{work.comm_bytes / 2**20:.3g} MiB at {work.link_bps * 8 / 1e6:.4g} Mbit/s "
                "(the slowest node's link)")
    return 0.0, "none needed when the input keeps up" if part == "data" else \
        "none needed when every rank's work is even"


def headroom(s: Summary, facts: RunFacts, *_: Any) -> Finding | None:
    """The rule: the part furthest above its expected time, on the slowest rank, with
    the figures and the loop's lever (an info)."""
    if not facts.peaks or not s.rank_accounting:
        return None
    row = max(s.rank_accounting, key=lambda r: r.get("step") or 0.0)
    if not row.get("step"):
        return None
    got = expected_step(row, work_of(facts, s), Peaks(**facts.peaks, seconds=0.0))
    gaps = {p: (v["measured"] or 0.0) - v["expected"] for p, v in got["parts"].items()
            if v["expected"] is not None and v["measured"] is not None}
    if not gaps:
        return None
    part = max(gaps, key=gaps.__getitem__)
    if gaps[part] <= 0:
        return None
    step = got["measured_step"]
    where = f" on rank {row['rank']}" if facts.world > 1 else ""
    said = [_compute_words(got, facts, row)]
    if got["host_share"] is not None:
        said.append(f"{got['host_share']:.0%} of the step is host time between operators "
                    f"({ms(row['host'])})")
    if got["launch_share"] is not None:
        said.append(f"{sum(got['work']['ops'].values()):.0f} operators at the measured "
                    f"{facts.peaks['launch_s'] * 1e6:.2g} µs each would take "
                    f"{_share(got['launch_share'])} of it")
    expected = got["parts"][part]["expected"]
    message = (f"measured step{where} {ms(step)}, expected {ms(got['expected_step'])} on "
               f"this CPU: " + "; ".join(s for s in said if s) + ". Furthest from "
               f"expected: {describe(row, part)}, expected {ms(expected)} "
               f"({got['parts'][part]['basis']}).")
    return Finding("headroom", "info", f"furthest from the expected step: {_LABELS[part]}",
                   message, _lever(part, facts, row), confidence="medium",
                   measurements={"part": part, "rank": row["rank"], "excess_s": gaps[part],
                                 "expected_step": got})


def _compute_words(got: dict[str, Any], facts: RunFacts, row: dict[str, Any]) -> str:
    share = got["compute_share"]
    if share is None:
        return ""
    peaks = facts.peaks
    return (f"compute runs at {_share(share)} of this CPU's measured {peaks['dtype']} matmul "
            f"rate ({got['work']['flops'] / 1e9:.3g} GFLOP in "
            f"{ms((row.get('forward') or 0.0) + (row.get('backward') or 0.0))} of forward "
            f"and backward, against {peaks['matmul_flops'] / 1e9:.3g} GFLOP/s)")


def _share(x: float) -> str:
    """A share as the messages write it: whole percent, or two digits below 1%.

    Example:
        >>> _share(0.713), _share(0.00031)
        ('71%', '0.031%')
    """
    return f"{x:.0%}" if x >= 0.01 or x <= 0 else f"{100 * x:.2g}%"


def work_of(facts: RunFacts, s: Summary) -> StepWork:
    """What a step does, from the run's facts and the measured summary."""
    comm = max((a.get("grad_bytes", 0.0) for a in s.rank_arrival), default=0.0)
    reach = [n["mbit_s"] for n in facts.links.get("nodes", ()) if n.get("mbit_s")]
    return StepWork(flops=facts.flops_per_step, optimizer_bytes=facts.optimizer_bytes,
                    comm_bytes=comm, link_bps=min(reach) * 1e6 / 8 if reach else 0.0,
                    world=facts.world)


def _lever(part: str, facts: RunFacts, row: dict[str, Any]) -> str:
    """What the loop can change about ``part``, in its own keys (a Fleet loop's advice
    is reworded by the caller)."""
    if part in ("host", "forward", "backward") and _tiny_operators(row, facts, part):
        fix = (f"raise data.batch_size from {facts.batch_size} (the operators stay, each "
               "does more work)")
        if not facts.compile:
            fix += " or set perf.compile=true (fewer, fused operators)"
        return fix + "."
    if part in ("forward", "backward"):
        return (f"the {part} operators do more than their matmuls: element-wise or "
                "memory-bound work, or extra work in the model; a torch profiler trace of "
                "a few steps shows which operators take the time.")
    if part == "optimizer":
        return ("the optimizer step takes far longer than its update's memory traffic: "
                "look at what else runs in it (optimizer hooks, per-parameter Python "
                "loops, extra work).")
    if part == "data":
        return "make the input keep up: raise data.num_workers (see input-bound)."
    if part == "late_ranks":
        return "even out the ranks' work (the straggler finding names the slow rank)."
    return ("send less or less often: raise optim.grad_accum (fewer gradient "
            "all-reduces per sample).")


def _tiny_operators(row: dict[str, Any], facts: RunFacts, part: str) -> bool:
    """Whether the step's operators are so small that their count, not their work,
    sets the time (:func:`operator_time` under :data:`TINY_OPERATOR` launches)."""
    each = operator_time(row)
    return part == "host" if each is None else each < TINY_OPERATOR * facts.peaks["launch_s"]


def operator_time(row: dict[str, Any]) -> float | None:
    """The mean seconds inside one operator of forward, backward and the optimizer step
    in an accounting row (None: the op clock counted none).

    Example:
        >>> operator_time({"forward": 0.001, "backward": 0.002, "optimizer": 0.0,
        ...                "ops": {"forward": 10, "backward": 20, "optimizer": 0}})
        0.0001
    """
    ops = row.get("ops") or {}
    count = sum(ops.get(p, 0.0) for p in ("forward", "backward", "optimizer"))
    if not count:
        return None
    return sum(row.get(p) or 0.0 for p in ("forward", "backward", "optimizer")) / count
