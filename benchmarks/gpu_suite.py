"""Every CUDA path checked and every GPU target measured, in two calls of under 10 minutes.

Stages, each a child process with its own time budget (a stage that fails or runs out of
time is recorded, and the next one runs):

1. ``tests``: ``pytest -m gpu`` over the test files that hold GPU tests.
2. ``new_paths``: ``pytest -m gpu tests/gpu/test_cuda_new_paths.py``, the paths merged
   since the last GPU check: fp16's scaler and the device-path non-finite guard through
   the engine's step, Fleet's optimizer wrapper with the ``-true`` precisions and the
   mixed ones' input casting, the compile caches (Triton's too) kept with the run, an
   NCCL rank's crash forensics and flight recorder, kernel counters beside NVML.
3. ``default_job``: ``gpufleet train`` with no arguments (wall time, tokens/s, MFU).
4. ``mfu``: ``benchmarks/mfu.py`` on a GPT-2-124M-class model in fp32, bf16 and
   bf16 + compile (tokens/s, MFU, the hand-written loop in lockstep, loss curves).
5. ``monitor``: ``benchmarks/monitor_overhead.py`` on the GPU (all monitoring, phase
   timing, the sampler and the non-finite check, each on against off, interleaved).
6. ``prefetch``: ``benchmarks/prefetch.py`` (the side-stream prefetcher on against off).
7. ``peers``: ``benchmarks/input_path.py`` (each way a batch reaches the GPU, alone),
   ``benchmarks/guard_floor.py --device cuda`` (the non-finite guard's device path
   beside cheaper stand-ins and a host read a step), then ``benchmarks/peers.py
   --device cuda`` twice (gpufleet's defaults, ``Fleet`` and
   the hand-written loop beside Lightning Fabric, Accelerate and the Lightning Trainer,
   on the MLP in fp32 with ``--breakdown``, then on the built-in GPT in bf16, warm); one
   stage, so that ``--out`` holds at most 8 files.

What lands in ``--out``: ``results.md`` (ready to paste into benchmarks/HISTORY.md),
``results.json`` and one ``<stage>.log`` per stage; both results files are rewritten
after every stage, so a run cut short still leaves what it measured. ``--dry-run``
runs every stage with tiny sizes (on the CPU when there is no GPU) to prove the plumbing.

On an H200 (2026-11-27) the stages took 112, 139, 58, 136, 75 and about 80 s: more
than one device call's 10 minutes. So run it as two calls, the checks first (about 545 s
of budgets with ``new_paths``, not yet timed on a GPU), then the comparisons (about 315 s):

    bash scripts/gpu_check.sh --stages tests,new_paths,default_job,mfu,prefetch
    bash scripts/gpu_check.sh --stages peers,monitor
    OUT=/tmp/gpu_dry bash scripts/gpu_check.sh --dry-run
    python benchmarks/gpu_suite.py --out DIR --stages mfu,prefetch --budget 300
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpu_report beside this file

from gpu_report import machine_facts, render_markdown, summarize  # noqa: E402

LOG_CAP = 1 << 20  # bytes of each stage's log kept (the tail)


@dataclass
class Context:
    """Where a run writes, and whether it is the small dry run."""

    out: Path
    work: Path  # run directories and raw JSON: a temporary folder, not --out
    dry_run: bool
    python: str = sys.executable
    mfu_args: str = ""  # extra flags for benchmarks/mfu.py


@dataclass
class Stage:
    """One step of the suite.

    Attributes:
        name: short id; also the log file's name.
        budget_s: seconds this stage is sure to get (earlier stages' leftovers add up).
        command: the command line for a context.
        result_file: the JSON the stage writes in ``ctx.work`` (None: none).
    """

    name: str
    budget_s: float
    command: Callable[[Context], list[str]]
    result_file: str | None = None


@dataclass
class Outcome:
    name: str
    status: str  # "passed", "failed (exit N)", "timed out after N s", "not run: ..."
    seconds: float = 0.0
    timeout_s: float = 0.0
    summary: dict[str, Any] = field(default_factory=dict)


# -- the stages -------------------------------------------------------------------------

#: The GPU tests of the paths merged since the last GPU check (issue 48): their own
#: stage, so that a short device call can run them first and their result stands apart.
NEW_PATHS = "tests/gpu/test_cuda_new_paths.py"


def gpu_test_files() -> list[str]:
    """Test files that hold tests marked ``gpu`` (collecting only these keeps a missing
    optional test dependency elsewhere from stopping the run), less the ``new_paths``
    stage's file."""
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                   if "mark.gpu" in p.read_text(errors="replace")
                   and str(p.relative_to(REPO)) != NEW_PATHS)
    return files or ["tests"]


