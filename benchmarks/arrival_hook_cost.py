"""What timing each rank's arrival under fsdp/hsdp and pipeline costs a training step.

Three measurements in one process:

1. one timed FSDP collective: ``gpufleet.monitor.arrival_hooks``'s all-gather wrapper
   around a collective that does nothing, less that bare collective (the median of
   ``--repeats`` loops of 200,000 calls). It includes the ring-of-collectives record,
   two clock reads, the phase lookup and three float additions;
2. one timed pipeline micro-batch (forward or backward), likewise;
3. a step of the default job's model (the built-in GPT of ``gpufleet train`` with no
   arguments: its blocks, width, context and batch), forward + backward + AdamW, in one
   process, as the yardstick.

Under fsdp the default job shards each block and the root: per step one all-gather per
unit in forward, one per unit in backward and one reduce-scatter per unit (hsdp adds an
all-reduce per unit), so the hooks' share of a step is
``3 x units x cost / step`` (``4 x`` for hsdp). Target: well under the monitoring budget
of 1% of a step.

    python benchmarks/arrival_hook_cost.py              # about half a minute on 2 idle cores
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.nn import functional as F

from gpufleet.config import Config
from gpufleet.core.machine import machine_summary
from gpufleet.core.phases import Phase, PhaseMarks
from gpufleet.job import build_model
from gpufleet.monitor.arrival_hooks import Waits, _TimedAllGather, time_stage


class _NoComm:
    """A collective that returns at once (what is left is the wrapper's own cost)."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return None


class _Stage:
    def forward_one_chunk(self, i):
        return None

    def backward_one_chunk(self, i):
        return None


def _median_ns(call, repeats: int, n: int = 200_000) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(n):
            call()
        times.append((time.perf_counter_ns() - start) / n)
    return statistics.median(times)


def hook_ns(repeats: int) -> tuple[float, float]:
    """(ns added per timed collective, ns added per timed micro-batch)."""
    waits = Waits()
    waits.marks = PhaseMarks(4)
    waits.marks.phases[0], waits.marks.count = Phase.FORWARD, 1
    bare = _NoComm()
    timed = _TimedAllGather(bare, waits)
    out, inp = torch.zeros(4), torch.zeros(2)
    comm = (_median_ns(lambda: timed(out, inp, None), repeats)
            - _median_ns(lambda: bare(out, inp, None), repeats))
    stage = _Stage()
    plain = _median_ns(lambda: stage.forward_one_chunk(0), repeats)
    time_stage(stage, Waits())
    chunk = _median_ns(lambda: stage.forward_one_chunk(0), repeats) - plain
    return comm, chunk


def default_job_step_ms(steps: int) -> tuple[float, int]:
    """(median ms of a step of the default job's model, its blocks)."""
    cfg = Config()
    torch.manual_seed(0)
    model = build_model(cfg)
    vocab = model.config.vocab_size
    x = torch.randint(0, vocab, (cfg.data.batch_size, cfg.model.block_size))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for i in range(steps + 2):  # 2 warm-up steps
        start = time.perf_counter()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, cfg.model.n_layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    print(machine_summary())
    print(f"load: {os.getloadavg()[0]:.1f} (1-min average)")
    comm, chunk = hook_ns(args.repeats)
    ms, blocks = default_job_step_ms(args.steps)
    units = blocks + 1  # each block, then the root
    fsdp_share = 3 * units * comm / (ms * 1e6)
    hsdp_share = 4 * units * comm / (ms * 1e6)
    print(f"one timed fsdp collective: +{comm:.0f} ns; one timed pipeline micro-batch: "
          f"+{chunk:.0f} ns (medians of {args.repeats} x 200,000)")
    print(f"default job's model ({blocks} blocks), one process: {ms:.1f} ms/step "
          f"(median of {args.steps})")
    print(f"fsdp: {3 * units} timed collectives/step = {fsdp_share * 100:.4f}% of a step; "
          f"hsdp: {4 * units} = {hsdp_share * 100:.4f}% (target: well under 1%)")


if __name__ == "__main__":
    main()
