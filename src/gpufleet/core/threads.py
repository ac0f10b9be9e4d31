"""A run's background threads that can be stopped from outside: :class:`ServiceThread`.

The watchdog and the system sampler each run a daemon thread for as long as their run
lasts. A loop that never ends its run (a ``Fleet`` neither finished nor launched, in a
notebook or a test) leaves them running until the interpreter exits, where the run's
exit hook stops them. :meth:`ServiceThread.stop` stops one earlier, from any thread: it
asks its owner to stop (which ends the thread's loop) and waits for the thread, the way
a test harness or a notebook ends the daemon threads it finds (``thread.stop()``).

Example:
    >>> import threading
    >>> halt = threading.Event()
    >>> t = ServiceThread(target=halt.wait, name="demo", stop=halt.set)
    >>> t.start(); t.stop(); t.is_alive()
    False
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class ServiceThread(threading.Thread):
    """A daemon thread running ``target`` until its owner's ``stop`` ends it.

    Args:
        target: the thread's loop; it returns once ``stop`` was called.
        name: the thread's name (``gpufleet-watchdog``...).
        stop: what makes ``target`` return (sets the owner's stop event, ...); called by
            :meth:`stop`, so it must not wait for this thread.
        join_s: how long :meth:`stop` waits for the thread.
    """

    def __init__(self, target: Callable[[], None], name: str, stop: Callable[[], None],
                 join_s: float = 5.0) -> None:
        super().__init__(target=target, name=name, daemon=True)
        self._ask_to_stop = stop
        self._join_s = join_s

    def stop(self) -> None:
        """Ask the owner to stop and wait (``join_s`` at most) for the thread to end."""
        self._ask_to_stop()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=self._join_s)
