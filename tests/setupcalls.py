"""Counts, per process, the setup calls a run makes once: naming the run, joining the
process group, seeding, setting up logging.

Each call appends ``PID NAME`` to the file that ``GPUFLEET_TEST_SETUP_CALLS`` names.
A rank that gpufleet starts imports this module when it unpickles the :class:`Model`
it was sent, and then counts its own calls (tests/ is on its PYTHONPATH).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

LOG_ENV = "GPUFLEET_TEST_SETUP_CALLS"
# Where each function is defined; every gpufleet module that imported it by name is
# patched too.
WATCHED = {"named": "gpufleet.plan", "join_process_group": "gpufleet.train.rank",
           "seed_everything": "gpufleet.train.seed", "setup_logging": "gpufleet.entry"}


# Modules that import a watched function by name and may be imported only when a run
# needs them: imported before patching, so that their names are patched (and restored).
USERS = ("gpufleet.train.engine.build", "gpufleet.train.checkpoint.rundir")


def install(set_attr: Callable[[Any, str, Any], None] = setattr) -> None:
    """Replace each watched function by one that records the call, then calls it."""
    for module in USERS:
        importlib.import_module(module)
    for name, home in WATCHED.items():
        original = getattr(importlib.import_module(home), name)

        def counted(*args: Any, _original: Any = original, _name: str = name,
                    **kwargs: Any) -> Any:
            with open(os.environ[LOG_ENV], "a", encoding="utf-8") as f:
                f.write(f"{os.getpid()} {_name}\n")
            return _original(*args, **kwargs)

        for module in list(sys.modules.values()):
            if (getattr(module, "__name__", "").startswith("gpufleet")
                    and getattr(module, name, None) is original):
                set_attr(module, name, counted)


def calls(path: Path) -> dict[int, Counter]:
    """``{pid: Counter(function name -> calls)}`` from the log."""
    per_process: dict[int, Counter] = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            pid, name = line.split()
            per_process.setdefault(int(pid), Counter())[name] += 1
    return per_process


class Model(nn.Module):
    """A small regression model that ranks import from here."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: Any) -> Any:
        return self.net(x)


def _record(name: str) -> None:
    with open(os.environ[LOG_ENV], "a", encoding="utf-8") as f:
        f.write(f"{os.getpid()} {name}\n")


def counted_model(**kwargs: Any) -> nn.Module:
    """A model factory that records each build."""
    _record("build_model")
    return Model()


def counted_data(**kwargs: Any) -> Any:
    """A data factory that records each build."""
    import toyjob

    _record("build_data")
    return toyjob.make_data()


if os.environ.get(LOG_ENV) and __name__ != "__main__":
    install()  # a launched rank: count from the start
