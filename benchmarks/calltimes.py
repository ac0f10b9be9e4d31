"""Timing chosen calls inside a training loop: each call of a wrapped function adds its
nanoseconds (``time.perf_counter_ns``) to a list under a key, for medians afterwards."""

from __future__ import annotations

import time
from typing import Any

now = time.perf_counter_ns
#: key -> nanoseconds of each call
TIMES: dict[str, list[int]] = {}


def record(key: str, ns: int) -> None:
    TIMES.setdefault(key, []).append(ns)


def time_calls(owner: Any, name: str, key: str) -> None:
    """Replace ``owner.name`` (a class's method, a module's function) with a wrapper that
    records each call's time under ``key``."""
    original = getattr(owner, name)

    def call(*args: Any, **kwargs: Any) -> Any:
        start = now()
        try:
            return original(*args, **kwargs)
        finally:
            record(key, now() - start)

    setattr(owner, name, call)
