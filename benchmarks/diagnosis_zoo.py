"""A zoo of real slowdowns: each is built for real on this machine, trained with gpufleet,
diagnosed, then trained again with the fix the first finding suggests, side by side.

    python benchmarks/diagnosis_zoo.py            # every scenario, 2 interleaved repeats
    python benchmarks/diagnosis_zoo.py --quick    # a fast subset, 1 repeat
    python benchmarks/diagnosis_zoo.py --only input-bound,clean --json out.json

Prints the machine, then a table: scenario | expected | first finding | correct? (a clean
run is right when no finding warns: an info, e.g. about other work on the node, may be
true of the machine) |
speed-up when the fix is applied (samples per second of wall time, evaluation,
checkpoints and logging included; the median of the repeats of each, runs alternating).
A fix that is a setting comes from the finding itself (its ``changes``); a fix outside
gpufleet's settings (a slow rank's extra work) is the cause removed, and the row says
so. Runs use one torch thread unless the scenario is about threads (see BASE_ENV).

The model and data factories below are what the runs train (``diagnosis_zoo:make_mlp``
with this folder on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import random
import re
import signal
import statistics
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import Dataset

from gpufleet.monitor.accounting import TOLERANCE, run_residual

HERE = Path(__file__).resolve().parent


# -- what the runs train -----------------------------------------------------------------
class _Mlp(nn.Module):
    def __init__(self, dim: int, width: int, depth: int, extra: int, slow_rank: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(dim, width), nn.GELU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.body = nn.Sequential(*layers, nn.Linear(width, 1))
        # A straggler: rank `slow_rank` does `extra` more forwards of real arithmetic.
        self.extra, self.slow_rank = extra, slow_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.extra and int(os.environ.get("RANK", "0")) == self.slow_rank:
            with torch.no_grad():
                for _ in range(self.extra):
                    self.body(x)
        return self.body(x)


def make_mlp(dim: int = 256, width: int = 512, depth: int = 3, extra: int = 0,
             slow_rank: int = -1, quota_rank: int = -1, quota_us: int = 10000) -> nn.Module:
    """An MLP regressor; ``extra`` forwards more on rank ``slow_rank``; rank
    ``quota_rank`` moves itself into a cgroup that allows it ``quota_us`` of CPU per
    100 ms (a container's CPU limit)."""
    if _mine(quota_rank):
        _join_quota_group(quota_us)
    return _Mlp(dim, width, depth, extra, slow_rank)


#: The cgroup (v1 cpu controller, or v2) the quota-throttled rank moves into.
QUOTA_GROUP = "gpufleet-zoo-quota"


def _cgroup_base() -> tuple[Path, int] | None:
    """Where a child cgroup with a CPU quota can be made here, and its version."""
    v2 = Path("/sys/fs/cgroup")
    if (v2 / "cgroup.controllers").is_file() and "cpu" in \
            (v2 / "cgroup.subtree_control").read_text().split():
        return v2, 2
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").is_file():
        return v1, 1
    return None


def cpu_quota_missing() -> str | None:
    if os.geteuid() != 0:
        return "skipped: needs root to make a cgroup with a CPU quota"
    if _cgroup_base() is None:
        return "skipped: no writable cgroup cpu controller (v1 or v2) here"
    return None


def _join_quota_group(quota_us: int) -> None:
    base, version = _cgroup_base()  # type: ignore[misc]
    group = base / QUOTA_GROUP
    group.mkdir(exist_ok=True)
    if version == 2:
        (group / "cpu.max").write_text(f"{quota_us} 100000")
    else:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(quota_us))
    (group / "cgroup.procs").write_text(str(os.getpid()))


def remove_quota_group() -> None:
    found = _cgroup_base()
    if found is not None:
        try:
            (found[0] / QUOTA_GROUP).rmdir()
        except OSError:
            pass


def _mine(rank: int) -> bool:
    return int(os.environ.get("RANK", "0")) == rank


