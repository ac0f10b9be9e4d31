"""What the ring of last collectives (``gpufleet.core.ring``) costs a training step.

Two measurements in one process:

1. the time of one record (``enter`` then ``leave``, as every collective does), the
   median of ``--repeats`` loops of 200,000 records;
2. a DDP training step of the built-in GPT (4 blocks of ``--width``, sequence 256,
   vocabulary 8192, batch ``--batch``) on a one-rank gloo group, with gpufleet's
   all-reduce hook (``ArrivalTimer``, which notes each gradient bucket in the ring) and
   a metrics all-reduce every step, noted as ``Strategy.all_reduce`` notes it. The
   records per step are counted from the ring itself.

The ring's share of a step is records per step x time per record / step time.
Target: well under the monitoring budget of 1% of a step.

    python benchmarks/collective_ring.py              # about a minute on 2 idle cores
    python benchmarks/collective_ring.py --width 512 --steps 30
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from gpufleet.core.machine import machine_summary
from gpufleet.core.phases import Phase
from gpufleet.core.ring import RING, CollectiveRing
from gpufleet.models.gpt import build_gpt
from gpufleet.monitor.arrival import ArrivalTimer

SEQ, VOCAB = 256, 8192


def record_ns(repeats: int, n: int = 200_000) -> float:
    """Median nanoseconds of one ``enter`` + ``leave``."""
    ring = CollectiveRing()
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        for _ in range(n):
            ring.leave(ring.enter("all_reduce", 644, 0))
        times.append((time.perf_counter_ns() - start) / n)
    return statistics.median(times)


class _Trainer:
    """What ``ArrivalTimer`` reads from the trainer."""

    def __init__(self, model: DDP) -> None:
        self.model, self.step = model, 0


def ddp_steps(width: int, batch: int, steps: int) -> tuple[float, float]:
    """(median ms per step, ring records per step) of the GPT's DDP steps."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        torch.manual_seed(0)
        gpt = build_gpt(n_layer=4, n_head=max(1, width // 64), n_embd=width,
                        block_size=SEQ, vocab_size=VOCAB)
        model = DDP(gpt)
        timer = ArrivalTimer()
        timer.on_fit_start(_Trainer(model))
        assert timer.measures_wait, "the all-reduce hook was not registered"
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randint(0, VOCAB, (batch, SEQ))
        times, first_seq = [], None
        for i in range(steps + 3):  # 3 warm-up steps
            if i == 3:
                first_seq = RING.seq
            start = time.perf_counter()
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, VOCAB), x.view(-1))
            loss.backward()
            timer.on_phase(None, Phase.OPTIMIZER)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            stats = loss.detach().reshape(1)  # the metrics all-reduce, noted as
            n = RING.enter("all_reduce", 4)  # Strategy.all_reduce notes it (which does
            dist.all_reduce(stats)  # not reduce in a one-rank group)
            RING.leave(n)
            timer.on_phase(None, Phase.END)
            if i >= 3:
                times.append(time.perf_counter() - start)
        timer.on_fit_end(None, None)
        return statistics.median(times) * 1e3, (RING.seq - first_seq) / steps
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    print(machine_summary())
    ns = record_ns(args.repeats)
    ms, records = ddp_steps(args.width, args.batch, args.steps)
    share = records * ns / (ms * 1e6)
    print(f"one record (enter + leave): {ns:.0f} ns (median of {args.repeats} x 200,000)")
    print(f"GPT 4 x {args.width}, seq {SEQ}, batch {args.batch}, DDP on 1 gloo rank: "
          f"{ms:.1f} ms/step (median of {args.steps}), {records:.1f} records/step")
    print(f"ring share of a step: {share * 100:.5f}% (target: well under 1%)")


if __name__ == "__main__":
    main()
