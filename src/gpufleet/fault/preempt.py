"""Preemption: finish the step, write a checkpoint, exit with a status that means "run me
again".

Schedulers warn before they stop a job: Kubernetes sends SIGTERM (then SIGKILL after the
pod's grace period, 30 s by default), SLURM sends SIGTERM at preemption and, with
``#SBATCH --signal=USR1@90``, SIGUSR1 before the time limit. Ctrl-C sends SIGINT.

Each rank's handler only sets a flag. The ranks agree at step boundaries: every
``fault.preempt_check_every`` steps they all-reduce the flags (one int, on the CPU over
gloo: no GPU sync), so all of them stop after the same step even when only one rank got
the signal. Then they write a checkpoint and the run ends with exit status
:data:`REQUEUE_EXIT` (75, ``EX_TEMPFAIL``: try again later) for SIGTERM and SIGUSR1, or
130 for Ctrl-C. ``gpufleet train --resume latest`` continues bit for bit.

The launcher's agent (torch's elastic agent) forwards these signals to the ranks and
waits up to 30 s for them to end; gpufleet asks it to forward SIGUSR1 too
(``TORCHELASTIC_SIGNALS_TO_HANDLE``).
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

import torch

from gpufleet.core.ring import RING
from gpufleet.errors import INTERRUPT_EXIT, REQUEUE_EXIT

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# Your own loop (gpufleet.Fleet) leaves Ctrl-C to your loop (KeyboardInterrupt as usual).
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# For torch's elastic agent (read when it starts the ranks): the signals it turns into
# a shutdown that forwards the signal to every rank.
AGENT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def exit_status(signum: int) -> int:
    """The exit status of a run stopped by ``signum``: 130 for Ctrl-C, else 75."""
    return INTERRUPT_EXIT if signum == signal.SIGINT else REQUEUE_EXIT


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class PreemptionWatch:
    """Catches the stop signals of this rank; :meth:`should_stop` says, on every rank
    alike, whether to stop after this step.

    Args:
        check_every: steps between the ranks' agreements (each is one small CPU
            all-reduce when several ranks run).
        distributed: whether a process group joins several ranks.
        signals: the signals caught (the built-in loop's: SIGTERM, SIGUSR1, SIGINT).

    Example:
        >>> watch = PreemptionWatch(check_every=1, distributed=False)
        >>> watch.should_stop(1)
        False
        >>> watch.close()
    """

    def __init__(self, check_every: int, distributed: bool,
                 signals: tuple[signal.Signals, ...] = SIGNALS) -> None:
        self.check_every = check_every
        self.received: int | None = None  # the first stop signal this rank got
        self.stop_requested = False  # the last agreement was a requested stop
        self.grow_agreed = False  # the last agreement: new ranks join after this step
        self._distributed = distributed
        self._group: Any = None
        if distributed:
            import torch.distributed as dist

            # COLLECTIVE (once, at setup): a gloo group for the flag when the default
            # group runs on GPUs, so agreeing costs no device sync.
            if "gloo" not in str(dist.get_backend()):
                self._group = dist.new_group(backend="gloo")
        self._previous: dict[int, Any] = {}
        self._closed = False
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        else:
            log.warning("training runs outside the main thread: SIGTERM/SIGUSR1 cannot be "
                        "caught, so a preempted run stops without a final checkpoint")

    def regroup(self) -> None:
        """The ranks regrouped in process (after a lost node, :mod:`gpufleet.train.
        recovery`, or with new ranks that joined, built without a group,
        :mod:`gpufleet.train.recovery.growing`): the flags are
        agreed over the new process group, through a gloo group of their own made again
        when it is not gloo (COLLECTIVE then)."""
        import torch.distributed as dist

        self._distributed = True
        if "gloo" not in str(dist.get_backend()):
            self._group = dist.new_group(backend="gloo")

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._closed:  # a watch closed out of order left this handler in place
            self._pass_on(signum, frame)
        elif self.received is None:  # a signal handler: set a flag, nothing more
            self.received = signum

    def _pass_on(self, signum: int, frame: FrameType | None) -> None:
        """The signal as the handler before this watch would have taken it (two runs of
        one process whose watches were not closed in the reverse order of their
        making: the later one put this closed watch's handler back)."""
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # the default action (end the process)
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    def should_stop(self, step: int, requested: bool = False, grow: bool = False) -> bool:
        """Whether every rank stops after ``step`` (the same answer on all ranks): a
        stop signal, or a stop ``requested`` by the run (a callback, early stopping) on
        any rank; :attr:`stop_requested` then says which. ``grow``: this rank saw new
        ranks ready to join; :attr:`grow_agreed` says whether every rank takes them in
        after this step (some rank saw them, and nobody stops).

        COLLECTIVE every ``check_every`` steps when distributed: all ranks call it after
        each step.
        """
        self.grow_agreed = False
        if step % self.check_every:
            return False
        if not self._distributed:
            self.stop_requested = requested and self.received is None
            self.grow_agreed = grow and not (self.received is not None or requested)
            return self.received is not None or requested
        import torch.distributed as dist

        flag = torch.tensor([self.received or 0, int(requested), int(grow)],
                            dtype=torch.int32)
        n = RING.enter("all_reduce", 12)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)  # COLLECTIVE (CPU)
        RING.leave(n)
        signum, asked = int(flag[0]), bool(flag[1])
        if signum and self.received is None:
            self.received = signum  # another rank got it: stop for the same reason
        self.stop_requested = asked and not signum  # a signal wins: exit requeue-ably
        self.grow_agreed = bool(flag[2]) and not (signum or asked)
        return bool(signum) or asked

    def close(self) -> None:
        """Put back the handlers that were there before (where this watch's is still
        the one in place; a closed watch's handler passes a signal on to them)."""
        if self._closed:
            return
        self._closed = True
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._on_signal:
                signal.signal(sig, previous)
