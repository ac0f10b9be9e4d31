"""``fleet.strategy``: what a Fabric loop reads of ``fabric.strategy``, as
:class:`FleetStrategy`.

Lightning's ``fabric.strategy`` is Lightning's own Strategy object (its launcher,
precision plugin, checkpoint IO...). Fleet has gpufleet's strategies underneath, not
Lightning's, so it does not pretend to be one. What loops and Lightning's callbacks
(``SpikeDetection``, for one) read of it are the rank's facts and the collectives, and
those :class:`FleetStrategy` gives, as the same calls on the Fleet itself:

* ``root_device``, ``world_size``, ``global_rank``, ``local_rank``, ``node_rank``,
  ``num_nodes``, ``num_processes``, ``is_global_zero``, ``process_group_backend`` and
  ``name`` (gpufleet's strategy name: ``ddp``, ``fsdp``...);
* ``barrier``, ``broadcast``, ``all_gather``, ``all_reduce`` and
  ``reduce_boolean_decision`` (COLLECTIVE, each as the Fleet's).

Anything else (``launcher``, ``precision``, ``checkpoint_io``, Lightning's private
names) is an ``AttributeError`` that lists what is there. The object is read-only: the
strategy is decided once, by ``Fleet(strategy=...)``.

Example:
    >>> fleet = Fleet(accelerator="cpu")  # doctest: +SKIP
    >>> fleet.strategy.root_device, fleet.strategy.world_size  # doctest: +SKIP
    (device(type='cpu'), 1)
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from gpufleet.plan import RunPlan


class RankFacts(Protocol):
    """What :class:`FleetStrategy` reads of a :class:`~gpufleet.fleet.Fleet`."""

    plan: RunPlan

    @property
    def device(self) -> torch.device: ...
    @property
    def world_size(self) -> int: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def node_rank(self) -> int: ...
    @property
    def is_global_zero(self) -> bool: ...
    def barrier(self, name: str | None = None) -> None: ...
    def broadcast(self, obj: Any, src: int = 0) -> Any: ...
    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any: ...
    def all_reduce(self, data: Any, group: Any = None, reduce_op: Any = "mean") -> Any: ...

#: What a FleetStrategy gives (named in the error for anything else).
OFFERED = ("name", "root_device", "world_size", "global_rank", "local_rank", "node_rank",
           "num_nodes", "num_processes", "is_global_zero", "process_group_backend",
           "barrier", "broadcast", "all_gather", "all_reduce", "reduce_boolean_decision")


class FleetStrategy:
    """The rank's facts and collectives of a :class:`~gpufleet.fleet.Fleet`, under the
    names of Fabric's Strategy (see the module docs).

    Args:
        fleet: the Fleet whose facts and collectives these are.
    """

    def __init__(self, fleet: RankFacts) -> None:
        object.__setattr__(self, "_fleet", fleet)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"fleet.strategy is read-only (setting {name!r}): it shows the run's facts and "
            "collectives; the run's strategy is decided once, by Fleet(strategy=...).")

    # -- facts ------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """gpufleet's strategy name for this run (``single``, ``ddp``, ``fsdp``...)."""
        return str(self._fleet.plan.cfg.parallel.strategy)

    @property
    def root_device(self) -> torch.device:
        """This rank's device (``fleet.device``)."""
        return self._fleet.device

    @property
    def world_size(self) -> int:
        return self._fleet.world_size

    @property
    def global_rank(self) -> int:
        return self._fleet.global_rank

    @property
    def local_rank(self) -> int:
        return self._fleet.local_rank

    @property
    def node_rank(self) -> int:
        return self._fleet.node_rank

    @property
    def num_nodes(self) -> int:
        plan = self._fleet.plan
        return max(1, plan.world_size // max(plan.local_world_size, 1))

    @property
    def num_processes(self) -> int:
        """Ranks on this node."""
        return self._fleet.plan.local_world_size

    @property
    def is_global_zero(self) -> bool:
        return self._fleet.is_global_zero

    @property
    def process_group_backend(self) -> str:
        """``gloo`` or ``nccl``."""
        return self._fleet.plan.backend

    # -- collectives (each COLLECTIVE, as the Fleet's) ----------------------------------
    def barrier(self, name: str | None = None) -> None:
        self._fleet.barrier(name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._fleet.broadcast(obj, src)

    def all_gather(self, tensor: Any, group: Any = None, sync_grads: bool = False) -> Any:
        return self._fleet.all_gather(tensor, group=group, sync_grads=sync_grads)

    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return self._fleet.all_reduce(tensor, group=group, reduce_op=reduce_op)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """``decision`` of every rank combined: all of them True (``all``), or any of
        them (``all=False``), as Fabric's. COLLECTIVE + SYNC (reads the count)."""
        count = torch.tensor(int(decision), device=self._fleet.device)
        total = int(self._fleet.all_reduce(count, reduce_op="sum"))
        return total == self._fleet.world_size if all else total > 0

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"fleet.strategy has no {name!r}: it gives Fabric's strategy facts and "
            f"collectives ({', '.join(OFFERED)}), not Lightning's Strategy object "
            "(gpufleet's strategies are underneath). Read the plan instead "
            "(fleet.plan.precision, fleet.plan.cfg.parallel), or the Fleet's own "
            "methods.")
