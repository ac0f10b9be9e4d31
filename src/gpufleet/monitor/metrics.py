"""The monitoring fields of a ``metrics.jsonl`` train record, from the raw numbers the
loop gathered once per log interval."""

from __future__ import annotations

from typing import Any

from gpufleet.monitor.accounting import CLOCK
from gpufleet.monitor.arrival import ARRIVAL
from gpufleet.monitor.opclock import OPS
from gpufleet.monitor.phases import PHASES


def phase_metrics(table: list[float], world: int, rank: int,
                  device: list[float] | None = None) -> dict[str, Any]:
    """Per-rank phase times (a flat ``[world, phases]`` table, mean seconds per step).

    Returns ``phases`` (this rank's), ``rank_phases`` (every rank's),
    ``data_wait_share`` (the mean over ranks of the data wait's share of the step) and,
    on CUDA, ``device_phases`` (this rank's CUDA-stream times).

    Example:
        >>> m = phase_metrics([0.1, 0.2, 0.3, 0.1, 0.3, 0.0, 0.2, 0.3, 0.1, 0.4], 2, 0)
        >>> m["phases"]["data"], round(m["data_wait_share"], 3)
        (0.1, 0.05)
    """
    n = len(PHASES)
    rows = [table[r * n:(r + 1) * n] for r in range(world)]
    shares = [row[0] / sum(row) for row in rows if sum(row) > 0]
    out: dict[str, Any] = {
        "phases": dict(zip(PHASES, rows[rank])),
        "rank_phases": [{"rank": r, **dict(zip(PHASES, row))} for r, row in enumerate(rows)],
        "data_wait_share": sum(shares) / len(shares) if shares else 0.0,
    }
    if device is not None:
        out["device_phases"] = dict(zip(PHASES, device))
    return out


def arrival_metrics(table: list[float], world: int) -> list[dict[str, Any]]:
    """Every rank's waits for the others, GC pauses, gradient bytes and pipeline stage
    (a flat ``[world, ARRIVAL]`` table, mean per step); a wait of -1 means not measured.

    Example:
        >>> table = [0.01, 0.0, 4e6, 0.003, 0.0, -1.0, 0.002, 0.001, 4e6, 0.001, 0.0, -1.0]
        >>> row = arrival_metrics(table, 2)[1]
        >>> row["wait"], row["wait_fwd"], row["stage"]
        (0.002, 0.001, -1.0)
    """
    n = len(ARRIVAL)
    return [{"rank": r, **dict(zip(ARRIVAL, table[r * n:(r + 1) * n]))} for r in range(world)]


def clock_metrics(table: list[float], world: int) -> list[dict[str, Any]]:
    """Every rank's step clock for the accounting (a flat ``[world, CLOCK]`` table,
    mean seconds per step: wall time, evaluation, checkpoints).

    Example:
        >>> clock_metrics([0.1, 0.0, 0.02, 0.11, 0.0, 0.02], 2)[1]["wall"]
        0.11
    """
    n = len(CLOCK)
    return [{"rank": r, **dict(zip(CLOCK, table[r * n:(r + 1) * n]))} for r in range(world)]


def ops_metrics(table: list[float], world: int) -> list[dict[str, Any]]:
    """Every rank's op clock row for the accounting (a flat ``[world, OPS]`` table:
    seconds per step inside operators in forward, backward and the optimizer step, -1
    when not sampled, then the operators counted in each).

    Example:
        >>> row = [0.01, 0.02, 0.001, 20.0, 36.0, 4.0]
        >>> ops_metrics([*row, -1.0, -1.0, -1.0, 0.0, 0.0, 0.0], 2)[0]["count_backward"]
        36.0
    """
    n = len(OPS)
    return [{"rank": r, **dict(zip(OPS, table[r * n:(r + 1) * n]))} for r in range(world)]


def flops_metrics(flops_per_step: float, step_time_s: float,
                  peak_flops: float | None) -> dict[str, Any]:
    """Achieved TFLOP/s of one rank and, when the device's peak is known, its MFU.

    Example:
        >>> flops_metrics(2e12, 0.01, 400e12)
        {'tflops': 200.0, 'mfu': 0.5}
    """
    achieved = flops_per_step / step_time_s
    out: dict[str, Any] = {"tflops": achieved / 1e12}
    if peak_flops:
        out["mfu"] = achieved / peak_flops
    return out