class _ExtraBackward(torch.autograd.Function):
    """Identity whose backward does ``n`` extra matmuls of real arithmetic."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, n: int) -> torch.Tensor:
        ctx.n = n
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        _busy(ctx.n)
        return grad, None, None


class _Variant(nn.Module):
    """The MLP with one kind of extra cost on rank ``rank`` (see :func:`make_variant`)."""

    def __init__(self, kind: str, rank: int, amount: int, dim: int = 256) -> None:
        super().__init__()
        self.inner = make_mlp(dim=dim)
        self.kind, self.amount, self.dim = kind, amount if _mine(rank) else 0, dim
        self.garbage: list[dict[str, int]] = []
        self.calls = 0
        self.last = 0.0
        if kind == "optimizer" and self.amount:
            register_optimizer_step_post_hook(functools.partial(_busy, self.amount))
        if kind == "optimizer-elementwise" and self.amount:
            register_optimizer_step_post_hook(functools.partial(_elementwise, self.amount))
        if kind == "threads" and self.amount:
            torch.set_num_threads(1)  # this rank alone runs on one thread

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        batch = x.shape[0]
        out = self.inner(x.reshape(-1, self.dim))  # uneven: items of several rows
        out = out.view(batch, -1).mean(-1, keepdim=True)
        if self.kind == "backward" and self.amount:
            out = _ExtraBackward.apply(out, None, self.amount)
        if self.kind == "forward" and self.amount:
            _busy(self.amount)  # no extra call of the (maybe sharded) layers: fsdp-safe
        if self.kind == "gc" and self.amount:
            # Many live Python objects and a full collection every 4th step: the pauses
            # a long-lived cache of small objects brings.
            if not self.garbage:
                self.garbage = [{"i": i} for i in range(self.amount * 100_000)]
            if self.calls % 4 == 0:
                gc.collect()
        if self.kind == "item":
            self.last = out.mean().item()  # a user metric read every step (a host sync)
        if self.kind == "elementwise" and self.amount:
            _elementwise(self.amount)  # slow operators with no matmul (no FLOPs counted)
        if self.kind == "elementwise-backward" and self.amount:
            out = _ElementwiseBackward.apply(out, self.amount)
        if self.kind == "python" and self.amount:
            _python(self.amount)  # Python between the operators: host overhead
        return out


def _elementwise(n: int, *_: Any) -> None:
    """``n`` element-wise passes over 1M floats (memory-bound, no FLOPs counted)."""
    g = torch.ones(1 << 20)
    for _ in range(n):
        g = torch.tanh(g)


def _python(n: int) -> None:
    """``n`` x 10,000 steps of a pure Python loop (no operator)."""
    total = 0
    for i in range(n * 10_000):
        total += i


class _ElementwiseBackward(torch.autograd.Function):
    """Identity whose backward does ``n`` element-wise passes (see :func:`_elementwise`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, n: int) -> torch.Tensor:
        ctx.n = n
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _elementwise(ctx.n)
        return grad, None


def _busy(n: int, *_: Any) -> None:
    """``n`` 256x256 matmuls (about 2 ms each on one core): extra work."""
    g = torch.ones(256, 256) / 256
    for _ in range(n):
        g = torch.tanh(g @ g)


def make_variant(kind: str, rank: int = 1, amount: int = 1) -> nn.Module:
    """The MLP with ``kind`` of extra cost on rank ``rank``: ``forward`` or ``backward``
    (extra arithmetic there), ``optimizer`` (in the optimizer step), ``gc`` (full
    collections over many live objects), ``threads`` (one torch thread on that rank),
    ``item`` (a ``.item()`` every step, every rank); on every rank: ``elementwise``,
    ``elementwise-backward``, ``optimizer-elementwise`` (memory-bound work without
    FLOPs in forward, backward or the optimizer step), ``python`` (a Python loop in
    forward: host overhead)."""
    return _Variant(kind, rank, amount)


class _BusyOnRank(nn.Module):
    """Identity; on rank ``rank`` each forward also does ``amount`` matmuls of extra
    arithmetic (see :func:`_busy`)."""

    def __init__(self, rank: int, amount: int) -> None:
        super().__init__()
        self.amount = amount if _mine(rank) else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.amount:
            _busy(self.amount)
        return x


