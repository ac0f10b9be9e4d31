"""Start `gpufleet train` on the nodes of a bed the way a user would, and wait for it."""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpufleet.bench.netbed import NetBed
from gpufleet.train.checkpoint import format as ckpt

from .conftest import PYTHON, node_env

# Tiny regression job; 256 samples, a global batch of 32 (8 steps an epoch).
TOY = ["--model", "toyjob:make_model", "--model.loss", "torch.nn.functional:mse_loss",
       "--log.every", "1", "--optim.warmup_steps", "2", "--data.num_workers", "0",
       "--dist.timeout", "60", "--dist.rdzv_timeout", "60", "--log.progress", "lines"]


@dataclass
class Node:
    """One `gpufleet train` process on a node, its output in ``log``."""

    index: int
    proc: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start(bed: NetBed, node: int, args: list[str], cwd: Path, tag: str = "",
          env: dict | None = None, command: str = "train") -> Node:
    """Start ``gpufleet COMMAND ARGS`` (``train``, or ``run`` for a script of your own
    loop) on ``node``; output goes to cwd/node<i><tag>.log."""
    log = cwd / f"node{node}{tag}.log"
    with open(log, "w") as out:
        proc = bed.popen(node, [PYTHON, "-m", "gpufleet", command, *args], env=node_env(env),
                         cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    return Node(node, proc, log)


def wait(nodes: list[Node], timeout: float, expect: int | None = 0) -> list[int]:
    """Wait for every node's process; fail the test with their output on a timeout or an
    exit code other than ``expect`` (None: any)."""
    deadline = time.monotonic() + timeout
    codes = []
    for node in nodes:
        try:
            codes.append(node.proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            pytest.fail(f"node {node.index} still running after {timeout:.0f} s\n" +
                        _dump(nodes))
    if expect is not None and any(code != expect for code in codes):
        pytest.fail(f"exit codes {codes} (wanted {expect})\n" + _dump(nodes))
    return codes


def _dump(nodes: list[Node]) -> str:
    return "\n".join(f"--- node {n.index} ---\n{n.output()[-6000:]}" for n in nodes)


def final_weights(run_dir: Path) -> dict:
    """Model weights of a run's newest checkpoint (a file or a sharded directory)."""
    return ckpt.load_checkpoint(ckpt.list_checkpoints(run_dir)[-1])["model"]


def train_records(run_dir: Path) -> list[dict]:
    """The train records of a run's metrics.jsonl (every restart appends to it)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line being written right now
            continue
        if record.get("kind") == "train":
            records.append(record)
    return records


def wait_for(what, timeout: float, nodes: list[Node], poll: float = 0.2):
    """Poll ``what()`` until it returns something truthy; fail with the logs otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(poll)
    pytest.fail(f"gave up after {timeout:.0f} s waiting for {what.__doc__ or what}\n" +
                _dump(nodes))
