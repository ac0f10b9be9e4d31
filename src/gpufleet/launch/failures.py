"""What the launcher says when ranks fail: each failed rank, the first failure's cause
once (its own sentence for a config or code mistake, else the traceback), and advice that
fits the cause (a config mistake is not fixed by restarting the ranks)."""

from __future__ import annotations

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from gpufleet.fault import crash_forensics
from gpufleet.fault.fatal import rank_folders
from gpufleet.fault.watchdog import EXIT_RANK_LOST

# Exceptions that come from the config or the code: a restart fails the same way.
_USER_ERRORS = frozenset({
    "ConfigError", "BatchError", "CheckpointError", "TypeError", "ValueError", "AttributeError",
    "ImportError", "ModuleNotFoundError", "KeyError", "IndexError", "NameError",
    "AssertionError", "NotImplementedError", "ZeroDivisionError", "FileNotFoundError"})
_COMM_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError")


def describe_failures(err: ChildFailedError, max_restarts: int, where: str,
                      forensics: str | None = None) -> str:
    """The failed ranks, the first failure's cause once, and advice that fits it; with
    ``forensics`` (the folder the ranks linked their crash folders into), where each
    rank was: a collective mismatch named with both sides, a rank dead by a signal."""
    lines = [f"{len(err.failures)} rank(s) failed:"]
    for rank, failure in sorted(err.failures.items()):
        how = (f"killed by signal {failure.signal_name()}" if failure.exitcode < 0
               else f"exit code {failure.exitcode}")
        if failure.exitcode == EXIT_RANK_LOST:
            how += (" (it ended itself: another rank, or the store, stopped answering; "
                    "its report is in the log above and under <run dir>/hangs/)")
        lines.append(f"  rank {rank} (local rank {failure.local_rank}, pid {failure.pid}): "
                     f"{how}; error file: {failure.error_file}")
    root_rank, root = err.get_first_failure()
    message, stack = root.message, ""
    if root.exitcode == EXIT_RANK_LOST:
        message = "(no traceback: the rank ended itself; its report is in the log above)"
    if isinstance(message, dict):  # an error file written by @record
        stack = message.get("extraInfo", {}).get("py_callstack") or ""
        message = message.get("message") or ""
    kind = str(message).split(":", 1)[0].strip()
    known = kind in _USER_ERRORS or "ConfigError" in kind
    # A config or code mistake reads best as its own sentence; anything else shows the
    # traceback (once: the agent's own copy of it is not logged, see _launch_elastic).
    cause = str(message).rstrip() if known or not stack else stack.rstrip()
    positions = (crash_forensics.positions(crash_forensics.read_folders(
        rank_folders(forensics))) if forensics else [])
    lines += [f"First failure (rank {root_rank}):", cause, *positions, where,
              advice(kind, str(message), root.exitcode, root.signal_name(), max_restarts)]
    return "\n".join(lines)


def advice(kind: str, message: str, exitcode: int, signal_name: str,
           max_restarts: int) -> str:
    """What to do about a rank failure of exception ``kind`` (or signal), by its cause."""
    if kind in _USER_ERRORS or "ConfigError" in kind:
        return (f"This {kind} comes from the config or the code, so restarting the ranks "
                "would fail the same way: fix it and run again.")
    if "OutOfMemoryError" in kind or "out of memory" in message:
        return ("Out of GPU memory: lower data.batch_size (raise optim.grad_accum to keep "
                "the global batch), turn on parallel.activation_checkpointing, or shard the "
                "model with --strategy fsdp.")
    if exitcode < 0 and signal_name == "SIGKILL":
        return ("SIGKILL most often means the host ran out of memory (see `dmesg`), or a "
                "scheduler or a person ended the rank. Lower data.num_workers or "
                "data.batch_size; --dist.max_restarts N restarts the ranks after such a "
                "failure (from the last checkpoint: set --checkpoint.every).")
    if kind in _COMM_ERRORS or "timed out" in message or "Connection" in message:
        return ("A communication failure, often passing (a lost peer, a network blip): "
                "--dist.max_restarts N restarts the ranks from the last checkpoint (set "
                "--checkpoint.every); `gpufleet doctor` checks the network settings.")
    return (f"The agent allowed {max_restarts} restart(s) (--dist.max_restarts="
            f"{max_restarts}); fix the error above, or raise --dist.max_restarts to restart "
            "the ranks after transient failures.")
