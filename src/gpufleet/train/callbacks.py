"""The callback protocol, where user code has always imported it from.

It lives in the bottom layer (:mod:`gpufleet.core.callbacks`) so that monitors and fault
handlers implement it without importing the training package.
"""

from gpufleet.core.callbacks import Callback, CallbackList

__all__ = ["Callback", "CallbackList"]
