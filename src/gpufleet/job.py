"""Turn a config into a model, data sets and a loss: the built-in GPT job or your own.

``model.name`` and ``data.name`` are either a built-in name or an import string
``package.module:function``; the function is called with ``model.kwargs`` /
``data.kwargs`` and returns an ``nn.Module`` / a ``Dataset`` or ``(train, eval)``.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils.data import Dataset

from gpufleet.config import Config
from gpufleet.data.hf import hf_train_eval, is_hf_dataset, is_hf_dataset_dict
from gpufleet.errors import ConfigError, GpufleetError

log = logging.getLogger(__name__)

BUILTIN_MODELS = ("gpt",)
BUILTIN_DATA = ("stdlib",)
# Config keys whose value may be an import string that is imported and called.
FACTORY_KEYS = ("model.name", "data.name", "model.loss", "optim.factory", "sched.factory",
                "model.training_step")


@dataclass
class Job:
    """What the trainer trains."""

    model: nn.Module | dict[str, nn.Module]  # several: {name: module}, with a training_step
    train_data: Dataset
    eval_data: Dataset | None = None
    loss_fn: Any = None
    optimizer: Any = None  # yours (object or fn(params)); None: [optim]'s
    scheduler: Any = None  # yours (object or fn(optimizer)); None: [optim]'s schedule
    training_step: Any = None  # yours: fn(models, batch, step) -> loss or dict of losses


def import_object(spec: str, key: str) -> Any:
    """Import ``package.module:name`` (``key`` is the config key, for error messages).

    Example:
        >>> import_object("math:sqrt", "model.name")(4.0)
        2.0
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key} = {spec!r} is not an import string. Write it as "
                          "package.module:function, e.g. mypkg.models:build_model.")
    _search_current_folder()
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{key} = {spec!r}: cannot import module {module_name!r} ({e}). "
                          "Install the package, add its folder to PYTHONPATH, or run from "
                          "the folder that holds it.") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        names = [n for n in dir(module) if not n.startswith("_")]
        from gpufleet.errors import unknown_choice

        raise ConfigError(unknown_choice(f"{key} = {spec!r}: module {module_name!r} has no "
                                         f"{attr!r}; name", attr, names[:20])) from None


def require_trusted(cfg: Config, trust_code: bool, source: str) -> None:
    """Refuse a received config (``source``, e.g. a run directory) that names code to
    import and call, unless the user passed ``--trust-code``.

    Built-in names (``gpt``, ``stdlib``) and functions defined in gpufleet's own modules
    need no flag; any other ``package.module:function`` would run code the config's
    sender chose (``model.name = "os:system"`` runs a shell command).

    Raises:
        ConfigError: the config names such a factory and ``trust_code`` is False.
    """
    if trust_code:
        return
    foreign = [f"{key} = {value!r}" for key, value in _factories(cfg)
               if not _is_own_function(value)]
    if foreign:
        raise ConfigError(
            f"{source!r} names code to import and run: {', '.join(foreign)}. gpufleet does "
            "not run code named in a received config unless you say so. If you trust "
            "where this run directory came from, pass --trust-code (as with "
            "Transformers' trust_remote_code); otherwise do not use it.")


def _factories(cfg: Config) -> list[tuple[str, str]]:
    values = (cfg.model.name, cfg.data.name, cfg.model.loss, cfg.optim.factory,
              cfg.sched.factory, cfg.model.training_step)
    return [(k, v) for k, v in zip(FACTORY_KEYS, values, strict=True) if v and ":" in v]


def _is_own_function(spec: str) -> bool:
    """A function defined in a gpufleet module (not a name one of them imported, such as
    ``os`` or ``subprocess.run``): importing gpufleet's own modules runs no foreign code."""
    module_name = spec.partition(":")[0]
    if module_name != "gpufleet" and not module_name.startswith("gpufleet."):
        return False
    try:
        obj = import_object(spec, "factory")
    except ConfigError:
        return False
    return getattr(obj, "__module__", "").startswith("gpufleet") and callable(obj)
def _search_current_folder() -> None:
    """Let factories be found in the current folder, as ``python -m`` does.

    The ``gpufleet`` script (unlike ``python -m``) does not put the current folder on
    ``sys.path``. It is added last, so it never shadows an installed package.
    """
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)


def build_job(cfg: Config) -> Job:
    """Build the model, the data sets and the loss that ``cfg`` names."""
    step = cfg.model.training_step
    return Job(build_model(cfg), *build_data(cfg),
               loss_fn=import_object(cfg.model.loss, "model.loss") if cfg.model.loss else None,
               training_step=import_object(step, "model.training_step") if step else None)


