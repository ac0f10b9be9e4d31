"""Cutting a model into pipeline stages, and keeping this rank's (step 4 of
:func:`gpufleet.parallel.parallelize.parallelize`).

:func:`keep_stage` cuts the model and keeps the stage of this rank's place in the mesh
(a model's own ``pipeline_units``/``pipeline_stage`` hooks, or a sequential cut); the
rest needs no process group. A model can be split when its forward is "run the
layers in order": an ``nn.Sequential`` (nested plain ``nn.Sequential`` containers are
opened up, so ``blocks.3`` can start a stage). A stage is a pruned copy of the
container tree holding only its own layers, so its state-dict names are the full
model's (``blocks.3.weight``, not ``0.weight``), and the stages' state dicts together
are exactly the full model's.

Example:
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 1))
    >>> units = sequential_units(net)
    >>> plan_stages(units, 2, "")  # 320 parameters | 0 + 4,160 + 65
    [0, 1]
    >>> list(stage_module(net, units, 1, 4).state_dict())
    ['2.weight', '2.bias', '3.weight', '3.bias']
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard

import torch
import torch.distributed as dist
from torch import nn

from gpufleet.errors import ConfigError, GpufleetError, did_you_mean
from gpufleet.parallel.dims import ParallelDims


@dataclass
class StageSplit:
    """This rank's share of a pipeline, as :func:`keep_stage` cut it.

    Attributes:
        module: this rank's stage, on the run's device.
        index: the stage's number in its pipeline (0: the first).
        stages: stages per pipeline (``pp``).
        group: the process group of this rank's pipeline (None: it spans all ranks).
        pipelines: the global ranks of every pipeline, stage by stage.
        layers: the layer names each stage holds, stage by stage.
        tied: the model's ``pipeline_ties()`` (pairs of parameter names one weight
            takes on two stages; empty for a sequential cut).
        loss: the model's ``pipeline_loss(output, target)``: the loss its forward
            computes from the last stage's output, for a run without a loss function
            (None: the model has none).
    """

    module: nn.Module
    index: int
    stages: int
    group: Any
    pipelines: list[list[int]]
    layers: list[list[str]]
    tied: list[tuple[str, str]] = field(default_factory=list)
    loss: Callable[[Any, Any], torch.Tensor] | None = None


class StageHooks(Protocol):
    """A model that cuts itself into stages (the built-in GPT does), in place of the
    sequential cut: :func:`keep_stage` calls these hooks when it has ``pipeline_stage``."""

    def pipeline_units(self) -> list[tuple[str, nn.Module]]:
        """The layers the forward runs, in order, with their qualified names."""
        ...

    def pipeline_stage(self, units: list[str]) -> nn.Module:
        """The stage holding the named units (of :meth:`pipeline_units`)."""
        ...

    def pipeline_ties(self) -> Iterable[tuple[str, str]]:
        """Pairs of parameter names one weight takes on two stages."""
        ...


def _cuts_itself(model: nn.Module) -> TypeGuard[StageHooks]:
    """Whether ``model`` has its own ``pipeline_stage`` hook (:class:`StageHooks`)."""
    return callable(getattr(model, "pipeline_stage", None))


def check_pipelinable(precision: Any) -> None:
    """Refuse what a pipeline schedule cannot run: torch without
    ``torch.distributed.pipelining``, or a loss-scaling precision (fp16-mixed)."""
    try:
        from torch.distributed.pipelining import PipelineStage  # noqa: F401
    except ImportError as e:  # torch < 2.4
        raise GpufleetError(f"parallel.strategy = 'pipeline' needs "
                            f"torch.distributed.pipelining (torch >= 2.4), and this "
                            f"torch {torch.__version__} has none: {e}. Upgrade torch.") from e
    if getattr(precision, "scales_loss", False):
        raise ConfigError("parallel.strategy = 'pipeline' cannot use precision.mode = "
                          "'fp16-mixed': the schedule runs backward itself, past the loss "
                          "scaler. Use --precision bf16-mixed (or fp32).")


def keep_stage(model: nn.Module, dims: ParallelDims, mesh: Any, split: str,
               device: torch.device) -> StageSplit:
    """Cut ``model`` into ``dims.pp`` stages and keep this rank's, moved to ``device``.

    Args:
        model: the whole model (a ``pipeline_stage`` hook of its own, or sequential).
        dims: the mesh degrees.
        mesh: the run's DeviceMesh, whose ``pp`` rows are the pipelines; None when one
            pipeline spans every rank.
        split: ``parallel.pipeline.split`` (where stages 2..N begin; empty: balanced).
        device: this rank's device.
    """
    if mesh is not None:  # this rank's pipeline is a row of the mesh
        group, index = mesh.get_group("pp"), mesh.get_local_rank("pp")
        # [pp, dp_replicate, dp_shard, tp] global ranks: one pipeline per column
        pipelines = mesh.mesh.reshape(dims.pp, -1).t().tolist()
    else:
        group, index = None, dist.get_rank()
        pipelines = [list(range(dims.pp))]
    own = model if _cuts_itself(model) else None  # the model's own hooks, or None
    units = own.pipeline_units() if own is not None else sequential_units(model)
    starts = [*plan_stages(units, dims.pp, split), len(units)]
    first, stop = starts[index], starts[index + 1]
    stage = (own.pipeline_stage([n for n, _ in units[first:stop]]) if own is not None
             else stage_module(model, units, first, stop)).to(device)
    layers = [[n for n, _ in units[a:b]] for a, b in itertools.pairwise(starts)]
    return StageSplit(stage, index, dims.pp, group, pipelines, layers,
                      list(own.pipeline_ties()) if own is not None else [], stage_loss(model))


def stage_loss(model: nn.Module) -> Callable[[Any, Any], torch.Tensor] | None:
    """The model's ``pipeline_loss(output, target)`` hook, or None."""
    loss = getattr(model, "pipeline_loss", None)
    return loss if callable(loss) else None


