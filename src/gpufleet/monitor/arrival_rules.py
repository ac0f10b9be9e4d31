"""The rules that read when ranks arrive at their collectives
(:mod:`gpufleet.monitor.arrival`): the straggler, the slow pipeline stage, and
communication-bound.

Every rank's step lasts as long as the slowest rank's (the collectives even them out),
so a rank's *own* time is its step minus what it waited for the others: at the end of
backward under ddp, in forward and backward under fsdp/hsdp, in a pipeline stage's sends
and receives. The rank with the most own time is the straggler; where its extra time
sits (data, forward, backward, optimizer, callbacks/logging, GC pauses) is the phase to
fix; under pipeline, a stage whose compute per micro-batch exceeds the others' is the
slow stage. What the last rank to arrive still waits is the collectives' own cost, with
the wait for late ranks subtracted: only that can make a run communication-bound.
"""

from __future__ import annotations

from statistics import median

from gpufleet.monitor.findings import Finding, RunFacts, Summary, ms
from gpufleet.monitor.links import link_sentence, slow_node_fix, slow_nodes

# How the phases are named in findings ("other" holds the step-end callbacks and the log).
_PHASE_WORDS = {"data": "data loading", "forward": "forward", "backward": "backward",
                "optimizer": "the optimizer step", "other": "callbacks and logging",
                "gc": "garbage-collection pauses"}
_KIND = {"data": "input-bound", "forward": "forward", "backward": "backward",
         "optimizer": "optimizer step", "other": "callbacks/logging", "gc": "GC pauses"}
_STEP_KEYS = ("data", "forward", "backward", "optimizer", "other")
# A rank whose own work per step exceeds the others' by this share of the step (and by
# 1 ms) is named at info level; from 15% (and 2 ms) on, as a warning.
SMALL_EXCESS = 0.05


def _arrival_rows(s: Summary) -> list[dict[str, float]] | None:
    """Every rank's arrival row, in the order of ``rank_phases``, when every rank
    measured its wait (None otherwise: no DDP all-reduce, another hook, an old run)."""
    rows = {r["rank"]: r for r in s.rank_arrival}
    if len(s.rank_phases) < 2 or any(p["rank"] not in rows for p in s.rank_phases):
        return None
    found = [rows[p["rank"]] for p in s.rank_phases]
    return None if min(r["wait"] for r in found) < 0 else found


def measured_waits(s: Summary) -> list[float] | None:
    """Every rank's wait for the others per step (forward and backward together), when
    every rank measured it (None otherwise)."""
    rows = _arrival_rows(s)
    return None if rows is None else [r["wait"] + r.get("wait_fwd", 0.0) for r in rows]


def own_phases(s: Summary, rows: list[dict[str, float]]) -> list[dict[str, float]]:
    """Each rank's own seconds per step in each phase (forward and backward without
    their waits, GC pauses apart from the phase they fell in: counted in ``gc`` and
    ``total``)."""
    own = []
    for p, r in zip(s.rank_phases, rows, strict=True):
        row = {k: p[k] for k in _STEP_KEYS}
        row["forward"] = max(0.0, row["forward"] - r.get("wait_fwd", 0.0))
        row["backward"] = max(0.0, row["backward"] - r["wait"])
        row["gc"] = r.get("gc", 0.0)
        row["total"] = sum(row[k] for k in _STEP_KEYS)
        own.append(row)
    return own


def _pipelined(rows: list[dict[str, float]]) -> bool:
    return any(r.get("stage", -1) >= 0 for r in rows)


