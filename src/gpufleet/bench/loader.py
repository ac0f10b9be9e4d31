"""``gpufleet bench loader``: how many DataLoader workers, and pinned memory or not.

Builds the training data set exactly as ``gpufleet train`` would (the built-in stdlib
corpus or your ``--data package.module:function``), measures every combination of
``--workers`` and ``--pin`` with :func:`gpufleet.data.tuner.tune_loader`, prints a table
and the config keys to set.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gpufleet.core.machine import machine_summary, usable_cores
from gpufleet.errors import ConfigError, unknown_choice

PIN_CHOICES = ("auto", "true", "false", "both")
CANDIDATE_WORKERS = (0, 1, 2, 4)

if TYPE_CHECKING:  # torch is imported only when the benchmark runs, not to build the CLI
    from torch.utils.data import Dataset


def add_parser(benches: argparse._SubParsersAction) -> None:
    """Add the ``loader`` subcommand to ``gpufleet bench``."""
    p = benches.add_parser(
        "loader", help="find the fastest DataLoader workers / pin_memory for your data",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Measure DataLoader throughput on your own data set, reading random "
                    "indices as training does, for several worker counts and pin_memory "
                    "settings, and recommend the data.* config keys to set.",
        epilog="examples:\n"
               "  gpufleet bench loader                       # the built-in stdlib corpus\n"
               "  gpufleet bench loader --data mypkg.data:load --kwargs '{root = \"/d\"}'\n"
               "  gpufleet bench loader --workers 0,2,4,8 --pin both --batches 100")
    p.add_argument("--data", metavar="SPEC", default=None,
                   help="'stdlib' or your factory package.module:function (= data.name; "
                        "default: the config's, 'stdlib')")
    p.add_argument("--kwargs", metavar="TABLE", default=None,
                   help="keyword arguments for your factory as a TOML inline table, "
                        "e.g. '{n = 3}' (= data.kwargs)")
    p.add_argument("--config", metavar="FILE", help="TOML config whose [data] (and "
                   "model.block_size) to use")
    p.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help="samples per batch (default: data.batch_size, 16)")
    p.add_argument("--workers", default=None, metavar="LIST",
                   help="comma-separated worker counts (default: 0,1,2,4 up to the cores)")
    p.add_argument("--pin", default="auto", metavar="MODE",
                   help="pin_memory: auto (both with CUDA, false without), true, false, both")
    p.add_argument("--batches", type=int, default=50, metavar="N",
                   help="timed batches per setup (default 50)")
    p.add_argument("--warmup", type=int, default=5, metavar="N",
                   help="untimed batches first, including start-up (default 5)")


def run(args: argparse.Namespace) -> int:
    """Run ``gpufleet bench loader`` with parsed ``args``; prints the report."""
    workers = parse_workers(args.workers) if args.workers is not None else default_workers()
    pin_options(args.pin, cuda=False)  # an unknown --pin is named before torch loads
    # Deferred: torch and the data stack take seconds to import; the flags' mistakes
    # above are answered without them.
    import torch
    from rich.console import Console

    from gpufleet.data.tuner import recommend, tune_loader, usable_pin_options

    pins, notes = usable_pin_options(pin_options(args.pin, torch.cuda.is_available()))
    if not pins:
        raise ConfigError(f"--pin {args.pin}: pinned memory needs CUDA, and there is none "
                          "here. Use --pin false (or auto).")
    dataset, batch_size = build_bench_data(args)
    console = Console(highlight=False, soft_wrap=True)  # soft wrap: lines stay copyable
    console.print(f"machine: {machine_summary()}", markup=False)
    console.print(f"data: {type(dataset).__name__}, {len(dataset):,} samples, batch size "
                  f"{batch_size}; measuring {len(workers) * len(pins)} setup(s) x "
                  f"{args.batches} batches (random indices)")
    results = tune_loader(dataset, batch_size=batch_size, workers=workers, pin_options=pins,
                          batches=args.batches, warmup=args.warmup)
    best = recommend(results)
    console.print(_table(results, best, notes))
    console.print(recommendation_line(results, best), markup=False)
    return 0


def parse_workers(text: str) -> list[int]:
    """Parse ``--workers`` (``"0,2,4"``) into a list of worker counts.

    Example:
        >>> parse_workers("0, 2,4")
        [0, 2, 4]
    """
    counts = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise ConfigError(f"--workers {text!r}: {part!r} is not a worker count. Give "
                              "whole numbers >= 0 separated by commas, e.g. --workers 0,2,4.")
        counts.append(int(part))
    return list(dict.fromkeys(counts))


def default_workers() -> list[int]:
    """0, 1, 2 and 4 workers, leaving out counts above this machine's usable cores."""
    cores = usable_cores()
    return [w for w in CANDIDATE_WORKERS if w <= cores]


