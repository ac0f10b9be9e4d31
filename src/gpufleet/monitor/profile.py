"""Profiling on request: a torch profiler trace of chosen optimizer steps, per rank.

``--profile.steps=A-B`` traces optimizer steps A to B (1-based, both included) on every
rank and writes ``<run_dir>/profile/rank-<R>.json``: a Chrome trace (open it in
``chrome://tracing`` or https://ui.perfetto.dev) of the CPU ops and, on a GPU, the CUDA
kernels. Each trace carries the rank: torch adds ``distributedInfo`` (backend, rank,
world size) when a process group exists, which is what trace-analysis tools such as
Holistic Trace Analysis read; without a process group this callback adds the same
``distributedInfo`` itself, and always a ``gpufleet`` entry ``{"rank", "world_size",
"steps"}``. Each traced step is marked ``ProfilerStep#N``.

Example:
    >>> parse_steps("10-12")
    (10, 12)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from gpufleet.core.callbacks import Callback
from gpufleet.errors import ConfigError

log = logging.getLogger(__name__)


def parse_steps(text: str) -> tuple[int, int]:
    """``"A-B"`` (or ``"A"``) as the first and last step to trace, 1-based, inclusive.

    Raises:
        ConfigError: not of the form A-B with 1 <= A <= B.

    Example:
        >>> parse_steps("5")
        (5, 5)
        >>> parse_steps("12-10")
        Traceback (most recent call last):
        ...
        gpufleet.errors.ConfigError: profile.steps = '12-10': the first step comes after \
the last. Write A-B with 1 <= A <= B, e.g. profile.steps=10-12.
    """
    parts = text.strip().split("-")
    try:
        first, last = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        first, last = 0, -1
    if len(parts) > 2 or first < 1 or last < 1:
        raise ConfigError(f"profile.steps = {text!r}: not a step range. Write A-B with "
                          "1 <= A <= B (optimizer steps, both traced), e.g. "
                          "profile.steps=10-12.")
    if first > last:
        raise ConfigError(f"profile.steps = {text!r}: the first step comes after the last. "
                          "Write A-B with 1 <= A <= B, e.g. profile.steps=10-12.")
    return first, last


class ProfilerCallback(Callback):
    """Runs torch.profiler around optimizer steps A..B and writes this rank's trace.

    Create one on every rank. The profiler starts after step A-1 (at fit start for
    A = 1) and stops after step B, or at the end of training if that comes first.

    Args:
        steps: ``"A-B"`` as in ``profile.steps``.
        run_dir: the run directory (the trace goes to ``<run_dir>/profile``).
        rank: this process's global rank.
        world_size: the number of ranks.

    Example:
        >>> cb = ProfilerCallback("3-4", "runs/x", rank=1, world_size=2)
        >>> cb.path.as_posix()
        'runs/x/profile/rank-1.json'
    """

    essential = False  # a failed trace loses the trace, not the run

    def __init__(self, steps: str, run_dir: str | Path, rank: int, world_size: int) -> None:
        self.first, self.last = parse_steps(steps)
        self.rank, self.world_size = rank, world_size
        self.path = Path(run_dir) / "profile" / f"rank-{rank}.json"
        self._prof: Any = None
        self._range: Any = None
        self._done = False

    def on_fit_start(self, trainer: Any) -> None:
        step = trainer.step
        end = getattr(trainer, "max_steps", None)  # run.max_steps, or where epochs end
        if end is not None and end < self.last:
            log.info("profile.steps = %d-%d goes past the run's last step %d; tracing up to "
                     "step %d.", self.first, self.last, end, end)
            self.last = max(self.first, end)
        if step >= self.last:
            log.info("profile.steps = %d-%d: this run resumes at step %d, after the "
                     "window; nothing is traced.", self.first, self.last, step)
            self._done = True
        elif step >= self.first - 1:
            self._start(step)

    def on_step_end(self, trainer: Any, step: int) -> None:
        if self._prof is not None:
            self._mark(None)
            if step >= self.last:
                self._finish()
            else:
                self._mark(step + 1)
        elif not self._done and step == self.first - 1:
            self._start(step)

    def on_fit_end(self, trainer: Any, result: Any) -> None:
        if self._prof is not None:
            log.info("Training ended at step %d, before the profile window %d-%d did; "
                     "writing what was traced.", trainer.step, self.first, self.last)
            self._finish()

    def on_exception(self, trainer: Any, error: BaseException) -> None:
        if self._prof is not None:  # the steps up to the failure: often what explains it
            log.info("Training failed at step %d, inside the profile window %d-%d; "
                     "writing what was traced.", trainer.step, self.first, self.last)
            self._finish()

    def _start(self, step: int) -> None:
        import torch
        import torch.distributed as dist
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(activities=activities, record_shapes=True)
        self._prof.start()
        meta = {"rank": self.rank, "world_size": self.world_size,
                "steps": [max(step + 1, self.first), self.last]}
        self._prof.add_metadata_json("gpufleet", json.dumps(meta))
        if not (dist.is_available() and dist.is_initialized()):
            # torch adds distributedInfo only with a process group; trace tools read it.
            self._prof.add_metadata_json("distributedInfo", json.dumps(
                {"backend": None, "rank": self.rank, "world_size": self.world_size}))
        log.info("Profiling steps %d-%d (%s).", meta["steps"][0], self.last,
                 ", ".join(a.name for a in activities))
        self._mark(step + 1)

    def _mark(self, step: int | None) -> None:
        """End the open ``ProfilerStep#N`` range; open one for ``step`` unless None.

        (torch's own ``profile.step()`` marks steps only when a schedule is given.)
        """
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if step is not None:
            from torch.autograd.profiler import record_function

            self._range = record_function(f"ProfilerStep#{step}")
            self._range.__enter__()

    def _finish(self) -> None:
        self._mark(None)
        prof, self._prof, self._done = self._prof, None, True
        prof.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.path))
        log.info("Profiler trace of rank %d written: %s", self.rank, self.path)
