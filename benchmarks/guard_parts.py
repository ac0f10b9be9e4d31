"""Where the non-finite guard's time goes inside the training loop, call by call.

``peers.py --breakdown`` gives the guard's share of a step as the difference of two
loops; this times the calls themselves in one ``gpufleet.fit`` of the peers' MLP job
(256-256-10, batch 32, SGD, 1 torch thread), guard on and off in turn:
``NonFiniteGuard.inspect`` and its parts on the device path (the list of gradients,
each gradient's number for the culprit, the interval's flag, the one fused check), the
optimizer's step and ``zero_grad``. Then the same check in a tight loop outside
training, beside one fused check over the gradients themselves (no record for the
culprit) and the sum of the largest gradient alone: the read of every gradient, which
no guard of the gradients avoids. Prints medians in µs and the machine.

    OMP_NUM_THREADS=1 python benchmarks/guard_parts.py --steps 3000
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import calltimes  # (this script's folder)
import peers  # the peers' jobs and loops (this script's folder)
import torch

from gpufleet.core.machine import machine_summary
from gpufleet.train.guard.nonfinite import NonFiniteGuard

_now = calltimes.now
_times = calltimes.TIMES
_timed = calltimes.time_calls


def _flag_gradients_in_parts(self: NonFiniteGuard, step_loss: torch.Tensor,
                             optimizer: Any) -> None:
    """The device path's check on a CPU (``NonFiniteGuard._flag_gradients`` with every
    gradient whole), with a clock read between its parts."""
    t0 = _now()
    grads = [g for p in self._params if (g := p.grad) is not None]
    t1 = _now()
    checked = [g.sum(dtype=torch.float32) for g in grads]
    t2 = _now()
    each = tuple(checked)
    checked.append(step_loss)
    found = self._interval.next_flag(each, step_loss)
    t3 = _now()
    torch._amp_foreach_non_finite_check_and_unscale_(checked, found, self._one)
    t4 = _now()
    optimizer.found_inf = found
    for key, ns in (("  the list of gradients", t1 - t0), ("  each gradient's sum", t2 - t1),
                    ("  the interval's flag", t3 - t2), ("  the fused check", t4 - t3)):
        _times.setdefault(key, []).append(ns)


def _tight(fn: Callable[[], Any], n: int = 20000) -> float:
    for _ in range(500):
        fn()
    best = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best.append((time.perf_counter() - start) / n * 1e6)
    return min(best)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=2, help="guard on, then off, this often")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(machine_summary())
    NonFiniteGuard._flag_gradients = _flag_gradients_in_parts  # type: ignore[method-assign]
    _timed(NonFiniteGuard, "inspect", "NonFiniteGuard.inspect")
    _timed(torch.optim.SGD, "step", "SGD.step (fused)")
    _timed(torch.optim.Optimizer, "zero_grad", "zero_grad")
    job, skip = peers.mlp_job(args.steps), args.steps // 5
    for r in range(args.rounds):
        for guard in (True, False):
            _times.clear()
            peers.gpufleet_loop({"fault.skip_nonfinite": guard})(job, lambda: None)
            print(f"round {r + 1}, guard {'on' if guard else 'off'} (median µs per call, "
                  f"steps {skip + 1}-{args.steps}):")
            for key, ns in _times.items():
                print(f"  {key:32s} {statistics.median(ns[skip:]) / 1e3:7.2f}")
    model = job.make_model()
    x, y = job.data[:32]
    torch.nn.functional.cross_entropy(model(x), y).backward()
    grads = [q.grad for q in model.parameters()]
    loss, one = torch.ones(()), torch.ones(())

    def sums_and_check() -> None:
        checked = [g.sum(dtype=torch.float32) for g in grads] + [loss]
        torch._amp_foreach_non_finite_check_and_unscale_(checked, torch.zeros(()), one)

    def one_check() -> None:  # no record: a skipped step could not name its parameter
        torch._amp_foreach_non_finite_check_and_unscale_([*grads, loss], torch.zeros(()), one)

    print("outside training, a tight loop (best of 5, µs per call):")
    for what, fn in (("each gradient's sum and the fused check", sums_and_check),
                     ("one fused check of the gradients", one_check),
                     ("each gradient's sum alone", lambda: [g.sum() for g in grads]),
                     ("the 256x256 gradient's sum alone", lambda: grads[0].sum())):
        print(f"  {what:40s} {_tight(fn):7.2f}")


if __name__ == "__main__":
    main()
