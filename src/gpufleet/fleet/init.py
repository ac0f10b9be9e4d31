"""Building a model where it will train: ``init_module`` and ``init_tensor`` of
:class:`~gpufleet.fleet.Fleet`, as Lightning Fabric's.

Under :meth:`FleetInit.init_module` the tensors a model's constructor makes are created
on this rank's device from the start (torch's default device, set for the block), so a
large model is not built on the host first and copied. ``empty_init=True`` also skips
the initialisation functions of ``torch.nn.init`` (what torch's layers and most models
initialise their weights with): the weights are left as allocated, for a loop that loads
a checkpoint into them next and would otherwise pay for random numbers it throws away.

Example:
    >>> fleet = Fleet(accelerator="cpu")  # doctest: +SKIP
    >>> with fleet.init_module(empty_init=True):  # doctest: +SKIP
    ...     model = GPT(config)  # on fleet.device, weights not drawn  # doctest: +SKIP
    >>> fleet.load_raw("gpt.pt", model)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from gpufleet.fleet.dtypes import ForwardDtypes
from gpufleet.fleet.part import FleetPart


class FleetInit(FleetPart):
    """``init_module`` and ``init_tensor`` of :class:`~gpufleet.fleet.Fleet` (a part of
    it)."""

    _dtypes: ForwardDtypes  # a true precision's default dtype applies here too

    @contextlib.contextmanager
    def init_module(self, empty_init: bool | None = None) -> Iterator[None]:
        """Build the model inside this block: its parameters and buffers are created on
        this rank's device. ``empty_init=True`` leaves the weights uninitialised (the
        functions of ``torch.nn.init`` do nothing here): load a checkpoint into them
        before training (:meth:`load_raw`, :meth:`load`). None and False initialise as
        usual. Every rank builds the whole model, also under fsdp (its shards are made
        at :meth:`setup`). Under a true precision (``"bf16-true"``...) the tensors are
        created in its dtype, as with Fabric."""
        device = self._rank_run().device
        with torch.device(device), self._dtypes.default_dtype(), \
                (_SkipInit() if empty_init else contextlib.nullcontext()):
            yield

    @contextlib.contextmanager
    def init_tensor(self) -> Iterator[None]:
        """Tensors created inside this block are created on this rank's device."""
        with torch.device(self._rank_run().device), self._dtypes.default_dtype():
            yield


_INIT_FILE = torch.nn.init.__file__


class _SkipInit(TorchFunctionMode):
    """Makes every function of ``torch.nn.init`` leave its tensor untouched: the ones
    that hand themselves to torch's override hook return at once; in the others, each
    write made from ``torch/nn/init.py`` (in place: ``uniform_``, ``fill_``, ``copy_``;
    or ``out=``) into the storage of the tensor being initialised is not carried out.
    What they read of it (its shape, for the fan) still is, and their scratch tensors
    are computed as usual (a rejection loop over them still ends)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        out = kwargs.get("out")
        written = out if out is not None else (args[0] if args and _writes_in_place(func)
                                               else None)
        caller = sys._getframe(1)
        if isinstance(written, torch.Tensor) and caller.f_code.co_filename == _INIT_FILE:
            target = _initialised(caller)
            if target is not None and _same_storage(written, target):
                return written  # an init function's write into its tensor: left undone
        return func(*args, **kwargs)


def _initialised(frame: Any) -> torch.Tensor | None:
    """The tensor the outermost ``torch.nn.init`` function on the stack initialises (its
    ``tensor`` argument), from ``frame`` (one in torch/nn/init.py) outwards."""
    found = None
    while frame is not None:
        if frame.f_code.co_filename == _INIT_FILE:
            value = frame.f_locals.get("tensor")
            if isinstance(value, torch.Tensor):
                found = value
        frame = frame.f_back
    return found


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _writes_in_place(func: Any) -> bool:
    """``uniform_``, ``copy_``, ``tensor[i] = v``: not ``__get__`` (a property read)."""
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or (name.endswith("_") and not name.startswith("__"))
