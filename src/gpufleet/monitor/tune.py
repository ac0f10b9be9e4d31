"""``gpufleet tune TRAIN-ARGS``: the diagnosis closes its own loop.

Runs the job for a few hundred steps as given, reads what the diagnosis found, runs it
again with each suggested change (a finding's ``changes``: config keys, and ``env.NAME``
for an environment variable), and prints what each change measured. Runs alternate
(baseline, change 1, change 2, ..., baseline, ...) so that a machine whose load drifts
affects them alike; throughput is samples per second of wall time between the first and
the last log interval, evaluation, checkpoints and logging included.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Measured:
    """One training run as tune (and the diagnosis zoo) sees it."""

    samples_per_s: float
    findings: list[Any] = field(default_factory=list)
    run_dir: Path | None = None
    output: str = ""


def apply_changes(args: list[str], changes: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """``args`` (``gpufleet train`` arguments) with ``changes`` applied, and the
    environment variables they set.

    A changed key replaces the user's own ``--key=V`` / ``--key V`` and its short flag.

    Example:
        >>> apply_changes(["--batch-size", "2", "--log.every=1"],
        ...               {"data.batch_size": 8, "env.OMP_NUM_THREADS": 1})
        (['--log.every=1', '--data.batch_size=8'], {'OMP_NUM_THREADS': '1'})
    """
    from gpufleet.config.flags import SHORTCUTS

    env = {k[4:]: str(v) for k, v in changes.items() if k.startswith("env.")}
    keys = {k: v for k, v in changes.items() if not k.startswith("env.")}
    flags = {f"--{k}" for k in keys} | {f for f, (k, _) in SHORTCUTS.items() if k in keys}
    out: list[str] = []
    i = 0
    while i < len(args):
        name = args[i].split("=", 1)[0]
        if name in flags:
            i += 1 if "=" in args[i] else 2
            continue
        out.append(args[i])
        i += 1
    return out + [f"--{k}={v}" for k, v in keys.items()], env


def long_enough(args: list[str], changes: dict[str, Any]) -> list[str]:
    """``args`` with ``run.max_steps`` raised, when a change spaces something out
    (``log.every``, ``checkpoint.every``, ``run.eval_every``), to three of its intervals:
    a run must log, save or evaluate as often as it will to be measured fairly.

    Example:
        >>> long_enough(["--max-steps=40", "--lr=0.1"], {"log.every": 100})
        ['--lr=0.1', '--run.max_steps=300']
    """
    spans = [int(v) for k, v in changes.items() if k.endswith("every")]
    if not spans:
        return args
    steps = 0
    for i, a in enumerate(args):
        name, _, value = a.partition("=")
        if name in ("--max-steps", "--run.max_steps"):
            steps = int(value or args[i + 1])
    wanted = 3 * max(spans)
    return args if steps >= wanted else apply_changes(args, {"run.max_steps": wanted})[0]


def throughput(run_dir: str | Path) -> float:
    """Samples per second of wall time from the first to the last train record of
    ``<run_dir>/metrics.jsonl`` (0 with fewer than two records)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return 0.0
    train = [r for r in map(json.loads, path.read_text().splitlines())
             if r.get("kind") == "train"]
    if len(train) < 2 or train[-1]["time"] <= train[0]["time"]:
        return 0.0
    samples = sum(r["samples_per_s"] * r["step_time_s"] * (r["step"] - prev["step"])
                  for prev, r in itertools.pairwise(train))
    return samples / (train[-1]["time"] - train[0]["time"])


def measure(args: list[str], run_dir: Path, env: dict[str, str] | None = None,
            timeout: float = 900.0, launcher: list[str] | None = None) -> Measured:
    """Run ``gpufleet train ARGS`` (or ``launcher + ARGS``) into ``run_dir`` and measure
    it."""
    from gpufleet.monitor.diagnose import findings_for_run

    cmd = [*(launcher or [sys.executable, "-m", "gpufleet", "train"]), *args,
           f"--run.dir={run_dir}", "--log.progress=off", "--monitor.report=false"]
    proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    return Measured(throughput(run_dir), findings_for_run(run_dir), run_dir,
                    proc.stdout + proc.stderr)


def tune(args: list[str], out: Path, steps: int = 200, repeats: int = 2) -> list[dict]:
    """Measure the job and each change its findings suggest; one row per change.

    Returns rows ``{"rule", "change", "before", "after", "speedup"}`` (samples/s), the
    baseline's own row first (``rule`` "baseline").
    """
    base = [*args, f"--run.max_steps={steps}"]
    first = measure(base, out / "base-0")
    tries = [(f.rule, f.changes) for f in first.findings if f.changes]
    before = [first.samples_per_s]
    after: dict[int, list[float]] = {i: [] for i in range(len(tries))}
    for r in range(repeats):
        for i, (_, changes) in enumerate(tries):
            changed, env = apply_changes(base, changes)
            changed = long_enough(changed, changes)
            after[i].append(measure(changed, out / f"try{i}-{r}", env).samples_per_s)
        if r + 1 < repeats:
            before.append(measure(base, out / f"base-{r + 1}").samples_per_s)
    b = statistics.median(before)
    rows = [{"rule": "baseline", "change": "", "before": b, "after": b, "speedup": 1.0}]
    for i, (rule, changes) in enumerate(tries):
        a = statistics.median(after[i])
        rows.append({"rule": rule, "change": describe_changes(changes), "before": b,
                     "after": a, "speedup": a / b if b else 0.0})
    return rows


def describe_changes(changes: dict[str, Any]) -> str:
    """``changes`` as the user would type them (``--key=V``; ``NAME=V`` for env)."""
    return " ".join(f"{k[4:]}={v}" if k.startswith("env.") else f"--{k}={v}"
                    for k, v in changes.items())


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``gpufleet tune`` to the CLI's subparsers.

    Example:
        >>> parser = argparse.ArgumentParser(prog="gpufleet")
        >>> add_parser(parser.add_subparsers(dest="command"))
        >>> args, rest = parser.parse_known_args(["tune", "--steps", "50", "--batch-size=4"])
        >>> args.steps, rest
        (50, ['--batch-size=4'])
    """
    p = sub.add_parser(
        "tune", help="measure the speed-up of each fix the diagnosis suggests",
        description="Train for a few hundred steps as the given train arguments say (every "
                    "argument tune does not know is one for gpufleet train), then again "
                    "with each change the diagnosis suggests, and print the measured "
                    "speed-ups.")
    p.add_argument("--steps", type=int, default=200, help="steps per run (default 200)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each (default 2)")
    p.add_argument("--out", default="runs/tune", help="folder for the runs")


def run(args: argparse.Namespace) -> int:
    """Tune and print the table; returns the exit code."""
    if args.steps < 20 or args.repeats < 1:
        print("gpufleet tune: --steps must be >= 20 (the diagnosis needs a few log "
              "intervals) and --repeats >= 1.", file=sys.stderr)
        return 2
    try:
        rows = tune(list(args.train_args), Path(args.out), args.steps, args.repeats)
    except RuntimeError as e:
        print(f"gpufleet tune: {e}", file=sys.stderr)
        return 1
    if len(rows) == 1:
        print(f"No finding with a change to try: {rows[0]['before']:.1f} samples/s as is.")
        return 0
    print(f"{'finding':<26} {'change':<36} {'samples/s':>22} {'speed-up':>9}")
    for r in rows[1:]:
        print(f"{r['rule']:<26} {r['change']:<36} "
              f"{r['before']:>9.1f} -> {r['after']:>9.1f} {r['speedup']:>8.2f}x")
    return 0
