"""What a run keeps to survive a lost node: its in-memory snapshots
(``fault.snapshot_every``) and its in-process recovery, for the ranks left after a loss
and for a node that joins (``fault.recover_in_process``). ``build_run`` makes them over
the built-in loop's state (:class:`BuiltInLoopState`: its checkpointer and training
stream); your own loop's (``Fleet``) over the state it registered; the models'
:class:`~gpufleet.train.recovery.reshard.Source` (fsdp, hsdp) is kept where each model is
placed."""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from gpufleet.errors import ConfigError
from gpufleet.fault.snapshot import SnapshotCallback
from gpufleet.launch import is_initialized, job_store
from gpufleet.train.checkpoint.checkpointer import Position
from gpufleet.train.engine.run import Run
from gpufleet.train.recovery.reshard import rebuilt_from_sources
from gpufleet.train.seed import seed_everything

log = logging.getLogger(__name__)


class BuiltInLoopState:
    """The built-in loop's state, as snapshots capture it and recovery restores it (a
    :class:`~gpufleet.train.recovery.loopstate.LoopState`): the checkpointer's own state
    functions (:meth:`~gpufleet.train.checkpoint.checkpointer.Checkpointer.rank_state`,
    ``restore``) and the training stream's position."""

    def __init__(self, run: Run) -> None:
        self.run = run

    @property
    def boundary_at_step_end(self) -> bool:
        return True  # the loop steps its schedule inside the step

    @property
    def sampler(self) -> Any:
        return self.run.stream.sampler

    def capture(self) -> dict[str, Any]:
        run = self.run
        at = Position(run.state.step, run.stream.epoch, run.stream.consumed)
        return run.saver.rank_state(at)

    def storages(self) -> set[int]:
        return self.run.saver.optimizer_storages()

    def wait(self) -> None:
        self.run.saver.wait()

    def regroup(self, rank: int, shard: int, shards: int, copies: int) -> None:
        run, saver, first = self.run, self.run.saver, self.run.parts[0]
        saver.env = run.env
        saver.model, saver.optimizer = first.model, first.optimizer
        saver.scheduler = first.scheduler
        saver.regroup()  # COLLECTIVE where sharded writes have a group
        if run.evaluator is not None:
            run.evaluator.model = first.model
            run.evaluator.reshard(shard, shards)  # its sampler's, or a stream's share
        run.stream.reshard(rank, shard, shards, copies)

    def restore(self, state: dict[str, Any], source: str) -> int:
        run = self.run
        at = run.saver.restore(state, source)
        # As a run resumed at another world size: this rank's seed, as build_run sets it.
        seed_everything(run.cfg.run.seed + run.env.rank)
        run.state.step = at.step  # before the stream starts: its ledger records the step
        run.stream.start(at.epoch, at.consumed)
        return at.step


def recovery_of(run: Run, join: Any, backend: str) -> Any:
    """In-process recovery from the snapshots after a lost node, and for nodes that join
    (``fault.recover_in_process``), where the run can have it; None otherwise. ``join``:
    this rank's place among the live ranks it joins (None: it started with them)."""
    fault, env, loop = run.cfg.fault, run.env, run.loop_state
    if not (fault.recover_in_process and run.monitors.snapshots is not None
            and loop is not None and (is_initialized() or join is not None)):
        return None
    from gpufleet.train.recovery.growing import Growing
    from gpufleet.train.recovery.recovery import Recovery

    reason = why_not_in_process(run)
    if join is not None:
        if reason:  # the live ranks' agent offered; they cannot have built a Recovery
            raise ConfigError(f"rank {env.rank} cannot join the live ranks: {reason}")
        recovery = Recovery(run, None, backend)
    elif reason:
        if env.is_main:
            log.info("a lost node is recovered by the elastic agent's restart from the "
                     "newest checkpoint, not in process: %s", reason)
        return None
    else:
        recovery = Recovery(run, job_store(), dist.get_backend())
    recovery.growing = Growing(recovery, join)  # takes new ranks in, or joins live ones
    return recovery


def why_not_in_process(run: Run) -> str:
    """Why this run's ranks left after a lost node cannot go on in process ("" when
    they can: see :func:`~gpufleet.train.recovery.recovery.not_replicated`)."""
    from gpufleet.train.recovery.recovery import not_replicated

    sampler = run.loop_state.sampler if run.loop_state is not None else None
    return not_replicated(run.strategy, sampler, rebuilt_from_sources(run.parts),
                          run.cfg.dist.nnodes)


def snapshots_of(run: Run) -> SnapshotCallback | None:
    """In-memory snapshots of this rank's state (``fault.snapshot_every``), captured by
    the loop's state (``run.loop_state``); None where the run has none (your own loop,
    before it registered its state, or where a lost node is not recovered in process)."""
    loop = run.loop_state
    if loop is None:
        return None

    def capture() -> tuple[dict[str, Any], set[int]]:
        return loop.capture(), loop.storages()

    env, dims, traits = run.env, run.strategy.dims, run.strategy.traits
    whole = (traits.data_parallel == "replicate" and dims.world_size == dims.dp_replicate
             and not traits.consolidates_optimizer)  # ddp: each rank its own whole copy
    return SnapshotCallback(run.cfg.fault.snapshot_every, capture, rank=env.rank,
                            world_size=env.world_size, node_rank=env.node_rank,
                            local_rank=env.local_rank, device=run.device,
                            timeout_s=run.cfg.dist.timeout, send=not whole,
                            at_next_step=not loop.boundary_at_step_end)


def steps_again(run: Run) -> None:
    """After an in-process recovery, before the steps begin again (both loops): the
    time since the last step's phase marks is no step's phase, and a sample of the
    operators' time under way is dropped."""
    if run.monitors.phase_timer is None:
        return
    run.phases.hand_over()
    run.monitors.phase_timer.restart()
    if run.monitors.op_clock is not None:
        run.monitors.op_clock.drop()
