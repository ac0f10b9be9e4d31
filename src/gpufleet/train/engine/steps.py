"""Your training step: the loss (or losses) of one micro-batch, computed by your code.

A training step is ``fn(models, batch, step)``:

* ``models``: your model as the strategy placed it (a DDP replica, FSDP's shards), or,
  when you train several (a GAN's generator and discriminator), a dict name -> placed
  model, in the order you gave them;
* ``batch``: the micro-batch, on the run's device;
* ``step``: the optimizer step being made (0 first; every micro-batch of one step gets
  the same number), for alternating updates.

It returns a scalar loss tensor, or a dict of them. Every value of a dict is logged under
its key (averaged over the log interval and the ranks). Which values drive backward:

* one model: the value under ``"loss"``, else the first one;
* several models: the value named after each model drives that model's optimizer, and
  its backward reaches that model's parameters only (the discriminator's loss leaves no
  gradient in the generator). A model whose name is missing sits the step out: its
  optimizer and scheduler do not step (train them in turns with ``step % 2``).

gpufleet does the rest per model: backward under autocast (one loss scaler per
optimizer under ``fp16-mixed``), gradient accumulation with the gradient sync held back
on every wrapped model until the last micro-batch, unscaling, the non-finite guard,
clipping, the optimizer and scheduler steps, and the checkpoint holding all of them.

Example:
    >>> import torch
    >>> split_losses({"loss": torch.tensor(2.0), "mse": torch.tensor(1.0)}, ["model"])
    ({'model': tensor(2.)}, {'loss': tensor(2.), 'mse': tensor(1.)})
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gpufleet.config import Config
from gpufleet.errors import ConfigError
from gpufleet.parallel import strategy_class, strategy_names
from gpufleet.parallel.dims import StrategyTraits

#: The name of the one model of a run that trains one.
ONE_MODEL = "model"


def named_models(model: nn.Module | Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    """``model`` as ``{name: module}``: one module is named ``"model"``.

    Raises:
        ConfigError: a mapping that is empty or holds something other than modules.
    """
    if isinstance(model, nn.Module):
        return {ONE_MODEL: model}
    if not isinstance(model, Mapping) or not model:
        raise ConfigError(f"model = {type(model).__name__}: give an nn.Module, or several "
                          "as a dict {name: nn.Module} (e.g. {'generator': G, "
                          "'discriminator': D}) with a training_step.")
    bad = [f"{k!r} ({type(v).__name__})" for k, v in model.items()
           if not isinstance(k, str) or not isinstance(v, nn.Module)]
    if bad:
        raise ConfigError(f"the models dict holds {', '.join(bad)}: give string names "
                          "mapped to nn.Module objects.")
    return dict(model)


def per_model(value: Any, names: Sequence[str], what: str) -> dict[str, Any]:
    """``value`` (an optimizer or scheduler, or a dict of them by model name) for each of
    ``names``; one value for several models must be a factory, called per model.

    Raises:
        ConfigError: a dict whose names are not the models', or one object for several
            models.
    """
    if isinstance(value, Mapping):
        if set(value) - set(names):
            raise ConfigError(
                f"{what} is given for {sorted(set(value) - set(names))}, which are not "
                f"models of this run ({list(names)}). Key the dict by the models' names.")
        return {name: value.get(name) for name in names}
    if value is None or len(names) == 1:
        return {name: value for name in names}
    if not isinstance(value, type) and hasattr(value, "state_dict"):  # an object
        raise ConfigError(
            f"one {what} object for {len(names)} models ({list(names)}): give a dict "
            f"{{name: {what}}}, one per model, or a factory that gpufleet calls per model.")
    return {name: value for name in names}  # a factory, called for each model


def check_strategy(strategy: str, several: bool, has_step: bool) -> None:
    """Refuse, before any rank starts, what ``strategy`` cannot train (by its traits).

    Raises:
        ConfigError: a training step under a pipelined strategy (whose schedule runs
            the micro-batches through the stages itself), or several models under a
            strategy whose traits do not say ``several_models`` (single and ddp do).
    """
    traits = (strategy_class(strategy).traits if strategy in strategy_names()
              else StrategyTraits())  # "auto", not decided yet: no trait to claim
    if has_step and traits.pipelined:
        raise ConfigError(
            f"parallel.strategy = {strategy!r} runs its own schedule of micro-batches through "
            "the stages, so a training_step of yours cannot run in it. Use ddp, fsdp or "
            "single with a training_step, or drop the training_step to use pipeline.")
    if several and not traits.several_models:
        several_ok = [n for n in strategy_names() if strategy_class(n).traits.several_models]
        raise ConfigError(
            f"parallel.strategy = {strategy!r} trains one model; several models (a dict "
            f"of them) train under {' or '.join(several_ok)}. Use "
            "--parallel.strategy ddp (or single on one rank), or combine the models into "
            "one nn.Module.")


def models_and_step(cfg: Config, model: Any, training_step: Any,
                     eval_data: Any) -> tuple[dict[str, nn.Module], Any]:
    """The models by name and your training step (given, or named by
    ``model.training_step``), checked against the strategy before anything is built.

    Raises:
        ConfigError: several models without a step or with evaluation data, a step that
            is not callable, or what the strategy cannot train.
    """
    from gpufleet.job import import_object

    models = named_models(model)
    if training_step is None and cfg.model.training_step:
        training_step = import_object(cfg.model.training_step, "model.training_step")
    if training_step is not None and not callable(training_step):
        raise ConfigError(f"training_step = {training_step!r} is not callable: give a "
                          "function fn(models, batch, step) returning the loss.")
    several = len(models) > 1
    if several and training_step is None:
        raise ConfigError(
            f"several models ({list(models)}) need a training_step(models, batch, step) "
            "that returns a loss per model name; pass training_step=... (or "
            "--model.training_step pkg.mod:fn).")
    if several and eval_data is not None:
        raise ConfigError(
            "eval_data with several models: gpufleet evaluates one model with its loss. "
            "Drop eval_data and evaluate in a callback (on_log) of your own.")
    check_strategy(cfg.parallel.strategy, several, training_step is not None)
    return models, training_step


def split_losses(out: Any, names: Sequence[str]) -> tuple[dict[str, torch.Tensor],
                                                          dict[str, torch.Tensor]]:
    """A training step's return value as ``(driving, logged)``: the loss each model's
    backward starts from (by model name), and every value to log (by its own key).

    Raises:
        ConfigError: the step returned no loss, or a value that is not a scalar tensor.
    """
    if isinstance(out, torch.Tensor):
        _check_scalar("the training_step's return value", out)
        return {names[0]: out}, {}
    if not isinstance(out, Mapping) or not out:
        raise ConfigError(
            f"the training_step returned {type(out).__name__}: return the loss (a scalar "
            "tensor) or a dict of them, e.g. {'loss': loss} or, for several models, "
            f"one loss per model name {list(names)}.")
    for key, value in out.items():
        _check_scalar(f"the training_step's {key!r}", value)
    if len(names) == 1:
        key = "loss" if "loss" in out else next(iter(out))
        return {names[0]: out[key]}, dict(out)
    driving = {name: out[name] for name in names if name in out}
    if not driving:
        raise ConfigError(
            f"the training_step returned {list(out)}, and none is named after a model "
            f"{list(names)}: the loss under each model's name trains that model.")
    return driving, dict(out)


def _check_scalar(what: str, value: Any) -> None:
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ConfigError(f"{what} is {shape}, not a scalar loss tensor. Reduce it "
                          "(e.g. .mean()) before returning it.")


class UserStep:
    """Calls your training step and keeps what it returned for the log line.

    Args:
        fn: your ``training_step(models, batch, step)``.
        names: the models' names, in order.
    """

    def __init__(self, fn: Callable[..., Any], names: Sequence[str]) -> None:
        self.fn, self.names = fn, list(names)
        self.step = 0  #: set by the loop before each optimizer step
        #: Detached sums of each logged value, and how many micro-batches returned it.
        self.logged: dict[str, list[Any]] = {}

    def __call__(self, models: Any, batch: Any) -> dict[str, torch.Tensor]:
        driving, logged = split_losses(self.fn(models, batch, self.step), self.names)
        for key, value in logged.items():
            total = self.logged.setdefault(key, [None, 0])
            value = value.detach().float()
            total[0] = value if total[0] is None else total[0] + value
            total[1] += 1
        return driving

    def as_loss_fn(self) -> Callable[[nn.Module, Any], torch.Tensor]:
        """``loss_fn(model, batch)`` for a strategy's own forward and backward (one
        model): the loss that drives backward."""
        name = self.names[0]
        return lambda model, batch: self(model, batch)[name]

    def take_logged(self) -> dict[str, list[Any]]:
        """The logged sums since the last call (device tensors) and their counts."""
        logged, self.logged = self.logged, {}
        return logged


def forward_backward_parts(parts: Sequence[Any], batch: Any, step: UserStep,
                           precision: Any, loss_scale: float,
                           mark: Callable[[], None] | None = None
                           ) -> dict[str, torch.Tensor]:
    """One micro-batch through your step over several models (``parts``: the run's
    :class:`~gpufleet.train.engine.run.ModelPart` objects), and each model's backward
    from its own loss, reaching its own parameters only; returns each model's detached,
    unscaled loss (the models that sat the step out are missing).

    The losses may share a graph (the generator's output in both of a GAN's losses), so
    every backward but the last keeps it.
    """
    models = {part.name: part.model for part in parts}
    with precision.autocast():
        driving = step(models, batch)
    if mark is not None:
        mark()
    by_name = {part.name: part for part in parts}
    last = len(driving) - 1
    for i, (name, loss) in enumerate(driving.items()):
        part = by_name[name]
        part.precision.backward(loss * loss_scale if loss_scale != 1.0 else loss,
                                inputs=part.params, retain_graph=i < last)
    return {name: loss.detach() for name, loss in driving.items()}


def no_sync_all(strategy: Any, parts: Sequence[Any]) -> contextlib.ExitStack:
    """Hold back the gradient sync of every wrapped model (a micro-batch that is not an
    optimizer step's last)."""
    stack = contextlib.ExitStack()
    for part in parts:
        stack.enter_context(strategy.no_sync(part.model))
    return stack
