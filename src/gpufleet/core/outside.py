"""Whether an error raised inside a callback is the callback's own or the run's.

A callback that may fail without stopping training (``essential = False``) has its
errors contained: a metrics sink that cannot reach its server must not take the run
down. But Python raises some errors in whatever code runs at that moment, a callback's
included, and those belong to the run:

- an exception raised by a signal handler (PyTorch's DataLoader raises "DataLoader
  worker (pid ...) is killed by signal" from its SIGCHLD handler, in the next Python
  line the main thread runs);
- a failure of torch.distributed (a collective the callback issued failed, or the
  process group is broken: the other ranks would wait in it) and the CUDA runtime's
  errors (the device is unusable for everyone after one);
- running out of memory.

``KeyboardInterrupt`` and ``SystemExit`` are not ``Exception`` and are never contained.
:func:`from_outside` tells them apart from the traceback's frames and the error's type;
it runs only on the error path, so it costs a step nothing.
"""

from __future__ import annotations

import signal
from types import CodeType, TracebackType

import torch
import torch.distributed as dist

#: Errors that are never a callback's own: the run stops on them whatever raised them.
_RUN_ERRORS: tuple[type[BaseException], ...] = (
    dist.DistError,  # DistBackendError, DistNetworkError, DistStoreError
    torch.AcceleratorError,  # CUDA errors (a device-side assert, an illegal access)
    torch.OutOfMemoryError, MemoryError,
)
#: Words of the runtime errors older builds raise as a plain RuntimeError.
_RUN_MESSAGES = ("CUDA error", "NCCL error", "CUBLAS_STATUS_", "CUDNN_STATUS_",
                 "DataLoader worker (pid")
#: Code whose errors are the run's: torch.distributed (a collective failed) and the
#: DataLoader's worker checks (a worker died).
_RUN_CODE = ("/torch/distributed/", "/torch/utils/data/_utils/signal_handling.py")


def from_outside(error: BaseException) -> bool:
    """True when ``error``, caught around a callback, comes from outside its code.

    Example:
        >>> from_outside(ValueError("a sink's own bug"))
        False
        >>> from_outside(KeyboardInterrupt())
        True
    """
    seen: set[int] = set()
    handlers = _signal_handler_code()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if _outside(error, handlers):
            return True
        # A callback that caught the run's error and raised one of its own (``raise X
        # from e``, or while handling it): the run's error is the one that counts.
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    return False


def _outside(error: BaseException, handlers: set[CodeType]) -> bool:
    if not isinstance(error, Exception) or isinstance(error, _RUN_ERRORS):
        return True
    if isinstance(error, RuntimeError) and any(m in str(error) for m in _RUN_MESSAGES):
        return True
    return any(code in handlers or any(part in code.co_filename for part in _RUN_CODE)
               for code in _frames(error.__traceback__))


def _frames(tb: TracebackType | None) -> list[CodeType]:
    codes = []
    while tb is not None:
        codes.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    return codes


def _signal_handler_code() -> set[CodeType]:
    """The code of every Python function installed as a signal handler now."""
    codes = set()
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        code = getattr(handler, "__code__", None)
        if code is not None:
            codes.add(code)
    return codes
