"""The trainer's side of the diagnosis: collects the per-interval measurements, runs the
rules of :mod:`gpufleet.monitor.diagnose` on everything seen so far, says each new
finding once in the log, and records them (``metrics.jsonl`` and ``diagnosis.json``).

Runs on rank 0 only: the phase times of every rank reach it in the log-interval
all-reduce, so it needs no collective of its own.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from gpufleet.core.callbacks import Callback
from gpufleet.core.machine import cores_per_rank, usable_cores
from gpufleet.monitor.accounting import mean_accounting
from gpufleet.monitor.arrival import ARRIVAL
from gpufleet.monitor.diagnose import (
    DIAGNOSIS_FILE,
    Finding,
    RunFacts,
    Summary,
    diagnose,
)
from gpufleet.monitor.expected import expected_step, work_of
from gpufleet.monitor.host_rules import host_view
from gpufleet.monitor.kernel import kernel_view
from gpufleet.monitor.peaks import Peaks, cpu_peaks
from gpufleet.monitor.phases import PHASES

log = logging.getLogger(__name__)

#: seconds between two runs of the rules: every log interval adds its measurements to
#: the sums, but the rules, the host view and the records wait this long (and run once
#: more at the end), so that a run of short steps and frequent log lines pays for them
#: once per few seconds, not per few milliseconds
RULES_EVERY_S = 5.0


class Advisor(Callback):
    """Diagnoses the run as it goes (see the module docs).

    Args:
        facts: the run's setup (:func:`run_facts`).
        run_dir: where ``diagnosis.json`` goes.
        metrics_file: the run's ``MetricsFile`` (diagnosis records go there), or None.
        system: the system sampler (its newest sample feeds the GPU rules), or None.
        skip_intervals: log intervals left out at the start (start-up, compilation).
        phase_timer: the run's :class:`~gpufleet.monitor.phases.PhaseTimer` (its time
            outside steps: evaluation, checkpoints), or None.
    """

    essential = False

    def __init__(self, facts: RunFacts, run_dir: str | Path, metrics_file: Any = None,
                 system: Any = None, skip_intervals: int = 1, phase_timer: Any = None) -> None:
        self.facts, self.run_dir = facts, Path(run_dir)
        self.metrics_file, self.system = metrics_file, system
        self.phase_timer = phase_timer  # its time outside steps (eval, checkpoint)
        self.skip = skip_intervals
        self.intervals = 0
        self.steps = 0
        self._sums: dict[int, list[float]] = {}
        self._arrival: dict[int, list[float]] = {}  # per rank: ARRIVAL sums x steps
        self._accounting: list[dict[str, Any]] = []  # per rank: the running mean
        self._accounting_steps = 0
        self._step_s = 0.0
        self._flop_s = 0.0  # sum of tflops x steps
        self._mem_peak = 0.0
        self.syncs: list[tuple[str, int]] = []
        self.findings: list[Finding] = []
        self._said: set[tuple[str, str]] = set()
        self._last_step = 0
        self._outside: dict[str, tuple[float, int]] = {}
        self._log_callbacks: dict[str, float] = {}
        self._log_base: dict[str, float] = {}
        self._rules_due = 0.0  # time.monotonic() of the next run of the rules
        self._last_update = 0  # the step the rules last ran at

    def on_fit_start(self, trainer: Any) -> None:
        self._last_step = trainer.step

    def on_log(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        self.intervals += 1
        self.facts.steps = step
        if not self.facts.flops_per_step and getattr(trainer, "flops_per_step", 0):
            self.facts.flops_per_step = float(trainer.flops_per_step)
        if not self.facts.optimizer_bytes:  # once the optimizer's state exists
            self.facts.optimizer_bytes = float(optimizer_traffic(
                getattr(trainer, "optimizer", None)))
        steps, self._last_step = max(1, step - self._last_step), step
        logged = trainer.log_seconds
        if self.intervals <= self.skip or "rank_phases" not in metrics:
            self._log_base = dict(logged)  # start-up is left out here too
            return
        self.steps += steps
        self._step_s += metrics["step_time_s"] * steps
        for row in metrics["rank_phases"]:
            sums = self._sums.setdefault(row["rank"], [0.0] * len(PHASES))
            for i, name in enumerate(PHASES):
                sums[i] += row[name] * steps
        for row in metrics.get("rank_arrival", ()):
            sums = self._arrival.setdefault(row["rank"], [0.0] * len(ARRIVAL))
            for i, name in enumerate(ARRIVAL):
                sums[i] += row[name] * steps
        if metrics.get("rank_accounting"):
            self._accounting = mean_accounting(
                [self._accounting, metrics["rank_accounting"]],
                [self._accounting_steps, steps]) if self._accounting \
                else [dict(row) for row in metrics["rank_accounting"]]
            self._accounting_steps += steps
        if "tflops" in metrics:
            self._flop_s += metrics["tflops"] * steps
        self._mem_peak = max(self._mem_peak, metrics.get("mem_peak_gb", 0.0))
        timer = self.phase_timer
        self._outside = {k: (v[0], int(v[1])) for k, v in timer.outside.items()} \
            if timer is not None else {}
        self._log_callbacks = {k: v - self._log_base.get(k, 0.0) for k, v in logged.items()
                               if k != type(self).__name__}
        now = time.monotonic()
        if now >= self._rules_due:
            self._rules_due = now + RULES_EVERY_S
            self._update(step)

    def summary(self) -> Summary | None:
        if not self.steps:
            return None
        n = self.steps
        rows = [{"rank": r, **{name: v / n for name, v in zip(PHASES, sums)}}
                for r, sums in sorted(self._sums.items())]
        arrival = [{"rank": r, **{name: v / n for name, v in zip(ARRIVAL, sums)}}
                   for r, sums in sorted(self._arrival.items())]
        return Summary(steps=n, step_s=self._step_s / n, rank_phases=rows,
                       rank_arrival=arrival, rank_accounting=list(self._accounting),
                       tflops=self._flop_s / n or None, mem_peak_gb=self._mem_peak or None,
                       train_s=self._step_s, outside=dict(self._outside),
                       log_callbacks=dict(self._log_callbacks))

    def _update(self, step: int) -> None:
        self._last_update = step
        if self.facts.device == "cpu" and not self.facts.peaks:  # once, about 0.2 s
            peaks = cpu_peaks(self.facts.precision)
            self.facts.peaks = {k: v for k, v in vars(peaks).items() if k != "seconds"}
        if self.facts.device == "cpu" and not self.facts.device_flops:
            self.facts.device_flops = cpu_flops()
        summary = self.summary()
        if summary is None:
            return
        latest = self.system.latest() if self.system is not None else None
        if latest is not None:  # the host's CPU over the last half minute
            window = self.system.window(30.0)
            latest = {**latest, "host_view": host_view(window),
                      "kernel_view": kernel_view(window)}
        findings = [Finding(**{**f.to_dict(), "step": step})
                    for f in diagnose(summary, self.facts, latest, self.syncs)]
        new = [f for f in findings if (f.rule, f.title) not in self._said]
        for f in new:
            self._said.add((f.rule, f.title))
            log.warning("diagnosis at step %d: %s: %s Fix: %s", step, f.title, f.message,
                        f.fix)
        changed = [(f.rule, f.title) for f in findings] != [(f.rule, f.title)
                                                             for f in self.findings]
        self.findings = findings
        # Records and diagnosis.json are written when the findings change (and at the
        # end), not every log interval.
        if changed:
            if self.metrics_file is not None:
                self.metrics_file.write("diagnosis", {
                    "step": step, "findings": [f.to_dict() for f in findings]})
            self._save(summary)

    def _save(self, summary: Summary | None) -> None:
        path = self.run_dir / DIAGNOSIS_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({
            "findings": [f.to_dict() for f in self.findings],
            "steps_measured": summary.steps if summary else 0,
            # every rank's parts of its step and the residual (seconds per step)
            "accounting": summary.rank_accounting if summary else [],
            # each rank's parts against what this machine should do (CPU runs)
            "expected_step": [expected_step(row, work_of(self.facts, summary),
                                            Peaks(**self.facts.peaks, seconds=0.0))
                              for row in summary.rank_accounting]
            if summary and self.facts.peaks else [],
            "facts": vars(self.facts)}, indent=1))
        os.replace(tmp, path)

    def on_fit_end(self, trainer: Any, result: Any) -> None:
        if self._last_step > self._last_update:  # intervals the rules have not seen yet
            self._update(self._last_step)
        result.findings = list(self.findings)
        self._save(self.summary())


def cpu_flops() -> float:
    """FLOP/s of a plain fp32 matmul on this CPU with this process's torch threads
    (:func:`gpufleet.monitor.peaks.cpu_peaks`: measured once per process and thread
    count), the host-bound rule's yardstick."""
    return cpu_peaks("fp32").matmul_flops


