"""Diagnosis: what limits a run, in plain words, with the numbers and the fix.

Findings are written to ``<run_dir>/diagnosis.json`` (and as ``"kind": "diagnosis"``
records in ``metrics.jsonl``) while the run goes; :func:`findings_for_run` reads them back
for ``gpufleet report``.
"""

from __future__ import annotations

import dataclasses
import math
from statistics import median
from typing import Any

from gpufleet.monitor.accounting import describe
from gpufleet.monitor.arrival_rules import communication_bound, measured_waits, straggler
from gpufleet.monitor.expected import TINY_OPERATOR, headroom, operator_time
from gpufleet.monitor.findings import (
    DIAGNOSIS_FILE,
    Finding,
    RunFacts,
    Summary,
    findings_for_run,
    format_findings,
    ms,
)
from gpufleet.monitor.host_rules import HOST_RULES, host_view
from gpufleet.monitor.kernel import explains, summary
from gpufleet.monitor.links import link_sentence, slow_node_fix, slow_nodes

# The findings' types live in gpufleet.monitor.findings (the host rules use them too);
# they are named here as well, where the rules' callers have always found them.
__all__ = ["DIAGNOSIS_FILE", "Finding", "RunFacts", "Summary", "diagnose", "findings_for_run",
           "format_findings"]


def diagnose(s: Summary, facts: RunFacts, system: dict[str, Any] | None = None,
             syncs: list[tuple[str, int]] | None = None) -> list[Finding]:
    """Every rule that fires for this summary, most costly first."""
    found = [f for rule in _rules() if (f := rule(s, facts, system, syncs)) is not None]
    if any(f.rule == "straggler" and f.measurements.get("kernel") for f in found):
        # The others' wait in the all-reduce is the straggler's time, which the kernel
        # explains: not the link's.
        found = [f for f in found if f.rule != "communication-bound"]
    found.sort(key=lambda f: f.severity != "warn")
    found = [cite_accounting(f, s.rank_accounting) for f in found]
    if facts.own_loop:
        found = [in_own_loop_words(f) for f in found]
    return found


# The parts of the step accounting each rule rests on (gpufleet.monitor.accounting):
# a finding about them says how much of the measured step each part took.
RESTS_ON = {"input-bound": ("data",), "straggler": ("late_ranks",),
            "slow-stage": ("late_ranks",), "communication-bound": ("exposed_comm",),
            "host-bound": ("forward", "backward", "optimizer", "host"),
            "time-outside-steps": ("eval_checkpoint",), "slow-logging": ("other",)}


def cite_accounting(f: Finding, accounting: list[dict[str, Any]]) -> Finding:
    """``f`` with the accounting's parts it rests on (:data:`RESTS_ON`) cited: in its
    message, and in ``measurements["accounting"]`` (seconds per step, the rank's
    measured step and residual). The rank read is the finding's own (its ``rank``
    measurement), else the one where the first part is largest: for a straggler, the
    rank that waits longest for it."""
    parts = RESTS_ON.get(f.rule)
    if not parts or not accounting or f.measurements.get("accounting"):
        return f
    own = f.measurements.get("rank") if f.rule not in ("straggler", "slow-stage") else None
    rows = [r for r in accounting if r.get("rank") == own] or \
        [max(accounting, key=lambda r: r.get(parts[0]) or 0.0)]
    row = rows[0]
    cited = {p: row.get(p) or 0.0 for p in parts}
    where = f" on rank {row['rank']}" if len(accounting) > 1 else ""
    text = "; ".join(describe(row, p) for p in parts)
    message = (f"{f.message} Step accounting{where}: {text} (residual "
               f"{row.get('residual_share', 0.0):+.1%}).")
    return dataclasses.replace(f, message=message, measurements={**f.measurements, "accounting": {
        **cited, "rank": row["rank"], "step": row.get("step", 0.0),
        "residual": row.get("residual", 0.0)}})


