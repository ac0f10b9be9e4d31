"""The rules that read when ranks arrive at the gradient all-reduce
(:mod:`gpufleet.monitor.arrival`): the straggler, and communication-bound.

Every rank's step lasts as long as the slowest rank's (the all-reduce evens them out),
so a rank's *own* time is its step minus what it waited at the end of backward. The rank
with the most own time is the straggler; where its extra time sits (data, forward,
backward, optimizer, callbacks/logging, GC pauses) is the phase to fix. What the last
rank to arrive still waits is the all-reduce's own cost, with the wait for late ranks
subtracted: only that can make a run communication-bound.
"""

from __future__ import annotations

from gpufleet.monitor.findings import Finding, RunFacts, Summary
from gpufleet.monitor.links import link_sentence, slow_node_fix, slow_nodes

# How the phases are named in findings ("other" holds the step-end callbacks and the log).
_PHASE_WORDS = {"data": "data loading", "forward": "forward", "backward": "backward",
                "optimizer": "the optimizer step", "other": "callbacks and logging",
                "gc": "garbage-collection pauses"}
_KIND = {"data": "input-bound", "forward": "forward", "backward": "backward",
         "optimizer": "optimizer step", "other": "callbacks/logging", "gc": "GC pauses"}
_STEP_KEYS = ("data", "forward", "backward", "optimizer", "other")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def measured_waits(s: Summary) -> list[float] | None:
    """Every rank's wait at the end of backward, per step, when every rank measured it
    (None otherwise: no DDP all-reduce, another hook, an old run)."""
    rows = {r["rank"]: r for r in s.rank_arrival}
    if len(s.rank_phases) < 2 or any(p["rank"] not in rows for p in s.rank_phases):
        return None
    waits = [rows[p["rank"]]["wait"] for p in s.rank_phases]
    return None if min(waits) < 0 else waits


def own_phases(s: Summary, waits: list[float]) -> list[dict[str, float]]:
    """Each rank's own seconds per step in each phase (backward without its wait, GC
    pauses apart from the phase they fell in: counted in ``gc`` and ``total``)."""
    gcs = {r["rank"]: r.get("gc", 0.0) for r in s.rank_arrival}
    own = []
    for p, wait in zip(s.rank_phases, waits, strict=True):
        row = {k: p[k] for k in _STEP_KEYS}
        row["backward"] = max(0.0, row["backward"] - wait)
        row["gc"] = gcs.get(p["rank"], 0.0)
        row["total"] = sum(row[k] for k in _STEP_KEYS)
        own.append(row)
    return own


def straggler(s: Summary, facts: RunFacts) -> Finding | None:
    """The rank the others wait for, and the phase its extra time goes to."""
    waits = measured_waits(s)
    if waits is None:
        return None
    own = own_phases(s, waits)
    slow = max(range(len(own)), key=lambda i: own[i]["total"])
    rest = [o for i, o in enumerate(own) if i != slow]
    typical = _median([o["total"] for o in rest])
    excess = own[slow]["total"] - typical
    if excess < max(0.15 * s.step_s, 2e-3):
        return None
    extra = {k: own[slow][k] - _median([o[k] for o in rest]) for k in (*_STEP_KEYS, "gc")}
    # A GC pause is inside some phase: it wins when it explains most of the excess.
    phase = "gc" if extra["gc"] >= 0.5 * excess else max(_STEP_KEYS, key=extra.__getitem__)
    rank = s.rank_phases[slow]["rank"]
    share = extra[phase] / excess
    others_wait = _median([w for i, w in enumerate(waits) if i != slow])
    message = (f"rank {rank} spends {_ms(own[slow]['total'])} per step on its own work, the "
               f"other ranks {_ms(typical)}; they wait for it in the gradient all-reduce "
               f"({_ms(others_wait)} per step at the end of their backward, rank {rank} "
               f"{_ms(waits[slow])}). Its extra {_ms(excess)} goes to "
               f"{_PHASE_WORDS[phase]}: {_ms(own[slow][phase])} against "
               f"{_ms(_median([o[phase] for o in rest]))} elsewhere.")
    runner_up = max((k for k in (*_STEP_KEYS, "gc") if k != phase), key=extra.__getitem__)
    if share < 0.6 and extra[runner_up] > 0.25 * excess:
        message += (f" Part of it ({_ms(extra[runner_up])}) sits in "
                    f"{_PHASE_WORDS[runner_up]}: both are plausible places to look.")
    confidence = "high" if share >= 0.6 and excess >= 0.25 * s.step_s else "medium"
    return Finding("straggler", "warn", f"rank {rank} is the straggler ({_KIND[phase]})",
                   message, _straggler_fix(rank, phase), confidence=confidence,
                   measurements={"rank": rank, "phase": phase, "excess_s": excess,
                                 "own_s": [o["total"] for o in own], "wait_s": waits,
                                 "phase_excess_s": extra, "step_s": s.step_s})


def _straggler_fix(rank: int, phase: str) -> str:
    if phase == "data":
        return (f"make rank {rank}'s input as fast as the others': its node's storage and "
                "CPU load, data.num_workers, or uneven sample sizes (data.batching=tokens "
                "evens out the work per batch).")
    if phase == "gc":
        return (f"rank {rank} pauses for garbage collection: keep fewer Python objects "
                "alive per step (lists of tensors, per-sample dicts), or call gc.freeze() "
                "after setup.")
    if phase == "other":
        return (f"look at what rank {rank} does between steps (callbacks, metrics, "
                "logging): move the work to one interval or to every rank alike.")
    where = {"forward": "its forward", "backward": "its backward",
             "optimizer": "its optimizer step"}[phase]
    return (f"check what makes {where} slower on rank {rank}: its batches (uneven sizes "
            "or lengths), its device (clocks, temperature, other processes or fewer "
            f"threads: `gpufleet top` on its node) and code that runs on rank {rank} only.")


