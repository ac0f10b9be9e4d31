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

from gpufleet.fleet.run import FleetPart


class FleetInit(FleetPart):
    """``init_module`` and ``init_tensor`` of :class:`~gpufleet.fleet.Fleet` (a part of
    it)."""

    @contextlib.contextmanager
    def init_module(self, empty_init: bool | None = None) -> Iterator[None]:
        """Build the model inside this block: its parameters and buffers are created on
        this rank's device. ``empty_init=True`` leaves the weights uninitialised (the
        functions of ``torch.nn.init`` do nothing here): load a checkpoint into them
        before training (:meth:`load_raw`, :meth:`load`). None and False initialise as
        usual. Every rank builds the whole model, also under fsdp (its shards are made
        at :meth:`setup`)."""
        device = self._rank_run().device
        with torch.device(device), (_SkipInit() if empty_init else contextlib.nullcontext()):
            yield

    @contextlib.contextmanager
    def init_tensor(self) -> Iterator[None]:
        """Tensors created inside this block are created on this rank's device."""
        with torch.device(self._rank_run().device):
            yield


_INIT_FILE = torch.nn.init.__file__


class _SkipInit(TorchFunctionMode):
    """Makes every function of ``torch.nn.init`` leave its tensor untouched: the ones
    that hand themselves to torch's override hook return at once, and in the others
    each tensor operation made from ``torch/nn/init.py`` that writes into a tensor (in
    place: ``uniform_``, ``fill_``, ``copy_``; or ``out=``) is not carried out. What
    they read of the tensor (its shape, for the fan) still is."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        if (kwargs.get("out") is not None or (args and _writes_in_place(func))) and \
                sys._getframe(1).f_code.co_filename == _INIT_FILE:
            # an init function's write into its tensor (in place, or out=): left undone
            return kwargs["out"] if kwargs.get("out") is not None else args[0]
        return func(*args, **kwargs)


def _writes_in_place(func: Any) -> bool:
    """``uniform_``, ``copy_``, ``tensor[i] = v``: not ``__get__`` (a property read)."""
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or (name.endswith("_") and not name.startswith("__"))
