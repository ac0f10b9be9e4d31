"""This process as a rank of the job: its process group, its GPU."""

from __future__ import annotations

import torch

from gpufleet.errors import ConfigError
from gpufleet.fault.ncclenv import apply_nccl_defaults
from gpufleet.launch import DistEnv, init_process_group, is_initialized
from gpufleet.plan import RunPlan


def join_process_group(plan: RunPlan, env: DistEnv) -> None:
    """Join the job's process group with the plan's backend, if this process is one of
    several ranks and has not joined it yet.

    Done before anything else (also before the job builds its data), so that
    ``rank_zero_first`` and every collective work from the start.
    """
    if not env.is_distributed or is_initialized():
        return
    cfg = plan.cfg
    # The plan chose it: nccl on CUDA, gloo on CPU and under Horovod.
    if "nccl" in plan.backend:
        apply_nccl_defaults(cfg.run.dir or None)  # flight recorder, dump on timeout
    init_process_group(env, plan.backend, cfg.dist.init_method, cfg.dist.timeout)


def local_gpu_index(env: DistEnv) -> int:
    """This rank's GPU: its local rank, or 0 when the launcher gave it a single GPU
    (SLURM's --gpus-per-task=1 shows each task one device, whatever its local rank)."""
    count = torch.cuda.device_count()
    if count == 1:
        return 0
    if env.local_rank >= count:
        raise ConfigError(
            f"local rank {env.local_rank} has no GPU: only {count} visible. Start at most "
            "that many ranks per node (--nproc), or check CUDA_VISIBLE_DEVICES."
        )
    return env.local_rank
