"""Finding the lines of a training step that make the CPU wait for the GPU.

:class:`SyncProbe` runs a few optimizer steps under torch's CUDA sync-debug mode, which
warns at each synchronising call (``.item()``, ``.cpu()``, ``torch.cuda.synchronize``,
a data-dependent shape). The warning's own file and line are those of the Python frame
running when the call synchronised, often torch's (``torch/cuda/__init__.py`` for
``torch.cuda.synchronize``): no place to fix. So the probe takes the stack when the
warning is shown and names the innermost frame outside torch: the line that called into
torch. A sync made in gpufleet's own line (the log interval's one deliberate read) is
left out; one inside torch that gpufleet called for you (your loss, backward, the loss
scaler) keeps torch's place and names gpufleet's caller.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from collections import Counter
from typing import Any

import torch

from gpufleet.core.callbacks import Callback

#: what torch's sync-debug warnings say
_SYNC_WARNING = r"(?s).*synchroniz"


def _dirs() -> tuple[str, str, tuple[str, ...]]:
    """gpufleet's package folder, torch's, and the files of the warnings machinery
    (whose frames show the warning: ``warnings.py``, and ``_py_warnings.py`` from Python
    3.14 on)."""
    def folder(path: str) -> str:
        return os.path.dirname(os.path.abspath(path)) + os.sep

    stdlib = folder(warnings.__file__)
    return (folder(os.path.dirname(os.path.abspath(__file__))), folder(torch.__file__),
            (stdlib + "warnings.py", stdlib + "_py_warnings.py"))


def sync_site(stack: list[traceback.FrameSummary], ours: str, torch_dir: str,
              machinery: tuple[str, ...] = ()) -> str | None:
    """Where a sync happened, from the ``stack`` (outermost first) that warned of it:
    the innermost frame outside torch (the line of your code that called into torch);
    where that frame is gpufleet's, torch's own place, naming gpufleet's caller (your
    loss or model run by gpufleet, backward, the loss scaler: a sync all the same).
    None where the sync is gpufleet's own, made in its own line (the log interval's one
    read). Folders end with the path separator; frames in ``machinery`` are skipped.

    Example:
        >>> f = traceback.FrameSummary
        >>> sync = f("/py/torch/cuda/__init__.py", 1270, "synchronize")
        >>> sync_site([f("/home/me/train.py", 42, "step"), sync], "/py/gpufleet/", "/py/torch/")
        '/home/me/train.py:42'
        >>> sync_site([f("/py/gpufleet/base.py", 9, "backward"), sync], "/py/gpufleet/",
        ...           "/py/torch/")
        "/py/torch/cuda/__init__.py:1270 (called from gpufleet's /py/gpufleet/base.py:9)"
        >>> sync_site([f("/py/gpufleet/interval.py", 3, "close")], "/py/gpufleet/",
        ...           "/py/torch/")
    """
    frames = [fr for fr in stack if os.path.abspath(fr.filename) not in machinery]
    if not frames or os.path.abspath(frames[-1].filename).startswith(ours):
        return None
    inner = frames[-1]
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if path.startswith(torch_dir):
            continue
        if path.startswith(ours):
            return (f"{inner.filename}:{inner.lineno} "
                    f"(called from gpufleet's {frame.filename}:{frame.lineno})")
        return f"{frame.filename}:{frame.lineno}"
    return f"{inner.filename}:{inner.lineno}"


class SyncProbe(Callback):
    """Runs ``steps`` optimizer steps (after ``first_step - 1`` warm-up steps) under
    torch's CUDA sync-debug mode and hands the places in your code that synchronised to
    ``advisor`` (its ``syncs``: ``(file:line, count)``, most frequent first). CUDA only:
    on a CPU nothing ever waits for a device. Other warnings are shown as usual.

    Args:
        advisor: the run's :class:`~gpufleet.monitor.advisor.Advisor`.
        steps: steps to probe.
        first_step: the first step probed.
        set_mode: sets the sync-debug mode (default: ``torch.cuda.set_sync_debug_mode``).
    """

    def __init__(self, advisor: Any, steps: int, first_step: int = 3,
                 set_mode: Any = None) -> None:
        self.advisor, self.steps, self.first = advisor, steps, first_step
        self._set_mode = set_mode or torch.cuda.set_sync_debug_mode
        self._catcher: Any = None
        self._show: Any = None
        self._places: Counter[str] = Counter()
        self._dirs = _dirs()

    def on_step_end(self, trainer: Any, step: int) -> None:
        if step == self.first - 1:
            self.start()
        elif self._catcher is not None and step >= self.first - 1 + self.steps:
            self.stop()

    def on_fit_end(self, trainer: Any, result: Any) -> None:
        if self._catcher is not None:
            self.stop()

    def on_exception(self, trainer: Any, error: BaseException) -> None:
        self.on_fit_end(trainer, None)  # sync-debug mode off, warnings shown as before

    def start(self) -> None:
        """Warn at each synchronising call from now on, and note where it came from."""
        self._catcher = warnings.catch_warnings()  # restores filters and showwarning
        self._catcher.__enter__()
        warnings.filterwarnings("always", message=_SYNC_WARNING)
        self._show = warnings.showwarning
        warnings.showwarning = self._seen
        self._set_mode("warn")

    def stop(self) -> None:
        """Stop warning; hand the places found to the advisor."""
        self._set_mode("default")
        warnings.showwarning = self._show  # with context-aware warnings (Python 3.14
        self._catcher.__exit__(None, None, None)  # free-threaded) the exit keeps ours
        self._catcher = None
        self.advisor.syncs = self._places.most_common()

    def _seen(self, message: Any, category: Any, filename: str, lineno: int,
              file: Any = None, line: Any = None) -> None:
        if "synchroniz" not in str(message):
            self._show(message, category, filename, lineno, file, line)
            return
        # The stack of the thread that synchronised, from the warnings module's frame out.
        where = sync_site(traceback.extract_stack(sys._getframe(1)), *self._dirs)
        if where is not None:
            self._places[where] += 1
