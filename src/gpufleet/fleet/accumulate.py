"""Gradient accumulation as Accelerate's ``accumulate(model)`` does it:
:class:`Accumulation`, behind ``Fleet(gradient_accumulation_steps=N)`` and
``with fleet.accumulate(model):``.

Each ``accumulate`` block is one micro-batch. Every ``N``-th block, and the block of a
set-up loader's last batch of its pass, synchronises: its backward all-reduces the
gradients, and the set-up optimizers' ``step`` and ``zero_grad`` act. The other blocks
run backward without the all-reduce (ddp's ``no_sync``), and ``step`` and ``zero_grad``
do nothing there, so a loop written for Accelerate (step, zero_grad and the scheduler
called on every micro-batch) steps once per ``N``. With ``N`` above 1,
``fleet.backward`` divides the loss by ``N``, as Accelerate's ``backward`` does, so the
accumulated gradient is the mean over the micro-batches. ``fleet.sync_gradients`` says
whether this block synchronises (guard your scheduler's ``step`` with it: Fleet does
not wrap your scheduler).

Example:
    >>> acc = Accumulation(every=2)
    >>> [acc.begin(last_batch=False) for _ in range(3)]
    [False, True, False]
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Accumulation:
    """Counts the ``accumulate`` blocks and says which synchronise.

    Attributes:
        every: micro-batches per optimizer step (``gradient_accumulation_steps``).
        blocks: ``accumulate`` blocks begun.
        sync: the block under way (or the last one) synchronises; True outside any.
    """

    every: int = 1
    blocks: int = 0
    sync: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"gradient_accumulation_steps = {self.every!r}: give the number "
                             "of micro-batches per optimizer step, 1 or more.")

    def begin(self, last_batch: bool) -> bool:
        """A block begins (``last_batch``: a set-up loader has just handed out the last
        batch of its pass); returns whether it synchronises."""
        self.blocks += 1
        self.sync = self.blocks % self.every == 0 or last_batch
        if last_batch:
            self.blocks = 0  # the next pass counts its micro-batches from its start
        return self.sync