def build_model(cfg: Config) -> nn.Module:
    """The model ``model.name`` names (the built-in GPT or your factory)."""
    m = cfg.model
    if m.name == "gpt":
        from gpufleet.models import build_gpt

        if m.n_embd % 64 or (m.n_embd // m.n_head) % 8:
            log.warning("model.n_embd = %d (head size %d): tensor cores run fastest when the "
                        "width is a multiple of 64 and the head size a multiple of 8",
                        m.n_embd, m.n_embd // m.n_head)
        return build_gpt(n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd,
                         block_size=m.block_size, dropout=m.dropout)
    _check_import_string(m.name, "model.name", BUILTIN_MODELS)
    model = _call_factory(import_object(m.name, "model.name"), m.kwargs, "model", m.name)
    if isinstance(model, dict) and model and all(
            isinstance(v, nn.Module) for v in model.values()):
        return model  # several models by name, trained by model.training_step
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.name = {m.name!r} returned {type(model).__name__}, not a "
                          "torch.nn.Module. Make the factory return the model (or a dict "
                          "{name: module} of several, with model.training_step).")
    return model


def build_data(cfg: Config) -> tuple[Dataset, Dataset | None]:
    """The (train, eval) data sets ``data.name`` describes (eval may be None)."""
    d = cfg.data
    if d.name == "stdlib":
        from gpufleet.data.corpus import build_stdlib_corpus
        from gpufleet.data.tokens import split_train_eval
        from gpufleet.launch import rank_zero_first

        # Each node's first rank builds the cached token file; the others then reuse it.
        with rank_zero_first(local=True):
            path = build_stdlib_corpus(max_bytes=d.corpus_bytes)
        try:
            return split_train_eval(path, cfg.model.block_size, d.eval_fraction)
        except ValueError as e:
            raise ConfigError(f"the stdlib corpus does not fit model.block_size = "
                              f"{cfg.model.block_size} and data.eval_fraction = "
                              f"{d.eval_fraction}: {e}. Lower model.block_size or "
                              "data.eval_fraction, or raise data.corpus_bytes.") from e
    _check_import_string(d.name, "data.name", BUILTIN_DATA)
    out = _call_factory(import_object(d.name, "data.name"), d.kwargs, "data", d.name)
    if is_hf_dataset_dict(out) or is_hf_dataset(out):  # memory-mapped Arrow, as it is
        return hf_train_eval(out, None)
    if isinstance(out, dict):
        return out["train"], out.get("eval")
    if isinstance(out, (tuple, list)) and len(out) == 2:
        return out[0], out[1]
    if isinstance(out, Dataset) or hasattr(out, "__getitem__"):
        return out, None
    raise ConfigError(f"data.name = {d.name!r} returned {type(out).__name__}. Return a "
                      "Dataset, a (train, eval) pair, {'train': ..., 'eval': ...}, or a "
                      "Hugging Face Dataset or DatasetDict.")


def _call_factory(factory: Any, kwargs: dict, section: str, spec: str = "") -> Any:
    """``factory(**kwargs)``; its own failure reads as one line naming the factory, the
    error and where it was raised (a :class:`ConfigError`), not a traceback per rank."""
    import inspect

    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{section}.kwargs = {kwargs!r} do not fit "
                          f"{getattr(factory, '__name__', factory)}{_signature(factory)}: {e}. "
                          f"Fix the names in {section}.kwargs.") from None
    except ValueError:  # no signature to check (a builtin): let the call decide
        pass
    try:
        return factory(**kwargs)
    except GpufleetError:
        raise
    except Exception as e:
        raise ConfigError(_factory_failed(f"{section}.name = {spec!r}", e, section)) from e


def _factory_failed(what: str, error: Exception, section: str) -> str:
    """One line: which factory raised what, and the line of the raise."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    where = f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""
    text = " ".join(str(error).split()) or "(no message)"
    return (f"{what} raised {type(error).__name__}: {text}{where}. Fix the factory (or "
            f"{section}.kwargs) and run again.")


def _signature(fn: Any) -> str:
    import inspect

    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def _check_import_string(name: str, key: str, builtins: tuple[str, ...]) -> None:
    if ":" not in name:
        from gpufleet.errors import unknown_choice

        raise ConfigError(unknown_choice(key, name, builtins,
                                         "Or give your own factory as package.module:function."))
