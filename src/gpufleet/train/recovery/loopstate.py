"""What in-process recovery reads of a loop and puts back: :class:`LoopState`.

A loss is recovered the same way under both loops (:mod:`gpufleet.train.recovery.
recovery`): the ranks left regroup, rebuild their models over the new process group and
restore a snapshot. What differs is the loop's own state: the built-in loop keeps it in
its checkpointer and training stream (``gpufleet.train.engine.resilience.
BuiltInLoopState``), your own loop in the dict it registered with
``fleet.register_state`` (``gpufleet.fleet.recovery.FleetLoopState``). Each gives the
recovery, the snapshots and a joining rank this one interface.
"""

from __future__ import annotations

from typing import Any, Protocol


class LoopState(Protocol):
    """A loop's training state on this rank, as snapshots capture it and recovery
    restores it."""

    @property
    def boundary_at_step_end(self) -> bool:
        """The state is a step boundary's when the optimizer step ends (the built-in
        loop steps its schedule inside the step); False where the loop's own bookkeeping
        of a step (its scheduler, its counters) follows the optimizer's step, so that a
        snapshot waits for the loop to begin its next step."""
        ...

    @property
    def sampler(self) -> Any:
        """The training data's sampler (its position must be global, so that the ranks
        left split the rest of the epoch), or None where the loop's data position is
        its own."""
        ...

    def capture(self) -> dict[str, Any]:
        """This rank's whole training state now, from this rank alone (no collective):
        the live tensors, which a snapshot copies."""
        ...

    def storages(self) -> set[int]:
        """The storages of the tensors only an optimizer step changes (parameters,
        optimizer state): a snapshot copies them while the next step's forward runs."""
        ...

    def wait(self) -> None:
        """A checkpoint being written in the background ends (this rank)."""
        ...

    def regroup(self, rank: int, shard: int, shards: int, copies: int) -> None:
        """The ranks regrouped and the models were placed again over the new group: what
        else depends on it follows (this rank reads data shard ``shard`` of ``shards``,
        each sample read by ``copies`` ranks; the checkpoint writers' group)."""
        ...

    def restore(self, state: dict[str, Any], source: str) -> int:
        """Put ``state`` (what :meth:`capture` gave, copied) back in place, the data where
        it was; returns its step. ``source`` names it in messages."""
        ...
