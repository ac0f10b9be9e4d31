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

    Not essential: a full disk loses lines, not the run.
    """

    essential = False

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = None

    def on_fit_start(self, trainer: Any) -> None:
        self._file = open(self.path, "a", buffering=1)  # line-buffered: readable live

    def write(self, kind: str, metrics: dict[str, Any]) -> None:
        """Append one record of ``kind`` (train, eval, diagnosis)."""
        if self._file is not None:
            self._file.write(_encode({"kind": kind, "time": time.time(), **metrics}) + "\n")

    def on_log(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        self.write("train", metrics)

    def on_eval(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        self.write("eval", metrics)

    def on_user_log(self, trainer: Any, step: int, values: dict[str, float]) -> None:
        self.write("user", {"step": step, **values})

    def on_fit_end(self, trainer: Any, result: Any) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def on_exception(self, trainer: Any, error: BaseException) -> None:
        self.on_fit_end(trainer, None)
