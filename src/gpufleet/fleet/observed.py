"""What your own loop did, as the diagnosis reads it: :class:`LoopObservations`.

``fit`` decides its batch size, accumulation and evaluation interval from the config;
a :class:`~gpufleet.fleet.Fleet` loop decides them in its own code, and the config's
``data.batch_size``, ``optim.grad_accum`` and ``run.eval_every`` say nothing about it.
So the facts of an own loop are counted from its calls instead:

* batch size: the samples in the batch a backward pass trained on (the set-up loader
  read last before it; the most frequent size seen);
* accumulation: backward passes per optimizer step (under ``no_backward_sync``,
  ``accumulate`` or neither; the most frequent count);
* evaluation: a run of evaluation forwards (a set-up model called in ``eval()`` mode)
  between two optimizer steps is one evaluation; its cadence is the optimizer steps
  between the last two evaluations;
* steps (optimizer steps, resumed ones included) and restarts (the elastic agent's).

No host-device sync: only sizes and counts the host already has.

Example:
    >>> seen = LoopObservations()
    >>> for step in range(4):
    ...     seen.backward(8); seen.backward(8); seen.step_taken(2)
    ...     if step % 2 == 1: seen.eval_forward(); seen.eval_forward()
    >>> seen.batch_size, seen.grad_accum, seen.evaluations, seen.eval_every
    (8, 2, 2, 2)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class LoopObservations:
    """Counts of what the loop did on this rank.

    Attributes:
        steps: optimizer steps counted (a resumed loop's restored count included).
        evaluations: evaluations begun (runs of eval forwards between steps).
        eval_steps: the step count at each of the last two evaluations' starts.
        restarts: times the elastic agent restarted the ranks before this run.
    """

    steps: int = 0
    evaluations: int = 0
    eval_steps: list[int] = field(default_factory=list)
    restarts: int = 0
    _sizes: Counter = field(default_factory=Counter)
    _accumulation: Counter = field(default_factory=Counter)
    _evaluating: bool = False  # an evaluation began since the last step

    def backward(self, batch_size: int | None) -> None:
        """A backward pass on a batch of ``batch_size`` samples (None: not known)."""
        if batch_size:
            self._sizes[batch_size] += 1

    def step_taken(self, backward_passes: int) -> None:
        """An optimizer step after ``backward_passes`` backward passes."""
        self.steps += 1
        if backward_passes:
            self._accumulation[backward_passes] += 1
        self._evaluating = False

    def eval_forward(self) -> None:
        """A set-up model's forward in ``eval()`` mode."""
        if self._evaluating:
            return
        self._evaluating = True
        self.evaluations += 1
        self.eval_steps = [*self.eval_steps[-1:], self.steps]

    def resumed_at(self, step: int) -> None:
        """A checkpoint set the step count to ``step``."""
        self.steps = step

    @property
    def batch_size(self) -> int:
        """The most frequent batch size trained on (0: none seen yet)."""
        return self._sizes.most_common(1)[0][0] if self._sizes else 0

    @property
    def grad_accum(self) -> int:
        """The most frequent count of backward passes per optimizer step (1: none yet)."""
        return self._accumulation.most_common(1)[0][0] if self._accumulation else 1

    @property
    def eval_every(self) -> int:
        """Optimizer steps between the last two evaluations (0: fewer than two)."""
        if len(self.eval_steps) < 2:
            return 0
        return self.eval_steps[1] - self.eval_steps[0]
