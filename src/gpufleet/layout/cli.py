"""``gpufleet plan``: a dry run of a cluster you do not have.

    gpufleet plan --nnodes 16 --nproc 8 --parallel.tp 8 --parallel.pp 2 \\
        --model.n_layer 48 --model.n_embd 6144 --model.n_head 48 --gpu h100-80gb

takes the same flags as ``gpufleet train`` (and ``--config``), builds the layout's mesh
and its sharded model with torch's fake process group on this machine, and prints per
rank the memory of parameters, gradients, optimizer state, activations and buffers, the
bytes each mesh dimension moves per step and the FLOPs per step; with ``--gpu`` it says
whether the layout fits and, when it does not, the nearest layout that does.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import time
from typing import Any

from gpufleet.config.flags import SHORTCUTS


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan", help="memory, communication and FLOPs per rank of a layout, without its GPUs",
        description="Plan a layout you do not have: takes gpufleet train's flags (--nnodes, "
                    "--nproc, --parallel.tp/pp/dp_shard/dp_replicate, --model ..., "
                    "--batch-size, --precision) and prints what each rank holds and moves.")
    p.add_argument("--gpu", metavar="NAME", default="",
                   help="check the layout against this GPU's memory (h100-80gb, a100-40gb, "
                        "... or a number of GiB)")
    p.add_argument("--search-s", type=float, default=40.0, metavar="S",
                   help="seconds to spend looking for the nearest layout that fits")
    p.add_argument("--config", metavar="FILE", help="TOML file with [section] tables")
    for flag, (key, text) in SHORTCUTS.items():  # the same short flags as train
        p.add_argument(flag, dest=key, metavar="V", help=f"{text} (= --{key})")


def run(args: argparse.Namespace) -> int:
    from gpufleet.layout.devices import named_device
    from gpufleet.resolve import recipe_preset

    cfg = args.train_config  # gpufleet.cli read train's flags into it
    device = named_device(args.gpu) if args.gpu else None
    if device is not None:  # precision "auto" as a run on that GPU resolves it
        cfg = dataclasses.replace(cfg, precision=dataclasses.replace(
            cfg.precision, mode=device.precision(cfg.precision.mode, recipe_preset(cfg))))
    nodes, per_node = _world(cfg)
    dims = layout_dims(cfg, nodes * per_node, per_node)
    build_model, sample = _model_and_sample(cfg)
    started = time.perf_counter()
    from gpufleet.layout.estimate import estimate_layout
    from gpufleet.layout.report import print_estimate, print_suggestion

    # A plan checked against a GPU sizes the activations as CUDA's autocast keeps them.
    device_type = "cuda" if device is not None else "cpu"
    estimate = estimate_layout(cfg, dims, build_model, sample, device_type)
    print_estimate(cfg, estimate, nodes, per_node, device, trainable_with(cfg, dims,
                                                                           per_node))
    if device is not None and estimate.peak.total > device.usable_bytes:
        budget = args.search_s - (time.perf_counter() - started)
        found = nearest_fitting(cfg, dims, per_node, device, build_model, sample, budget)
        print_suggestion(found, device)
        return 1
    return 0


def _world(cfg: Any) -> tuple[int, int]:
    from gpufleet.errors import ConfigError

    nodes = int(str(cfg.dist.nnodes).split(":")[-1])
    per_node = cfg.dist.nproc
    if per_node < 1:
        raise ConfigError("gpufleet plan needs the ranks per node: give --nproc N (the GPUs "
                          "of one node).")
    return nodes, per_node


def layout_dims(cfg: Any, world: int, per_node: int) -> Any:
    """The degrees the config asks for over ``world`` ranks: degrees left at 0 are 1,
    but the strategy's own dimension takes the ranks left over (hsdp: ``dp_shard`` is
    one node's ranks). Any combination is planned, also one ``gpufleet train`` cannot
    run yet (see :func:`trainable_with`)."""
    from gpufleet.errors import ConfigError
    from gpufleet.parallel import strategy_class
    from gpufleet.parallel.dims import DIMS, ParallelDims

    par = cfg.parallel
    name = "ddp" if par.strategy in ("auto", "single") else par.strategy
    traits = strategy_class(name).traits
    given = {n: getattr(par, n) for n in DIMS}
    if traits.shard_default_per_node and not given["dp_shard"]:
        given["dp_shard"] = per_node
    fixed = math.prod(max(v, 1) for n, v in given.items() if n != traits.rest or v)
    if not given[traits.rest]:
        given[traits.rest] = world // fixed if world % fixed == 0 else 0
    dims = ParallelDims(**{n: max(v, 1) for n, v in given.items()})
    if dims.world_size != world or not given[traits.rest]:
        shown = " x ".join(f"{n}={v or '?'}" for n, v in given.items())
        raise ConfigError(f"parallel degrees {shown} do not multiply to the {world} ranks of "
                          f"--nnodes x --nproc. Change a degree, or leave one at 0 to take "
                          "the rest.")
    return dims


def trainable_with(cfg: Any, dims: Any, per_node: int) -> str | None:
    """A ``--strategy`` of ``gpufleet train`` that runs ``dims`` today, or None: the
    first preset whose own dimension (the one taking the ranks left over) spans several
    ranks, else the first that takes the degrees at all (``pipeline`` also runs pp = 1,
    but ``fsdp`` says dp_shard = 4 x tp = 2 better)."""
    from gpufleet.errors import ConfigError
    from gpufleet.parallel import strategy_class, strategy_names
    from gpufleet.parallel.dims import DIMS, plan_for

    exact = dataclasses.replace(cfg.parallel, **{n: getattr(dims, n) for n in DIMS})
    takers: list[str] = []
    for name in strategy_names():
        traits = strategy_class(name).traits
        if traits.one_process and dims.world_size > 1:
            continue
        try:
            if plan_for(dataclasses.replace(exact, strategy=name), traits,
                        dims.world_size, per_node) == dims:
                takers.append(name)
        except ConfigError:
            continue
    own = [n for n in takers if getattr(dims, strategy_class(n).traits.rest) > 1]
    return (own or takers or [None])[0]


def nearest_fitting(cfg: Any, dims: Any, per_node: int, device: Any, build_model: Any,
                    sample: Any, budget_s: float) -> Any:
    """The layout of the same world size closest to ``dims`` (fewest doublings and
    halvings of its degrees) whose peak memory fits ``device``; None when none of those
    tried within ``budget_s`` fits. Tensor parallelism stays within a node."""
    from gpufleet.errors import ConfigError
    from gpufleet.layout.estimate import estimate_layout

    started, tried = time.perf_counter(), {}
    for candidate in sorted(_layouts(dims.world_size, per_node),
                            key=lambda c: (_distance(c, dims), -c.dp_replicate)):
        if candidate == dims:
            continue
        if time.perf_counter() - started > budget_s:
            return None
        key = (candidate.pp, candidate.dp_shard, candidate.tp)  # replicas hold the same
        if key not in tried:
            try:
                tried[key] = estimate_layout(cfg, candidate, build_model, sample, "cuda")
            except ConfigError:  # heads or layers that do not divide, ...
                tried[key] = None
        found = tried[key]
        if found is not None and found.peak.total <= device.usable_bytes:
            return dataclasses.replace(found, dims=candidate)
    return None


def _layouts(world: int, per_node: int) -> list[Any]:
    from gpufleet.parallel.dims import ParallelDims

    divisors = [d for d in range(1, world + 1) if world % d == 0]
    out = []
    for pp, tp, shard in itertools.product(divisors, repeat=3):
        if per_node % tp or world % (pp * tp * shard):
            continue
        out.append(ParallelDims(pp=pp, tp=tp, dp_shard=shard,
                                dp_replicate=world // (pp * tp * shard)))
    return out


def _distance(a: Any, b: Any) -> float:
    from gpufleet.parallel.dims import DIMS

    return sum(abs(math.log2(getattr(a, n) / getattr(b, n))) for n in DIMS)


def _model_and_sample(cfg: Any) -> tuple[Any, tuple]:
    """How to build the model (the planner calls it on the meta device), and one batch
    of inputs for a model other than the built-in GPT (from the data factory)."""
    from gpufleet.job import build_data, build_model

    if cfg.model.name == "gpt":
        return (lambda: build_model(cfg)), ()
    import torch  # deferred: the parser is built without torch

    from gpufleet.data.loaders import train_collate
    from gpufleet.errors import ConfigError

    train, _ = build_data(cfg)
    batch = train_collate(train, cfg.data)([train[0]])
    if not (isinstance(batch, (tuple, list)) and isinstance(batch[0], torch.Tensor)):
        raise ConfigError("gpufleet plan sizes models whose batches are (inputs, target) "
                          f"with a tensor of inputs; {cfg.data.name!r} gives "
                          f"{type(batch).__name__} batches. Plan with --model gpt of a "
                          "similar size, or give such a data factory.")
    return (lambda: build_model(cfg)), (batch[0],)