def pin_options(mode: str, cuda: bool) -> list[bool]:
    """The ``pin_memory`` values ``--pin MODE`` asks for.

    Example:
        >>> pin_options("auto", cuda=False), pin_options("both", cuda=False)
        ([False], [True, False])
    """
    if mode == "auto":
        return [True, False] if cuda else [False]
    options = {"true": [True], "false": [False], "both": [True, False]}
    if mode not in options:
        raise ConfigError(unknown_choice("--pin", mode, PIN_CHOICES))
    return options[mode]


def build_bench_data(args: argparse.Namespace) -> tuple[Dataset, int]:
    """The training data set and batch size that ``args`` (and ``--config``) describe."""
    from gpufleet.config import load_config
    from gpufleet.config.loader import parse_value
    from gpufleet.job import build_data  # the same code path as `gpufleet train`

    overrides: dict[str, Any] = {}
    if args.data is not None:
        overrides["data.name"] = args.data
    if args.kwargs is not None:
        kwargs = parse_value(args.kwargs)
        if not isinstance(kwargs, dict):
            raise ConfigError(f"--kwargs {args.kwargs!r} is not a TOML inline table. Write "
                              "it as --kwargs '{n = 3, root = \"/data\"}'.")
        overrides["data.kwargs"] = kwargs
    if args.batch_size is not None:
        overrides["data.batch_size"] = args.batch_size
    cfg = load_config(args.config, overrides)
    if cfg.data.kwargs and ":" not in cfg.data.name:
        raise ConfigError(f"--kwargs is for your own data factory, but data.name = "
                          f"{cfg.data.name!r} is built in and takes none. Drop --kwargs "
                          "or pass --data package.module:function.")
    if args.batches < 1 or args.warmup < 1:
        raise ConfigError(f"--batches {args.batches} --warmup {args.warmup}: both must be "
                          "at least 1.")
    train, _ = build_data(cfg)
    return train, cfg.data.batch_size


def recommendation_line(results: Sequence[Any], best: Any) -> str:
    """``recommendation: --data.num_workers=N --data.pin_memory=B (...)`` for ``best``.

    The parenthesis compares with 0 workers (same pin_memory), or, when the best has 0
    workers, with the fastest other setup.
    """
    pin = "true" if best.pin_memory else "false"
    text = (f"recommendation: --data.num_workers={best.num_workers} "
            f"--data.pin_memory={pin} ({best.samples_per_s:,.0f} samples/s")
    others = [r for r in results if r is not best]
    zero = [r for r in others if r.num_workers == 0 and r.pin_memory == best.pin_memory]
    other = zero[0] if best.num_workers and zero else (
        max(others, key=lambda r: r.samples_per_s) if others else None)
    if other is not None:
        pinned = ", pinned" if other.pin_memory else ""
        noun = "worker" if other.num_workers == 1 else "workers"
        text += f"; {other.num_workers} {noun}{pinned}: {other.samples_per_s:,.0f} samples/s"
    return text + ")"


def _table(results: Sequence[Any], best: Any, notes: Sequence[str]) -> Any:
    from rich.table import Table

    caption = [*notes, "startup: seconds to the first batch (worker start-up included); "
               "RSS: main process + workers, shared pages counted per process; "
               "* = recommended (fewest workers within 5% of the best)"]
    table = Table(title="DataLoader throughput", caption="\n".join(caption),
                  caption_justify="left")
    for name in ("workers", "pin_memory", "samples/s", "batches/s", "startup s", "RSS MB"):
        table.add_column(name, justify="right")
    for r in results:
        mark = "*" if r is best else ""
        table.add_row(f"{mark}{r.num_workers}", str(r.pin_memory).lower(),
                      f"{r.samples_per_s:,.0f}", f"{r.batches_per_s:,.1f}",
                      f"{r.first_batch_s:.2f}",
                      f"{r.rss_mb:,.0f}" if r.rss_mb is not None else "-",
                      style="bold" if r is best else None)
    return table
