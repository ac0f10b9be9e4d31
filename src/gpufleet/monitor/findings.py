"""What the diagnosis finds and what it reads: :class:`Finding`, the run's
:class:`RunFacts` and the measured :class:`Summary` (the rules are in
:mod:`gpufleet.monitor.diagnose` and :mod:`gpufleet.monitor.host_rules`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DIAGNOSIS_FILE = "diagnosis.json"


def ms(seconds: float) -> str:
    """Seconds as the rules write them.

    Example:
        >>> ms(0.01234)
        '12.3 ms'
    """
    return f"{seconds * 1e3:.1f} ms"


@dataclass(frozen=True)
class Finding:
    """One thing that limits the run.

    Attributes:
        rule: a stable name, e.g. ``input-bound``, ``straggler``, ``host-bound``.
        severity: ``warn`` (costs speed now) or ``info`` (room to go faster).
        title: one short line, e.g. "input-bound on rank 3".
        message: what was measured, with the numbers.
        fix: what to change, with config keys and values.
        step: the optimizer step at which it was found.
        changes: the fix as settings to try (config keys, and ``env.NAME`` for an
            environment variable), when it is one; ``gpufleet tune`` measures them.
        confidence: ``high`` (measured directly), ``medium`` (measured, one cause
            likely) or ``low`` (inferred; another cause is as plausible); "" for rules
            that do not grade themselves.
        measurements: the numbers the finding rests on (seconds, bytes, ranks).
    """

    rule: str
    severity: str
    title: str
    message: str
    fix: str
    step: int = 0
    changes: dict[str, Any] = field(default_factory=dict)
    confidence: str = ""
    measurements: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Finding:
        return cls(**{k: data[k] for k in ("rule", "severity", "title", "message", "fix")},
                   step=int(data.get("step", 0)), changes=dict(data.get("changes") or {}),
                   confidence=str(data.get("confidence", "")),
                   measurements=dict(data.get("measurements") or {}))


def findings_for_run(run_dir: str | Path) -> list[Finding]:
    """The findings recorded for a run (empty when it recorded none)."""
    path = Path(run_dir) / DIAGNOSIS_FILE
    if not path.is_file():
        return []
    return [Finding.from_dict(d) for d in json.loads(path.read_text())["findings"]]


def format_findings(findings: list[Finding]) -> str:
    """Plain text for a terminal or a log: one paragraph per finding."""
    if not findings:
        return "No limit found: the measured phases look balanced."
    return "\n".join(f"[{f.severity}] {f.title}: {f.message} Fix: {f.fix}" for f in findings)


# -- what the rules know about the run -------------------------------------------------
@dataclass
class RunFacts:
    """The run's setup, as the rules need it (filled by the trainer once).

    Attributes:
        device: ``cpu`` or ``cuda``; device_name: e.g. "NVIDIA H100 80GB HBM3".
        world / local_world: ranks in the job / on this node.
        cpus_per_rank: CPU cores this node has per rank (caps data-loader workers).
        device_flops: FLOP/s one device can do (the GPU's peak for the run's precision,
            or on a CPU a measured matmul rate); None when unknown.
        device_flops_source: "peak" or "measured matmul".
        tensor_cores: a GPU with bf16 tensor cores (compute capability 8.0 or newer).
        tf32: fp32 matmuls ran as TF32 on the tensor cores (torch's flag, as the run had
            it).
        mem_total_gb: device memory (CUDA), else 0.
        cores: CPU cores this node's ranks may use; torch_threads: each rank's torch
            intra-op threads.
        log_every / eval_every / checkpoint_every: the run's intervals, in steps.
        checkpoint_async: checkpoints are written in the background already
            (``checkpoint.async_save``); async_save_possible: the strategy saves one
            file, so ``checkpoint.async_save`` can be turned on.
        links: the link probe's result on several nodes
            (:func:`gpufleet.monitor.links.probe_node_links`); empty otherwise.
        own_loop: a :class:`~gpufleet.fleet.Fleet` loop: ``batch_size``, ``grad_accum``,
            ``eval_every`` and ``evaluations`` are what the loop was seen doing
            (:mod:`gpufleet.fleet.observed`), not config keys, and the advice names
            the loop's own levers instead of ``fit``'s keys.
        evaluations: evaluations counted (an own loop's; 0 for ``fit``, whose phase
            timer counts them).
        steps: optimizer steps done when the facts were last updated.
        restarts: times the elastic agent restarted the ranks before this run.
        flops_per_step: FLOPs of one rank's forward and backward per optimizer step
            (torch's FLOP counter; 0: not counted).
        optimizer_bytes: bytes one rank's optimizer update reads and writes per step
            (parameters, gradients, optimizer state; 0: not known).
        peaks: this CPU's measured rates (:class:`gpufleet.monitor.peaks.Peaks` as a
            dict, without its ``seconds``); empty where not measured (a GPU).
    """

    device: str = "cpu"
    device_name: str = ""
    world: int = 1
    local_world: int = 1
    cpus_per_rank: int = 1
    num_workers: int = 0
    pin_memory: bool = False
    batch_size: int = 1
    grad_accum: int = 1
    precision: str = "fp32"
    strategy: str = "single"
    comm_hooks: bool = False  # the strategy takes parallel.ddp.comm_hook (its traits)
    # One process copies the module to every GPU each step (nn.DataParallel; its traits).
    copies_module_each_step: bool = False
    bucket_cap_mb: float = 25.0
    compile: bool = False
    device_flops: float | None = None
    device_flops_source: str = "peak"
    tensor_cores: bool = False
    tf32: bool = False
    mem_total_gb: float = 0.0
    cores: int = 1
    torch_threads: int = 1
    log_every: int = 10
    eval_every: int = 0
    checkpoint_every: int = 0
    checkpoint_async: bool = False
    async_save_possible: bool = True
    links: dict[str, Any] = field(default_factory=dict)
    own_loop: bool = False
    evaluations: int = 0
    steps: int = 0
    restarts: int = 0
    flops_per_step: float = 0.0
    optimizer_bytes: float = 0.0
    peaks: dict[str, Any] = field(default_factory=dict)


@dataclass
class Summary:
    """Mean per-step numbers over the part of the run seen so far (first interval left
    out: it holds start-up and compilation)."""

    steps: int
    step_s: float
    rank_phases: list[dict[str, float]]  # per rank: data, forward, backward, optimizer, other
    tflops: float | None = None  # achieved by one rank
    mem_peak_gb: float | None = None
    train_s: float = 0.0  # seconds in training steps
    outside: dict[str, tuple[float, int]] = field(default_factory=dict)  # eval, checkpoint
    log_callbacks: dict[str, float] = field(default_factory=dict)  # seconds in on_log
    # per rank, per step (gpufleet.monitor.arrival): wait (s waiting for other ranks in
    # backward; -1 not measured), gc (s in GC pauses), grad_bytes (moved by the
    # gradient collectives), wait_fwd (s waiting in forward: fsdp, pipeline), chunks
    # (a pipeline stage's micro-batches), stage (its number; -1: not a pipeline)
    rank_arrival: list[dict[str, float]] = field(default_factory=list)
    # per rank (gpufleet.monitor.accounting): the parts of its step, the measured step
    # (the log interval's clock) and the residual, seconds per step
    rank_accounting: list[dict[str, Any]] = field(default_factory=list)
