"""Your optimizer and scheduler, and the run's whole recipe in one line.

An optimizer you give (an object built on your model's parameters, or a factory called
as ``fn(params)``) is kept as what it is: its class, its defaults and each parameter
group's own settings, the groups named by parameter name. The strategy then builds it on
the parameters it placed (a DDP replica, FSDP's shards, ZeRO's optimizer class, one
pipeline stage's layers), so every strategy takes it the same way and a resume restores
its state by name. A scheduler object is moved onto that optimizer; a factory is called
with it.

Example:
    >>> import torch
    >>> net = torch.nn.Linear(2, 1)
    >>> sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    >>> spec = spec_from_optimizer(sgd, net)
    >>> spec.cls.__name__, spec.kwargs["momentum"], len(spec.build(net).param_groups)
    ('SGD', 0.9, 1)
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import torch
from torch import nn

from gpufleet.errors import ConfigError
from gpufleet.parallel import OptimizerSpec

log = logging.getLogger(__name__)

# Module names wrappers put in front of (or into) a parameter's name.
_WRAPPER_PARTS = ("module.", "_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def plain_name(name: str) -> str:
    """A parameter's name as the user's own module calls it."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def user_optimizer(optimizer: Any, model: nn.Module) -> torch.optim.Optimizer:
    """``optimizer`` as an object: a factory is called with ``model``'s parameters."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if not callable(optimizer):
        raise ConfigError(f"optimizer = {optimizer!r}: give a torch.optim optimizer built on "
                          "the model's parameters, or a function fn(params) returning one.")
    built = optimizer(model.parameters())
    if not isinstance(built, torch.optim.Optimizer):
        raise ConfigError(f"the optimizer factory {getattr(optimizer, '__name__', optimizer)!r} "
                          f"returned {type(built).__name__}, not a torch.optim.Optimizer. "
                          "Make it return the optimizer built on the parameters it is given.")
    return built


def spec_from_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> OptimizerSpec:
    """What rebuilds ``optimizer`` (built on ``model``'s parameters) on a placed model.

    Raises:
        ConfigError: the optimizer holds parameters that are not ``model``'s.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    groups: list[tuple[dict[str, Any], list[str]]] = []
    for i, group in enumerate(optimizer.param_groups):
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise ConfigError(
                f"the optimizer's parameter group {i} holds {len(missing)} tensor(s) that are "
                "not parameters of the model given to gpufleet. Build the optimizer on "
                "model.parameters() (or groups of them) of that same model.")
        settings = {k: v for k, v in group.items() if k != "params"}
        groups.append((settings, [names[id(p)] for p in group["params"]]))
    if any(optimizer.state.values()):
        log.warning("the optimizer given already has state (it has stepped); gpufleet builds "
                    "it anew on the placed parameters, so that state is not carried over")
    defaults = _constructor_defaults(type(optimizer), optimizer.defaults)

    def param_groups(placed: nn.Module) -> list[dict[str, Any]]:
        by_name = {plain_name(n): p for n, p in placed.named_parameters()}
        out = []
        for settings, group_names in groups:
            params = [by_name[n] for n in group_names if n in by_name]
            if params:  # a pipeline stage holds only its own layers
                out.append({**settings, "params": params})
        return out

    return OptimizerSpec(type(optimizer), param_groups, defaults)


def _constructor_defaults(cls: type, defaults: dict[str, Any]) -> dict[str, Any]:
    """The optimizer's defaults its constructor takes back. Some classes keep settings
    the constructor fixes (AdamW's ``decoupled_weight_decay``): those stay in the
    parameter groups, which carry every setting, and out of the keyword arguments."""
    # The class's own constructor is meant (cls is a class, not an instance).
    accepted = inspect.signature(cls.__init__).parameters  # type: ignore[misc]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return {k: v for k, v in defaults.items() if k != "params"}
    return {k: v for k, v in defaults.items() if k != "params" and k in accepted}


def place_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> Any:
    """``scheduler`` (an object built on the user's optimizer, or ``fn(optimizer)``) on
    the run's ``optimizer``; None stays None."""
    if scheduler is None:
        return None
    if not hasattr(scheduler, "state_dict") or not hasattr(scheduler, "step"):
        if not callable(scheduler):
            raise ConfigError(f"scheduler = {scheduler!r}: give an LR scheduler object or a "
                              "function fn(optimizer) returning one.")
        return scheduler(optimizer)
    old = scheduler.optimizer
    if len(old.param_groups) != len(optimizer.param_groups):
        raise ConfigError("the scheduler object is built on an optimizer whose parameter "
                          "groups differ from the run's; pass a factory fn(optimizer) "
                          "instead, so it is built on the run's optimizer.")
    for mine, theirs in zip(optimizer.param_groups, old.param_groups, strict=True):
        for key in ("lr", "initial_lr", "momentum", "betas"):
            if key in theirs:
                mine[key] = theirs[key]
    _rebind(scheduler, old, optimizer)
    _mark_steps(optimizer)
    return scheduler


def _rebind(scheduler: Any, old: Any, optimizer: torch.optim.Optimizer) -> None:
    """Point ``scheduler`` at ``optimizer``, and the schedulers it chains (SequentialLR,
    ChainedScheduler: each steps its own ``optimizer``) that were on ``old``."""
    if getattr(scheduler, "optimizer", None) is old:
        scheduler.optimizer = optimizer
    for inner in getattr(scheduler, "_schedulers", None) or ():
        _rebind(inner, old, optimizer)


def _mark_steps(optimizer: torch.optim.Optimizer) -> None:
    """Wrap ``optimizer.step`` the way an LR scheduler's constructor does, so that the
    moved scheduler sees the optimizer step before it (torch checks, and warns
    otherwise, on the scheduler's first step)."""
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    @functools.wraps(step)
    def counted(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    counted._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = counted  # type: ignore[method-assign]


def describe_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """``AdamW(lr=0.001, betas=(0.9, 0.999), ...)`` with every setting, plus the groups
    whose settings differ from the optimizer's."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeRO's local optimizer
    defaults = {k: v for k, v in optimizer.defaults.items() if v is not None}
    text = f"{type(inner).__name__}({', '.join(f'{k}={v}' for k, v in defaults.items())})"
    extra = []
    for i, group in enumerate(optimizer.param_groups):
        own = {k: v for k, v in group.items()
               if k not in ("params", "initial_lr") and defaults.get(k, v) != v}
        if own:
            extra.append(f"group {i}: " + ", ".join(f"{k}={v}" for k, v in own.items()))
    return text + (f" [{'; '.join(extra)}]" if extra else "")


def describe_scheduler(scheduler: Any) -> str:
    """A user scheduler's class and its plain settings."""
    settings = {k: v for k, v in vars(scheduler).items()
                if not k.startswith("_") and k not in ("last_epoch", "verbose", "base_lrs")
                and isinstance(v, (int, float, str, bool))}
    return f"{type(scheduler).__name__}({', '.join(f'{k}={v}' for k, v in settings.items())})"


def recipe_line(optimizer: torch.optim.Optimizer, schedule: str, cfg: Any,
                strategy: str, world: int) -> str:
    """The run's whole recipe in one line (also written to config.toml)."""
    o = cfg.optim
    clip = [f"by value {o.clip_value:g}"] if o.clip_value else []
    if o.clip_norm:
        clip.append(f"by norm {o.clip_norm:g}")
    tf32 = {"true": ", TF32 on", "false": ", TF32 off"}.get(cfg.perf.tf32, "") \
        if cfg.run.device == "cuda" else ""
    return (f"{describe_optimizer(optimizer)} | schedule: {schedule} | clip: "
            f"{' then '.join(clip) or 'off'} | grad_accum {o.grad_accum} | precision "
            f"{cfg.precision.mode}{tf32} | strategy {strategy} on {world} rank(s) | preset "
            f"{o.preset}")


