"""NCCL settings that make a failing or hanging job say so, set unless the user set them.

* ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``: a failed or timed-out collective tears the
  process down (instead of leaving it hung), so the elastic agent can restart the ranks.
  This is torch's own default since 2.2; it is set explicitly so older builds agree.
* ``TORCH_NCCL_TRACE_BUFFER_SIZE=2000``: the flight recorder keeps the last 2000
  collectives of each rank (a ring buffer in host memory; off when 0).
* ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` and ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``: on a
  collective timeout each rank writes that record to ``<run_dir>/hangs/nccl-trace-rank-<R>``
  (readable with torch's ``torchfrtrace`` tool), which shows which collective each rank
  was in.

They only matter with the NCCL backend and must be in the environment before the
process group is created.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path


def nccl_defaults(run_dir: str | Path | None) -> dict[str, str]:
    """The settings above; the trace file goes to the run directory when it is known."""
    values = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    if run_dir:
        values["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(Path(run_dir) / "hangs" /
                                                        "nccl-trace-rank-")
    return values


def apply_nccl_defaults(run_dir: str | Path | None,
                        environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each default that the environment does not set already; returns those set.

    Example:
        >>> env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
        >>> sorted(apply_nccl_defaults(None, env))
        ['TORCH_NCCL_ASYNC_ERROR_HANDLING', 'TORCH_NCCL_DUMP_ON_TIMEOUT']
        >>> env["TORCH_NCCL_TRACE_BUFFER_SIZE"]
        '0'
    """
    environ = os.environ if environ is None else environ
    applied = {k: v for k, v in nccl_defaults(run_dir).items() if k not in environ}
    environ.update(applied)
    if run_dir and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" in applied:
        (Path(run_dir) / "hangs").mkdir(parents=True, exist_ok=True)
    return applied
