"""The run's plan: its config resolved once, with who starts the ranks and how many.

:func:`make_plan` is the one place a config is resolved. The process that starts the
ranks (``gpufleet train``, :func:`gpufleet.fit`) makes the plan and sends it to every
rank; the ranks build from it (:func:`gpufleet.entry.run_rank`) and resolve nothing
again. Under torchrun, SLURM or mpirun no process of ours starts the ranks: each rank
makes the plan once at its entry, from the same config, machine and world, so every
rank gets the same plan.

Example:
    >>> from gpufleet.config import load_config
    >>> from gpufleet.launch import DistEnv
    >>> plan = make_plan(load_config(overrides=["run.device=cpu", "model.name=gpt"]),
    ...                  DistEnv.detect({}))
    >>> plan.launcher, plan.world_size, plan.strategy, plan.name
    ('none', 1, 'single', 'gpt-stdlib')
"""

from __future__ import annotations

import dataclasses
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufleet.config import Config
from gpufleet.errors import ConfigError
from gpufleet.launch import DistEnv
from gpufleet.launch.env import launched_layout
from gpufleet.launch.rendezvous import parse_nnodes
from gpufleet.parallel import strategy_class
from gpufleet.parallel.dims import ParallelDims
from gpufleet.resolve import Machine, resolve_with_dims

__all__ = ["RunPlan", "make_plan", "named", "run_name"]

#: Who starts the ranks: torch's elastic agent, torch.multiprocessing, nobody (this
#: process is the one rank), or a launcher outside gpufleet (torchrun, SLURM, mpirun).
LAUNCHERS = ("elastic", "spawn", "none", "external")


@dataclass(frozen=True)
class RunPlan:
    """Everything decided about a run before any rank builds it (immutable).

    Attributes:
        cfg: the config with every ``auto`` decided (device, precision, strategy,
            backend, ``max_steps``, ``num_workers``, ``dist.nproc`` and
            ``dist.launcher`` when a process of ours starts the ranks) and ``run.name``
            set; ``run.dir`` too once the launching process chose the directory (else
            rank 0 chooses it while building). This is what config.toml records.
        launcher: one of :data:`LAUNCHERS`.
        nproc: ranks on each node.
        nnodes: nodes, ``"N"`` or ``"MIN:MAX"``.
        node_rank: this node's rank (static multi-node runs).
        world_size: ranks in the run (with ``MIN:MAX`` nodes: at most this many).
        local_world_size: ranks on this node.
        dims: the mesh degrees (pp x dp_replicate x dp_shard x tp) for ``world_size``.
    """

    cfg: Config
    launcher: str
    nproc: int
    nnodes: str
    node_rank: int
    world_size: int
    local_world_size: int
    dims: ParallelDims

    @property
    def device(self) -> str:
        """``cuda`` or ``cpu``."""
        return self.cfg.run.device

    @property
    def precision(self) -> str:
        """The precision mode, e.g. ``bf16-mixed``."""
        return self.cfg.precision.mode

    @property
    def backend(self) -> str:
        """The process-group backend, ``nccl`` or ``gloo``."""
        return self.cfg.dist.backend

    @property
    def strategy(self) -> str:
        """The parallel strategy's name (never ``auto``)."""
        return self.cfg.parallel.strategy

    @property
    def name(self) -> str:
        """The run's name."""
        return self.cfg.run.name

    @property
    def run_dir(self) -> str:
        """The run directory, or ``""`` while rank 0 has yet to choose it."""
        return self.cfg.run.dir

    def with_config(self, cfg: Config) -> RunPlan:
        """This plan with the config the launching process completed (its run
        directory, the checkpoint to resume): nothing is resolved again."""
        return dataclasses.replace(self, cfg=cfg)

    def for_world(self, env: DistEnv) -> RunPlan:
        """The plan for the world this rank finds itself in: this plan when the world is
        the planned one. Only an elastic run whose node count changed (``MIN:MAX``) or a
        plan made for another world is planned again, for the ranks there are."""
        if (env.world_size, env.local_world_size) == (self.world_size,
                                                      self.local_world_size):
            return self
        return _plan_for_world(self.cfg, Machine.detect(), self.launcher, env)


def run_name(cfg: Config, model: Any = None) -> str:
    """The run's name: ``run.name`` when set, else one made from what is trained.

    From the config: the model and data factories' function names (``gpt-stdlib``,
    ``resnet18-fakedata``). For a module passed to :func:`gpufleet.fit`: its class
    name (``mlp``), or the script's name when the class is one of torch's own
    (``nn.Sequential``).

    Example:
        >>> from gpufleet.config import load_config
        >>> run_name(load_config(overrides={"model.name": "nets:resnet18",
        ...                                 "data.name": "vision:FakeData"}))
        'resnet18-fakedata'
    """
    if cfg.run.name:
        return cfg.run.name
    if model is None:
        name = "-".join(_factory_word(n) for n in (cfg.model.name, cfg.data.name))
    elif isinstance(model, dict):  # several models: their names (generator-discriminator)
        name = "-".join(map(str, model))
    elif type(model).__module__.startswith("torch."):
        script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else ""
        name = script if script and script not in ("-c", "__main__") else "fit"
    else:
        name = type(model).__name__
    return re.sub(r"[^a-z0-9_.-]+", "-", name.lower()).strip("-.") or "run"


