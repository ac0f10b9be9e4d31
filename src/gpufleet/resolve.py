"""A config resolved for this machine and world: every ``auto`` replaced, every
combination checked.

:func:`gpufleet.plan.make_plan` calls it once per run (in the launching process, or at
each rank's entry under torchrun, SLURM or mpirun) and keeps the result in the run's
plan; the result is what a run writes to its directory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from gpufleet.config import Config, ParallelConfig
from gpufleet.config.distributed import AUTO_SNAPSHOT_EVERY
from gpufleet.core.machine import default_num_workers
from gpufleet.errors import ConfigError
from gpufleet.launch.rendezvous import parse_nnodes
from gpufleet.parallel import strategy_class
from gpufleet.parallel.base import why_not_in_process
from gpufleet.parallel.dims import DIMS, ParallelDims, auto_preset, plan_for

__all__ = ["Machine", "auto_precision", "auto_tf32", "recipe_preset", "resolve",
           "resolve_with_dims", "strategy_for"]


@dataclass(frozen=True)
class Machine:
    """What the config is checked against: the devices this process can see."""

    cuda: bool
    gpus: int
    bf16: bool

    @classmethod
    def detect(cls) -> Machine:
        import torch

        cuda = torch.cuda.is_available()
        bf16 = False
        if cuda:
            try:  # native bf16 only: V100/T4 merely emulate it, slowly
                bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
            except TypeError:  # torch without the keyword
                bf16 = torch.cuda.is_bf16_supported()
        return cls(cuda=cuda, gpus=torch.cuda.device_count() if cuda else 0, bf16=bf16)


def strategy_for(par: ParallelConfig, world_size: int) -> str:
    """The strategy the ``[parallel]`` section means for a run of ``world_size`` ranks
    (the one place that decides ``auto``): the one named, as named (degrees it cannot
    use are then refused, never answered with another preset); for ``auto``, the preset
    the degrees given need (:func:`gpufleet.parallel.dims.auto_preset`: ``pipeline``
    for ``pp > 1``, else ``fsdp`` for ``dp_shard > 1``), else ``ddp`` on several ranks
    and ``single`` on one.

    Example:
        >>> from gpufleet.config import ParallelConfig
        >>> strategy_for(ParallelConfig(), 1), strategy_for(ParallelConfig(), 4)
        ('single', 'ddp')
        >>> strategy_for(ParallelConfig(dp_shard=2, tp=2, pp=2), 8)
        'pipeline'
        >>> strategy_for(ParallelConfig(strategy="ddp", pp=2), 2)  # refused by plan_for
        'ddp'
    """
    if par.strategy != "auto":
        return par.strategy
    return auto_preset({n: getattr(par, n) for n in DIMS}, world_size)


def recipe_preset(cfg: Config, model: Any = None, own_loop: bool = False) -> str:
    """The recipe preset (``optim.preset``) as far as it is known before the model is
    built: the one named; else by the model :func:`gpufleet.fit` was given; ``gpt`` for
    the built-in GPT; ``none`` for your own loop (:class:`gpufleet.Fleet`); ``auto``
    for a factory's model, whose optimizer preset is decided when it is built (its
    precision and TF32 are then those of your model: fp32 and torch's, also when the
    factory returns gpufleet's GPT; ``optim.preset = gpt`` asks for the GPT's).

    Example:
        >>> from gpufleet.config import load_config
        >>> recipe_preset(load_config()), recipe_preset(load_config(), own_loop=True)
        ('gpt', 'none')
    """
    if cfg.optim.preset != "auto":
        return cfg.optim.preset
    if own_loop:
        return "none"
    if model is not None:
        from gpufleet.models import model_preset

        return model_preset(model)
    return "gpt" if cfg.model.name == "gpt" else "auto"


def auto_precision(preset: str, device: str, bf16: bool) -> str:
    """``precision.mode = auto``: bf16-mixed for the built-in GPT's recipe (the ``gpt``
    preset) on a GPU with native bf16; otherwise fp32, as your own script computes (the
    diagnosis says when bf16-mixed would be faster).

    Example:
        >>> auto_precision("gpt", "cuda", True), auto_precision("none", "cuda", True)
        ('bf16-mixed', 'fp32')
    """
    return "bf16-mixed" if preset == "gpt" and device == "cuda" and bf16 else "fp32"


def auto_tf32(preset: str, device: str) -> str:
    """``perf.tf32 = auto``: ``true`` for the built-in GPT's recipe on a GPU; otherwise
    ``default``, torch's flags as torch or your script set them.

    Example:
        >>> auto_tf32("gpt", "cuda"), auto_tf32("none", "cuda"), auto_tf32("gpt", "cpu")
        ('true', 'default', 'default')
    """
    return "true" if preset == "gpt" and device == "cuda" else "default"


def resolve(cfg: Config, machine: Machine, world_size: int, local_world_size: int = 1,
            *, model: Any = None, own_loop: bool = False) -> Config:
    """Replace every ``auto`` by its value on this machine and check the combinations
    (``model``, ``own_loop``: as :func:`recipe_preset` takes them).

    The result is what a run writes to its directory, so a rerun from that file does
    not depend on which machine it lands on.
    """
    return resolve_with_dims(cfg, machine, world_size, local_world_size, model=model,
                             own_loop=own_loop)[0]


def resolve_with_dims(cfg: Config, machine: Machine, world_size: int,
                      local_world_size: int = 1, *, model: Any = None,
                      own_loop: bool = False) -> tuple[Config, ParallelDims]:
    """:func:`resolve`, and the mesh degrees it checked (``parallel.*`` for this world)."""
    run, prec, par, dist = cfg.run, cfg.precision, cfg.parallel, cfg.dist
    preset = recipe_preset(cfg, model, own_loop)
    device = run.device if run.device != "auto" else ("cuda" if machine.cuda else "cpu")
    if device == "cuda" and not machine.cuda:
        raise ConfigError("run.device = 'cuda' but no CUDA GPU is visible. "
                          "Use run.device=cpu, or check CUDA_VISIBLE_DEVICES and the driver "
                          "(`nvidia-smi`).")
    mode = prec.mode
    if mode == "auto":
        mode = auto_precision(preset, device, machine.bf16)
    tf32 = cfg.perf.tf32 if cfg.perf.tf32 != "auto" else auto_tf32(preset, device)
    if mode == "bf16-mixed" and device == "cuda" and not machine.bf16:
        raise ConfigError("precision.mode = 'bf16-mixed' but this GPU has no bf16 support. "
                          "Use precision.mode=fp16-mixed (with loss scaling) or fp32.")
    strategy = strategy_for(par, world_size)
    # The strategy's traits answer how many processes, which device and backend, and
    # which mesh degrees (gpufleet.parallel.dims).
    traits = strategy_class(strategy).traits
    if traits.needs_cuda and device != "cuda":
        wraps = f" ({traits.wraps})" if traits.wraps else ""
        raise ConfigError(f"parallel.strategy = {strategy!r}{wraps} needs CUDA GPUs, and none "
                          "is in use. Use parallel.strategy=ddp with --nproc N (runs on CPU with "
                          "gloo), or single.")
    dims = plan_for(dataclasses.replace(par, strategy=strategy), traits, world_size,
                    local_world_size)
    _check_tensor_split(cfg, dims)
    if traits.copies_module_each_step and cfg.perf.compile:
        raise ConfigError("perf.compile with parallel.strategy = 'dp': nn.DataParallel "
                          "copies the module to every GPU each step, which a compiled module "
                          "does not survive. Use parallel.strategy=ddp (one process per GPU).")
    if run.deterministic and cfg.perf.cudnn_benchmark:
        raise ConfigError("run.deterministic and perf.cudnn_benchmark contradict each other: "
                          "benchmarking picks algorithms by timing. Turn one of them off.")
    backend = traits.backend or dist.backend
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and device != "cuda":
        raise ConfigError("dist.backend = 'nccl' needs CUDA GPUs. Use dist.backend=gloo "
                          "(or auto) on CPU.")
    max_steps = run.max_steps
    if max_steps == -1:  # the default: 600 steps, unless epochs say when to stop
        max_steps = 600 if run.max_epochs == 0 else 0
    if max_steps == 0 and run.max_epochs == 0:
        raise ConfigError("run.max_steps = 0 and run.max_epochs = 0: the run would never end. "
                          "Set --max-steps N or --max-epochs N.")
    if par.ddp.comm_hook != "none" and not traits.comm_hooks:
        raise ConfigError(f"parallel.ddp.comm_hook = {par.ddp.comm_hook!r} compresses ddp's "
                          f"gradient all-reduce, but the strategy is {strategy!r}. Use "
                          "--strategy ddp, or parallel.ddp.comm_hook=none.")
    if par.ddp.comm_hook == "bf16" and backend != "nccl":
        raise ConfigError("parallel.ddp.comm_hook = 'bf16': torch's bf16 hook needs NCCL "
                          f"(CUDA GPUs), and this run uses {backend}. Use "
                          "parallel.ddp.comm_hook=fp16 (the same bytes) or powersgd.")
    workers = cfg.data.num_workers
    if workers < 0:
        workers = default_num_workers(device, local_world_size)
    snapshot_every = cfg.fault.snapshot_every
    if snapshot_every < 0:
        snapshot_every = auto_snapshot_every(cfg, device, strategy, dims)
    resolved = dataclasses.replace(
        cfg,
        run=dataclasses.replace(run, device=device, max_steps=max_steps),
        data=dataclasses.replace(cfg.data, num_workers=workers),
        precision=dataclasses.replace(prec, mode=mode),
        parallel=dataclasses.replace(par, strategy=strategy),
        dist=dataclasses.replace(dist, backend=backend),
        fault=dataclasses.replace(cfg.fault, snapshot_every=snapshot_every),
        perf=dataclasses.replace(cfg.perf, tf32=tf32),
    )
    return resolved, dims


def auto_snapshot_every(cfg: Config, device: str, strategy: str, dims: ParallelDims) -> int:
    """``fault.snapshot_every = -1`` (auto): in-memory snapshots every
    :data:`AUTO_SNAPSHOT_EVERY` steps where a lost node is then recovered in process
    and their cost was measured within budget, else 0. That is an elastic node range
    (``dist.nnodes`` MIN:MAX: the ranks left may go on) on CPUs, with ddp, fsdp or hsdp
    (+0.4-1.5% per step on the GPT default job). GPUs: 0 until the CUDA path (pinned
    buffers, a side stream, NCCL's abort) is measured.

    Example:
        >>> from gpufleet.config import Config, DistConfig
        >>> from gpufleet.parallel.dims import ParallelDims
        >>> def auto(nnodes, device="cpu"):
        ...     cfg = Config(dist=DistConfig(nnodes=nnodes))
        ...     return auto_snapshot_every(cfg, device, "ddp", ParallelDims(dp_replicate=4))
        >>> auto("1:2"), auto("2"), auto("1"), auto("1:2", "cuda")
        (10, 0, 0, 0)
    """
    fewest, most = parse_nnodes(cfg.dist.nnodes)
    if fewest == most or device != "cpu" or not cfg.fault.recover_in_process \
            or cfg.data.batching == "tokens":
        return 0
    cls = strategy_class(strategy)
    reason = why_not_in_process(cls, dims, reshards=cls.traits.data_parallel == "shard")
    return 0 if reason else AUTO_SNAPSHOT_EVERY


def _check_tensor_split(cfg: Config, dims: ParallelDims) -> None:
    """The built-in GPT gives every tensor parallel rank whole attention heads: a ``tp``
    that does not divide ``model.n_head`` fails here, before any rank starts."""
    model, tp = cfg.model, dims.tp
    if tp <= 1 or model.name != "gpt" or model.n_head % tp == 0:
        return
    fits = max(d for d in range(1, tp) if model.n_head % d == 0)
    raise ConfigError(
        f"parallel.tp = {tp} does not divide model.n_head = {model.n_head}: tensor "
        f"parallelism gives every tp rank whole attention heads. Use parallel.tp = {fits} "
        f"(a divisor of {model.n_head}), or model.n_head = "
        f"{model.n_head + (-model.n_head) % tp} (and n_embd a multiple of it).")
