"""Build a :class:`Config` from TOML, a dict and ``section.key=value`` overrides.

Every key is checked: an unknown or misspelled key, a value of the wrong type, or a
combination that cannot work raises :class:`ConfigError` naming the key, the valid
choices (closest match first) and the fix.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import tomli_w

from gpufleet.config.parallel import RENAMED as _PARALLEL_RENAMED
from gpufleet.config.schema import SECTIONS, Config
from gpufleet.config.section import tables
from gpufleet.errors import ConfigError, unknown_choice

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

#: old flat keys -> their new dotted place, refused with the new name
RENAMED = {f"parallel.{old}": f"parallel.{new}" for old, new in _PARALLEL_RENAMED.items()}

_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
               dict: "a table such as {key = 1}"}


def load_config(path: str | Path | None = None,
                overrides: Iterable[str] | Mapping[str, Any] = (),
                base: Config | None = None) -> Config:
    """Read a TOML file (optional) and apply overrides on top.

    Args:
        path: TOML file with ``[section]`` tables, or None for the defaults.
        base: a config to start from instead of the defaults (the file then updates it).
        overrides: ``"section.key=value"`` strings (values parsed as TOML, bare words as
            strings) or a mapping of ``"section.key"`` to a Python value.

    Example:
        >>> cfg = load_config(overrides=["optim.lr=1e-4", "parallel.strategy=ddp"])
        >>> cfg.optim.lr, cfg.parallel.strategy
        (0.0001, 'ddp')
    """
    data: dict[str, dict[str, Any]] = config_to_dict(base) if base is not None else {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist. Check the path.")
        try:
            from_file = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from e
        _merge(data, from_file)
    pairs = overrides.items() if isinstance(overrides, Mapping) else map(parse_override, overrides)
    for dotted, value in pairs:
        *tables, key = _split_key(dotted)
        place = data
        for name in tables:
            place = place.setdefault(name, {})
            if not isinstance(place, dict):
                raise ConfigError(f"config key {dotted!r}: {name!r} is a value, not a "
                                  "table. Fix the key.")
        place[key] = value
    return config_from_dict(data)


def _merge(into: dict[str, Any], update: Mapping[str, Any]) -> None:
    """``update``'s tables merged key by key into ``into``'s (a file over a base)."""
    for name, value in update.items():
        if isinstance(value, Mapping) and isinstance(into.get(name), dict):
            _merge(into[name], value)
        else:
            into[name] = value


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``"section.key=value"`` and parse the value as TOML (bare words are strings).

    Example:
        >>> parse_override("optim.lr=3e-4")
        ('optim.lr', 0.0003)
    """
    if "=" not in text:
        raise ConfigError(
            f"override {text!r} has no '='. Write it as section.key=value, e.g. optim.lr=3e-4."
        )
    key, raw = text.split("=", 1)
    return key.strip().removeprefix("--"), parse_value(raw.strip())


def parse_value(raw: str) -> Any:
    """Parse a command-line value as a TOML value; anything else is taken as a string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """Build and validate a :class:`Config` from nested ``{section: {key: value}}``."""
    sections = {}
    for name, values in data.items():
        if name not in SECTIONS:
            raise ConfigError(unknown_choice("config section", name, SECTIONS,
                                             "Fix the [section] name or the --section.key flag."))
        if not isinstance(values, Mapping):
            raise ConfigError(f"config section {name!r} must be a table of keys, "
                              f"got {values!r}. Write it as [{name}] with key = value lines.")
        sections[name] = _build_section(name, SECTIONS[name], values)
    return Config(**sections)


def _build_section(name: str, cls: type, values: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    subtables = tables(cls)
    choices = {f.name: f.metadata.get("choices", ()) for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key in subtables:
            if not isinstance(value, Mapping):
                raise ConfigError(f"{name}.{key} is a table of keys, got {value!r}. Write "
                                  f"it as [{name}.{key}] with key = value lines, or "
                                  f"--{name}.{key}.KEY=VALUE.")
            kwargs[key] = _build_section(f"{name}.{key}", subtables[key], value)
        elif f"{name}.{key}" in RENAMED:
            new = RENAMED[f"{name}.{key}"]
            raise ConfigError(
                f"{name}.{key} is now {new}: each parallelism has its own table. Write "
                f"--{new}={_flag_value(value)}, or in a config file {new.rpartition('.')[2]} = "
                f"... under [{new.rpartition('.')[0]}].")
        elif key not in fields:
            raise ConfigError(unknown_choice(f"{name}.{key}", key, sorted(fields),
                                             f"Valid keys of [{name}] are listed; "
                                             "`gpufleet train --help` explains each."))
        else:
            kwargs[key] = _coerce(f"{name}.{key}", value, hints[key], choices.get(key, ()))
    return cls(**kwargs)


def _flag_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _coerce(dotted: str, value: Any, kind: type, choices: tuple[str, ...] = ()) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is str and isinstance(value, bool) and "true" in choices:
        return "true" if value else "false"  # e.g. perf.tf32 = true
    if kind is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # e.g. dist.nnodes=2 parses as an integer
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        raise ConfigError(
            f"{dotted} expects {_TYPE_WORDS[kind]}, got {value!r} ({type(value).__name__}). "
            f"Fix the value, e.g. {dotted}={_example(kind)}."
        )
    return value


def _example(kind: type) -> str:
    return {bool: "true", int: "8", float: "0.5", str: "name", dict: "{key=1}"}[kind]


def _split_key(dotted: str) -> list[str]:
    parts = dotted.split(".")
    if len(parts) not in (2, 3) or not all(parts):
        raise ConfigError(
            f"config key {dotted!r} is not of the form section.key (or section.table.key). "
            f"Sections: {', '.join(SECTIONS)}; e.g. optim.lr, run.max_steps or "
            "parallel.ddp.comm_hook."
        )
    return parts


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """The config as nested plain dicts (what is written to the run directory)."""
    return dataclasses.asdict(cfg)


def write_config(cfg: Config, path: str | Path) -> Path:
    """Write the resolved config as TOML; ``load_config(path)`` reads it back."""
    path = Path(path)
    path.write_text(tomli_w.dumps(config_to_dict(cfg)))
    return path


def help_rows() -> list[tuple[str, str, str]]:
    """``(flag, default, help)`` for every config key, for ``--help``."""
    rows: list[tuple[str, str, str]] = []
    for section, cls in SECTIONS.items():
        _help_rows(section, cls, rows)
    return rows


def _help_rows(prefix: str, cls: type, rows: list[tuple[str, str, str]]) -> None:
    subtables = tables(cls)
    for f in dataclasses.fields(cls):
        if f.name in subtables:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        text = f.metadata["help"]
        if f.metadata["choices"]:
            text += f" [{'|'.join(f.metadata['choices'])}]"
        rows.append((f"--{prefix}.{f.name}", repr(default), text))
    for name, sub in subtables.items():
        _help_rows(f"{prefix}.{name}", sub, rows)