def make_stack(dim: int = 256, depth: int = 4, rank: int = 1, amount: int = 0) -> nn.Module:
    """An MLP regressor as one plain ``nn.Sequential`` (a pipeline cuts it into stages
    of equal layers); on rank ``rank`` each layer also does ``amount`` matmuls of extra
    arithmetic per micro-batch, so the stage that rank runs is slow."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(dim, dim), nn.GELU(), _BusyOnRank(rank, amount)]
    return nn.Sequential(*layers, nn.Linear(dim, 1))


class _Data(Dataset):
    def __init__(self, n: int, dim: int, delay: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x[:, :1].tanh()
        self.delay = delay

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay:
            time.sleep(self.delay)  # a slow read (storage, decoding)
        return self.x[i], self.y[i]


def make_data(n: int = 16384, dim: int = 256, delay: float = 0.0) -> Dataset:
    """Random inputs; each item takes ``delay`` seconds to read."""
    return _Data(n, dim, delay)


class _KilledWorker(Dataset):
    """Items as ``_Data``'s; on rank 0, the DataLoader worker that reads item ``at``
    is killed with SIGKILL (as the kernel's OOM killer or a person would)."""

    def __init__(self, n: int, dim: int, at: int) -> None:
        self.data, self.at = _Data(n, dim, 0.0), at

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == self.at and _mine(0) and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.data[i]


def make_killed_worker_data(n: int = 16384, dim: int = 256, at: int = 3000) -> Dataset:
    """Random inputs; rank 0's worker reading item ``at`` is killed."""
    return _KilledWorker(n, dim, at)


class _Rows(Dataset):
    """Items of ``rows`` x ``dim`` (``rows`` per rank: uneven work across ranks)."""

    def __init__(self, n: int, dim: int, rows: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, rows, dim, generator=g)
        self.y = self.x[:, 0, :1].tanh()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def make_uneven_data(n: int = 4096, dim: int = 256, rank: int = 1, rows: int = 4) -> Dataset:
    """Rank ``rank``'s items hold ``rows`` rows each, the others' one (a rank whose
    batches hold more work, as with unsorted variable-length samples)."""
    return _Rows(n, dim, rows if _mine(rank) else 1)


class _Texts(Dataset):
    """Items tokenized on read in the main process (a Python tokenizer per item)."""

    def __init__(self, n: int, dim: int, words: int) -> None:
        rng = random.Random(0)
        vocab = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
                 for _ in range(5000)]
        self.texts = [" ".join(rng.choices(vocab, k=words)) for _ in range(n)]
        self.dim = dim

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = [sum(map(ord, w)) % self.dim for w in re.findall(r"\w+", self.texts[i].lower())]
        x = torch.zeros(self.dim)
        for t in ids:  # a bag of words, built the slow way a Python tokenizer does
            x[t] += 1.0
        return x, x[:1].tanh()


def make_text_data(n: int = 8192, dim: int = 256, words: int = 30) -> Dataset:
    """Text tokenized in ``__getitem__``: with data.num_workers=0 it runs in the loop."""
    return _Texts(n, dim, words)


# -- the scenarios -----------------------------------------------------------------------
BASE = ["--model=diagnosis_zoo:make_mlp", "--model.loss=torch.nn.functional:mse_loss",
        "--data=diagnosis_zoo:make_data", "--data.num_workers=0", "--run.eval_every=0",
        "--log.every=5", "--optim.warmup_steps=2", "--checkpoint.save_final=false",
        "--batch-size=64", "--max-steps=40"]
# One torch thread per run, unless a scenario says otherwise: on a machine that others
# share, more threads than the cores left free is a slowdown of its own (the
# thread-oversubscription and cpu-contention scenarios), which the others leave out.
BASE_ENV = {"OMP_NUM_THREADS": "1"}


@dataclass
class Scenario:
    """One slowdown. ``cause_removed``: the run without the cause (args, env, hog), used
    when the finding's fix is not a setting."""

    name: str
    expected: str | None  # the rule that must come first (None: no finding at all)
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    hogs: int = 0  # busy processes outside the job, during the run
    cause_removed: tuple[list[str], dict[str, str], int] | None = None
    quick: bool = False
    launcher: str = "train"  # or "slow-sink": a callback that takes 50 ms per log
    needs: str | None = None  # why it cannot run here (None: it can)
    write_bps: int = 0  # the run's writes to its disk limited to this (0: no limit)


