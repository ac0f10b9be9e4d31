"""Tensor operations a training step dispatches, per loop: on a GPU each is about one
kernel launch, and a step of a small model is bound by them, so what gpufleet adds over
Fabric's step shows here on a CPU machine too.

Runs the loops of ``benchmarks/peers.py`` one after another on the MLP job (the CPU, one
thread), counts every ATen operation (a ``TorchDispatchMode``) over steps 20 to 40 of
each, and prints the count per step and each operation's difference from Lightning
Fabric's step (or the hand-written loop's when Lightning is not installed). A host read
(``_local_scalar_dense``, what ``.item()`` runs) is a synchronisation on a GPU.

    python benchmarks/ops_per_step.py
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import peers
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpufleet.core.machine import machine_summary

FIRST, LAST = 20, 40  # the steps counted (after the first steps' one-off work)


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count(loop: Callable[..., None], job: peers.Job) -> collections.Counter[str]:
    """The operations ``loop`` dispatches from the end of step FIRST to that of LAST."""
    counter, steps = _Count(), [0]

    def done() -> None:
        steps[0] += 1
        if steps[0] == FIRST:
            counter.__enter__()
        elif steps[0] == LAST:
            counter.__exit__(None, None, None)

    loop(job, done)
    return counter.ops


def main() -> None:
    torch.set_num_threads(1)
    job = peers.mlp_job(LAST + 10)
    loops: dict[str, Any] = {"hand-written": peers.hand}
    if peers.installed("lightning.fabric"):
        loops["Lightning Fabric"] = peers.fabric
    loops.update({"gpufleet defaults": peers.gpufleet_loop({}),
                  "gpufleet monitoring off": peers.gpufleet_loop(peers.MONITORING_OFF),
                  "gpufleet bare": peers.gpufleet_loop(peers.BARE),
                  "gpufleet Fleet": peers.fleet_loop({})})
    print(machine_summary())
    print(f"job: {job.name}; ATen operations over steps {FIRST + 1}-{LAST}, per step")
    counted = {name: count(loop, job) for name, loop in loops.items()}
    base_name = "Lightning Fabric" if "Lightning Fabric" in counted else "hand-written"
    base = counted[base_name]
    n = LAST - FIRST
    for name, ops in counted.items():
        diff = {op: (ops[op] - base[op]) / n for op in set(ops) | set(base)
                if ops[op] != base[op]}
        shown = ", ".join(f"{op} {d:+g}" for op, d in sorted(diff.items(),
                                                            key=lambda kv: -abs(kv[1])))
        versus = "" if name == base_name else f"   vs {base_name}: {shown or 'the same'}"
        print(f"{name:<26}{sum(ops.values()) / n:7.1f} ops/step{versus}")


if __name__ == "__main__":
    main()
