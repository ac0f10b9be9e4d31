"""``metrics.jsonl``: one JSON object per log interval, per evaluation and per value your
own loop logs (``Fleet.log``), always written."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from gpufleet.core.callbacks import Callback

# The metrics are plain numbers, strings, lists and dicts made by the loop: no cycle to
# look for, and a line's encoding is most of what a log line costs at small steps.
_encode = json.JSONEncoder(check_circular=False).encode


class MetricsFile(Callback):
    """Appends metrics to a JSON-lines file (a resumed run keeps adding to it).

    Not essential: a full disk loses lines, not the run. ``main_only``: write only while
    this rank is rank 0 (``trainer.env.is_main``), for a rank that becomes rank 0 when an
    in-process recovery goes on without the first one.
    """

    essential = False

    def __init__(self, path: str | Path, main_only: bool = False) -> None:
        self.path = Path(path)
        self.main_only = main_only
        self._file = None

    def on_fit_start(self, trainer: Any) -> None:
        self._file = open(self.path, "a", buffering=1)  # line-buffered: readable live

    def write(self, kind: str, metrics: dict[str, Any]) -> None:
        """Append one record of ``kind`` (train, eval, diagnosis)."""
        if self._file is not None:
            self._file.write(_encode({"kind": kind, "time": time.time(), **metrics}) + "\n")

    def _writes(self, trainer: Any) -> bool:
        return not self.main_only or trainer.env.is_main

    def on_log(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        if self._writes(trainer):
            self.write("train", metrics)

    def on_eval(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        if self._writes(trainer):
            self.write("eval", metrics)

    def on_user_log(self, trainer: Any, step: int, values: dict[str, float]) -> None:
        if self._writes(trainer):
            self.write("user", {"step": step, **values})

    def on_fit_end(self, trainer: Any, result: Any) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def on_exception(self, trainer: Any, error: BaseException) -> None:
        self.on_fit_end(trainer, None)
