"""The stall report: which rank is behind, and what the others wait in.

:class:`~gpufleet.fault.watchdog.Watchdog` writes it from every rank's heartbeat (step,
phase, since when) when a step stalls, or when a rank stops answering.
"""

from __future__ import annotations

from typing import Any

from gpufleet.core.phases import Phase
from gpufleet.fault.procstate import state_words

# Where a phase sits in the progress of a rank: steps done × 10 + this offset. Phases
# after "end" belong to the step just done; data/forward/backward/optimizer to the next.
_OFFSET = {Phase.END: 0, Phase.LOG: 1, Phase.EVAL: 2, Phase.CHECKPOINT: 3, Phase.DATA: 4,
           Phase.FORWARD: 5, Phase.BACKWARD: 6, Phase.OPTIMIZER: 7}
# What a rank in each phase is doing, for the report.
DOING = {
    "setup": "setting up",
    Phase.DATA: "loading the next batch (no collective)",
    Phase.FORWARD: "the forward pass",
    Phase.BACKWARD: "backward (with ddp: the gradient all-reduce that ends it)",
    Phase.OPTIMIZER: "the optimizer step (with fault.skip_nonfinite: the non-finite flag "
                     "all-reduce)",
    Phase.END: "finishing the step",
    Phase.LOG: "the metrics all-reduce of the log interval",
    Phase.EVAL: "evaluation (its loss all-reduce at the end)",
    Phase.CHECKPOINT: "saving a checkpoint (the gather of every rank's RNG state)",
}


def where_is(beat: dict[str, Any]) -> str:
    """The node, host and pid of the rank whose heartbeat is ``beat``."""
    addr = f", {beat['addr']}" if beat.get("addr") else ""
    return (f"node {beat.get('node', '?')}{addr}, host {beat.get('host', '?')}, "
            f"pid {beat.get('pid', '?')}")


def stall_report(beats: list[dict[str, Any] | None], now: float,
                 silent_after: float | None = None) -> str:
    """Name the rank(s) that stopped answering, those that are behind, and what the
    others wait in.

    A beat with ``age_s`` (seconds since it last changed) above ``silent_after`` is a rank
    that stopped answering: it is named as such, and not as "behind". The first line is
    the summary; one line per rank follows.

    Example:
        >>> beats = [{"rank": 0, "step": 7, "phase": "backward", "phase_since": 0.0},
        ...          {"rank": 1, "step": 7, "phase": "data", "phase_since": 0.0}]
        >>> stall_report(beats, 9.0).splitlines()[0][:66]
        'rank 1 is behind: step 8, loading the next batch (no collective) f'
    """
    gone = [b for b in beats if b and silent_after is not None
            and b.get("age_s", 0.0) > silent_after]
    known = [b for b in beats if b and b not in gone]
    silent = [r for r, b in enumerate(beats) if not b]
    where = {b["rank"]: b["step"] * 10 + _OFFSET.get(b["phase"], 0) for b in known}
    lines = []
    for b in gone:
        why = state_words(b.get("proc_state", ""), b.get("pid", "?"), b.get("host", "?"))
        lines.append(f"rank {b['rank']} ({where_is(b)}) stopped answering: no heartbeat for "
                     f"{b['age_s']:.0f} s (last seen with {b['step']} steps done, phase "
                     f"{b['phase']!r}); {why or 'its node is down or cut off'}, it is not "
                     "slow")
    if known:
        low = min(where.values())
        behind = [b for b in known if where[b["rank"]] == low]
        ahead = [b for b in known if where[b["rank"]] != low]
        b0 = behind[0]
        step = b0["step"] + (1 if _OFFSET.get(b0["phase"], 0) >= 4 else 0)
        doing = f"{DOING.get(b0['phase'], b0['phase'])} for {now - b0['phase_since']:.1f} s"
        ranks = ", ".join(str(b["rank"]) for b in behind)
        if gone:
            lines.append(f"still answering: rank {', '.join(str(b['rank']) for b in known)}"
                         f" (rank {ranks} at step {step}, {doing}), waiting for the lost "
                         "rank(s)")
        elif len(known) == 1 and not silent:
            lines.append(f"rank {ranks}: step {step}, {doing}")
        elif ahead:
            waits = sorted({DOING.get(b["phase"], b["phase"]) for b in ahead})
            others = ", ".join(str(b["rank"]) for b in ahead)
            lines.append(f"rank {ranks} {'is' if len(behind) == 1 else 'are'} behind: "
                         f"step {step}, {doing}; rank {others} "
                         f"{'waits' if len(ahead) == 1 else 'wait'} in {'; '.join(waits)}")
        else:
            lines.append(f"every rank is at the same point: step {step}, {doing} (a "
                         "collective or the device itself is stuck; see the stacks)")
    if silent:
        lines.append(f"no heartbeat from rank {', '.join(map(str, silent))} (dead or "
                     "never started)")
    for b in known:
        lines.append(f"  rank {b['rank']}: {b['step']} steps done, phase {b['phase']!r} "
                     f"for {now - b['phase_since']:.1f} s (host {b.get('host', '?')}, "
                     f"pid {b.get('pid', '?')})")
    return "\n".join(lines)