def scenarios() -> list[Scenario]:
    cores = len(os.sched_getaffinity(0))
    straggle = ["--nproc=2", "--batch-size=32", "--model.kwargs={slow_rank = 1, extra = 6}"]
    return [
        Scenario("clean", None, quick=True),
        Scenario("input-bound loader", "input-bound",
                 ["--data.kwargs={delay = 0.002}"], quick=True),
        Scenario("straggler rank (7x forward work on rank 1)", "straggler", straggle,
                 cause_removed=(["--nproc=2", "--batch-size=32"], {}, 0)),
        Scenario("CPU taken by processes outside the job", "cpu-contention",
                 ["--batch-size=32", "--max-steps=300"], env={"OMP_NUM_THREADS": str(cores)},
                 hogs=cores),
        # 2 ranks, each with as many threads as the node has cores (OMP_NUM_THREADS set
        # to the core count by hand; torch caps it there, gpufleet then leaves it be).
        Scenario("threads beyond the cores (2 ranks x all cores)", "thread-oversubscription",
                 ["--nproc=2", "--batch-size=32"], env={"OMP_NUM_THREADS": str(cores)}),
        Scenario("host-bound tiny steps", "host-bound",
                 ["--model.kwargs={dim = 16, width = 16, depth = 2}", "--batch-size=2",
                  "--data.kwargs={dim = 16}"], quick=True),
        Scenario("communication-bound over a slow link (2 nodes, one at 20 Mbit/s)",
                 "communication-bound", launcher="two-nodes", needs=_netbed_missing()),
        Scenario("checkpoint every step", "time-outside-steps",
                 ["--checkpoint.every=1", "--model.kwargs={width = 1024}"], quick=True),
        Scenario("slow metrics sink (50 ms per log, every step)", "slow-logging",
                 ["--log.every=1"], launcher="slow-sink", quick=True),
        # Designed from users' reports, not from the rules.
        *_user_reports(cores),
        # Crashes: named, not survived (no fix to measure).
        Scenario("mismatched collective that aborts (only rank 1 all-reduces, at step 3)",
                 "collective-mismatch", launcher="crash-mismatch", quick=True),
        Scenario("loader worker killed (SIGKILL to rank 0's DataLoader worker)",
                 "loader-worker-killed", ["--nproc=2", "--data.num_workers=2",
                                          "--data=diagnosis_zoo:make_killed_worker_data",
                                          "--max-steps=400", "--log.every=1"],
                 launcher="crash-loader"),
        # The run: rank 1 held to 10% of a core by its cgroup's CPU quota.
        Scenario("quota-throttled rank (rank 1's cgroup: 10 ms of CPU per 100 ms)",
                 "straggler", ["--nproc=2", "--batch-size=32", "--max-steps=200",
                               "--model.kwargs={quota_rank = 1}"],
                 cause_removed=(["--nproc=2", "--batch-size=32", "--max-steps=200"], {}, 0),
                 needs=cpu_quota_missing()),
        Scenario("data-loader workers restarted every epoch", "input-bound",
                 needs="not buildable: gpufleet keeps its workers for the whole run "
                       "(persistent_workers) and takes no user DataLoader"),
    ]


def _variant(kind: str, amount: int, *more: str) -> list[str]:
    return ["--model=diagnosis_zoo:make_variant",
            f'--model.kwargs={{kind = "{kind}", amount = {amount}}}', *more]


