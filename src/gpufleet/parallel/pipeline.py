"""``pipeline``: the model cut into stages, one per rank, fed micro-batch by micro-batch.

Every rank holds one stage (:func:`gpufleet.parallel.parallelize.parallelize` cuts the
model, see :mod:`gpufleet.parallel.pipeline_split`, and moves only this rank's stage to
its device; with ``dp > 1`` it then shards the stage). A training step runs a
``torch.distributed.pipelining`` schedule over ``parallel.pipeline.microbatches`` micro-batches:
``gpipe`` (all forwards, then all backwards) or ``1f1b`` (one forward, one backward in
the steady state: the same bubble, activations of at most ``stages`` micro-batches
alive instead of all). The pipeline spans all ranks, so all ranks read the same
batches (:meth:`PipelineParallel.data_shard`): the first stage feeds the inputs, the
last uses the targets.

How the loop's pieces map onto the pipeline:

* **loss**: only the last stage computes it. Once per ``forward_backward`` the last stage
  broadcasts the mean micro-batch loss to every rank (COLLECTIVE: one scalar), so every
  rank returns the same loss and the loop's mean over ranks is the pipeline's loss.
* **gradient scaling**: the schedule's own ``scale_grads`` is off; each micro-batch loss
  is divided by ``microbatches * grad_accum`` before its backward instead, so
  ``optim.grad_accum`` works as usual: each loop micro-step runs one whole schedule and
  the gradients add up. ``no_sync`` has nothing to do (no gradient all-reduce exists).
* **clipping**: each stage holds different parameters; the global norm is the square
  root of the stages' squared norms summed with one all-reduce (COLLECTIVE, in
  :mod:`gpufleet.parallel.grad_norm`).
* **evaluation**: :meth:`eval_model` runs the stages one after another on each whole
  evaluation batch, each stage broadcasting its output, so every rank ends with the
  model's output and the loop computes the same loss on every rank
  (the evaluation sample count the loop reports is ``stages`` times the real one).
* **bubble share**: ``(stages - 1) / (microbatches + stages - 1)``, logged once and kept
  in :attr:`PipelineParallel.bubble_share` and :meth:`PipelineParallel.describe`.
* **checkpoints**: :meth:`state_dict` is a COLLECTIVE (every rank must call it): the
  stages' model and optimizer states are gathered into the full model's state, in the
  layout a ``single`` run saves, so a pipeline checkpoint loads anywhere and back.

* **a model that computes its own loss** (``GPT(idx, targets)``, no loss function
  given): the last stage returns the model's output, and the model's
  ``pipeline_loss(output, target)`` hook turns it into the same loss (the built-in GPT
  has one); without the hook the launching process's preflight asks for a loss function.

Limits: fp16-mixed is refused (the schedule runs backward itself, past the loss
scaler; use bf16-mixed); batches must be ``(inputs, target)`` with the batch size a
multiple of the micro-batch count and the same shape every step.

Example:
    >>> # gpufleet train --nproc 2 --strategy pipeline --parallel.pipeline.schedule gpipe
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpufleet.config import ParallelConfig
from gpufleet.core.tree import map_tensors
from gpufleet.errors import ConfigError
from gpufleet.launch import broadcast_object, gather_objects
from gpufleet.parallel.base import OptimizerSpec, Strategy
from gpufleet.parallel.dims import ParallelDims, StrategyTraits
from gpufleet.parallel.fsdp import fsdp_api
from gpufleet.parallel.pipeline_split import StageSplit, bubble_share
from gpufleet.parallel.tensor import without_strided

log = logging.getLogger(__name__)


class PipelineParallel(Strategy):
    """One pipeline stage per rank, run by a GPipe or 1F1B schedule."""

    name = "pipeline"
    # The stages take the ranks dp_shard leaves (all of them by default); ranks of one
    # pipeline read the same batches, and with dp > 1 parallelize shards each stage.
    traits = StrategyTraits(rest="pp", dims=frozenset({"pp", "dp_replicate", "dp_shard", "tp"}),
                            pipelined=True)
    needs_process_group = True
    # saves_on_every_rank stays False for a pipeline alone: state_dict (a collective,
    # called on every rank) gathers the whole model, and rank 0 writes one ordinary
    # checkpoint file. With dp or tp > 1 every rank writes its shards (__init__).

    def __init__(self, cfg: ParallelConfig, device: torch.device,
                 precision: Any = None, dims: ParallelDims | None = None) -> None:
        super().__init__(cfg, device, precision, dims)
        self.stages = self.dims.pp
        self.microbatches = cfg.pipeline.microbatches
        self.bubble_share = bubble_share(self.stages, self.microbatches)
        if self.dims.dp > 1 or self.dims.tp > 1:
            # Each stage's ranks write their own shards; evaluation forwards all-gather.
            self.saves_on_every_rank = self.eval_in_lockstep = True

    # -- building ------------------------------------------------------------------
    def attach(self, model: nn.Module, stage: StageSplit | None = None) -> None:
        """Build the schedule over ``model``, this rank's stage as parallelize left it
        (sharded when ``dp > 1``), and find its tied parameters. COLLECTIVE: the ties'
        process groups. A hook, not part of the split: the schedule and the ties must
        hold the sharded stage's parameters, which FSDP replaces."""
        from torch.distributed.pipelining import PipelineStage

        assert stage is not None, "parallelize splits a pipelined model before attach"
        self._group, self.rank = stage.group, stage.index
        self._ties = tied_pairs(stage.tied, model, stage.pipelines, self.rank)
        self._head = _LastStageHead(stage.loss)
        self.layers = stage.layers
        self.is_first, self.is_last = self.rank == 0, self.rank == self.stages - 1
        self._stage = PipelineStage(model, self.rank, self.stages, self.device,
                                    group=self._group)
        self._schedule = self._build_schedule()
        self._mb_losses: list[torch.Tensor] = []
        self._loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None
        self._loss_scale = 1.0
        if self.is_first:
            log.info("pipeline: %d stages x %d micro-batches (%s), bubble share %.1f%%; "
                     "stage layers: %s", self.stages, self.microbatches,
                     self.cfg.pipeline.schedule, 100 * self.bubble_share,
                     " | ".join(f"{s[0]}..{s[-1]}" if len(s) > 1 else s[0] for s in self.layers))

    @property
    def pipeline_stage(self) -> Any:
        """This rank's ``torch.distributed.pipelining.PipelineStage`` (built by
        :meth:`attach`), whose micro-batch methods the schedule calls (the arrival
        timer times them)."""
        return self._stage

    def _sync_ties(self, before: list[torch.Tensor | None]) -> None:
        """Sum over the two stages of each tie what this step's backward added to the
        tied parameter's gradient (COLLECTIVE over the pair: one all-reduce)."""
        for (param, group), old in zip(self._ties, before, strict=True):
            assert param.grad is not None, "backward gave each tied parameter a gradient"
            grad = _local(param.grad)
            added = grad - old if old is not None else grad.clone()
            dist.all_reduce(added, group=group)
            grad.copy_(added if old is None else old + added)

    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The global gradient norm; a tied parameter's second copy is left out (its
        gradient is the first copy's), so the norm is the whole model's."""
        from gpufleet.parallel.grad_norm import grad_norm

        copies = {id(p) for p, _ in self._ties if not self.is_first}
        grads = (p.grad for p in model.parameters()
                 if p.grad is not None and id(p) not in copies)
        return grad_norm(grads, self.device, self.dims)

    def _build_schedule(self) -> Any:
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[self.cfg.pipeline.schedule]
        kwargs: dict[str, Any] = {}
        if "scale_grads" in inspect.signature(cls.__init__).parameters:
            # Off: dividing the gradients after every schedule would also shrink the ones
            # accumulated by earlier micro-steps. The loss is scaled instead.
            kwargs["scale_grads"] = False
        return cls(self._stage, n_microbatches=self.microbatches,
                   loss_fn=self._microbatch_loss, **kwargs)

    def setup_optimizer(self, model: nn.Module, spec: OptimizerSpec) -> torch.optim.Optimizer:
        optimizer = spec.build(model)
        names = {id(p): n for n, p in model.named_parameters()}
        own = [(_group_key(g), [names[id(p)] for p in g["params"]])
               for g in optimizer.param_groups]
        self._own_names = [names_ for _, names_ in own]
        # COLLECTIVE (once): every stage's parameter groups, to lay out the full model's
        # optimizer state the way a single process numbers it.
        merged: list[tuple[str, list[str]]] = []
        per_stage = dist.get_world_size() // self.stages  # one part per stage, in order
        for part in gather_objects(own)[::per_stage]:
            for key, group_names in part:
                slot = next((i for i, (k, _) in enumerate(merged) if k == key), None)
                if slot is None:
                    merged.append((key, []))
                    slot = len(merged) - 1
                merged[slot][1].extend(group_names)
        self._layout = [group_names for _, group_names in merged]
        self._slots = [next(i for i, (k, _) in enumerate(merged) if k == key)
                       for key, _ in own]
        return optimizer

    def describe(self) -> dict[str, Any]:
        """The pipeline's shape for the run's report (``bubble_share`` in 0..1)."""
        return {"strategy": self.name, "schedule": self.cfg.pipeline.schedule,
                "stages": self.stages, "microbatches": self.microbatches,
                "bubble_share": self.bubble_share, "stage_layers": self.layers}

    # -- the step --------------------------------------------------------------------
    def forward_backward(self, model: nn.Module, batch: Any,
                         loss_fn: Callable[[nn.Module, Any], torch.Tensor],
                         precision: Any, loss_scale: float,
                         mark: Callable[[], None] | None = None) -> torch.Tensor:
        inputs, target = self._split_batch(batch)
        self._loss_fn, self._loss_scale = loss_fn, loss_scale
        self._mb_losses = []
        before = [None if p.grad is None else _local(p.grad).clone() for p, _ in self._ties]
        # COLLECTIVE: the schedule's point-to-point sends and receives of activations
        # (forward) and their gradients (backward) between neighbouring stages.
        with precision.autocast(), _without_module_tracking():
            if self.is_first and self.is_last:
                self._schedule.step(inputs, target=target)
            elif self.is_first:
                self._schedule.step(inputs)
            elif self.is_last:
                self._schedule.step(target=target)
            else:
                self._schedule.step()
        if self._ties:
            self._sync_ties(before)
        if mark is not None:
            # The schedule interleaves forwards and backwards: phase timing counts all
            # of it as forward.
            mark()
        if self.is_last:
            # The last M: on the first step the schedule also calls the loss once while
            # it infers the shapes of the gradients it will send.
            loss = torch.stack(self._mb_losses[-self.microbatches:]).float().mean()
        else:
            loss = torch.zeros((), device=self.device)
        # COLLECTIVE: the last stage's loss to every rank (one scalar per micro-step).
        dist.broadcast(loss, src=self.global_rank(self.stages - 1), group=self._group)
        return loss

    def _microbatch_loss(self, output: Any, target: Any) -> torch.Tensor:
        """The schedule's loss: the user's loss (through the loop's loss function, with
        the model's output standing in for the model), scaled for the backward."""
        assert self._loss_fn is not None
        loss = self._loss_fn(self._head, (output, target))
        self._mb_losses.append(loss.detach())
        return loss * (self._loss_scale / self.microbatches)

    def _split_batch(self, batch: Any) -> tuple[torch.Tensor, Any]:
        if not (type(batch) in (tuple, list) and len(batch) == 2
                and isinstance(batch[0], torch.Tensor)):
            raise ConfigError(
                f"parallel.strategy = 'pipeline' needs (inputs, target) batches (the first "
                f"stage takes the inputs, the last computes the loss from the target); got "
                f"{type(batch).__name__}. Return (x, y) from your dataset.")
        inputs, target = batch
        if inputs.shape[0] % self.microbatches:
            raise ConfigError(
                f"batch of {inputs.shape[0]} samples does not split into "
                f"parallel.pipeline.microbatches = {self.microbatches} equal micro-batches. "
                "Make data.batch_size a multiple of the micro-batch count.")
        return inputs, target

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # no gradient all-reduce to skip

    def eval_model(self, model: nn.Module) -> nn.Module:
        return _PipelineForward(model, self)

    def global_rank(self, stage: int) -> int:
        """The rank that runs ``stage`` of this rank's pipeline."""
        return stage if self._group is None else dist.get_global_rank(self._group, stage)

    # -- state (COLLECTIVE: every rank calls these) -------------------------------------
    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The full model and optimizer state (as ``single`` saves it), on every rank;
        with FSDP, this rank's shards keyed by the full model's names (every rank
        writes them, see :mod:`gpufleet.train.checkpoint.sharded`)."""
        if self.saves_on_every_rank:
            msd, osd = fsdp_api().get_state_dict(model, optimizer)
            if len(osd["param_groups"]) == len(self._layout):
                # Every stage writes the same groups (the keys are the group numbers): each
                # names the whole model's parameters, of which a stage loads its own.
                osd["param_groups"] = [{**g, "params": self._layout[slot]} for g, slot
                                       in zip(osd["param_groups"], self._slots, strict=True)]
            return without_strided({"model": msd, "optimizer": osd})
        opt = optimizer.state_dict()
        own_state, own_groups = {}, []
        for i, group in enumerate(opt["param_groups"]):
            for index, name in zip(group["params"], self._own_names[i], strict=True):
                if index in opt["state"]:
                    own_state[name] = opt["state"][index]
            own_groups.append((self._slots[i], {k: v for k, v in group.items()
                                                if k != "params"}))
        part = _to_cpu((model.state_dict(), own_state, own_groups))
        full_model: dict[str, Any] = {}
        full_state: dict[int, Any] = {}  # by the parameter's number in the whole model
        groups: list[dict[str, Any] | None] = [None] * len(self._layout)
        number = {name: i for i, name in enumerate(n for g in self._layout for n in g)}
        for model_part, state_part, group_part in gather_objects(part):  # COLLECTIVE
            full_model.update(model_part)
            full_state.update({number[n]: s for n, s in state_part.items()})
            for slot, hyper in group_part:
                groups[slot] = {**hyper, "params": [number[n] for n in self._layout[slot]]}
        full_state = dict(sorted(full_state.items()))
        return {"model": full_model, "optimizer": {"state": full_state, "param_groups": groups}}

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                        state: dict[str, Any]) -> None:
        """Load this stage's share of a full checkpoint (any strategy's)."""
        if self.saves_on_every_rank:
            raise ConfigError("pipeline with parallel.dp_shard > 1 resumes from sharded "
                              "checkpoints (a step-N/ folder); resume this single-file one "
                              "with parallel.dp_shard = 1, then continue from its next "
                              "checkpoint.")
        full = state["model"]
        model.load_state_dict({k: full[k] for k in model.state_dict()})  # KeyError: no fit
        opt = state["optimizer"]
        if len(opt["param_groups"]) != len(self._layout) or any(
                len(g["params"]) != len(names)
                for g, names in zip(opt["param_groups"], self._layout)):
            raise ValueError("the optimizer's parameter groups differ from this model's")
        own: dict[str, Any] = {"state": {}, "param_groups": []}
        number = 0
        for i, slot in enumerate(self._slots):
            group = opt["param_groups"][slot]
            ids = []
            for name in self._own_names[i]:
                saved = group["params"][self._layout[slot].index(name)]
                if saved in opt["state"]:
                    own["state"][number] = opt["state"][saved]
                ids.append(number)
                number += 1
            own["param_groups"].append({**{k: v for k, v in group.items() if k != "params"},
                                        "params": ids})
        optimizer.load_state_dict(own)


class _PipelineForward(nn.Module):
    """Forward through all stages for evaluation; every rank gets the last stage's output.

    COLLECTIVE per call: each stage in turn broadcasts its output (shape first), so the
    next stage can run and, after the last, every rank holds the model's output. Every
    rank must evaluate the same batches (they do: the stages share one data shard).
    Evaluation is rare, so one broadcast per stage (not a send to the next stage only)
    is a fair price for its simplicity.
    """

    def __init__(self, stage: nn.Module, strategy: PipelineParallel) -> None:
        super().__init__()
        self.stage = stage
        self._strategy = strategy

    def forward(self, inputs: torch.Tensor, target: Any = None) -> torch.Tensor:
        """The model's output for ``inputs``; with ``target`` (a loop without a loss
        function calls the model as ``model(inputs, target)``), its loss."""
        s = self._strategy
        hidden = inputs
        for index in range(s.stages):
            if s.rank == index:
                hidden = self.stage(hidden)
                if not isinstance(hidden, torch.Tensor):
                    raise ConfigError(
                        "pipeline evaluation passes one tensor from stage to stage, and "
                        f"stage {index} returned {type(hidden).__name__}. Return a tensor "
                        "from each stage's last layer.")
            src = s.global_rank(index)
            meta = broadcast_object((tuple(hidden.shape), hidden.dtype)
                                    if s.rank == index else None, src=src, group=s._group)
            if s.rank != index:  # (rank ``src`` sent its shape and dtype)
                assert meta is not None
                hidden = torch.empty(meta[0], dtype=meta[1], device=s.device)
            dist.broadcast(hidden, src=src, group=s._group)
        return s._head(hidden, target)


class _LastStageHead(nn.Module):
    """What the loop's loss function calls as "the model" on the last stage, whose
    output the schedule hands over.

    Called with the output alone it returns it, so a loss function of yours computes
    ``loss(output, target)``. Called with the target too, as a loop without a loss
    function calls a model that computes its own loss (``GPT(idx, targets)``), it
    returns the model's ``pipeline_loss(output, target)``: the loss its forward would
    have computed from that output.
    """

    def __init__(self, loss: Callable[[Any, Any], torch.Tensor] | None) -> None:
        super().__init__()
        self._loss = loss

    def forward(self, output: Any, target: Any = None) -> Any:
        if target is None:
            return output
        if self._loss is None:  # the launching process's preflight refuses this first
            raise ConfigError(
                "parallel.strategy = 'pipeline': the last stage returns the model's output, "
                "and this run has no loss function, while the model computes its loss "
                "inside a forward the stages never run whole. Pass a loss function "
                "(--model.loss=package.module:function, loss_fn=... in Python) or give "
                "the model a pipeline_loss(output, target) method.")
        return self._loss(output, target)


@contextlib.contextmanager
def _without_module_tracking() -> Iterator[None]:
    """Pause the module tracker of an active ``FlopCounterMode`` (the loop counts the
    first step's FLOPs). Its gradient hooks break the schedule's ``autograd.grad``
    calls; the FLOPs are still counted, only not attributed to modules."""
    try:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    except ImportError:
        yield
        return
    # A FlopCounterMode's dispatch mode holds the counter (torch's private attribute).
    counters = [getattr(mode, "counter", None) for mode in _get_current_dispatch_mode_stack()]
    trackers = [c.mod_tracker for c in counters if c is not None and hasattr(c, "mod_tracker")]
    for tracker in trackers:
        tracker.__exit__()
    try:
        yield
    finally:
        for tracker in trackers:
            tracker.__enter__()


def tied_pairs(tied: list[tuple[str, str]], stage: nn.Module, pipelines: list[list[int]],
               stage_index: int) -> list[tuple[nn.Parameter, Any]]:
    """``(parameter, process group)`` for each pair of names in ``tied`` (the model's
    ``pipeline_ties()``) that sit on different stages, one of them on this rank's
    ``stage``; the group holds the two stages' ranks of this rank's pipeline.
    COLLECTIVE: every rank creates every pipeline's groups, in the same order."""
    if not tied:
        return []
    held = dict(stage.named_parameters(remove_duplicate=False))
    stage_of = _stage_of_params(pipelines, held)
    ties: list[tuple[nn.Parameter, Any]] = []
    rank = dist.get_rank()
    for a, b in tied:
        first, last = stage_of(a), stage_of(b)
        if first == last:
            continue
        for ranks in pipelines:  # COLLECTIVE: one new group per pipeline, on every rank
            group = dist.new_group([ranks[first], ranks[last]])
            if rank in (ranks[first], ranks[last]):
                ties.append((held[a if stage_index == first else b], group))
    return ties


def _stage_of_params(pipelines: list[list[int]],
                     held: dict[str, nn.Parameter]) -> Callable[[str], int]:
    """Which stage holds a parameter name: every rank learns the stages' names once
    (COLLECTIVE over all ranks: one gather of names)."""
    names = gather_objects(sorted(held))
    by_rank = {r: set(n) for r, n in enumerate(names)}
    ranks = next(p for p in pipelines if dist.get_rank() in p)

    def stage_of(name: str) -> int:
        return next(i for i, r in enumerate(ranks) if name in by_rank[r])

    return stage_of


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local part of a DTensor (sharing its storage), or the tensor itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _group_key(group: dict[str, Any]) -> str:
    """A parameter group's settings (its identity across stages), as text."""
    return repr(sorted((k, v) for k, v in group.items() if k != "params"))


def _to_cpu(obj: Any) -> Any:
    return map_tensors(obj, lambda t: t.detach().cpu())
