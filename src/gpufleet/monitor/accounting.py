"""Step accounting: where every rank's measured step went, part by part, and what the
parts leave unexplained (the residual).

Two independent clocks meet here, once per log interval. The step clock is the log
interval's own (:class:`gpufleet.train.engine.interval.LogInterval`): the wall time from
one log line's reduction to the next, evaluation and checkpoints included, divided by
the steps; nothing in it knows about phases. The parts come from the loop's phase marks
(:class:`gpufleet.monitor.phases.PhaseTimer`), split further with what the collectives'
hooks measured (:class:`gpufleet.monitor.arrival.ArrivalTimer`):

- ``data``: waiting for the next batch (the data phase).
- ``forward``: the forward phase less the time inside collectives begun there (fsdp's
  all-gathers; a pipeline stage's schedule outside its own micro-batches).
- ``backward``: backward compute: the backward phase less the time inside its
  collectives (ddp: from the last gradient bucket ready to the end of backward; fsdp:
  the reduce-scatters, hsdp's all-reduce; pipeline: the loss broadcast).
- ``exposed_comm``: collective time no compute hid, on every rank of the group: the
  least any rank spent inside the collectives (the rank that arrived last waits only
  for the transfer).
- ``late_ranks``: waiting for late ranks: what this rank spent inside the collectives
  beyond that least (a rank that arrived ``x`` ms earlier waits ``x`` ms more).
- ``optimizer``: unscale, guard, clip, step, zero_grad.
- ``host``: host overhead: on a CPU, the time of forward, backward and the optimizer
  step (less their collectives) spent outside any operator: Python between the
  operators, the dispatcher, hooks. Measured on a sampled step by
  :class:`gpufleet.monitor.opclock.OpClock` (the time inside operators, per phase),
  taken from each phase of the interval, so ``forward``, ``backward`` and
  ``optimizer`` are then the time inside their operators. None where not measured
  (CUDA: an operator returns once its kernel is queued, so its time is the launch, not
  the work; torch.compile; before the first sample): there it stays inside its phase.
- ``eval_checkpoint``: evaluation and checkpoints, per step of the interval they ran in.
- ``other``: the log line, callbacks and the rest between steps.

``residual`` is the step clock less the parts' sum: kept as measured, never forced to
zero. It holds what no mark covers (the time before a run's first step, a recovery)
and any part measured larger than the phase that holds it (a part is never negative:
the excess shows here). Under pipeline the stage's forward phase holds both directions
of its micro-batches, so ``forward`` holds its backward compute too. Host overhead
only moves time between parts of one phase: it never changes the residual.

Example:
    >>> phases = [{"rank": 0, "data": 0.01, "forward": 0.02, "backward": 0.05,
    ...            "optimizer": 0.01, "other": 0.001}]
    >>> arrival = [{"rank": 0, "wait": 0.02, "wait_fwd": 0.0}]
    >>> clock = [{"rank": 0, "wall": 0.092, "eval": 0.0, "checkpoint": 0.0}]
    >>> row = rank_accounting(phases, arrival, clock)[0]
    >>> round(row["backward"], 3), round(row["exposed_comm"], 3), round(row["residual"], 3)
    (0.03, 0.02, 0.001)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: The parts of a step, in the order the report stacks them.
PARTS = ("data", "forward", "backward", "exposed_comm", "late_ranks", "optimizer", "host",
         "eval_checkpoint", "other")
#: What each rank adds to the log interval's table for the accounting (mean seconds per
#: step): the step clock's wall time, evaluation's and checkpoints' host time.
CLOCK = ("wall", "eval", "checkpoint")
#: The residual, as a share of the measured step, above which the accounting is off.
TOLERANCE = 0.05


def rank_accounting(rank_phases: Sequence[dict[str, Any]],
                    rank_arrival: Sequence[dict[str, Any]] | None,
                    rank_clock: Sequence[dict[str, Any]],
                    rank_ops: Sequence[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Every rank's parts of its step, its measured step and the residual (seconds per
    step; see the module docs).

    Args:
        rank_phases: per rank, the phase timer's mean seconds per step (``data``,
            ``forward``, ``backward``, ``optimizer``, ``other``).
        rank_arrival: per rank, the arrival timer's row (``wait``: seconds inside the
            collectives begun in backward, -1 when not measured; ``wait_fwd``: in
            forward), or None when it did not run.
        rank_clock: per rank, :data:`CLOCK`'s values.
        rank_ops: per rank, the op clock's row (:data:`gpufleet.monitor.opclock.OPS`:
            seconds per step inside operators in ``ops_forward``, ``ops_backward``,
            ``ops_optimizer``, -1 when not sampled), or None when it did not run.

    Returns:
        One dict per rank: ``rank``, each of :data:`PARTS` (``host`` None: not
        measured), ``step`` (the step clock), ``residual``, ``residual_share``
        (residual / step), ``comm_measured`` (whether the collectives' time was
        measured apart from the phases holding them) and ``ops`` (operators per step
        in forward, backward and the optimizer step, as the sample that measured
        ``host`` counted them; absent without one).
    """
    comm = [_comm(rank_arrival, r) for r in range(len(rank_phases))]
    measured = [c for c in comm if c is not None]
    # The least any rank of the group spent inside the collectives: the transfer itself.
    exposed = min(fwd + bwd for fwd, bwd in measured) if measured else 0.0
    rows = []
    for r, phases in enumerate(rank_phases):
        clock = rank_clock[r] if r < len(rank_clock) else {}
        fwd_wait, bwd_wait = comm[r] if comm[r] is not None else (0.0, 0.0)
        inside = fwd_wait + bwd_wait
        row: dict[str, Any] = {
            "rank": int(phases.get("rank", r)),
            "data": phases["data"],
            "forward": max(0.0, phases["forward"] - fwd_wait),
            "backward": max(0.0, phases["backward"] - bwd_wait),
            "exposed_comm": min(exposed, inside) if comm[r] is not None else 0.0,
            "late_ranks": max(0.0, inside - exposed) if comm[r] is not None else 0.0,
            "optimizer": phases["optimizer"],
            "host": None,
            "eval_checkpoint": clock.get("eval", 0.0) + clock.get("checkpoint", 0.0),
            "other": phases["other"],
        }
        _split_host(row, rank_ops[r] if rank_ops and r < len(rank_ops) else None)
        step = float(clock.get("wall", 0.0))
        total = sum(row[p] or 0.0 for p in PARTS)
        row["step"] = step
        row["residual"] = step - total
        row["residual_share"] = (step - total) / step if step > 0 else 0.0
        row["comm_measured"] = comm[r] is not None
        rows.append(row)
    return rows