def communication_bound(s: Summary, facts: RunFacts) -> Finding | None:
    """Communication-bound when the all-reduce itself is slow: the last rank to arrive
    still waits most of the step. Without that measurement, only several nodes can make
    it plausible (and then a straggler in backward is as plausible)."""
    waits = measured_waits(s)
    if waits is None:
        return _unmeasured(s, facts)
    comm = min(waits)  # the last rank to arrive waits for nobody: the transfer alone
    if comm < max(0.3 * s.step_s, 2e-3):
        return None
    grad_bytes = max((r.get("grad_bytes", 0.0) for r in s.rank_arrival), default=0.0)
    several = facts.world > facts.local_world
    measured_slow = bool(slow_node_fix(facts.links))
    message = (f"the last rank to reach the gradient all-reduce still waits {_ms(comm)} of "
               f"each {_ms(s.step_s)} step ({comm / s.step_s:.0%}) for it to finish, "
               f"moving {grad_bytes / 2**20:.3g} MiB of gradients per step (the wait for "
               f"late ranks is not counted: the others wait {_ms(max(waits))} at most).")
    if facts.links:
        message += " " + link_sentence(facts.links)
    fix = (f"raise optim.grad_accum from {facts.grad_accum} to {2 * facts.grad_accum} (one "
           f"all-reduce per {2 * facts.grad_accum} micro-batches) or data.batch_size, or "
           f"raise parallel.ddp.bucket_cap_mb from {facts.bucket_cap_mb:g} to "
           f"{max(50.0, 2 * facts.bucket_cap_mb):g} (fewer, larger messages)")
    if measured_slow and facts.comm_hooks:  # a link measured slow: send fewer bytes
        fix += (", send fewer bytes with parallel.ddp.comm_hook=powersgd (low-rank) or "
                "fp16 (half the bytes), or average less often with --strategy local_sgd")
    if measured_slow:
        fix += ". Or " + slow_node_fix(facts.links)
    elif several:
        fix += (". Measure each node's link with `gpufleet bench allreduce` run on every "
                "node with the run's --nnodes/--node-rank/--master-addr")
    fix += "."
    if several:
        severity, confidence = "warn", "high" if measured_slow else "medium"
    else:
        # One node: nothing says the all-reduce is slow for its bytes (no link to
        # measure it against); gloo reduces on a CPU that may be busy with other work.
        severity, confidence = "info", "low"
        message += (" On one node no link was measured slow: a busy CPU (gloo reduces "
                    "on the CPU) or the gradients' size may be the cause; "
                    "`gpufleet bench allreduce` measures what this node's all-reduce can "
                    "do.")
    return Finding("communication-bound", severity, "communication-bound", message, fix,
                   changes={"optim.grad_accum": 2 * facts.grad_accum},
                   confidence=confidence,
                   measurements={"comm_s": comm, "wait_s": waits, "grad_bytes": grad_bytes,
                                 "step_s": s.step_s, "nodes": facts.world // max(
                                     1, facts.local_world)})


def _unmeasured(s: Summary, facts: RunFacts) -> Finding | None:
    """Several nodes, no arrival measurement (FSDP, a compression hook): a backward far
    longer than twice the forward on every rank points at the link or at a straggler."""
    if facts.world <= facts.local_world:
        return None  # one node: no link to blame without a measurement
    waits = [p["backward"] - 2 * p["forward"] for p in s.rank_phases]
    wait = min(waits)
    if wait < max(0.3 * s.step_s, 2e-3):
        return None
    message = (f"backward takes {_ms(min(p['backward'] for p in s.rank_phases))} against "
               f"{_ms(min(p['forward'] for p in s.rank_phases))} of forward on every rank "
               f"(it usually computes about twice the forward): about {_ms(wait)} of each "
               f"{_ms(s.step_s)} step ({wait / s.step_s:.0%}) is spent waiting. Two causes "
               "are plausible and this run cannot tell them apart: a slow link between the "
               "nodes, or one rank whose backward does extra work (the all-reduce makes "
               "every rank wait for it).")
    if facts.links:
        message += " " + link_sentence(facts.links)
    fix = (f"raise optim.grad_accum from {facts.grad_accum} to {2 * facts.grad_accum} "
           "(fewer all-reduces hide either cause)")
    if slow_node_fix(facts.links) and facts.comm_hooks:  # a link measured slow
        fix += (", send fewer bytes with parallel.ddp.comm_hook=powersgd (low-rank) or "
                "fp16 (half the bytes), or average less often with --strategy local_sgd")
    if slow_node_fix(facts.links):
        fix += ". Or " + slow_node_fix(facts.links)
    else:
        fix += (". Find the node behind the slowest link with `gpufleet bench allreduce` "
                "run on every node with the run's --nnodes/--node-rank/--master-addr")
    slow = ", ".join(str(n["node"]) for n in slow_nodes(facts.links))
    return Finding("communication-bound", "warn", "communication-bound (or a straggler)",
                   message, fix + ".", changes={"optim.grad_accum": 2 * facts.grad_accum},
                   confidence="medium" if slow else "low",
                   measurements={"wait_s": wait, "step_s": s.step_s})