def _pytest_gpu(ctx: Context, files: list[str]) -> list[str]:
    cmd = [ctx.python, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
           "-o", "addopts=", "--continue-on-collection-errors", *files]
    try:
        import pytest_timeout  # noqa: F401
        cmd.append("--timeout=240")
    except ImportError:
        pass  # the stage's own budget still bounds it
    return cmd


def _tests(ctx: Context) -> list[str]:
    return _pytest_gpu(ctx, gpu_test_files())


def _new_paths(ctx: Context) -> list[str]:
    return _pytest_gpu(ctx, [NEW_PATHS])


def _default_job(ctx: Context) -> list[str]:
    cmd = [ctx.python, "-m", "gpufleet", "train", f"--run.dir={ctx.work / 'default-job'}",
           "--log.progress=lines"]
    if ctx.dry_run:
        cmd += ["--max-steps=20", "--model.n_layer=1", "--model.n_embd=32", "--model.n_head=2",
                "--model.block_size=32", "--data.corpus_bytes=100000", "--run.eval_every=0",
                "--log.every=5", "--run.eval_batches=2"]
    return cmd


def _mfu(ctx: Context) -> list[str]:
    cmd = [ctx.python, str(REPO / "benchmarks" / "mfu.py"), "--out", str(ctx.work / "mfu.json")]
    if ctx.dry_run:  # no compile row: inductor on a CPU takes minutes
        cmd += ["--device=cpu", "--no-compile", "--hand=on", "--n-layer=1", "--n-head=2",
                "--n-embd=32", "--seq=32", "--batch=2", "--vocab=128", "--steps=25",
                "--warmup=5", "--curve-steps=10"]
    return cmd + shlex.split(ctx.mfu_args)  # e.g. "--batch 32": later flags win


def _monitor(ctx: Context) -> list[str]:
    cmd = [ctx.python, str(REPO / "benchmarks" / "monitor_overhead.py"), "--model=gpt",
           "--json", str(ctx.work / "monitor.json")]
    if ctx.dry_run:
        cmd += ["--device=cpu", "--widths=32", "--steps=22", "--repeats=1", "--batch=2",
                "--rows=monitoring,nonfinite"]
    else:
        cmd += ["--device=cuda", "--widths=768", "--steps=150", "--repeats=1", "--batch=16",
                "--rows=monitoring,phases,sampler,nonfinite"]
    return cmd


def _peers(ctx: Context) -> list[str]:
    """The input paths alone, then both jobs, one after the other, in one shell (each
    runs when one before it fails too; the stage fails when any does)."""
    paths = [ctx.python, str(REPO / "benchmarks" / "input_path.py"), "--json",
             str(ctx.work / "input_path.json")]
    paths += ["--device=cpu", "--batches=50", "--repeats=1"] if ctx.dry_run else \
        ["--device=cuda"]
    guard = [ctx.python, str(REPO / "benchmarks" / "guard_floor.py"), "--turn-steps=50",
             "--json", str(ctx.work / "guard_floor.json")]
    guard += ["--device=cpu", "--steps=60", "--warmup=5"] if ctx.dry_run else \
        ["--device=cuda", "--steps=1000"]
    runs = [shlex.join(paths), shlex.join(guard)]
    for job, precision, extra in (("mlp", "fp32", ["--steps=1000", "--breakdown"]),
                                  ("gpt", "bf16", ["--steps=400", "--breakdown"])):
        cmd = [ctx.python, str(REPO / "benchmarks" / "peers.py"), f"--job={job}",
               "--turn-steps=50", "--no-import-times", "--json",
               str(ctx.work / f"peers_{job}.json")]
        if ctx.dry_run:
            cmd += ["--device=cpu", "--precision=fp32", "--steps=60", "--warmup=5"]
        else:
            cmd += ["--device=cuda", f"--precision={precision}", *extra]
        runs.append(shlex.join(cmd))
    script = "; ".join(f"{run} || failed=1" for run in runs)
    return ["bash", "-c", f"failed=0; {script}; exit $failed"]


