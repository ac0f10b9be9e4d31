"""Torch's NCCL flight recorder: where its dumps are, for the hang report.

With ``TORCH_NCCL_TRACE_BUFFER_SIZE`` above 0 (``gpufleet.fault.ncclenv`` sets 2000)
each NCCL process group keeps its last collectives, with their state on the device, and
with ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` every rank writes them at a collective timeout to
``<prefix><rank>``, the prefix from ``TORCH_FR_DUMP_TEMP_FILE`` (newer torch) or
``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``, else torch's ``/tmp/nccl_trace_rank_``. torch's
``torchfrtrace`` tool reads them. Gloo keeps no such record: nothing is said there.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

#: The variables naming the dump prefix, the newer name first.
PREFIX_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
#: torch's prefix when neither is set.
DEFAULT_PREFIX = "/tmp/nccl_trace_rank_"
_SIZE_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def dump_prefix(environ: Mapping[str, str] | None = None) -> str:
    """The prefix each rank's dump is written under (the rank follows it)."""
    environ = os.environ if environ is None else environ
    return next((environ[k] for k in PREFIX_VARS if environ.get(k)), DEFAULT_PREFIX)


def dump_files(ranks: list[int], environ: Mapping[str, str] | None = None) -> list[Path]:
    """The dumps that exist for ``ranks``, in rank order.

    Example:
        >>> dump_files([0, 1], {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/nowhere/trace-"})
        []
    """
    prefix = dump_prefix(environ)
    return [Path(f"{prefix}{r}") for r in ranks if Path(f"{prefix}{r}").is_file()]


def report_note(backend: str, ranks: list[int],
                environ: Mapping[str, str] | None = None) -> str:
    """What the hang report says about the flight recorder: on NCCL its dumps, or where
    they will be written, or how to turn it on; "" on any other backend.

    Example:
        >>> report_note("gloo", [0, 1], {})
        ''
        >>> report_note("nccl", [0], {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"})[:36]
        'NCCL flight recorder: off (TORCH_NCC'
    """
    if backend.lower() != "nccl":
        return ""
    environ = os.environ if environ is None else environ
    found = dump_files(ranks, environ)
    if found:
        return ("NCCL flight recorder dumps (each rank's last collectives as the device "
                "saw them; read them with torch's `torchfrtrace`): " +
                ", ".join(map(str, found)))
    size = next((environ[k] for k in _SIZE_VARS if environ.get(k)), "0")
    if size.strip() in ("", "0"):
        return ("NCCL flight recorder: off (TORCH_NCCL_TRACE_BUFFER_SIZE is 0 or unset); "
                "set it to e.g. 2000 before the run starts to get each rank's device-side "
                "record at a collective timeout.")
    return (f"NCCL flight recorder: no dump yet; at the collective timeout (dist.timeout) "
            f"each rank writes {dump_prefix(environ)}<rank>, read them with torch's "
            "`torchfrtrace`.")