def optimizer_traffic(optimizer: Any) -> int:
    """Bytes an optimizer's update reads and writes per step on this rank: each
    trainable parameter, its gradient (the parameter's size: gradients are usually
    gone, zeroed to None, when this is read) and its state tensors read, the parameter
    and the state written (a sharded tensor counts its local shard); 0 for what is not
    a torch optimizer.

    Example:
        >>> p = torch.nn.Parameter(torch.zeros(1000))
        >>> opt = torch.optim.SGD([p], lr=0.1)
        >>> optimizer_traffic(opt)  # read p and its gradient, write p: 3 x 4000 bytes
        12000
    """
    total = 0
    for group in getattr(optimizer, "param_groups", ()):
        for p in group["params"]:
            if not p.requires_grad:
                continue
            state = [t for t in optimizer.state.get(p, {}).values()
                     if isinstance(t, torch.Tensor) and t.ndim > 0]
            total += 3 * _local_bytes(p) + 2 * sum(_local_bytes(t) for t in state)
    return total


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def run_facts(trainer: Any, links: dict[str, Any] | None = None) -> RunFacts:
    """What the rules need to know about ``trainer``'s setup; ``links``: the link
    probe's result (:func:`gpufleet.monitor.links.probe_node_links`), if one ran."""
    from gpufleet.monitor.flops import device_peak_flops

    cfg, device = trainer.cfg, trainer.device
    facts = RunFacts(
        device=device.type, world=trainer.env.world_size,
        local_world=trainer.env.local_world_size,
        cpus_per_rank=cores_per_rank(trainer.env.local_world_size),
        num_workers=cfg.data.num_workers, pin_memory=trainer.pin_memory,
        batch_size=cfg.data.batch_size, grad_accum=cfg.optim.grad_accum,
        precision=cfg.precision.mode, strategy=cfg.parallel.strategy,
        comm_hooks=trainer.strategy.traits.comm_hooks,
        copies_module_each_step=trainer.strategy.traits.copies_module_each_step,
        bucket_cap_mb=cfg.parallel.ddp.bucket_cap_mb, compile=cfg.perf.compile,
        cores=usable_cores(), torch_threads=torch.get_num_threads(),
        log_every=cfg.log.every, eval_every=cfg.run.eval_every,
        checkpoint_every=cfg.checkpoint.every, checkpoint_async=cfg.checkpoint.async_save,
        async_save_possible=not trainer.strategy.saves_on_every_rank,
        links=dict(links or {}), restarts=trainer.env.restart_count)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.device_name = props.name
        facts.tensor_cores = props.major >= 8
        facts.tf32 = torch.backends.cuda.matmul.allow_tf32
        facts.mem_total_gb = props.total_memory / 2**30
        facts.device_flops = device_peak_flops(cfg, device)
    else:
        facts.device_name = "CPU"
        # 0: measured (a plain matmul, 0.1 s) when the rules first run, not before the
        # first step.
        facts.device_flops = cfg.monitor.peak_tflops * 1e12
        facts.device_flops_source = "peak" if cfg.monitor.peak_tflops else "measured matmul"
    return facts
