"""``single``: one process, one device. The base class already does everything."""

from __future__ import annotations

from gpufleet.parallel.base import Strategy
from gpufleet.parallel.dims import StrategyTraits


class SingleDevice(Strategy):
    """Train on one device with no wrapping."""

    name = "single"
    traits = StrategyTraits(one_process=True, several_models=True)