def _user_reports(cores: int) -> list[Scenario]:
    """Slowdowns as users describe them in bug reports."""
    two = ["--nproc=2", "--batch-size=32"]
    return [
        Scenario("backward straggler (rank 1: extra arithmetic in backward)", "straggler",
                 [*two, *_variant("backward", 4)], quick=True,
                 cause_removed=([*two, *_variant("backward", 0)], {}, 0)),
        Scenario("optimizer-step straggler (rank 1's optimizer does extra work)",
                 "straggler", [*two, *_variant("optimizer", 4)],
                 cause_removed=([*two, *_variant("optimizer", 0)], {}, 0)),
        Scenario("GC pauses on rank 1 (300k live objects, a full collection every 4th "
                 "step)", "straggler", [*two, *_variant("gc", 3)],
                 cause_removed=([*two, *_variant("gc", 0)], {}, 0)),
        Scenario("one rank with fewer threads (rank 1 on 1 thread, rank 0 on half the "
                 "cores)", "straggler", [*two, *_variant("threads", 1)],
                 env={"OMP_NUM_THREADS": str(max(1, cores // 2))},
                 cause_removed=([*two, *_variant("threads", 0)],
                                {"OMP_NUM_THREADS": str(max(1, cores // 2))}, 0),
                 needs=None if cores >= 4 else f"skipped: needs 4 cores ({cores} here: "
                       "each of 2 ranks already runs on one thread)"),
        # On a CPU an .item() waits for no device: there is nothing to find.
        Scenario("a user metric read with .item() every step (CPU: no device to wait "
                 "for)", None, _variant("item", 1)),
        Scenario("uneven batches (rank 1's items hold 4x the rows)", "straggler",
                 [*two, *_variant("uneven", 0), "--data=diagnosis_zoo:make_uneven_data"],
                 cause_removed=([*two, *_variant("uneven", 0),
                                 "--data=diagnosis_zoo:make_uneven_data",
                                 "--data.kwargs={rows = 1}"], {}, 0)),
        Scenario("tokenizer in the main process (num_workers=0)", "input-bound",
                 ["--data=diagnosis_zoo:make_text_data"]),
        # About 10 MiB a checkpoint every 5 steps, the run's disk writes held to 8 MiB/s
        # by the kernel's block-I/O throttle (the checkpoint's fsync waits for them).
        Scenario("checkpoints to a slow file system (writes held to 8 MiB/s)",
                 "time-outside-steps", ["--checkpoint.every=5",
                                        "--model.kwargs={width = 640, depth = 3}"],
                 write_bps=8 * 2**20, needs=slow_disk_missing()),
        Scenario("clean, 2 ranks", None, two),
        *_one_part_each(),
        *_sharded_and_pipelined(),
        Scenario("clean, 2 nodes (network bed, links unlimited)", None,
                 launcher="two-nodes-clean", needs=_netbed_missing()),
    ]


def _one_part_each() -> list[Scenario]:
    """One slowdown in each part of the step accounting on one rank, named by the
    expected step (``headroom:PART``: the part furthest above what this CPU should do);
    the other parts have rows above (data: input-bound; late ranks: the stragglers;
    exposed communication: the slow link; checkpoints: time-outside-steps)."""
    def every(kind: str, amount: int) -> list[str]:
        return ["--model=diagnosis_zoo:make_variant",
                f'--model.kwargs={{kind = "{kind}", rank = 0, amount = {amount}}}']
    return [
        Scenario("forward: memory-bound work without FLOPs (30 passes over 4 MiB)",
                 "headroom:forward", every("elementwise", 30),
                 cause_removed=(every("elementwise", 0), {}, 0)),
        Scenario("backward: memory-bound work without FLOPs (30 passes over 4 MiB)",
                 "headroom:backward", every("elementwise-backward", 30),
                 cause_removed=(every("elementwise-backward", 0), {}, 0)),
        Scenario("optimizer step: a post-hook's memory-bound work (30 passes over 4 MiB)",
                 "headroom:optimizer", every("optimizer-elementwise", 30),
                 cause_removed=(every("optimizer-elementwise", 0), {}, 0)),
        Scenario("host overhead: a Python loop in forward (200,000 steps)", "headroom:host",
                 every("python", 20), cause_removed=(every("python", 0), {}, 0)),
        Scenario("a rank that swaps", "straggler",
                 needs="not built: this machine has no swap device, and making one and filling "
                       "memory until a rank swaps would take memory from the other work "
                       "sharing it"),
    ]


def _sharded_and_pipelined() -> list[Scenario]:
    """Stragglers where the collectives sit in forward too (fsdp) or between stages
    (pipeline), and the same runs clean."""
    fsdp = ["--nproc=2", "--batch-size=128", "--strategy=fsdp"]
    # Micro-batches of 64 rows of 512: enough arithmetic per micro-batch that a clean
    # pipeline is not held back by per-operation overhead (host-bound).
    pipe = ["--nproc=2", "--batch-size=256", "--strategy=pipeline",
            "--model=diagnosis_zoo:make_stack", "--data.kwargs={dim = 512}"]
    return [
        Scenario("fsdp forward straggler (rank 1: extra arithmetic in forward)", "straggler",
                 [*fsdp, *_variant("forward", 20)],
                 cause_removed=([*fsdp, *_variant("forward", 0)], {}, 0)),
        Scenario("fsdp backward straggler (rank 1: extra arithmetic in backward)",
                 "straggler", [*fsdp, *_variant("backward", 20)],
                 cause_removed=([*fsdp, *_variant("backward", 0)], {}, 0)),
        Scenario("pipeline slow stage (rank 1's stage: extra arithmetic per micro-batch)",
                 "slow-stage", [*pipe, "--model.kwargs={dim = 512, amount = 2}"],
                 cause_removed=([*pipe, "--model.kwargs={dim = 512}"], {}, 0)),
        Scenario("clean, fsdp on 2 ranks", None, fsdp),
        Scenario("clean, pipeline on 2 ranks", None, [*pipe, "--model.kwargs={dim = 512}"]),
    ]


def _netbed_missing() -> str | None:
    try:
        from gpufleet.bench.netbed import netbed_available  # type: ignore[import-not-found]
    except ImportError:
        return "skipped: needs the network bed (gpufleet.bench.netbed)"
    reason = netbed_available()
    return f"skipped: the network bed cannot run here ({reason})" if reason else None


# -- running them ------------------------------------------------------------------------
@contextmanager
def hogging(n: int) -> Iterator[None]:
    """``n`` processes outside the job that keep a core busy each."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def _launcher(kind: str) -> list[str] | None:
    if kind == "slow-sink":
        return [sys.executable, str(Path(__file__).resolve()), "_train-with-slow-sink"]
    return None


def slow_disk_missing() -> str | None:
    from gpufleet.bench.slowdisk import slow_disk_missing as missing

    return missing()


def _measure(scn: Scenario, args: list[str], env: dict[str, str], hogs: int,
             run_dir: Path) -> Any:
    from gpufleet.bench.slowdisk import slow_disk
    from gpufleet.monitor.tune import measure

    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    launcher = _launcher(scn.launcher)
    with hogging(hogs), slow_disk(run_dir.parent, scn.write_bps) as enter:
        if enter:  # the run (and every process it starts) joins the limited group
            launcher = [*enter, *(launcher or [sys.executable, "-m", "gpufleet", "train"])]
        return measure(args, run_dir,
                       {**BASE_ENV, **scn.env, **env, "PYTHONPATH": path},
                       launcher=launcher)


def residual(run_dir: Path) -> tuple[float, float] | None:
    """The step accounting's residual of a run: (mean, worst interval), each the worst
    rank's share of its measured step (:func:`gpufleet.monitor.accounting.run_residual`)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return run_residual([r for r in records if r.get("kind") == "train"])


def run_scenario(scn: Scenario, out: Path, repeats: int,
                 fix_runs: bool = True) -> dict[str, Any]:
    """Diagnose the slow run, apply the fix, measure both; one table row (``fix_runs``
    False: the diagnosis and the accounting only)."""
    from gpufleet.monitor.tune import apply_changes, describe_changes, long_enough

    row: dict[str, Any] = {"scenario": scn.name, "expected": scn.expected or "(none)"}
    if scn.needs:
        return {**row, "first": "-", "correct": "-", "fix": "-", "speedup": None,
                "note": scn.needs}
    if scn.launcher == "two-nodes":
        return {**row, **_slow_link(out, repeats)}
    if scn.launcher == "two-nodes-clean":
        return {**row, **_two_nodes_clean(out)}
    if scn.launcher.startswith("crash-"):
        return {**row, **_crash(scn, out)}
    given = [*BASE, *scn.args]
    slow = [_measure(scn, given, {}, scn.hogs, out / "slow-0")]
    first = slow[0].findings[0] if slow[0].findings else None
    row["first"] = label(first)
    row["residual"] = residual(out / "slow-0")
    if scn.expected is None:  # a clean run: right when nothing warns (an info may be
        warns = [f for f in slow[0].findings if f.severity == "warn"]  # true of the node)
        row["correct"] = not warns
    else:
        row["correct"] = row["first"] == row["expected"]
    row["confident_wrong"] = _confident_wrong(first, row["correct"])
    if first is not None and first.confidence:
        row["first"] += f" ({first.confidence})"
    if scn.expected is None or not fix_runs:
        return {**row, "fix": "-", "speedup": None, "note": _titles(slow[0])}
    if scn.cause_removed is not None:
        args, env, hogs = scn.cause_removed
        fix, what = ([*BASE, *args], env, hogs), "cause removed"
    elif first is not None and first.changes:
        args, env = apply_changes(given, first.changes)
        fix = (long_enough(args, first.changes), env, scn.hogs)
        what = describe_changes(first.changes)
    else:
        return {**row, "fix": "(none suggested)", "speedup": None, "note": _titles(slow[0])}
    fixed = []
    for r in range(repeats):  # slow, fixed, slow, fixed, ...
        fixed.append(_measure(scn, *fix, out / f"fixed-{r}"))
        if r + 1 < repeats:
            slow.append(_measure(scn, given, {}, scn.hogs, out / f"slow-{r + 1}"))
    before = statistics.median(m.samples_per_s for m in slow)
    after = statistics.median(m.samples_per_s for m in fixed)
    return {**row, "fix": what, "before": before, "after": after,
            "speedup": after / before if before else None, "note": _titles(slow[0])}


_MISMATCH = """
import sys
import torch
from torch.utils.data import DataLoader, TensorDataset
import gpufleet

fleet = gpufleet.Fleet(accelerator="cpu", devices=2, run_dir=sys.argv[1])
net = torch.nn.Linear(64, 64)
model, opt = fleet.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
loader = fleet.setup_dataloaders(DataLoader(
    TensorDataset(torch.randn(256, 64), torch.randn(256, 64)), batch_size=8))
for step, (x, y) in enumerate(loader):
    fleet.backward(torch.nn.functional.mse_loss(model(x), y))
    opt.step()
    opt.zero_grad()
    if step == 2 and fleet.global_rank == 1:
        fleet.all_reduce(torch.ones(1))
"""


def _crash(scn: Scenario, out: Path) -> dict[str, Any]:
    """A run that must stop, named: the first thing said is what the output names."""
    out.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, **BASE_ENV, "PYTHONPATH": path}
    if scn.launcher == "crash-mismatch":
        script = out / "train.py"
        script.write_text(_MISMATCH)
        cmd = [sys.executable, "-m", "gpufleet", "run", str(script), "--nproc", "2", "--",
               str(out / "run")]
    else:
        cmd = [sys.executable, "-m", "gpufleet", "train", *BASE, *scn.args,
               "--run-dir", str(out / "run")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    said = done.stdout + done.stderr
    named = {"collective-mismatch": re.search(r"collective mismatch: rank 1 entered "
                                              r"all_reduce #\d+ \(4 bytes, step 3, "
                                              r"train\.py:\d+\) while rank 0 was in", said),
             "loader-worker-killed": re.search(r"DataLoader worker \(pid \d+\) is killed "
                                               r"by signal", said)
             and "Training goes on without it" not in said}
    first = next((k for k, v in named.items() if v and done.returncode != 0), "(not named)")
    line = next((ln for ln in said.splitlines() if ln.startswith("collective mismatch:")
                 or "is killed by signal" in ln), "")
    return {"first": first, "correct": first == scn.expected, "confident_wrong": False,
            "fix": "-", "speedup": None, "note": line.strip()[:200]}


def _slow_link(out: Path, repeats: int, mbit: float = 20.0) -> dict[str, Any]:
    """The slow-link row: ddp across two bed nodes, node 1's link at ``mbit``; the first
    finding's own change applied, both measured on the same limited link."""
    from slow_link import run_two_nodes, throughput  # benchmarks/slow_link.py

    from gpufleet.bench.netbed import NetBed
    from gpufleet.bench.runs import small_gpt_job
    from gpufleet.monitor.diagnose import findings_for_run
    from gpufleet.monitor.tune import apply_changes, describe_changes

    batch = 8
    given = [*small_gpt_job(30, batch_size=batch, n_embd=96, n_layer=2), "--strategy", "ddp"]
    env = {**os.environ, **BASE_ENV}
    slow: list[float] = []
    fixed: list[float] = []
    with NetBed(2) as bed:
        bed.rate_limit(1, mbit)
        run_two_nodes(bed, given, out / "slow-0", env)
        slow.append(throughput(out / "slow-0", batch))
        findings = findings_for_run(out / "slow-0")
        first = findings[0] if findings else None
        row: dict[str, Any] = {"first": first.rule if first else "(none)",
                               "residual": residual(out / "slow-0"),
                               "note": "; ".join(f.title for f in findings)}
        row["correct"] = row["first"] == "communication-bound"
        row["confident_wrong"] = _confident_wrong(first, row["correct"])
        if first is None or not first.changes:
            return {**row, "fix": "(none suggested)", "speedup": None}
        args, _ = apply_changes(given, first.changes)
        accum = int(first.changes.get("optim.grad_accum", 1))
        for r in range(repeats):  # slow, fixed, slow, fixed, ...
            run_two_nodes(bed, args, out / f"fixed-{r}", env)
            fixed.append(throughput(out / f"fixed-{r}", batch * accum))
            if r + 1 < repeats:
                run_two_nodes(bed, given, out / f"slow-{r + 1}", env)
                slow.append(throughput(out / f"slow-{r + 1}", batch))
    before, after = statistics.median(slow), statistics.median(fixed)
    return {**row, "fix": describe_changes(first.changes), "before": before, "after": after,
            "speedup": after / before if before else None}


def _two_nodes_clean(out: Path) -> dict[str, Any]:
    """The clean 2-node row: ddp across two bed nodes, no link limited; right when
    nothing warns."""
    from slow_link import run_two_nodes  # benchmarks/slow_link.py

    from gpufleet.bench.netbed import NetBed
    from gpufleet.bench.runs import small_gpt_job
    from gpufleet.monitor.diagnose import findings_for_run

    given = [*small_gpt_job(30, batch_size=8, n_embd=96, n_layer=2), "--strategy", "ddp"]
    with NetBed(2) as bed:
        run_two_nodes(bed, given, out / "clean", {**os.environ, **BASE_ENV})
    findings = findings_for_run(out / "clean")
    shares = residual(out / "clean")
    first = findings[0] if findings else None
    correct = not any(f.severity == "warn" for f in findings)
    return {"first": (first.rule if first else "(none)") + (
                f" ({first.confidence})" if first and first.confidence else ""),
            "correct": correct, "confident_wrong": _confident_wrong(first, correct),
            "fix": "-", "speedup": None, "residual": shares,
            "note": "; ".join(f.title for f in findings) or "-"}


def label(finding: Any) -> str:
    """A first finding as the table compares it: its rule, and for ``headroom`` the
    part it names (``headroom:forward``)."""
    if finding is None:
        return "(none)"
    if finding.rule == "headroom":
        return f"headroom:{finding.measurements.get('part')}"
    return finding.rule


def _confident_wrong(first: Any, correct: bool) -> bool:
    """A wrong first finding that does not say it is unsure: a warning whose confidence
    is not "low" (rules that do not grade themselves count as sure)."""
    return first is not None and not correct and first.severity == "warn" and \
        first.confidence != "low"


def _titles(m: Any) -> str:
    return "; ".join(f.title for f in m.findings)


def _residual_cell(r: dict[str, Any]) -> str:
    shares = r.get("residual")
    if not shares:
        return "-"
    mean, worst = shares
    flag = " OVER 5%" if abs(worst) > TOLERANCE else ""
    return f"{mean:+.1%} / {worst:+.1%}{flag}"


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| scenario | expected | first finding | correct? | wrong but confident? | "
          "fix applied | speed-up | accounting residual (mean / worst interval) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        speed = f"{r['speedup']:.2f}x ({r['before']:.0f} -> {r['after']:.0f} samples/s)" \
            if r.get("speedup") else (r.get("note") or "-")
        correct = {True: "yes", False: "NO"}.get(r["correct"], r["correct"])
        wrong = {True: "YES", False: "no"}.get(r.get("confident_wrong", "-"), "-")
        print(f"| {r['scenario']} | {r['expected']} | {r['first']} | {correct} | {wrong} | "
              f"{r['fix']} | {speed} | {_residual_cell(r)} |")
    ran = [r for r in rows if r["correct"] in (True, False)]
    said = [r for r in ran if r["first"] != "(none)"]
    due = [r for r in ran if r["expected"] != "(none)"]
    hits = [r for r in said if r["correct"]]
    print(f"\nprecision (first findings that are right): {len(hits)}/{len(said)}; recall "
          f"(slowdowns named first): {sum(r['correct'] for r in due)}/{len(due)}; "
          f"wrong but confident: {sum(bool(r.get('confident_wrong')) for r in ran)}/"
          f"{len(ran)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the fast subset, 1 repeat")
    parser.add_argument("--repeats", type=int, default=None, help="runs of each (2)")
    parser.add_argument("--only", default="", help="comma-separated scenario name parts")
    parser.add_argument("--json", default="", help="also write the rows here")
    parser.add_argument("--out", default="", help="folder for the runs (default: temp)")
    parser.add_argument("--no-fix", action="store_true",
                        help="diagnose and account only: no runs with the fix applied")
    args = parser.parse_args(argv)
    from gpufleet.core.machine import machine_summary

    repeats = args.repeats or (1 if args.quick else 2)
    chosen = [s for s in scenarios() if (s.quick or not args.quick) and
              (not args.only or any(o in s.name or o == s.expected
                                    for o in args.only.split(",")))]
    print(f"machine: {machine_summary()}")
    print(f"load: {os.getloadavg()[0]:.1f} (1-min average) on "
          f"{len(os.sched_getaffinity(0))} usable core(s)")
    out = Path(args.out or tempfile.mkdtemp(prefix="gpufleet-zoo-"))
    rows = []
    for i, scn in enumerate(chosen):
        start = time.perf_counter()
        try:
            rows.append(run_scenario(scn, out / f"s{i}", repeats, not args.no_fix))
        finally:
            remove_quota_group()  # empty once the throttled rank has ended
        print(f"  {scn.name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    # The step accounting's check: every run's parts within 5% of its measured step.
    over = [r["scenario"] for r in rows if r.get("residual")
            and abs(r["residual"][1]) > TOLERANCE]
    if over:
        print(f"\naccounting check FAILED (residual over {TOLERANCE:.0%} of the step): "
              + "; ".join(over))
        return 1
    print(f"\naccounting check passed: every residual within {TOLERANCE:.0%} of the step")
    return 0


def _train_with_slow_sink(argv: list[str]) -> int:
    """``gpufleet train ARGV`` in this process, with a sink that takes 50 ms per log."""
    from gpufleet.api import train
    from gpufleet.cli import _build_parser, parse_train_config
    from gpufleet.core.callbacks import Callback

    class SlowSink(Callback):
        essential = False

        def on_log(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
            time.sleep(0.05)  # a remote logger on a slow connection

    args, rest = _build_parser().parse_known_args(["train", *argv])
    train(parse_train_config(args, rest), callbacks=[SlowSink()])
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["_train-with-slow-sink"]:
        sys.exit(_train_with_slow_sink(sys.argv[2:]))
    sys.exit(main())