def _split_host(row: dict[str, Any], ops: dict[str, Any] | None) -> None:
    """Each compute part of ``row`` down to its time inside operators; what is left of
    the three is ``host`` (seconds per step). Not measured (no sample): unchanged."""
    if not ops or ops.get("ops_forward", -1.0) < 0:
        return
    host = 0.0
    for part in ("forward", "backward", "optimizer"):
        inside = min(row[part], max(0.0, float(ops[f"ops_{part}"])))
        host += row[part] - inside
        row[part] = inside
    row["host"] = host
    row["ops"] = {part: float(ops.get(f"count_{part}", 0.0))
                  for part in ("forward", "backward", "optimizer")}


def _comm(rank_arrival: Sequence[dict[str, Any]] | None, r: int) -> tuple[float, float] | None:
    """Rank ``r``'s seconds inside collectives in forward and backward (None: not
    measured)."""
    if not rank_arrival or r >= len(rank_arrival) or rank_arrival[r].get("wait", -1.0) < 0:
        return None
    row = rank_arrival[r]
    return float(row.get("wait_fwd", 0.0)), float(row["wait"])


def worst_residual(rows: Sequence[dict[str, Any]]) -> float:
    """The largest residual share over the ranks, by magnitude, with its sign (0.0 for
    none).

    Example:
        >>> worst_residual([{"residual_share": 0.01}, {"residual_share": -0.03}])
        -0.03
    """
    return max((r["residual_share"] for r in rows), key=abs, default=0.0)


