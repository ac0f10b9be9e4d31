"""The ``gpufleet`` command line."""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from gpufleet.config import Config, help_rows, load_config, parse_override
from gpufleet.config.flags import SHORTCUTS
from gpufleet.errors import (
    INTERRUPT_EXIT,
    ConfigError,
    GpufleetError,
    LaunchError,
    RunStopped,
    unknown_choice,
)
from gpufleet.launch import ssh

# Subcommands other than `train`: name -> module. Each module has
# ``add_parser(subparsers)`` and ``run(args) -> int`` and imports only the standard
# library at the top, so building the parser stays fast; heavy imports go inside run().
COMMANDS: dict[str, str] = {
    "bench": "gpufleet.bench",
    "serve": "gpufleet.serve.cli",
    "export": "gpufleet.serve.export_cli",
    "doctor": "gpufleet.doctor.cli",
    "cleanup": "gpufleet.procs",
    "checkpoint": "gpufleet.train.checkpoint.migrate",
    "data": "gpufleet.train.ledger_cli",
    "tokens": "gpufleet.hf.cli",
    "report": "gpufleet.monitor.report_cli",
    "top": "gpufleet.monitor.top",
    "tune": "gpufleet.monitor.tune",
    "plan": "gpufleet.layout.cli",
    "sbatch": "gpufleet.launch.sbatch",
    "run": "gpufleet.fleet.cli",
    "store": "gpufleet.launch.store",
    "etcd": "gpufleet.launch.etcd_cluster",
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    if not argv:
        parser.print_help()
        return 0
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "train":
            if ssh.wants_hosts(args):
                return _cmd_train_hosts(args, argv[argv.index("train") + 1:])
            return _cmd_train(args, rest)
        if args.command in ("tune", "plan", "sbatch"):  # the rest are train arguments
            args.train_args = rest
            if args.command == "plan":  # the config those flags describe, read here
                args.train_config = parse_train_config(args, rest)
            return importlib.import_module(COMMANDS[args.command]).run(args)
        if args.command in COMMANDS and not rest:
            return importlib.import_module(COMMANDS[args.command]).run(args)
        parser.error(f"unrecognised arguments: {' '.join(rest)}")
    except RunStopped as e:
        print(f"gpufleet: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C before training started: nothing to save
        print("gpufleet: interrupted (Ctrl-C) before training started", file=sys.stderr)
        return INTERRUPT_EXIT
    except LaunchError as e:
        print(f"gpufleet: error: {e}", file=sys.stderr)
        return 1
    except GpufleetError as e:
        print(f"gpufleet: error: {e}", file=sys.stderr)
        return 2
    return 0


def _build_parser() -> argparse.ArgumentParser:
    from gpufleet import __version__

    parser = argparse.ArgumentParser(
        prog="gpufleet",
        description="Multi-GPU PyTorch training that is fast, survives faults, and says "
                    "in plain words why a run is slow.")
    parser.add_argument("--version", action="version", version=f"gpufleet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = sub.add_parser(
        "train", help="train a model (with no options: a small GPT on Python's stdlib)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a model. With no options, a small byte-level GPT trains on a "
                    "corpus built from this interpreter's standard library sources.",
        epilog=_config_help())
    train.add_argument("--config", metavar="FILE", help="TOML file with [section] tables")
    for flag, (key, text) in SHORTCUTS.items():
        train.add_argument(flag, dest=key, metavar="V", help=f"{text} (= --{key})")
    ssh.add_arguments(train)
    for module in COMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def _config_help() -> str:
    lines = ["every config key (TOML [section] key, or --section.key=VALUE):", ""]
    for flag, default, text in help_rows():
        lines.append(f"  {flag} (default {default})")
        lines.extend(textwrap.wrap(text, 80, initial_indent="      ",
                                   subsequent_indent="      "))
    lines += ["", "examples:",
              "  gpufleet train                                  # the default job",
              "  gpufleet train --nproc 2 --strategy ddp         # two local ranks",
              "  gpufleet train --model mypkg.nets:build --data mypkg.data:load",
              "  gpufleet train --resume latest                  # continue the last run",
              "  gpufleet train --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 "
              "--master-port 29500",
              "  gpufleet train --hosts node1,node2 --nproc 8      # every node over ssh"]
    return "\n".join(lines)


def parse_train_config(args: argparse.Namespace, rest: Sequence[str]) -> Config:
    """The config from --config, --section.key overrides and the short flags."""
    overrides: list[str] = []
    i = 0
    while i < len(rest):
        token = rest[i]
        name = token.split("=", 1)[0]
        if not token.startswith("--") or "." not in name:
            flags = [*SHORTCUTS, "--config"]
            raise ConfigError(unknown_choice("command-line flag", name, flags,
                                             "Or give a config key as --section.key=VALUE "
                                             "(see gpufleet train --help)."))
        if "=" in token:
            overrides.append(token[2:])
        elif i + 1 < len(rest):
            overrides.append(f"{token[2:]}={rest[i + 1]}")
            i += 1
        else:
            raise ConfigError(f"{token} has no value. Write {token}=VALUE.")
        i += 1
    for _, (key, _text) in SHORTCUTS.items():
        value = getattr(args, key, None)
        if value is not None:
            overrides.append(f"{key}={value}")
    for text in overrides:
        parse_override(text)  # early, precise errors for malformed overrides
    from gpufleet.train.checkpoint.rundir import as_new_run

    base = None
    if args.config:
        # A run's own config.toml starts a new run; overrides (--run-dir too) apply on top.
        base, note = as_new_run(load_config(args.config), args.config)
        if note:
            print(f"gpufleet: {note}", file=sys.stderr)
    return load_config(overrides=overrides, base=base)


def _cmd_train(args: argparse.Namespace, rest: Sequence[str]) -> int:
    cfg = parse_train_config(args, rest)
    # Deferred: the training stack imports torch (seconds); the parser, --help and a
    # mistake in the flags or the config are answered before it.
    from gpufleet.entry import run_training, stopped_message
    from gpufleet.fault.preempt import exit_status

    result = run_training(cfg)
    if result is not None:
        _print_summary(result)
        if result.preempted:
            raise RunStopped(stopped_message(result.preempted, result.run_dir),
                             exit_status(getattr(signal, result.preempted)))
    return 0


def _cmd_train_hosts(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``gpufleet train --hosts ...``: the same command on every host, over ssh."""
    _, train_args = ssh.host_flags().parse_known_args(argv)
    job = ssh.job_from_args(args, train_args)
    node0, rest = _build_parser().parse_known_args(["train", *job.node_args(0, 1)])
    parse_train_config(node0, rest)  # a bad flag fails here, not on every node
    logging.basicConfig(format="gpufleet: %(message)s")
    logging.getLogger(ssh.__name__).setLevel(logging.INFO)
    return ssh.run_hosts(job)


def _print_summary(result: Any) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="gpufleet run summary", show_header=False)
    first = result.losses[0] if result.losses else None
    rows = [
        ("steps", str(result.steps)),
        ("epochs", f"{result.epochs:.2f}"),
        ("train loss", f"{first[1]:.4f} (step {first[0]}) -> {result.final_loss:.4f} "
                       f"(step {result.losses[-1][0]})" if first else "-"),
        ("eval loss", f"{result.eval_loss:.4f}" if result.eval_loss is not None else "-"),
        *((f"eval {name}", f"{value:.4f}") for name, value in
          (result.eval_metrics[-1][1] if getattr(result, "eval_metrics", None) else {}).items()),
        ("throughput", (f"{result.tokens_per_s:,.0f} tokens/s, " if result.tokens_per_s
                        else "") + f"{result.samples_per_s:,.1f} samples/s"),
        ("training time", f"{result.train_time_s:.1f} s"),
        ("run directory", result.run_dir),
        ("checkpoint", result.checkpoint or "-"),
    ]
    for sink, error in getattr(result, "callback_errors", {}).items():
        rows.append((f"[red]{sink} failed[/]", escape(error)))
    for name, value in rows:
        table.add_row(name, value)
    console = Console(stderr=False)
    console.print(table)
    if getattr(result, "findings", None):
        from gpufleet.monitor.diagnose import format_findings

        console.print("diagnosis:", highlight=False)
        for line in format_findings(result.findings).splitlines():
            console.print(f"  {line}", highlight=False, markup=False, soft_wrap=True)
