"""``gpufleet bench``: measure one part of the training pipeline on this machine.

Each benchmark is a module with ``add_parser(subparsers)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse

from gpufleet.bench import allreduce, loader

BENCHMARKS = {"loader": loader, "allreduce": allreduce}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``gpufleet bench`` and one subcommand per benchmark to the CLI's subparsers.

    Example:
        >>> parser = argparse.ArgumentParser(prog="gpufleet")
        >>> add_parser(parser.add_subparsers(dest="command"))
        >>> parser.parse_args(["bench", "loader", "--batches", "5"]).batches
        5
    """
    bench = sub.add_parser("bench", help="measure a part of the pipeline (e.g. the data loader)",
                           description="Measure one part of the training pipeline here.")
    benches = bench.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    for module in BENCHMARKS.values():
        module.add_parser(benches)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark that ``args.bench`` names; returns the exit code."""
    return BENCHMARKS[args.bench].run(args)