def straggler(s: Summary, facts: RunFacts) -> Finding | None:
    """The rank the others wait for, and the phase its extra time goes to (under
    pipeline, a stage's compute is :func:`slow_stage`'s)."""
    rows = _arrival_rows(s)
    if rows is None:
        return None
    own = own_phases(s, rows)
    slow = max(range(len(own)), key=lambda i: own[i]["total"])
    rest = [o for i, o in enumerate(own) if i != slow]
    typical = median([o["total"] for o in rest])
    excess = own[slow]["total"] - typical
    small = excess < max(0.15 * s.step_s, 2e-3)
    if excess < max(SMALL_EXCESS * s.step_s, 1e-3):
        return None
    extra = {k: own[slow][k] - median([o[k] for o in rest]) for k in (*_STEP_KEYS, "gc")}
    # A GC pause is inside some phase: it wins when it explains most of the excess.
    phase = "gc" if extra["gc"] >= 0.5 * excess else max(_STEP_KEYS, key=extra.__getitem__)
    if phase == "forward" and _pipelined(rows):  # a slow stage: named from 15% on
        return None if small else slow_stage(s, facts, rows, own, slow)
    rank = s.rank_phases[slow]["rank"]
    share = extra[phase] / excess
    waited = _where_they_wait(rows, slow, rank, facts.strategy)
    message = (f"rank {rank} spends {ms(own[slow]['total'])} per step on its own work, the "
               f"other ranks {ms(typical)}; {waited}. Its extra {ms(excess)} goes to "
               f"{_PHASE_WORDS[phase]}: {ms(own[slow][phase])} against "
               f"{ms(median([o[phase] for o in rest]))} elsewhere.")
    runner_up = max((k for k in (*_STEP_KEYS, "gc") if k != phase), key=extra.__getitem__)
    if share < 0.6 and extra[runner_up] > 0.25 * excess:
        message += (f" Part of it ({ms(extra[runner_up])}) sits in "
                    f"{_PHASE_WORDS[runner_up]}: both are plausible places to look.")
    confidence = "high" if share >= 0.6 and excess >= 0.25 * s.step_s else "medium"
    severity = "warn"
    if small:  # measured on every step, but small: said, not sounded as an alarm
        severity, confidence = "info", "low"
        message += (f" It is {excess / s.step_s:.0%} of the step: small enough that uneven "
                    "load on the ranks' cores could explain it too; a longer run tells.")
    return Finding("straggler", severity, f"rank {rank} is the straggler ({_KIND[phase]})",
                   message, _straggler_fix(rank, phase), confidence=confidence,
                   measurements={"rank": rank, "phase": phase, "excess_s": excess,
                                 "own_s": [o["total"] for o in own],
                                 "wait_s": [r["wait"] for r in rows],
                                 "wait_forward_s": [r.get("wait_fwd", 0.0) for r in rows],
                                 "phase_excess_s": extra, "step_s": s.step_s})


def _where_they_wait(rows: list[dict[str, float]], slow: int, rank: int,
                     strategy: str) -> str:
    """Where the other ranks wait for rank ``rank`` (row ``slow``), with the waits."""
    others = [r for i, r in enumerate(rows) if i != slow]
    bwd = median([r["wait"] for r in others])
    fwd = median([r.get("wait_fwd", 0.0) for r in others])
    if strategy not in _SHARDED and not any(r.get("wait_fwd", 0.0) for r in rows):
        return (f"they wait for it in the gradient all-reduce ({ms(bwd)} per step at the "
                f"end of their backward, rank {rank} {ms(rows[slow]['wait'])})")
    where = _SHARDED.get(strategy, _SHARDED["fsdp"])
    return (f"they wait for it in the collectives of forward and backward ({where}): "
            f"{ms(fwd)} and {ms(bwd)} per step, rank {rank} "
            f"{ms(rows[slow].get('wait_fwd', 0.0))} and {ms(rows[slow]['wait'])}")


# The collectives a sharded strategy's forward and backward wait in.
_SHARDED = {"fsdp": "FSDP's all-gathers and reduce-scatters",
            "hsdp": "FSDP's all-gathers and reduce-scatters, and the all-reduce across "
                    "replicas"}


