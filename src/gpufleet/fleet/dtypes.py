"""The dtypes a set-up model's forward sees: :class:`ForwardDtypes`, as Lightning
Fabric's precision plugins convert them.

* ``"32-true"``: nothing is converted.
* the mixed precisions (``"bf16-mixed"``, ``"16-mixed"``): the forward runs under the
  run's autocast; floating-point inputs come in the autocast dtype and floating-point
  outputs go back in torch's default dtype (float32), as Fabric's ``MixedPrecision``
  converts them.
* the true precisions (``"bf16-true"``, ``"16-true"``, ``"64-true"``): the model is
  converted to that dtype at ``setup``, floating-point inputs are cast to it, and the
  forward, ``init_module`` and ``init_tensor`` run with it as torch's default dtype (the
  tensors they create are of it); outputs go back in the default dtype outside (float32),
  as Fabric's ``HalfPrecision`` and ``DoublePrecision`` do. No loss scaling, no autocast.

Example:
    >>> d = ForwardDtypes(inputs=torch.bfloat16, true=torch.bfloat16)
    >>> d.convert_input((torch.ones(1), torch.ones(1, dtype=torch.long)))[0].dtype
    torch.bfloat16
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpufleet.core.tree import map_tensors

#: Fabric's true precisions: the dtype a model computes in, without autocast.
TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16,
               "fp16-true": torch.float16, "64-true": torch.float64, "64": torch.float64}


@dataclass(frozen=True)
class ForwardDtypes:
    """What a set-up model's forward converts (see the module docs).

    Attributes:
        inputs: floating-point inputs are cast to this (None: left as they are).
        true: the true precision's dtype (None: not a true precision): the model's
            dtype, and torch's default dtype inside the forward and ``init_module``.
        outputs: floating-point outputs are cast to torch's default dtype.
    """

    inputs: torch.dtype | None = None
    true: torch.dtype | None = None
    outputs: bool = False

    @classmethod
    def for_run(cls, precision_arg: Any, autocast_dtype: torch.dtype | None
                ) -> ForwardDtypes:
        """The conversions for ``Fleet(precision=precision_arg)`` and the run's autocast
        dtype (None without autocast)."""
        true = TRUE_DTYPES.get(str(precision_arg))
        if true is not None:
            return cls(inputs=true, true=true, outputs=True)
        if autocast_dtype is not None:
            return cls(inputs=autocast_dtype, outputs=True)
        return cls()

    def convert_module(self, module: nn.Module) -> nn.Module:
        """The model in the true precision's dtype (in place), as Fabric converts it:
        ``64-true`` with ``module.double()``, which leaves complex tensors as they are
        (complex128 when built under ``init_module``); the half precisions with
        ``module.to(dtype)``, which casts complex ones too."""
        if self.true is None:
            return module
        if self.true == torch.float64:
            return module.double()
        return module.to(dtype=self.true)

    def convert_input(self, data: Any) -> Any:
        if self.inputs is None:
            return data
        dtype = self.inputs
        return map_tensors(data, lambda t: _floating_as(t, dtype))

    def convert_output(self, data: Any) -> Any:
        if not self.outputs:
            return data
        default = torch.get_default_dtype()
        return map_tensors(data, lambda t: _floating_as(t, default))

    @contextlib.contextmanager
    def default_dtype(self) -> Iterator[None]:
        """Torch's default dtype is the true precision's inside (nothing otherwise)."""
        if self.true is None:
            yield
            return
        before = torch.get_default_dtype()
        torch.set_default_dtype(self.true)
        try:
            yield
        finally:
            torch.set_default_dtype(before)


def _floating_as(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if torch.is_floating_point(tensor) else tensor
