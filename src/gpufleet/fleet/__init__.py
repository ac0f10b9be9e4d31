"""Your own training loop on gpufleet: :class:`Fleet` (see :mod:`gpufleet.fleet.fleet`).

The names are imported on first use, so that ``gpufleet run``'s parser (in
:mod:`gpufleet.fleet.cli`) is built without the training stack.

Example:
    >>> from gpufleet.fleet import Fleet
    >>> Fleet.__name__
    'Fleet'
"""

from __future__ import annotations

import importlib
from typing import Any

# ``Fabric``: Fleet under Lightning Fabric's name, so that a Fabric script moves over by
# its import line alone (``import gpufleet as L``; ``L.Fabric(...)``).
_EXPORTS = {"Fleet": "gpufleet.fleet.fleet", "Fabric": "gpufleet.fleet.fleet",
            "FleetLoader": "gpufleet.fleet.loader", "FleetModule": "gpufleet.fleet.wrappers",
            "FleetOptimizer": "gpufleet.fleet.wrappers", "Recovered": "gpufleet.fleet.recovery"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), "Fleet" if name == "Fabric"
                       else name)
    raise AttributeError(f"module 'gpufleet.fleet' has no attribute {name!r}")
