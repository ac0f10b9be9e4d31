"""Where a log line's time goes inside the training loop, call by call.

``peers.py --breakdown`` prices a log line every 10 steps (against every 50) as the
difference of two loops; this times the calls themselves in one ``gpufleet.fit`` of the
peers' MLP job (256-256-10, batch 32, SGD, 1 torch thread), defaults on: the whole of
the loop's between-steps work on a log step, the interval's close (its one read of the
device values), the hand-over of the phase marks, and each callback's ``on_log``.
Medians in µs per log line (a line every ``log.every`` steps), after the first fifth
of the run, and the machine.

    OMP_NUM_THREADS=1 python benchmarks/log_line_parts.py --steps 3000
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import calltimes  # (this script's folder)
import peers  # the peers' jobs and loops (this script's folder)
import torch

from gpufleet.core import callbacks
from gpufleet.core.machine import machine_summary
from gpufleet.core.phases import PhaseAnnouncer
from gpufleet.train.engine.interval import LogInterval
from gpufleet.train.loop import Trainer

_now = calltimes.now
_times = calltimes.TIMES
_timed = calltimes.time_calls


def _time_each_on_log() -> None:
    """Each callback's ``on_log``, under the name the slow-logging rule knows it by."""
    wrap = callbacks._timed

    def timed(name: str, fn: Any, seconds: dict[str, float]) -> Any:
        def call(*args: Any) -> None:
            start = _now()
            try:
                fn(*args)
            finally:
                _times.setdefault(f"on_log: {name}", []).append(_now() - start)

        return wrap(name, call, seconds)

    callbacks._timed = timed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--every", type=int, default=10, help="log.every")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(machine_summary())
    # Called only on the steps that have something due: with the defaults, the log steps.
    _timed(Trainer, "_between_steps", "between steps, all of it")
    _timed(LogInterval, "close", "  the interval's close")
    _timed(PhaseAnnouncer, "hand_over", "  the phase marks handed over")
    _time_each_on_log()
    job = peers.mlp_job(args.steps)
    for r in range(args.rounds):
        _times.clear()
        peers.gpufleet_loop({"log.every": args.every})(job, lambda: None)
        print(f"round {r + 1}: median µs per log line (one every {args.every} steps), "
              f"after the first fifth of {args.steps} steps:")
        for key, ns in _times.items():
            kept = ns[len(ns) // 5:]
            print(f"  {key:36s} {statistics.median(kept) / 1e3:7.1f}  ({len(kept)} calls)")


if __name__ == "__main__":
    main()