def named(cfg: Config, model: Any = None) -> Config:
    """``cfg`` with ``run.name`` set (see :func:`run_name`)."""
    if cfg.run.name:
        return cfg
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=run_name(cfg, model)))


def _factory_word(spec: str) -> str:
    """``mypkg.nets:resnet18`` -> ``resnet18``; built-in names stay as they are."""
    return spec.rpartition(":")[2].rpartition(".")[2] or spec


def make_plan(cfg: Config, env: DistEnv | None = None, *, model: Any = None,
              machine: Machine | None = None, here: bool = False,
              own_loop: bool = False) -> RunPlan:
    """Resolve ``cfg`` once into the run's plan (the one resolve of a run).

    Args:
        cfg: the run's config as the user gave it.
        env: this process's place in the job (default: detected). A process started
            as a rank (torchrun, SLURM, mpirun) plans for the world it is in; any other
            decides here how many ranks to start and with which launcher.
        model: the module :func:`gpufleet.fit` was given, which names an unnamed run
            and decides the recipe's preset (:func:`gpufleet.resolve.recipe_preset`).
        machine: the devices to resolve against (default: this machine's).
        here: this process is the run's one rank, whatever ``dist.nproc`` says (a
            :func:`gpufleet.fit` that starts no ranks, a direct ``build_run``).
        own_loop: the run is your own loop (:class:`gpufleet.Fleet`): no preset of
            gpufleet's recipes applies.

    Raises:
        ConfigError: a setting this machine or world cannot run, naming the fix.
    """
    env = env or DistEnv.detect()
    machine = machine or Machine.detect()
    cfg = named(cfg, model)  # e.g. gpt-stdlib: every rank and node then agrees on it
    if env.is_distributed:  # torchrun, SLURM, horovodrun or mpirun started this rank
        if env.source == "slurm":  # config.toml records the layout srun started
            cfg = dataclasses.replace(cfg, dist=dataclasses.replace(
                cfg.dist, **launched_layout(env)))
        return _plan_for_world(cfg, machine, "external", env, model, own_loop)
    if here:
        return _plan_for_world(cfg, machine, "none", env, model, own_loop)
    dist = cfg.dist
    launcher, nproc = _ranks_here(cfg, machine)
    cfg = dataclasses.replace(cfg, dist=dataclasses.replace(dist, nproc=nproc,
                                                            launcher=launcher))
    world = nproc * parse_nnodes(dist.nnodes)[1]
    resolved, dims = resolve_with_dims(cfg, machine, world, nproc, model=model,
                                       own_loop=own_loop)
    return RunPlan(cfg=resolved, launcher=launcher, nproc=nproc, nnodes=dist.nnodes,
                   node_rank=dist.node_rank, world_size=world, local_world_size=nproc,
                   dims=dims)


def _plan_for_world(cfg: Config, machine: Machine, launcher: str, env: DistEnv,
                    model: Any = None, own_loop: bool = False) -> RunPlan:
    """The plan of a rank whose world is already set (``env``)."""
    resolved, dims = resolve_with_dims(cfg, machine, env.world_size, env.local_world_size,
                                       model=model, own_loop=own_loop)
    nodes = max(1, env.world_size // max(env.local_world_size, 1))
    return RunPlan(cfg=resolved, launcher=launcher, nproc=env.local_world_size,
                   nnodes=str(nodes), node_rank=env.node_rank, world_size=env.world_size,
                   local_world_size=env.local_world_size, dims=dims)


def _ranks_here(cfg: Config, machine: Machine) -> tuple[str, int]:
    """Who starts the ranks on this node, and how many: ``dist.launcher`` and
    ``dist.nproc`` decided (``auto``: torch's elastic agent when there is more than one
    rank, a node or a restart to manage; ``nproc`` 0: one rank per visible GPU)."""
    dist, name = cfg.dist, cfg.parallel.strategy
    traits = None if name == "auto" else strategy_class(name).traits
    if traits is not None and traits.ranks_started_elsewhere:
        if dist.nproc > 1:
            raise ConfigError(
                f"--nproc {dist.nproc} with --strategy {name}: its ranks are started by "
                f"horovodrun, not by gpufleet. Run: horovodrun -np {dist.nproc} gpufleet "
                f"train --strategy {name} ... (without --nproc).")
        nproc = 1  # one process here; horovodrun -np N starts more
    elif dist.nproc:
        nproc = dist.nproc
    elif cfg.run.device == "cpu" or (traits is not None and traits.one_process):
        nproc = 1  # dp: one process drives every GPU; single: one process, one GPU
    else:
        nproc = max(1, machine.gpus)  # auto and the multi-process strategies
    multi_node = parse_nnodes(dist.nnodes)[1] > 1
    launcher = dist.launcher
    if launcher == "slurm":
        raise ConfigError("dist.launcher = 'slurm' records that srun started the ranks of "
                          "the run this config comes from, but this process is not a rank "
                          "of an srun step. Run it under srun, or pass --launcher auto.")
    if launcher == "auto":
        needs_agent = nproc > 1 or multi_node or dist.max_restarts > 0
        launcher = "elastic" if needs_agent else "none"
    if launcher == "none" and (nproc > 1 or multi_node):
        raise ConfigError(f"dist.launcher = 'none' runs one process, but {nproc} rank(s) "
                          f"on {dist.nnodes} node(s) were asked for. Use "
                          "--launcher elastic (or spawn), or --nproc 1.")
    return launcher, nproc
