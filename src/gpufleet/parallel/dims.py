"""The run's parallel plan: how many ranks each kind of parallelism spans, checked once.

Every rank sits at one point of a 4-D grid, outermost first::

    pp  x  dp_replicate  x  dp_shard  x  tp

* ``pp``: pipeline stages (each holds a slice of the layers);
* ``dp_replicate``: whole replicas that all-reduce their gradients (DDP; across nodes
  in HSDP);
* ``dp_shard``: ranks that shard parameters, gradients and optimizer state (FSDP;
  within a node in HSDP);
* ``tp``: tensor parallel ranks that split each layer's matrices (innermost, so they
  are neighbours on one node).

The product of the four is the world size. Data parallel ranks (``dp_replicate x
dp_shard``) read different batches; ranks that differ only in ``tp`` or ``pp`` read the
same ones. :func:`plan_for` turns the ``[parallel]`` section into a :class:`ParallelDims`
and answers, in one place, whether a strategy runs with this many processes, this
device and these degrees; :meth:`ParallelDims.build_mesh` builds the one
``DeviceMesh`` every parallelism is applied over.

Example:
    >>> ParallelDims(dp_replicate=2, dp_shard=2, tp=1, pp=1).world_size
    4
    >>> ParallelDims(dp_replicate=2, dp_shard=2, tp=1, pp=1).dp_rank(3)
    3
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpufleet.errors import ConfigError

#: Mesh dimensions, outermost first (the rank order of the grid).
DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
#: What may keep a strategy's data parallel ranks in step (``StrategyTraits.data_parallel``).
DATA_PARALLEL = ("none", "replicate", "shard", "threads", "optimizer")
#: The preset a degree above 1 needs, most demanding first: ``pp`` the pipeline (which
#: takes every other degree too), ``dp_shard`` FSDP (which takes ``dp_replicate``, i.e.
#: HSDP, and ``tp``), ``tp`` and ``dp_replicate`` DDP (tensor parallel replicas).
PRESET_FOR_DEGREE = (("pp", "pipeline"), ("dp_shard", "fsdp"), ("tp", "ddp"),
                     ("dp_replicate", "ddp"))


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of the four parallelisms (each >= 1).

    Attributes:
        dp_replicate: replicas that all-reduce gradients.
        dp_shard: ranks one FSDP shard group spans.
        tp: tensor parallel degree.
        pp: pipeline stages.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in DIMS:
            if getattr(self, name) < 1:
                raise ConfigError(f"parallel.{name} = {getattr(self, name)}: a degree is a "
                                  "count of ranks, at least 1 (0 lets the strategy choose).")

    @property
    def world_size(self) -> int:
        """The number of ranks the plan needs."""
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data parallel degree: how many different batches one step reads."""
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int) -> int:
        """Which data parallel replica ``rank`` is (the data shard it reads)."""
        return (rank // self.tp) % self.dp

    def describe(self) -> str:
        """The degrees above 1, e.g. ``"dp_replicate=2 x dp_shard=2"``."""
        parts = [f"{n}={getattr(self, n)}" for n in DIMS if getattr(self, n) > 1]
        return " x ".join(parts) or "one rank"

    def build_mesh(self, device_type: str) -> Any:
        """The run's ``DeviceMesh`` over all four dimensions (COLLECTIVE: every rank
        builds it). Slice it by name, e.g. ``mesh["dp_replicate", "dp_shard"]``."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, tuple(getattr(self, n) for n in DIMS),
                                mesh_dim_names=DIMS)


@dataclass(frozen=True)
class StrategyTraits:
    """What a strategy asks of the run, read by :func:`plan_for` (one per strategy class).

    Attributes:
        rest: the dimension that takes the ranks the config leaves unassigned.
        dims: the dimensions it can use above 1.
        one_process: runs in one process (``single``, ``dp``).
        needs_cuda: needs CUDA devices (``dp``).
        backend: a process-group backend it requires (``horovod``: gloo), or None.
        ranks_started_elsewhere: its ranks are started by another launcher
            (``horovodrun``), never by ``--nproc``.
        shard_default_per_node: ``dp_shard`` left at 0 spans the ranks of one node
            (HSDP: shard within a node, replicate across nodes).
        wraps: the torch class it is built on, named in errors (``nn.DataParallel``).
        reduces_in_backward: every step's backward ends waiting for a gradient
            all-reduce or reduce-scatter (what a communication-bound run waits on).
        comm_hooks: takes torch's DDP communication hooks (``parallel.ddp.comm_hook``:
            fp16, bf16, powersgd compress its gradient all-reduce).
        copies_module_each_step: the module is copied to every device each step
            (``nn.DataParallel``), which a compiled module does not survive; one process
            then drives several GPUs, and the first one does more than the rest.
        consolidates_optimizer: the optimizer state is sharded by rank and gathered on
            one rank to save (``ZeroRedundancyOptimizer``): sharded checkpoints do not
            load into it.
        tp_by_replicate_mesh: with ``tp > 1`` the whole replicas are kept in step by
            FSDP2 over a replicate-only mesh (torch's DDP cannot hold the split's DTensor
            parameters; ``ddp``).
        data_parallel: what keeps the data parallel ranks in step, applied by
            :func:`gpufleet.parallel.parallelize.parallelize` (step 5) even at degree 1:
            ``"replicate"`` (torch's DistributedDataParallel), ``"shard"`` (FSDP2),
            ``"threads"`` (``nn.DataParallel``, one process), ``"optimizer"`` (its
            optimizer reduces the gradients; nothing wraps the module), ``"none"``
            (only what the degrees ask for).
        pipelined: runs a pipeline schedule, so the model is split into stages even at
            ``pp = 1`` (``pipeline``); a training step of the user's cannot run in it.
        device_map: places the model's modules on devices by ``parallel.device_map``
            (``model_parallel``).
        several_models: trains several models (a dict of them) in one run.
    """

    rest: str = "dp_replicate"
    dims: frozenset[str] = frozenset({"dp_replicate"})
    one_process: bool = False
    needs_cuda: bool = False
    backend: str | None = None
    ranks_started_elsewhere: bool = False
    shard_default_per_node: bool = False
    reduces_in_backward: bool = False
    comm_hooks: bool = False
    copies_module_each_step: bool = False
    consolidates_optimizer: bool = False
    tp_by_replicate_mesh: bool = False
    wraps: str = ""
    data_parallel: str = "none"
    pipelined: bool = False
    device_map: bool = False
    several_models: bool = False

    def __post_init__(self) -> None:
        if self.data_parallel not in DATA_PARALLEL:
            raise ValueError(f"StrategyTraits.data_parallel = {self.data_parallel!r}; "
                             f"valid: {', '.join(DATA_PARALLEL)}.")


def auto_preset(degrees: dict[str, int], world_size: int) -> str:
    """The preset ``parallel.strategy = auto`` takes: the one the degrees given need
    (:data:`PRESET_FOR_DEGREE`, the first degree above 1 decides), else ``ddp`` on
    several ranks and ``single`` on one.

    Example:
        >>> auto_preset({"dp_shard": 2, "tp": 2, "pp": 2}, 8)
        'pipeline'
        >>> auto_preset({"dp_replicate": 2, "dp_shard": 2, "tp": 2}, 8)
        'fsdp'
        >>> auto_preset({"tp": 2}, 2), auto_preset({}, 4), auto_preset({}, 1)
        ('ddp', 'ddp', 'single')
    """
    for dim, preset in PRESET_FOR_DEGREE:
        if degrees.get(dim, 0) > 1:
            return preset
    return "ddp" if world_size > 1 else "single"


def plan_for(par: Any, traits: StrategyTraits, world_size: int,
             local_world_size: int | None = None) -> ParallelDims:
    """The degrees of ``par`` (the ``[parallel]`` section) for a run of ``world_size``.

    A degree of 0 is chosen: ``traits.rest`` takes the ranks left over, the others are
    1 (``dp_shard`` is the node's rank count under HSDP's traits).

    Raises:
        ConfigError: a degree the strategy cannot use, degrees whose product is not the
            world size, or a one-process strategy with several ranks.
    """
    strategy = par.strategy
    if traits.one_process and world_size > 1:
        raise ConfigError(f"parallel.strategy = {strategy!r} runs in one process, but this "
                          f"run has {world_size} ranks, which would train independent "
                          "copies. Use parallel.strategy=ddp for several processes, or "
                          "--nproc 1.")
    given = {n: getattr(par, n) for n in DIMS}  # pp first: the order errors print
    if traits.shard_default_per_node and not given["dp_shard"]:
        given["dp_shard"] = min(local_world_size or world_size, world_size)
    for name, value in given.items():
        if value > 1 and name not in traits.dims:
            usable = ", ".join(sorted(traits.dims))
            needed = auto_preset({n: v for n, v in given.items() if n not in traits.dims},
                                 world_size)
            raise ConfigError(
                f"parallel.{name} = {value} cannot be used with parallel.strategy = "
                f"{strategy!r}, which spreads over {usable} only. Use parallel.strategy = "
                f"{needed} (the preset for {name} > 1), or leave parallel.strategy = auto "
                f"to take the preset the degrees need, or set parallel.{name} = 1 to keep "
                f"{strategy}.")
    fixed = 1
    for name, value in given.items():
        if name != traits.rest or value:
            fixed *= max(value, 1)
    if not given[traits.rest]:
        given[traits.rest] = world_size // fixed if world_size % fixed == 0 else 0
        if not given[traits.rest]:
            raise ConfigError(_mismatch(given, world_size, fixed))
    return _checked(given, world_size)


def _checked(given: dict[str, int], world_size: int) -> ParallelDims:
    """The degrees as :class:`ParallelDims`, or the error printing their product."""
    dims = ParallelDims(**{n: max(v, 1) for n, v in given.items()})
    if dims.world_size != world_size:
        shown = {n: getattr(dims, n) for n in DIMS}
        raise ConfigError(_mismatch(shown, world_size, dims.world_size))
    return dims


def _mismatch(given: dict[str, int], world_size: int, product: int) -> str:
    shown = " x ".join(f"{n}={v or '?'}" for n, v in given.items())
    return (f"parallel degrees {shown} multiply to {product}, and this run has "
            f"{world_size} rank(s). Make pp x dp_replicate x dp_shard x tp "
            f"equal {world_size} (leave one at 0 to take the rest), or change --nproc.")
