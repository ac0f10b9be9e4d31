"""What machine a measurement ran on: every benchmark prints it beside its numbers.

The facts live in the bottom layer (:mod:`gpufleet.core.machine`); benchmarks import
them from here.
"""

from gpufleet.core.machine import cores_per_rank, cpu_model, machine_summary, usable_cores

__all__ = ["cores_per_rank", "cpu_model", "machine_summary", "usable_cores"]
