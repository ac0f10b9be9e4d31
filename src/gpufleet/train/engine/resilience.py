"""What a run keeps to survive a lost node: its in-memory snapshots
(``fault.snapshot_every``) and its in-process recovery, for the ranks left after a loss
and for a node that joins (``fault.recover_in_process``). ``build_run`` makes them; the
models' :class:`~gpufleet.train.recovery.reshard.Source` (fsdp, hsdp) is kept where each model is
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

log = logging.getLogger(__name__)


def recovery_of(run: Run, join: Any, backend: str) -> Any:
    """In-process recovery from the snapshots after a lost node, and for nodes that join
    (``fault.recover_in_process``), where the run can have it; None otherwise. ``join``:
    this rank's place among the live ranks it joins (None: it started with them)."""
    fault, env = run.cfg.fault, run.env
    if not (fault.recover_in_process and run.monitors.snapshots is not None
            and (is_initialized() or join is not None)):
        return None
    from gpufleet.train.recovery.growing import Growing
    from gpufleet.train.recovery.recovery import Recovery, not_replicated

    reason = not_replicated(run.strategy, run.stream.sampler, rebuilt_from_sources(run.parts),
                            run.cfg.dist.nnodes)
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


def snapshots_of(run: Run) -> SnapshotCallback | None:
    """In-memory snapshots of this rank's state (``fault.snapshot_every``), captured
    with the checkpointer's own state functions; None where the run has none (your
    own loop's, which saves through ``Fleet.save``)."""
    saver, stream = run.checkpointer, run.data
    if saver is None or stream is None:
        return None

    def capture() -> tuple[dict[str, Any], set[int]]:
        at = Position(run.state.step, stream.epoch, stream.consumed)
        return saver.rank_state(at), saver.optimizer_storages()

    env, dims, traits = run.env, run.strategy.dims, run.strategy.traits
    whole = (traits.data_parallel == "replicate" and dims.world_size == dims.dp_replicate
             and not traits.consolidates_optimizer)  # ddp: each rank its own whole copy
    return SnapshotCallback(run.cfg.fault.snapshot_every, capture, rank=env.rank,
                            world_size=env.world_size, node_rank=env.node_rank,
                            local_rank=env.local_rank, device=run.device,
                            timeout_s=run.cfg.dist.timeout, send=not whole)
