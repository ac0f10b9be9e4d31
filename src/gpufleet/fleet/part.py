"""What the parts of :class:`~gpufleet.fleet.Fleet` share: :class:`FleetPart`.

Fleet is put together from parts (its setup, collectives, gradient calls, checkpoints,
logs), each a class of one concept. Each reads this rank's
:class:`~gpufleet.train.engine.run.Run`, the one run object of gpufleet's engine, built
for your loop by :func:`~gpufleet.train.engine.build.build_own_loop_run`, and the
loaders your loop set up (:class:`~gpufleet.fleet.loader.SetUpLoaders`, the run's data
counts).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

from gpufleet.fleet.loader import SetUpLoaders
from gpufleet.train.engine.run import Run


class FleetPart:
    """A part of :class:`~gpufleet.fleet.Fleet`: Fleet itself gives the run, once this
    process is a rank."""

    _loaders: SetUpLoaders  # the loaders your loop set up
    #: the context of every call that runs a collective: a lost node is recovered
    #: there (gpufleet.fleet.recovery.RecoveryGuard, once this process is a rank)
    _guard: AbstractContextManager[Any] = contextlib.nullcontext()

    def _rank_run(self) -> Run:
        raise NotImplementedError