def mean_accounting(records: Sequence[Sequence[dict[str, Any]]],
                    weights: Sequence[float]) -> list[dict[str, Any]]:
    """Per rank, the weighted mean of several intervals' accounting (weights: their
    steps); the residual share is recomputed from the means. A part measured in some
    intervals only (``host`` before the first sample) counts as 0 in the others, whose
    time stayed in the phases that held it.

    Example:
        >>> a = [{"rank": 0, "data": 0.1, "step": 0.2, "residual": 0.01, "host": None}]
        >>> b = [{"rank": 0, "data": 0.3, "step": 0.4, "residual": 0.03, "host": None}]
        >>> m = mean_accounting([a, b], [1, 1])[0]
        >>> round(m["data"], 3), round(m["residual_share"], 3), m["host"]
        (0.2, 0.067, None)
    """
    sums: dict[int, dict[str, Any]] = {}
    total = sum(weights)
    if not total:
        return []
    for rows, w in zip(records, weights):
        for row in rows:
            acc = sums.setdefault(int(row["rank"]), {"rank": int(row["rank"])})
            for key, value in row.items():
                if key == "rank":
                    continue
                if isinstance(value, bool):
                    acc[key] = value if key not in acc else (acc[key] and value)
                elif value is None:  # not measured: None unless another interval was
                    acc.setdefault(key, None)  # (its time then stayed in its phases)
                elif isinstance(value, (int, float)):
                    acc[key] = (acc.get(key) or 0.0) + value * w / total
                elif isinstance(value, dict):  # counts of one sample: the newest kept
                    acc[key] = dict(value)
    out = []
    for r in sorted(sums):
        acc = sums[r]
        step = acc.get("step", 0.0)
        acc["residual_share"] = acc.get("residual", 0.0) / step if step > 0 else 0.0
        out.append(acc)
    return out


def describe(row: dict[str, Any], part: str) -> str:
    """A part's time against the measured step, as findings cite it.

    Example:
        >>> describe({"data": 0.177, "step": 0.197}, "data")
        'data wait 177.0 ms of the 197.0 ms measured step (90%)'
    """
    label = _LABELS.get(part, part)
    value, step = row.get(part) or 0.0, row.get("step", 0.0)
    share = f" ({value / step:.0%})" if step > 0 else ""
    return f"{label} {value * 1e3:.1f} ms of the {step * 1e3:.1f} ms measured step{share}"


_LABELS = {"data": "data wait", "backward": "backward compute",
           "exposed_comm": "exposed communication", "late_ranks": "waiting for late ranks",
           "host": "host overhead", "eval_checkpoint": "checkpoint and evaluation"}


def run_residual(train: Sequence[dict[str, Any]]) -> tuple[float, float] | None:
    """How far a run's parts are from its measured steps: ``(mean, worst)``, each the
    residual share with the largest magnitude over the ranks; ``mean`` over the
    intervals after the first (which holds the start-up before the first step, no
    step's time), ``worst`` the worst single one of them. None: no accounting recorded.

    Args:
        train: the run's ``metrics.jsonl`` train records, in order.

    Example:
        >>> recs = [{"step": s, "rank_accounting": [{"rank": 0, "step": 0.1,
        ...          "residual": r, "residual_share": r / 0.1}]}
        ...         for s, r in ((5, 0.05), (10, 0.001), (15, -0.003))]
        >>> [round(v, 3) for v in run_residual(recs)]
        [-0.01, -0.03]
    """
    with_acc = [r for r in train if r.get("rank_accounting")]
    if not with_acc:
        return None
    steady = with_acc[1:] or with_acc
    weights = [max(1, r["step"] - p["step"]) for p, r in zip(with_acc, steady)] \
        if len(with_acc) > 1 else [1]
    mean = worst_residual(mean_accounting([r["rank_accounting"] for r in steady], weights))
    worst = max((worst_residual(r["rank_accounting"]) for r in steady), key=abs)
    return mean, worst