def _prefetch(ctx: Context) -> list[str]:
    cmd = [ctx.python, str(REPO / "benchmarks" / "prefetch.py"), "--json",
           str(ctx.work / "prefetch.json")]
    if ctx.dry_run:
        cmd += ["--device=cpu", "--features=64", "--hidden=32", "--batch=8", "--samples=256",
                "--workers=0", "--steps=10", "--log-every=5", "--repeats=1"]
    return cmd


STAGES = [  # budgets: what each took on an H200 (2026-11-27), plus a margin
    Stage("tests", 125, _tests),
    # Not yet run on a GPU; estimated: two fits of the tiny GPT (~10 s), four small Fleet
    # loops (~10 s), two compiled runs in fresh processes (~50 s), an NCCL rank (~10 s)
    # and a sampled fit (~10 s), plus pytest's start
    Stage("new_paths", 110, _new_paths),
    # 139 s before the 4 CUDA input rows; the input paths alone add about 20 s, the
    # guard's stand-ins (8 loops of 1000 MLP steps) about 30 s
    Stage("peers", 225, _peers, "peers_mlp.json"),
    Stage("default_job", 70, _default_job, "default-job"),
    Stage("mfu", 150, _mfu, "mfu.json"),
    Stage("monitor", 90, _monitor, "monitor.json"),
    # ~75 s to its results; its exit then waited 21 s for the data workers of earlier
    # fits (fixed since: TrainStream.close), so the stage ran out at 94 s
    Stage("prefetch", 90, _prefetch, "prefetch.json"),
]

#: seconds one device call leaves the suite (a call runs 10 minutes at most)
CALL_S = 575.0


# -- running ----------------------------------------------------------------------------

def run_stage(stage: Stage, ctx: Context, timeout_s: float) -> Outcome:
    """Run one stage as a child process in its own session, its output in
    ``<out>/<name>.log``; past ``timeout_s`` its whole process group is ended."""
    log_path = ctx.out / f"{stage.name}.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"),
                                                      env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    cmd = stage.command(ctx)
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=max(1.0, timeout_s))
            status = "passed" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            _end_group(proc)
            status = f"timed out after {timeout_s:.0f} s"
    _keep_tail(log_path)
    return Outcome(stage.name, status, time.monotonic() - start, timeout_s)


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM the stage's process group, then SIGKILL what is left after 10 s."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _keep_tail(path: Path) -> None:
    if path.stat().st_size > LOG_CAP:
        data = path.read_bytes()[-LOG_CAP:]
        path.write_bytes(b"[... earlier output cut ...]\n" + data)


def run_suite(stages: list[Stage], ctx: Context, budget_s: float,
              on_stage: Callable[[list[Outcome]], None] = lambda _o: None) -> list[Outcome]:
    """Run the stages in order. Each may run until the suite's deadline minus the budgets
    of the stages after it, so leftovers flow down and no stage eats another's share.
    Budgets that add up to more than ``budget_s`` shrink in proportion."""
    deadline = time.monotonic() + budget_s
    scale = min(1.0, budget_s / max(1e-9, sum(s.budget_s for s in stages)))
    outcomes: list[Outcome] = []
    for i, stage in enumerate(stages):
        reserved = scale * sum(s.budget_s for s in stages[i + 1:])
        timeout_s = deadline - time.monotonic() - reserved
        if timeout_s < 1:
            outcome = Outcome(stage.name, "not run: no time left in the budget")
        else:
            outcome = run_stage(stage, ctx, timeout_s)
        try:
            outcome.summary = summarize(stage.name, ctx, outcome.status)
        except Exception as e:  # a stage that wrote nothing readable is still recorded
            outcome.summary = {"error": f"{type(e).__name__}: {e}"}
        outcomes.append(outcome)
        on_stage(outcomes)
    return outcomes