# What fit's keys are in a Fleet loop, which reads none of them: the loop's own lever,
# named in words (longest first, so "data.batching=tokens" goes before "data.batching").
_OWN_LOOP_WORDS = (
    ("data.pin_memory=true", "pin_memory=True in your DataLoader"),
    ("data.batching=tokens evens out the work per batch",
     "batches of about equal tokens even out the work per batch"),
    ("data.num_workers", "your DataLoader's num_workers"),
    ("data.batch_size", "your DataLoader's batch_size"),
    ("optim.grad_accum", "the micro-batches your loop accumulates per optimizer step"),
    ("run.eval_every", "how often your loop evaluates"),
    ("run.eval_batches", "the batches each of your evaluations reads"),
    ("checkpoint.every", "how often your loop calls fleet.save"),
    ("log.every", "Fleet(log_every=...)"),
    ("precision.mode=bf16-mixed", 'Fleet(precision="bf16-mixed")'),
    ("perf.compile=true", "torch.compile your model before fleet.setup"),
    ("perf.tf32=true", "torch.backends.cuda.matmul.allow_tf32 = True in your script"),
)
# Keys a Fleet loop does not read: not offered as settings to try there.
_FIT_ONLY = ("data.", "optim.", "run.", "checkpoint.every", "perf.compile")


def in_own_loop_words(finding: Finding) -> Finding:
    """``finding`` as advice for a Fleet loop: fit's config keys in its message and
    fix become the loop's own levers in words (a ``Fleet`` argument, your DataLoader's
    setting, your loop's cadence), and the keys a Fleet loop does not read leave its
    ``changes``."""
    message, fix = finding.message, finding.fix
    for key, words in _OWN_LOOP_WORDS:
        message, fix = message.replace(key, words), fix.replace(key, words)
    changes = {k: v for k, v in finding.changes.items() if not k.startswith(_FIT_ONLY)}
    return dataclasses.replace(finding, message=message, fix=fix, changes=changes)


def _input_bound(s: Summary, facts: RunFacts, *_: Any) -> Finding | None:
    worst = max(s.rank_phases, key=lambda p: p["data"])
    step = sum(worst[k] for k in ("data", "forward", "backward", "optimizer", "other"))
    share = worst["data"] / step if step > 0 else 0.0
    if share < 0.25 or worst["data"] < 1e-3:
        return None
    compute = max(step - worst["data"], 1e-6)
    workers = facts.num_workers
    # Seconds one worker needs per batch: measured directly without workers; with N
    # workers each delivers a batch every N steps while the loop waits on them.
    load = worst["data"] if workers == 0 else workers * step
    needed = math.ceil(load / compute) + 1  # +1 absorbs jitter
    cap = max(1, facts.cpus_per_rank)
    rank = f" on rank {worst['rank']}" if facts.world > 1 else ""
    message = (f"{ms(worst['data'])} of each {ms(step)} step ({share:.0%}) waits for "
               f"the next batch, with data.num_workers = {workers}. One batch takes about "
               f"{ms(load)} to load and {ms(compute)} to train on.")
    changes = {"data.num_workers": min(needed, cap)}
    if needed <= cap:
        fix = f"raise data.num_workers from {workers} to {needed}."
    else:
        fix = (f"raise data.num_workers from {workers} to {cap} (this node has {cap} CPU "
               f"core(s) per rank; about {needed} would hide the loading), and make loading "
               "cheaper: pre-process once and cache, or read fewer, larger records.")
    if facts.device == "cuda" and not facts.pin_memory:
        fix += " Also set data.pin_memory=true (faster, asynchronous copies to the GPU)."
    fix += " `gpufleet bench loader` measures the options."
    return Finding("input-bound", "warn", f"input-bound{rank}", message, fix,
                   changes=changes)


def _straggler(s: Summary, facts: RunFacts, system: dict[str, Any] | None = None,
               *_: Any) -> Finding | None:
    found = _straggler_found(s, facts)
    if found is not None and found.rule == "straggler" and found.title.startswith("rank "):
        rank = int(found.title.split()[1])
        why = explains((system or {}).get("kernel_view") or {}, rank)
        if why is not None:  # the kernel counted the cause: said, and sure
            d = system["kernel_view"][rank]
            return dataclasses.replace(
                found, severity="warn", confidence="high",
                title=f"rank {rank} is the straggler: {why[0]}",
                message=found.message + f" The kernel says why: over {d['seconds']:.0f} s, "
                f"rank {rank}'s {why[0]}; the other ranks show no such cause.",
                fix=_kernel_fix(why[0], rank) + " " + found.fix,
                measurements={**found.measurements, "kernel": summary(d),
                              "kernel_cause": why[0]})
    share = _cpu_share(facts, system)
    if found is None or share >= 1.0 or found.confidence == "high":
        return found
    # Other processes take cores the ranks ask for: the scheduler can give the ranks
    # unequal shares of what is left, which looks like a straggler as well.
    # An info, not a warning: on a loaded node a clean run shows such differences too.
    return dataclasses.replace(
        found, severity="info", confidence="low",
        message=found.message + (f" Other processes leave this run {share:.0%} of the CPU "
                                 "its ranks ask for, and the scheduler can share that out "
                                 "unevenly: that is as plausible a cause of a difference "
                                 "this size."))


