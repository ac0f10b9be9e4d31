"""Diagnosis rules about what surrounds the step: other processes taking the node's
cores, more torch threads than cores, time spent between steps (evaluation,
checkpoints) and slow log callbacks (metric sinks).

Each rule has the signature of :mod:`gpufleet.monitor.diagnose`'s rules and returns a
:class:`~gpufleet.monitor.diagnose.Finding` or None. ``system`` is the system sampler's
newest sample, with ``host_view`` (:func:`host_view`, averaged over recent samples)
added by the advisor when it has one.
"""

from __future__ import annotations

import math
from typing import Any

from gpufleet.monitor.findings import Finding, RunFacts, Summary, ms

#: share of the node's cores other processes must use, and how busy the node must be
CONTENTION_OTHERS = 0.2
CONTENTION_BUSY = 0.8
#: share of the run's time between steps (evaluation, checkpoints) that is a finding
OUTSIDE_SHARE = 0.2
#: share of the step time spent in log callbacks that is a finding, and the least time
#: per log interval (a line written to a local file is not one, however short the step)
LOGGING_SHARE = 0.1
LOGGING_FLOOR_S = 0.005


def host_view(samples: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The node's CPU over ``samples`` (oldest first; the first one is left out when
    there are more, its counters read since an earlier moment): cores, cores busy, the
    run's own processes' cores, the other processes' mean cores, busiest first, and the
    samples it rests on.

    Example:
        >>> s = {"cpu_pct": [100.0, 90.0], "proc_cpu_pct": 50.0,
        ...      "others": [{"pid": 7, "name": "stress", "cpu_pct": 130.0}]}
        >>> v = host_view([s])
        >>> v["cores"], v["busy"], v["ours"], v["others"][0]["cores"]
        (2, 1.9, 0.5, 1.3)
    """
    usable = samples[1:] if len(samples) > 1 else samples
    usable = [s for s in usable if s.get("cpu_pct")]
    if not usable:
        return None
    n = len(usable)
    others: dict[tuple[int, str], float] = {}
    for s in usable:
        for p in s.get("others", []):
            key = (p["pid"], p["name"])
            others[key] = others.get(key, 0.0) + p["cpu_pct"] / 100 / n
    return {
        "cores": len(usable[-1]["cpu_pct"]),
        "samples": n,
        "busy": round(sum(sum(s["cpu_pct"]) for s in usable) / 100 / n, 2),
        "ours": round(sum(s.get("proc_cpu_pct", 0.0) for s in usable) / 100 / n, 2),
        "others": [{"pid": pid, "name": name, "cores": round(c, 2)} for (pid, name), c
                   in sorted(others.items(), key=lambda kv: -kv[1])],
    }


def _cpu_contention(s: Summary, facts: RunFacts, system: dict[str, Any] | None,
                    *_: Any) -> Finding | None:
    view = (system or {}).get("host_view") or (host_view([system]) if system else None)
    if not view:
        return None
    cores, others = view["cores"], view["others"]
    taken = sum(p["cores"] for p in others)
    if taken < max(0.5, CONTENTION_OTHERS * cores) or view["busy"] < CONTENTION_BUSY * cores:
        return None
    names = ", ".join(f"{p['name']} (pid {p['pid']}): {p['cores']:.1f} core(s)"
                      for p in others[:3])
    free = max(1, int(cores - taken) // max(1, facts.local_world))
    message = (f"other processes use {taken:.1f} of this node's {cores} cores "
               f"({taken / cores:.0%}): {names}. The node is {view['busy'] / cores:.0%} "
               f"busy; the run's own processes get {view['ours']:.1f} core(s) for "
               f"{facts.local_world} rank(s) of {facts.torch_threads} torch thread(s)")
    fix = "stop, pause or move those processes (or run on a node of your own)"
    if facts.torch_threads <= free:  # nothing to change in the run itself
        return Finding("cpu-contention", "info", "other processes take the CPU",
                       message + ".", fix + ".")
    message += (f", more than the {free} core(s) per rank left free: the threads of one "
                "operation wait for each other behind the others' work.")
    fix += (f"; if they must stay, give each rank only the cores left: "
            f"OMP_NUM_THREADS={free}.")
    return Finding("cpu-contention", "warn", "other processes take the CPU", message, fix,
                   changes={"env.OMP_NUM_THREADS": free})


def _threads_beyond_cores(s: Summary, facts: RunFacts, *_: Any) -> Finding | None:
    if facts.device != "cpu":
        return None
    threads = facts.torch_threads * facts.local_world
    if threads <= facts.cores:
        return None
    per_rank = max(1, facts.cores // max(1, facts.local_world))
    message = (f"{facts.local_world} rank(s) x {facts.torch_threads} torch thread(s) = "
               f"{threads} threads on {facts.cores} usable core(s): the threads of one "
               "operation wait for each other while the scheduler swaps them, and every "
               "step slows down.")
    fix = (f"set OMP_NUM_THREADS={per_rank} (or leave it unset: gpufleet gives each of "
           f"{facts.local_world} rank(s) {per_rank}), and do not raise "
           "torch.set_num_threads above it in your code.")
    return Finding("thread-oversubscription", "warn", "more threads than cores", message,
                   fix, changes={"env.OMP_NUM_THREADS": per_rank})


_OUTSIDE_KEYS = {"checkpoint": ("checkpoint.every", "checkpoint_every"),
                 "eval": ("run.eval_every", "eval_every")}


def _time_outside_steps(s: Summary, facts: RunFacts, *_: Any) -> Finding | None:
    total = sum(t for t, _ in s.outside.values())
    if total <= 0 or s.train_s <= 0:
        return None
    share = total / (total + s.train_s)
    if share < OUTSIDE_SHARE:
        return None
    kind = max(s.outside, key=lambda k: s.outside[k][0])
    seconds, count = s.outside[kind]
    each = seconds / max(1, count)
    key, attr = _OUTSIDE_KEYS.get(kind, (f"{kind} interval", ""))
    every = getattr(facts, attr, 0) if attr else 0
    what = "checkpoint writes" if kind == "checkpoint" else "evaluations"
    if facts.own_loop:
        return _own_loop_outside(s, facts, kind, what, share)
    # Steps between two of them so that they take 5% of the time: each <= 0.05 (each +
    # every * step).
    wanted = max(2 * every, math.ceil(19 * each / max(s.step_s, 1e-6)))
    message = (f"{what} take {each:.2f} s each, {count} so far, every {every} step(s) of "
               f"{ms(s.step_s)}: {share:.0%} of the run's time goes to work between "
               "training steps.")
    fix = f"raise {key} from {every} to {_nice(wanted)} (about 5% of the time then)"
    changes = {key: _nice(wanted)} if attr else {}
    if kind == "eval":
        fix += ", or evaluate on fewer batches (run.eval_batches)"
    elif not facts.checkpoint_async and facts.async_save_possible:
        # The write itself (a slow or shared file system) then leaves the step's path;
        # only the copy to host memory still stops training.
        fix += (", or set checkpoint.async_save=true: the file is then written by a "
                "writer thread while training goes on")
    return Finding("time-outside-steps", "warn", f"{what} eat the run", message, fix + ".",
                   changes=changes)


def _own_loop_outside(s: Summary, facts: RunFacts, kind: str, what: str,
                      share: float) -> Finding:
    """:func:`_time_outside_steps` for a Fleet loop: the loop decides when it evaluates
    and saves, so the count and cadence are what it was seen doing (an evaluation is
    one run of eval forwards between optimizer steps) and the fix is in words, with no
    config key (no ``run.eval_every`` or ``checkpoint.every`` is read there)."""
    seconds, timed = s.outside[kind]
    count = facts.evaluations if kind == "eval" and facts.evaluations else timed
    each = seconds / max(1, count)
    every = facts.eval_every if kind == "eval" else 0
    if not every and count and facts.steps:  # (saves: steps per save, on average)
        every = max(1, round(facts.steps / count))
    wanted = max(2 * every, math.ceil(19 * each / max(s.step_s, 1e-6)))
    cadence = f"every {every} step(s)" if every else "at intervals not yet seen"
    message = (f"{what} take {each:.2f} s each, {count} so far, {cadence} of "
               f"{ms(s.step_s)}: {share:.0%} of the run's time goes to work between "
               "training steps.")
    if kind == "eval":
        fix = (f"evaluate less often in your loop: {cadence} now, every {_nice(wanted)} "
               "would take about 5% of the time; or evaluate on fewer batches")
    else:
        fix = (f"call fleet.save less often in your loop: {cadence} now, every "
               f"{_nice(wanted)} would take about 5% of the time")
        if not facts.checkpoint_async and facts.async_save_possible:
            fix += (", or pass Fleet(overrides={'checkpoint.async_save': True}): the "
                    "file is then written by a writer thread while training goes on")
    return Finding("time-outside-steps", "warn", f"{what} eat the run", message, fix + ".",
                   measurements={"each_s": each, "count": count, "every": every})


def _slow_logging(s: Summary, facts: RunFacts, *_: Any) -> Finding | None:
    if not s.log_callbacks or s.steps <= 0 or s.step_s <= 0:
        return None
    name, seconds = max(s.log_callbacks.items(), key=lambda kv: kv[1])
    per_step = seconds / s.steps
    share = per_step / s.step_s
    every = facts.log_every
    if share < LOGGING_SHARE or per_step * every < LOGGING_FLOOR_S:
        return None
    wanted = _nice(math.ceil(every * share / 0.02))
    message = (f"{name}.on_log takes {per_step * every * 1e3:.0f} ms at each log interval "
               f"(every {every} step(s)): {ms(per_step)} per {ms(s.step_s)} step "
               f"({share:.0%}), while training waits.")
    fix = (f"raise log.every from {every} to {wanted}, or make {name} cheaper (write in "
           "a background thread, batch its writes, check its destination).")
    return Finding("slow-logging", "warn", f"slow log callback: {name}", message, fix,
                   changes={"log.every": wanted})


def _nice(n: int) -> int:
    """``n`` rounded up to 1, 2 or 5 times a power of ten."""
    n = max(1, n)
    scale = 10 ** (len(str(n)) - 1)
    return next(m * scale for m in (1, 2, 5, 10) if m * scale >= n)


HOST_RULES = (_threads_beyond_cores, _cpu_contention, _time_outside_steps, _slow_logging)