def write_results(ctx: Context, facts: dict[str, Any], outcomes: list[Outcome]) -> None:
    """results.json and results.md in ``ctx.out`` (rewritten after every stage)."""
    data = {"machine": facts, "dry_run": ctx.dry_run,
            "stages": [vars(o) for o in outcomes]}
    (ctx.out / "results.json").write_text(json.dumps(data, indent=1, default=str))
    (ctx.out / "results.md").write_text(render_markdown(data))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    names = [s.name for s in STAGES]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT"),
                   help="folder for results.md, results.json and the logs (default: $OUT)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny sizes, CPU where there is no GPU: proves the plumbing")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole suite (default: the stages' budgets, at "
                        "most 575; dry run: 460)")
    p.add_argument("--stages", default=",".join(names), help=f"of: {', '.join(names)}")
    p.add_argument("--mfu-args", default="", metavar="FLAGS",
                   help="extra flags for benchmarks/mfu.py, e.g. '--batch 32'")
    args = p.parse_args(argv)
    if not args.out:
        p.error("no output folder: pass --out DIR or set OUT")
    chosen = args.stages.split(",")
    unknown = [s for s in chosen if s not in names]
    if unknown:
        p.error(f"--stages: unknown {', '.join(unknown)}; choose from {', '.join(names)}")
    args.stages = [s for s in STAGES if s.name in chosen]
    if args.budget is None:
        needed = sum(s.budget_s for s in args.stages)
        # dry run: 400 s was the six stages' share; new_paths' 110 s keeps theirs
        args.budget = 460.0 if args.dry_run else min(CALL_S, needed)
        if not args.dry_run and needed > CALL_S:
            print(f"note: these stages' budgets add up to {needed:.0f} s, more than one "
                  f"device call's {CALL_S:.0f} s, so each gets less; run them in two calls "
                  "(--stages tests,new_paths,default_job,mfu,prefetch, then "
                  "--stages peers,monitor)",
                  file=sys.stderr, flush=True)
    return args


def missing_requirements(python: str) -> str | None:
    """What stops ``python`` from importing gpufleet from the source tree (a package of
    its requirements missing there), or None: every stage needs it, so a missing one is
    named before the budget is spent on stages that would all fail the same way."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([python, "-c", "import gpufleet.config, gpufleet.api"], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit {done.returncode}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = missing_requirements(sys.executable)
    if problem:
        print(f"gpufleet does not import here: {problem}. Install what is missing first "
              "(on a machine without a registry: carry its wheel and put it on PYTHONPATH)",
              file=sys.stderr, flush=True)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    facts = machine_facts()
    print(f"machine: {facts['summary']}; driver {facts.get('driver') or 'n/a'}", flush=True)
    if not args.dry_run and not facts["cuda"]:
        print("NOTE: no CUDA device: the GPU tests will skip and the benchmarks run on the "
              "CPU. Use --dry-run for the quick plumbing check.", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpufleet-gpu-suite-") as work:
        ctx = Context(out, Path(work), args.dry_run, mfu_args=args.mfu_args)

        def progress(outcomes: list[Outcome]) -> None:
            last = outcomes[-1]
            print(f"[{last.name}] {last.status} in {last.seconds:.0f} s "
                  f"(limit {last.timeout_s:.0f} s)", flush=True)
            write_results(ctx, facts, outcomes)

        outcomes = run_suite(args.stages, ctx, args.budget, progress)
    print(f"wrote {out / 'results.md'} and {out / 'results.json'}")
    return 0 if all(o.status == "passed" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
