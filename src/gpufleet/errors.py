"""Errors a user can cause, and the helper that words them.

Every message names the bad value, the valid choices (closest match first) and the fix.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class GpufleetError(Exception):
    """Base class for errors gpufleet raises on purpose (bad input, bad environment)."""


class ConfigError(GpufleetError, ValueError):
    """A configuration key, value or combination that cannot work."""


class BatchError(ConfigError, TypeError):
    """The model, its batches and the loss function do not fit together (e.g. no loss
    function for a model that does not return its loss): a mistake in the config or the
    code, found on the first batch, not a fault of the run."""


class NotLaunchedError(ConfigError, RuntimeError):
    """A ``Fleet`` planned for several ranks used in a process that is not one of them
    yet (a ``RuntimeError`` too, as Lightning Fabric raises it): launch the ranks first."""


class LaunchError(GpufleetError, RuntimeError):
    """The processes of a run could not be started or did not finish."""


class CheckpointError(GpufleetError, RuntimeError):
    """A checkpoint could not be found, read or written."""


class TrainingStopped(GpufleetError, RuntimeError):
    """Training cannot go on (e.g. the loss stayed non-finite for too many steps)."""


#: The exit status of a run stopped to be run again (SIGTERM, SLURM's SIGUSR1): sysexits.h
#: EX_TEMPFAIL, a temporary failure. Here, not in :mod:`gpufleet.fault.preempt`, so that
#: the command line and ``gpufleet sbatch`` read it without importing torch.
REQUEUE_EXIT = 75
#: The exit status of a run stopped by Ctrl-C: 128 + SIGINT, what shells report.
INTERRUPT_EXIT = 130


class RunStopped(GpufleetError):
    """A run stopped early on a signal (preemption, Ctrl-C); ``exit_code`` is the status
    the process should end with (see :mod:`gpufleet.fault.preempt`), ``signal`` the
    signal's name."""

    def __init__(self, message: str, exit_code: int, signal: str = "") -> None:
        super().__init__(message)
        self.exit_code, self.signal = exit_code, signal


class JsonlError(GpufleetError, ValueError):
    """A JSON Lines file, or its index, that cannot be read as asked."""


def closest_first(value: str, choices: Iterable[str]) -> list[str]:
    """Return ``choices`` ordered so that the ones closest to ``value`` come first.

    Example:
        >>> closest_first("ddq", ["single", "dp", "ddp"])
        ['ddp', 'dp', 'single']
    """
    choices = list(choices)
    ratio = {c: difflib.SequenceMatcher(None, value.lower(), c.lower()).ratio() for c in choices}
    return sorted(choices, key=lambda c: (-ratio[c], choices.index(c)))


def did_you_mean(value: str, choices: Iterable[str]) -> str | None:
    """Return the single choice close enough to ``value`` to be a likely typo, if any."""
    choices = list(choices)
    prefixed = [c for c in choices if c.lower().startswith(value.lower())]
    if value and len(prefixed) == 1:  # "bf16" for "bf16-mixed"
        return prefixed[0]
    matches = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_choice(what: str, value: object, choices: Iterable[str], fix: str = "") -> str:
    """Word the message for a value that is not one of ``choices``.

    Example:
        >>> unknown_choice("parallel.strategy", "ddq", ["single", "dp", "ddp"])
        "parallel.strategy: unknown value 'ddq'. Did you mean 'ddp'? Valid: ddp, dp, single."
    """
    choices = list(choices)
    ordered = closest_first(str(value), choices)
    guess = did_you_mean(str(value), choices)
    hint = f" Did you mean {guess!r}?" if guess else ""
    tail = f" {fix}" if fix else ""
    return f"{what}: unknown value {value!r}.{hint} Valid: {', '.join(ordered)}.{tail}"
