"""What every config section is built from: :func:`opt` fields with help, choices and
bounds, and :class:`Section`, which checks them when a section is made."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import field
from typing import Any, ClassVar

from gpufleet.errors import ConfigError, unknown_choice


def opt(default: Any, help: str, *, choices: tuple[str, ...] = (), min: float | None = None):
    """A config field with its help text, its valid choices and its lower bound."""
    meta = {"help": help, "choices": choices, "min": min}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)


def table(cls: type) -> Any:
    """A sub-table of a section (``[parallel.ddp]``): its own :class:`Section` class."""
    return field(default_factory=cls, metadata={"help": cls.__doc__ or "", "table": cls})


def tables(cls: type) -> dict[str, type]:
    """``{field name: Section class}`` of a section's sub-tables."""
    return {f.name: f.metadata["table"] for f in dataclasses.fields(cls)
            if "table" in f.metadata}


AUTO = -1.0  # an optimizer setting whose default depends on the model (train.optim)


class Section:
    """Checks the choices and bounds declared with :func:`opt`."""

    #: the section's name in a config file ("parallel"), set by the schema
    _section_name: ClassVar[str] = ""

    def __post_init__(self) -> None:
        section = self._section_name
        for f in dataclasses.fields(self):
            if "table" in f.metadata:
                continue  # a sub-table checked itself when it was made
            value = getattr(self, f.name)
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                raise ConfigError(unknown_choice(f"{section}.{f.name}", value, choices))
            if isinstance(value, float) and not math.isfinite(value):
                # NaN passes every bound (each comparison is False): catch it by name.
                raise ConfigError(
                    f"{section}.{f.name} = {value!r} is not a finite number. Set "
                    f"{section}.{f.name} to a number such as {f.default!r}.")
            low = f.metadata.get("min")
            if low is not None and value < low:
                raise ConfigError(
                    f"{section}.{f.name} = {value!r} is below its minimum {low}. "
                    f"Set {section}.{f.name} to {low} or more."
                )