def slow_stage(s: Summary, facts: RunFacts, rows: list[dict[str, float]],
               own: list[dict[str, float]], slow: int) -> Finding:
    """The pipeline stage whose compute sets the pace (row ``slow`` computes the most
    per step): every other stage waits for it in its sends and receives."""
    stage = int(rows[slow]["stage"])
    per_chunk = [o["forward"] / max(1.0, r.get("chunks", 0.0)) for o, r in zip(own, rows)]
    rest = [i for i in range(len(rows)) if int(rows[i]["stage"]) != stage]
    typical = median([per_chunk[i] for i in rest]) if rest else 0.0
    excess = own[slow]["forward"] - (median([own[i]["forward"] for i in rest])
                                     if rest else 0.0)
    ranks = [s.rank_phases[i]["rank"] for i in range(len(rows))
             if int(rows[i]["stage"]) == stage
             and own[i]["forward"] - own[slow]["forward"] > -0.5 * excess]
    waits = [r["wait_fwd"] + r["wait"] for r in rows]
    others_wait = median([waits[i] for i in rest]) if rest else 0.0
    who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    stages = max(int(r["stage"]) for r in rows) + 1
    chunks = rows[slow].get("chunks", 0.0)
    message = (f"pipeline stage {stage} of {stages} ({who}) computes {ms(per_chunk[slow])} "
               f"per micro-batch ({chunks:.0f} per step: {ms(own[slow]['forward'])}), the "
               f"other stages {ms(typical)}; they wait for it in their sends and receives "
               f"({ms(others_wait)} per step, stage {stage} {ms(waits[slow])}).")
    link = waits[slow] < 0.5 * others_wait  # only the others wait: not the link
    if link:
        message += (" It is the stage's own compute, not the link: a slow link would keep "
                    "every stage waiting, this one too.")
    else:
        message += (f" Stage {stage} waits about as long as the others: a slow link "
                    "between the stages is as plausible.")
    fix = (f"give stage {stage} less work: move layers to its neighbours with "
           "parallel.pipeline.split (the layers where stages 2..N begin), or, if its "
           f"layers hold no more work than the others', check {who}'s device (clocks, "
           "temperature, other processes or fewer threads: `gpufleet top` on its node).")
    confidence = "high" if link and excess >= 0.25 * s.step_s else "medium"
    return Finding("slow-stage", "warn", f"pipeline stage {stage} ({who}) is the slow stage",
                   message, fix, confidence=confidence,
                   measurements={"stage": stage, "ranks": ranks, "excess_s": excess,
                                 "compute_per_microbatch_s": per_chunk,
                                 "wait_s": waits, "step_s": s.step_s})


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
    """Communication-bound when the collectives themselves are slow: the last rank to arrive
    still waits most of the step. Without that measurement, only several nodes can make
    it plausible (and then a straggler in backward is as plausible)."""
    rows = _arrival_rows(s)
    if rows is None:
        return _unmeasured(s, facts)
    if _pipelined(rows):  # a stage's waits hold the schedule's bubble: not judged here
        return None
    waits = [r["wait"] + r.get("wait_fwd", 0.0) for r in rows]
    comm = min(waits)  # the last rank to arrive waits for nobody: the transfer alone
    if comm < max(0.3 * s.step_s, 2e-3):
        return None
    grad_bytes = max((r.get("grad_bytes", 0.0) for r in s.rank_arrival), default=0.0)
    several = facts.world > facts.local_world
    measured_slow = bool(slow_node_fix(facts.links))
    sharded = facts.strategy in _SHARDED or any(r.get("wait_fwd", 0.0) for r in rows)
    what = _SHARDED.get(facts.strategy, _SHARDED["fsdp"]) if sharded \
        else "the gradient all-reduce"
    message = (f"the last rank to reach {what} still waits {ms(comm)} of "
               f"each {ms(s.step_s)} step ({comm / s.step_s:.0%}) for them to finish, "
               f"moving {grad_bytes / 2**20:.3g} MiB per step (the wait for "
               f"late ranks is not counted: the others wait {ms(max(waits))} at most).")
    if facts.links:
        message += " " + link_sentence(facts.links)
    if sharded:
        fix = (f"raise data.batch_size, or optim.grad_accum from {facts.grad_accum} to "
               f"{2 * facts.grad_accum} (the reduce-scatters run once per optimizer step), "
               "or set parallel.fsdp.reshard_after_forward=false (one all-gather per block "
               "fewer, for more memory)")
    else:
        fix = (f"raise optim.grad_accum from {facts.grad_accum} to {2 * facts.grad_accum} "
               f"(one all-reduce per {2 * facts.grad_accum} micro-batches) or "
               f"data.batch_size, or raise parallel.ddp.bucket_cap_mb from "
               f"{facts.bucket_cap_mb:g} to {max(50.0, 2 * facts.bucket_cap_mb):g} (fewer, "
               "larger messages)")
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
    """Several nodes, no arrival measurement (a compression hook, local SGD): a backward far
    longer than twice the forward on every rank points at the link or at a straggler."""
    if facts.world <= facts.local_world:
        return None  # one node: no link to blame without a measurement
    waits = [p["backward"] - 2 * p["forward"] for p in s.rank_phases]
    wait = min(waits)
    if wait < max(0.3 * s.step_s, 2e-3):
        return None
    message = (f"backward takes {ms(min(p['backward'] for p in s.rank_phases))} against "
               f"{ms(min(p['forward'] for p in s.rank_phases))} of forward on every rank "
               f"(it usually computes about twice the forward): about {ms(wait)} of each "
               f"{ms(s.step_s)} step ({wait / s.step_s:.0%}) is spent waiting. Two causes "
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