def _kernel_fix(cause: str, rank: int) -> str:
    """What to do about the kernel's cause of a slow rank."""
    if cause.startswith("its cgroup throttled"):
        return (f"Raise or remove the CPU quota of rank {rank}'s cgroup (cpu.max on cgroup "
                "v2, cpu.cfs_quota_us on v1: the container's or job's CPU limit), or ask "
                "the scheduler for as many CPUs as the rank runs threads.")
    if "swapped" in cause or "memory" in cause:
        return (f"Give rank {rank}'s node more memory headroom: fewer data.num_workers, a "
                "smaller data.batch_size or other processes moved off.")
    if cause.startswith("other processes"):
        return f"Move the other processes off rank {rank}'s cores (`gpufleet top`)."
    return f"Look at rank {rank}'s storage (I/O wait)."


def _straggler_found(s: Summary, facts: RunFacts) -> Finding | None:
    if len(s.rank_phases) < 2:
        return None
    if measured_waits(s) is not None:  # when each rank arrives at the all-reduce
        return straggler(s, facts)
    # Not measured (no DDP all-reduce to time): the gradient all-reduce evens out step
    # times, so compare what each rank does before it: data wait + forward.
    before = [p["data"] + p["forward"] for p in s.rank_phases]
    slow = max(range(len(before)), key=before.__getitem__)
    others = [b for i, b in enumerate(before) if i != slow]
    excess = before[slow] - median(others)
    if excess < max(0.15 * s.step_s, 2e-3):
        return None
    p = s.rank_phases[slow]
    rest = [q for i, q in enumerate(s.rank_phases) if i != slow]
    data_excess = p["data"] - median([q["data"] for q in rest])
    kind = "input-bound" if data_excess > 0.5 * excess else "compute-bound"
    message = (f"rank {p['rank']} spends {ms(before[slow])} per step on data and forward, "
               f"the other ranks {ms(median(others))}; they wait for it in the gradient "
               f"all-reduce (their backward: {ms(median([q['backward'] for q in rest]))}, "
               f"rank {p['rank']}'s: {ms(p['backward'])}). It is {kind}: "
               f"{ms(p['data'])} of data wait against "
               f"{ms(median([q['data'] for q in rest]))} elsewhere.")
    if kind == "input-bound":
        fix = (f"make rank {p['rank']}'s input as fast as the others': its node's storage "
               "and CPU load, data.num_workers, or uneven sample sizes (data.batching="
               "tokens evens out the work per batch).")
    else:
        fix = (f"check rank {p['rank']}'s device (clocks, temperature, other processes: "
               "`gpufleet top` on its node) and whether its batches hold more work.")
    return Finding("straggler", "warn", f"rank {p['rank']} is the straggler ({kind})",
                   message, fix)


