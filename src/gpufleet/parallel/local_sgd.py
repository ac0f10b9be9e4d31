"""``local_sgd``: each rank steps on its own gradients; the models are averaged now and then.

Plain DDP all-reduces every gradient every step. Local SGD (post-local SGD, Lin et al.
2018) lets every rank take optimizer steps on its own gradients and averages the
*parameters* every ``parallel.local_sgd.period`` steps with torch's ``PeriodicModelAverager``:
one all-reduce of the parameters per period instead of one of the gradients per step.

Hierarchical averaging (``parallel.local_sgd.inter_node_period > 0``) uses torch's
``HierarchicalModelAverager``: the ranks of a node (``LOCAL_WORLD_SIZE`` consecutive
ranks) average every ``parallel.local_sgd.period`` steps over the fast intra-node links, and all
ranks average every ``parallel.local_sgd.inter_node_period`` steps over the network.

Collectives, in order:

* steps ``< local_sgd_warmup_steps``: DDP's gradient all-reduce during backward, exactly
  as ``ddp`` (the models stay identical; averaging is skipped);
* later steps: no gradient communication at all (the DDP communication hook returns the
  local gradients untouched), and right after ``optimizer.step()`` (an optimizer step
  hook) on the steps the period selects, one all-reduce (average) of the parameters over
  the node or over all ranks. Steps the loop skips (non-finite) average nothing.

With period 1 and a linear optimizer (SGD with momentum and weight decay) this gives
exactly ``ddp``'s parameters. With AdamW, or with gradient clipping (each rank clips its
own gradients), the averaged models differ from ddp's by design. Buffers (BatchNorm
statistics) are not averaged; with ``broadcast_buffers`` DDP copies rank 0's every
forward. Between averaging steps the ranks hold different models: the checkpoint holds
rank 0's.

Example:
    >>> from gpufleet.parallel.local_sgd import averaging_plan
    >>> dict(averaging_plan(period=4, inter_node_period=16, world_size=16,
    ...                     local_world_size=8))
    {4: 8, 16: 16}
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from gpufleet.errors import ConfigError
from gpufleet.launch import DistEnv
from gpufleet.parallel.base import OptimizerSpec
from gpufleet.parallel.ddp import DistributedDataParallel
from gpufleet.parallel.dims import StrategyTraits

log = logging.getLogger(__name__)


class LocalSGD(DistributedDataParallel):
    """DDP without per-step gradient all-reduce after warm-up, plus model averaging."""

    name = "local_sgd"
    # DDP-wrapped by parallelize; no per-step gradient all-reduce after the warm-up.
    traits = StrategyTraits(data_parallel="replicate")

    def attach(self, model: nn.Module, stage: Any = None) -> None:
        """Put the warm-up-then-local communication hook on the DDP wrapper ``model``
        and build the model averager (COLLECTIVE when hierarchical: the intra-node
        groups). A hook here, not in the optimizer: it must sit on the wrapper."""
        from torch.distributed.algorithms.model_averaging.averagers import (
            PeriodicModelAverager,
        )
        from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
            HierarchicalModelAverager,
        )

        assert isinstance(model, DDP), "parallelize wraps local_sgd's model in DDP first"
        cfg, env = self.cfg, DistEnv.detect()
        self._state = _HookState(warmup_steps=cfg.local_sgd.warmup_steps)
        model.register_comm_hook(self._state, _local_after_warmup_hook)
        plan = averaging_plan(cfg.local_sgd.period, cfg.local_sgd.inter_node_period,
                              env.world_size, env.local_world_size)
        # The averagers count their own steps; their warm-up matches the hook's, so the
        # first averaging comes on the first step without a gradient all-reduce.
        if len(plan) == 1:
            self.averager: Any = PeriodicModelAverager(
                period=cfg.local_sgd.period, warmup_steps=cfg.local_sgd.warmup_steps)
        else:
            # COLLECTIVE (once): every rank creates the intra-node subgroups.
            self.averager = HierarchicalModelAverager(
                period_group_size_dict=plan, warmup_steps=cfg.local_sgd.warmup_steps)
        if env.is_main:
            levels = ", ".join(f"{size} ranks every {period} step(s)"
                               for period, size in plan.items())
            log.info("local_sgd: gradient all-reduce for %d warm-up step(s), then model "
                     "averaging over %s", cfg.local_sgd.warmup_steps, levels)

    def keeps_optimizer(self) -> bool:
        return False  # it builds its own around the optimizer (or hooks it)

    def setup_optimizer(self, model: nn.Module, spec: OptimizerSpec) -> torch.optim.Optimizer:
        optimizer = super().setup_optimizer(model, spec)
        params = list(self.unwrap(model).parameters())
        # Right after optimizer.step(), while the gradients still exist: torch's
        # averagers average only parameters that have a gradient, and the loop zeroes
        # them (set to None) before after_optimizer_step.
        optimizer.register_step_post_hook(lambda *_: self._average(params))
        self._step = 0
        return optimizer

    def _average(self, params: list[nn.Parameter]) -> None:
        # The averager counts the loop's steps (see after_optimizer_step).
        self.averager.step = self._step
        # COLLECTIVE on the steps the period selects: all-reduce (average) of the
        # parameters over the node's ranks or over all ranks.
        self.averager.average_parameters(params)

    def after_optimizer_step(self, model: nn.Module, step: int) -> None:
        # The hook and the averager decide the next step by the loop's step count.
        self._step = self._state.step = step + 1

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                        state: dict[str, Any]) -> None:
        super().load_state_dict(model, optimizer, state)
        # A resumed run goes on where the saved one stopped: its first step must not
        # fall back into the warm-up's gradient all-reduce or shift the averaging phase.
        self._step = self._state.step = int(state.get("step", 0))

    def describe(self) -> dict[str, Any]:
        """Settings worth a line in the run's report."""
        cfg = self.cfg
        return {"strategy": self.name, "local_sgd_period": cfg.local_sgd.period,
                "local_sgd_inter_node_period": cfg.local_sgd.inter_node_period,
                "local_sgd_warmup_steps": cfg.local_sgd.warmup_steps}


