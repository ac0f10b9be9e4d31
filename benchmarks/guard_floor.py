"""What the non-finite guard could cost at the least, beside what it costs, in one run.

The MLP job of ``peers.py`` (256-256-10, batch 32, SGD, 1 torch thread) in loops that
take turns a step, or with ``--turn-steps`` a block of steps, at a time
(``peers.Baton``): Lightning Fabric (no guard), gpufleet with its defaults, and
gpufleet with the guard's per-step check swapped for cheaper ones that give up part of
what it promises:

* ``defaults``: one number per gradient (on this CPU its float32 sum), kept by
  reference for the log interval so that a skipped step names its first bad parameter,
  then one fused finiteness check of those numbers and the loss; the flag goes to the
  fused optimizer.
* ``norms kept``: the record as an accelerator keeps it, each gradient's norm (one fused
  kernel there), where on a CPU the defaults keep each gradient's sum.
* ``one check, no culprit``: one fused finiteness check over the gradients themselves
  and the loss (the least work that still reads every gradient); a skipped step could
  not name its parameter.
* ``loss only``: the check of the loss alone (does not see a non-finite gradient under
  a finite loss: not a guard of the gradients at all).
* ``flags only``: no check at all, only what the guard does around one (the interval's
  flag handed to the fused optimizer, read and settled at the log interval): the cost
  of the machinery, not a guard.
* ``no guard``: ``fault.skip_nonfinite = false``.
* ``one check read on the host``: the ``one check`` above, its flag then read on the
  host every step, as the guard's host path does (a sync per step on a GPU). Beside
  ``defaults`` on a GPU it says what the device path's launches cost against one sync,
  where a small model leaves the GPU idle anyway.

Each swapped check is a stand-in for the cost only: it is patched into the guard of its
own loop (by thread), with everything else of the guard (the interval's flags, the log
read) as it is. Prints wall and CPU µs per step (median of 50-step blocks) and the ratio
to Fabric's CPU time.

    python benchmarks/guard_floor.py --steps 3000
    python benchmarks/guard_floor.py --steps 3000 --turn-steps 50   # warm loops
    python benchmarks/guard_floor.py --device cuda --steps 1000 --turn-steps 50

On a GPU every loop runs in fp32 on one device, each turn ends with the device
synchronized (as in ``peers.py``), and the defaults' record is each gradient's norm (one
fused kernel), so the ``norms kept`` row is left out there. The wall clock is the figure
to read on a GPU; the CPU clock on a CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import threading
from typing import Any

import peers  # the peers' loops and their turn-taking (this script's folder)
import torch

from gpufleet.core.machine import machine_summary
from gpufleet.train.guard.nonfinite import NonFiniteGuard

_REAL = NonFiniteGuard._flag_gradients


def _one_check(self: NonFiniteGuard, step_loss: torch.Tensor, optimizer: Any) -> None:
    grads = [g for p in self._params if (g := p.grad) is not None]
    found = self._interval.next_flag(None, step_loss)
    torch._amp_foreach_non_finite_check_and_unscale_([*grads, step_loss], found, self._one)
    optimizer.found_inf = found


def _norms_kept(self: NonFiniteGuard, step_loss: torch.Tensor, optimizer: Any) -> None:
    grads = [g for p in self._params if (g := p.grad) is not None]
    norms = torch._foreach_norm(grads)
    found = self._interval.next_flag(norms, step_loss)
    torch._amp_foreach_non_finite_check_and_unscale_([*norms, step_loss], found, self._one)
    optimizer.found_inf = found


def _host_read(self: NonFiniteGuard, step_loss: torch.Tensor, optimizer: Any) -> None:
    _one_check(self, step_loss, optimizer)
    optimizer.found_inf.item()  # SYNC on a GPU: what the host path reads every step


def _loss_only(self: NonFiniteGuard, step_loss: torch.Tensor, optimizer: Any) -> None:
    found = self._interval.next_flag(None, step_loss)
    torch._amp_foreach_non_finite_check_and_unscale_([step_loss], found, self._one)
    optimizer.found_inf = found


def _flags_only(self: NonFiniteGuard, step_loss: torch.Tensor, optimizer: Any) -> None:
    optimizer.found_inf = self._interval.next_flag(None, step_loss)


CHECKS = {"gpufleet defaults": _REAL, "gpufleet norms kept": _norms_kept,
          "gpufleet one check, no culprit": _one_check,
          "gpufleet one check read on the host": _host_read,
          "gpufleet loss only": _loss_only, "gpufleet flags only": _flags_only}


def _by_thread(self: NonFiniteGuard, step_loss: torch.Tensor, optimizer: Any) -> None:
    CHECKS[threading.current_thread().name](self, step_loss, optimizer)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--turn-steps", type=int, default=1,
                   help="steps a loop runs before passing the baton (see peers.py)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--json", metavar="PATH", help="also write the table here as JSON")
    args = p.parse_args()
    torch.set_num_threads(1)
    if not peers.installed("lightning.fabric"):
        sys.exit("Lightning Fabric is not installed: pip install -e '.[bench]'")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible here")
    NonFiniteGuard._flag_gradients = _by_thread  # every swapped loop pays the same lookup
    job = dataclasses.replace(peers.mlp_job(args.steps), device=args.device)
    checks = [name for name in CHECKS
              if not (args.device == "cuda" and name == "gpufleet norms kept")]
    loops = {"Lightning Fabric": peers.fabric,
             **{name: peers.gpufleet_loop({}) for name in checks},
             "gpufleet no guard": peers.gpufleet_loop({"fault.skip_nonfinite": False})}
    where = "CPU" if args.device == "cpu" else torch.cuda.get_device_name()
    print(machine_summary())
    print(f"load average (1, 5, 15 min): {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"job: {job.name}; {args.steps} steps each, turns of {args.turn_steps} "
          f"step(s), 1 torch thread; on {where}, fp32")
    names = list(loops)
    # Each loop's thread is named after it.
    baton = peers.run_in_turns(job, loops, args.turn_steps)

    def blocks(xs: list[float]) -> float:
        return peers.block_median(xs, args.warmup)

    rows = [{"loop": name, "wall_us": blocks(baton.wall[i]) * 1e6,
             "cpu_us": blocks(baton.cpu[i]) * 1e6, "error": baton.errors.get(i)}
            for i, name in enumerate(names)]
    fabric = rows[0] if not rows[0]["error"] else {"wall_us": math.nan, "cpu_us": math.nan}
    print(f"\n{'loop':<38}{'wall us/step':>13}{'cpu us/step':>13}{'wall vs Fabric':>16}"
          f"{'cpu vs Fabric':>15}")
    for r in rows:
        if r["error"]:
            print(f"{r['loop']:<38}failed: {r['error']}")
            continue
        print(f"{r['loop']:<38}{r['wall_us']:>13.1f}{r['cpu_us']:>13.1f}"
              f"{r['wall_us'] / fabric['wall_us']:>16.3f}{r['cpu_us'] / fabric['cpu_us']:>15.3f}")
    print(f"load average at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_summary(), "job": job.name, "device": where,
                       "steps": args.steps, "turn_steps": args.turn_steps, "rows": rows},
                      f, indent=2)


if __name__ == "__main__":
    main()