def _host_bound(s: Summary, facts: RunFacts, system: dict[str, Any] | None = None,
                *_: Any) -> Finding | None:
    if not s.tflops or not facts.device_flops:
        return None
    worst_data = max(p["data"] for p in s.rank_phases)
    if worst_data >= 0.25 * s.step_s:  # input-bound is its own rule
        return None
    # The step's own work: the wait in the gradient all-reduce is neither arithmetic nor
    # per-operation overhead (the communication rules judge it).
    waits = measured_waits(s)
    waited = sorted(waits)[len(waits) // 2] if waits else 0.0
    busy_s = max(s.step_s - waited, 1e-9)
    # On a CPU the yardstick is what the run's cores can do; when other processes take
    # some of them, the ranks get only a share of it.
    share = _cpu_share(facts, system)
    use = s.tflops * 1e12 * (s.step_s / busy_s) / (facts.device_flops * share)
    # A short step below 15% of the yardstick is overhead-bound; a long one (over 50 ms,
    # where per-operation overhead is a smaller share) must fall below 5%.
    if use >= (0.15 if busy_s <= 0.05 else 0.05) or _big_operators(s, facts):
        return None
    what = ("its peak" if facts.device_flops_source == "peak"
            else "a plain matmul on this CPU")
    message = (f"a step does {s.tflops * s.step_s * 1e3:.3g} GFLOP in {ms(s.step_s)}: "
               f"{s.tflops * 1e3:.3g} GFLOP/s, {use:.1%} of the "
               f"{facts.device_flops / 1e9:.3g} GFLOP/s of {what}")
    if waited:
        message += f" (counting the {ms(busy_s)} outside the gradient all-reduce)"
    if share < 1.0:
        message += f" and of the {share:.0%} of it other processes leave to the run"
    message += (f", while data is ready ({worst_data / s.step_s:.0%} of the step waits "
                "for it). The time goes to Python and per-operation overhead, not to "
                "arithmetic.")
    confidence = ""  # host-bound does not grade itself where the cores were measured
    if facts.device == "cpu" and not _cores_measured(system):
        # The yardstick is the whole CPU's: a CPU shared with processes nobody measured
        # gives the run less, which looks the same.
        confidence = "low"
        message += (" Other processes' use of the cores was not measured (too few "
                    "system samples: a short run): if they took cores, that is as "
                    "plausible a cause.")
    fix = (f"raise data.batch_size from {facts.batch_size} (to {4 * facts.batch_size}, "
           "say: the overhead per step stays, the work grows)")
    if not facts.compile:
        fix += ", set perf.compile=true (fuses operations)"
    if facts.device == "cuda":
        fix += ", and perf.compile_mode=reduce-overhead (CUDA graphs: one launch per step)"
    return Finding("host-bound", "warn", "host-bound", message, fix + ".",
                   changes={"data.batch_size": 4 * facts.batch_size}, confidence=confidence,
                   measurements={"use": use, "step_s": s.step_s, "busy_s": busy_s,
                                 "cpu_share": share})


def _big_operators(s: Summary, facts: RunFacts) -> bool:
    """Whether the op clock measured operators that each do real work (a mean time
    inside of :data:`~gpufleet.monitor.expected.TINY_OPERATOR` launch costs or more):
    then a low FLOP rate is slow work inside them (element-wise, memory-bound), not
    overhead between them, and the headroom finding names the part."""
    if not facts.peaks or not s.rank_accounting:
        return False
    each = operator_time(max(s.rank_accounting, key=lambda r: r.get("step") or 0.0))
    return each is not None and each >= TINY_OPERATOR * facts.peaks["launch_s"]


def _cores_measured(system: dict[str, Any] | None) -> bool:
    """Whether the node's samples measured other processes' use of the cores (a process's
    CPU share needs two reads: one sample alone cannot show it)."""
    view = (system or {}).get("host_view") or (host_view([system]) if system else None)
    return bool(view) and view.get("samples", 0) >= 2


def _cpu_share(facts: RunFacts, system: dict[str, Any] | None) -> float:
    """The share of the cores its threads ask for that other processes leave to a CPU
    run (1.0 on a GPU, or with no sample of the node)."""
    if facts.device != "cpu" or not system:
        return 1.0
    view = system.get("host_view") or host_view([system])
    wanted = min(facts.cores, facts.local_world * facts.torch_threads)
    if not view or wanted <= 0:
        return 1.0
    taken = sum(p["cores"] for p in view["others"])
    return min(1.0, max(0.05, (view["cores"] - taken) / wanted))


def _reduces_in_backward(strategy: str) -> bool:
    """Whether the strategy's backward ends with a gradient all-reduce (its traits)."""
    from gpufleet.errors import ConfigError
    from gpufleet.parallel import strategy_class  # here: parallel imports the loop's modules

    try:
        return strategy_class(strategy).traits.reduces_in_backward
    except ConfigError:  # a run recorded by a strategy this install does not have
        return False


def _communication_bound(s: Summary, facts: RunFacts, *_: Any) -> Finding | None:
    if facts.world < 2 or not _reduces_in_backward(facts.strategy):
        return None
    return communication_bound(s, facts)


def _slow_link(s: Summary, facts: RunFacts, *_: Any) -> Finding | None:
    """A node's link far slower than the others' while communication is not yet the
    limit (when it is, the communication-bound finding names the node)."""
    if not slow_node_fix(facts.links) or _communication_bound(s, facts) is not None:
        return None
    names = ", ".join(f"node {n['node']}" for n in slow_nodes(facts.links))
    return Finding(
        "slow-link", "info", f"slow link: {names}",
        link_sentence(facts.links) + " The gradient all-reduce does not hold the steps "
        "back yet; a larger model, more nodes or shorter steps will make it the limit.",
        slow_node_fix(facts.links) + ".")


def _memory_headroom(s: Summary, facts: RunFacts, *_: Any) -> Finding | None:
    if facts.device != "cuda" or not s.mem_peak_gb or not facts.mem_total_gb:
        return None
    used = s.mem_peak_gb / facts.mem_total_gb
    if used >= 0.5:
        return None
    grow = max(2, int(0.8 / max(used, 1e-3)))
    return Finding(
        "memory-headroom", "info", "memory headroom",
        f"the peak is {s.mem_peak_gb:.1f} of {facts.mem_total_gb:.1f} GiB ({used:.0%}).",
        f"raise data.batch_size from {facts.batch_size} (up to about {grow}x before memory "
        "runs short) for more work per step.")


def _fp32_on_tensor_cores(s: Summary, facts: RunFacts, *_: Any) -> Finding | None:
    if facts.device != "cuda" or facts.precision != "fp32" or not facts.tensor_cores:
        return None
    if facts.tf32:  # the matmuls use the tensor cores already, at half bf16's rate
        return Finding(
            "fp32-on-tensor-cores", "info", "fp32 (TF32 matmuls) on a tensor-core GPU",
            f"the run computes in fp32 on {facts.device_name}; its matmuls run as TF32, "
            "and bf16 runs them about twice as fast with half the activation memory.",
            "set precision.mode=bf16-mixed (no loss scaling needed).",
            changes={"precision.mode": "bf16-mixed"})
    return Finding(
        "fp32-on-tensor-cores", "warn", "fp32 on a tensor-core GPU",
        f"the run computes in fp32 on {facts.device_name}, whose tensor cores run bf16 "
        "several times faster.",
        "set precision.mode=bf16-mixed (no loss scaling needed), or at least "
        "perf.tf32=true for fp32 matmuls.", changes={"precision.mode": "bf16-mixed"})


def _host_syncs(s: Summary, facts: RunFacts, system: Any,
                syncs: list[tuple[str, int]] | None) -> Finding | None:
    if not syncs:
        return None
    total = sum(n for _, n in syncs)
    places = ", ".join(f"{where} ({n}x)" for where, n in syncs[:5])
    return Finding(
        "host-syncs", "warn", "host-device syncs in the step",
        f"{total} synchronising call(s) in the probed steps: {places}. Each makes the CPU "
        "wait until the GPU has caught up, so the next kernels start late.",
        "keep values on the device inside the step (accumulate tensors, read them once "
        "per log interval); avoid .item(), .cpu(), .tolist(), printing tensors and "
        "data-dependent shapes (nonzero, boolean masks) in forward and the loss.")


def _dp_imbalance(s: Summary, facts: RunFacts, system: dict[str, Any] | None,
                  *_: Any) -> Finding | None:
    if not facts.copies_module_each_step or not system or len(system.get("gpus", [])) < 2:
        return None
    utils = [g.get("util_pct", 0.0) for g in system["gpus"]]
    first, rest = utils[0], sum(utils[1:]) / len(utils[1:])
    if first - rest < 30:
        return None
    return Finding(
        "dp-imbalance", "warn", "one GPU busy, the others idle",
        f"GPU 0 is {first:.0f}% busy, the other {len(utils) - 1} {rest:.0f}% on average: "
        "nn.DataParallel scatters inputs and gathers outputs on GPU 0, in one process.",
        f"use parallel.strategy=ddp with --nproc {len(utils)} (one process per GPU).")


def _rules() -> tuple[Any, ...]:
    """Every rule, in the order their findings are given (warnings before infos): what
    slows the node from outside the step first, then the step's own limits."""
    return (*HOST_RULES, _input_bound, _straggler, _communication_bound, _host_bound,
            _slow_link, _memory_headroom, _fp32_on_tensor_cores, _host_syncs, _dp_imbalance,
            headroom)