class _HookState:
    """What the communication hook needs: the optimizer step it is in."""

    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = warmup_steps
        self.step = 0


# DDP refuses a hook whose `bucket` or return annotation is not the exact object (as text
# under `from __future__ import annotations` they never are): those two stay bare.
def _local_after_warmup_hook(state: _HookState, bucket):
    """DDP communication hook: average the gradients like plain DDP during warm-up, and
    afterwards hand back this rank's own gradients without any communication."""
    if state.step < state.warmup_steps:
        # COLLECTIVE (warm-up only). torch annotates the group as a ProcessGroup; its body
        # takes None as the default (WORLD) group.
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def averaging_plan(period: int, inter_node_period: int, world_size: int,
                   local_world_size: int) -> OrderedDict[int, int]:
    """``{period: group size}`` for torch's model averagers, smallest period first.

    Args:
        period: steps between averaging within a node (or over all ranks when flat).
        inter_node_period: steps between averaging over all ranks (0: flat averaging).
        world_size: ranks in the job.
        local_world_size: ranks on each node.

    Raises:
        ConfigError: the periods or the node layout cannot form a hierarchy.

    Example:
        >>> dict(averaging_plan(period=2, inter_node_period=0, world_size=4,
        ...                     local_world_size=4))
        {2: 4}
    """
    if period < 1:
        raise ConfigError(f"parallel.local_sgd.period = {period}: must be at least 1.")
    if not inter_node_period:
        return OrderedDict([(period, world_size)])
    if inter_node_period <= period or inter_node_period % period:
        raise ConfigError(
            f"parallel.local_sgd.inter_node_period = {inter_node_period} must be a multiple "
            f"of parallel.local_sgd.period = {period} and larger than it (e.g. "
            f"{period * 4}): the ranks of a node average every {period} step(s), all ranks "
            "less often.")
    if world_size % local_world_size:
        raise ConfigError(
            f"hierarchical local_sgd needs the same number of ranks on every node: "
            f"{world_size} ranks do not split into nodes of {local_world_size}. Start the "
            "same --nproc on every node, or set parallel.local_sgd.inter_node_period=0.")
    if local_world_size == world_size:
        log.warning("local_sgd: one node only, so the inter-node period %d adds nothing; "
                    "averaging over all %d ranks every %d step(s)", inter_node_period,
                    world_size, period)
        return OrderedDict([(period, world_size)])
    return OrderedDict([(period, local_world_size), (inter_node_period, world_size)])