def check_stage_loss(model: Any, loss_fn: Any) -> None:
    """Refuse, before any rank starts, a pipelined run with no loss to compute on its
    last stage: no loss function given, and a model that computes its loss in its own
    forward (which the stages never run whole) without a ``pipeline_loss`` hook.

    Raises:
        ConfigError: naming the two ways to give the last stage its loss.
    """
    if loss_fn is not None or not isinstance(model, nn.Module) or stage_loss(model):
        return
    raise ConfigError(
        f"parallel.strategy = 'pipeline' computes the loss on the last stage from its "
        f"output, and this run has no loss function while the model "
        f"({type(model).__name__}) computes its loss inside its own forward, which the "
        "stages never run whole. Pass a loss function (loss_fn=... in Python, "
        "--model.loss=package.module:function on the CLI), or give the model a "
        "pipeline_loss(output, target) method (the built-in GPT has one).")


def sequential_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers a sequential model runs, in order, with their qualified names."""
    if not isinstance(model, nn.Sequential) or type(model).forward is not nn.Sequential.forward:
        raise ConfigError(
            f"parallel.strategy = 'pipeline' splits models that run their layers in order "
            f"(an nn.Sequential), and this model is a {type(model).__name__} with its own "
            "forward. Build it as nn.Sequential(embedding, *blocks, head) with the glue "
            "code inside those layers, or use a strategy that keeps the model whole "
            "(ddp, fsdp).")
    units: list[tuple[str, nn.Module]] = []

    def walk(seq: nn.Module, prefix: str) -> None:
        for name, child in seq.named_children():
            if type(child) is nn.Sequential:
                walk(child, f"{prefix}{name}.")
            else:
                units.append((f"{prefix}{name}", child))

    walk(model, "")
    return units


def plan_stages(units: list[tuple[str, nn.Module]], stages: int, split: str) -> list[int]:
    """Index of the first unit of each stage: at the user's split names, or balanced.

    Args:
        units: from :func:`sequential_units`.
        stages: how many stages (the pipeline's ranks).
        split: ``pipeline_split``: comma-separated names where stages 2..N begin; empty
            for a split that balances the parameter counts.

    Raises:
        ConfigError: too few layers, or split names that are unknown, out of order or
            not ``stages - 1`` of them.
    """
    names = [n for n, _ in units]
    if len(units) < stages:
        raise ConfigError(f"parallel.strategy = 'pipeline' with {stages} stages needs at "
                          f"least {stages} layers, and the model has {len(units)} "
                          f"({', '.join(names)}). Start fewer ranks (--nproc).")
    wanted = [s.strip() for s in split.split(",") if s.strip()]
    if not wanted:
        return balanced_split([sum(p.numel() for p in m.parameters()) for _, m in units],
                              stages)
    if len(wanted) != stages - 1:
        raise ConfigError(
            f"parallel.pipeline.split = {split!r} names {len(wanted)} split point(s), and "
            f"{stages} stages need {stages - 1}: the layers where stages 2..{stages} begin "
            f"(layers: {', '.join(names)}).")
    starts = [0]
    for name in wanted:
        index = next((i for i, n in enumerate(names)
                      if n == name or n.startswith(name + ".")), None)
        if index is None:
            guess = did_you_mean(name, names)
            hint = f" Did you mean {guess!r}?" if guess else ""
            raise ConfigError(f"parallel.pipeline.split: no layer {name!r} in the model."
                              f"{hint} Layers in order: {', '.join(names)}.")
        if index <= starts[-1]:
            raise ConfigError(f"parallel.pipeline.split = {split!r}: {name!r} does not come "
                              "after the previous split point; list the layers in model "
                              "order, each stage holding at least one layer.")
        starts.append(index)
    return starts


def balanced_split(sizes: list[int], stages: int) -> list[int]:
    """Stage starts that minimise the largest stage's size (contiguous, non-empty).

    Example:
        >>> balanced_split([4, 4, 1, 1, 6], 3)
        [0, 1, 4]
    """
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[k][i]: smallest largest-stage size for units[:i] cut into k stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    starts, i = [], n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def stage_module(model: nn.Module, units: list[tuple[str, nn.Module]], start: int,
                 stop: int) -> nn.Sequential:
    """The layers ``units[start:stop]`` in a pruned copy of the model's container tree."""
    keep = {name for name, _ in units[start:stop]}

    def prune(seq: nn.Module, prefix: str) -> nn.Sequential:
        out = nn.Sequential()
        for name, child in seq.named_children():
            full = f"{prefix}{name}"
            if type(child) is nn.Sequential:
                sub = prune(child, full + ".")
                if len(sub):
                    out.add_module(name, sub)
            elif full in keep:
                out.add_module(name, child)
        return out

    return prune(model, "")


def bubble_share(stages: int, microbatches: int) -> float:
    """Share of each stage's time spent idle in a GPipe or 1F1B step.

    Both schedules fill and drain the pipeline once per step: ``stages - 1`` slots idle
    out of ``microbatches + stages - 1`` (1F1B keeps fewer activations alive, not
    fewer bubbles).

    Example:
        >>> round(bubble_share(4, 8), 3)
        0.273
    """
    return (stages - 1) / (microbatches + stages - 1)
