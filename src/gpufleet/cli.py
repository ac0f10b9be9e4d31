"""The ``gpufleet`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import signal
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpufleet.config import Config, config_to_dict, help_rows, load_config, parse_override
from gpufleet.config.flags import SHORTCUTS
from gpufleet.errors import ConfigError, GpufleetError, LaunchError, RunStopped, unknown_choice
from gpufleet.fault.preempt import INTERRUPT_EXIT, exit_status

# Subcommands other than `train`: name -> module. Each module has
# ``add_parser(subparsers)`` and ``run(args) -> int`` and imports only the standard
# library at the top, so building the parser stays fast; heavy imports go inside run().
COMMANDS: dict[str, str] = {
    "bench": "gpufleet.bench",
    "serve": "gpufleet.serve.cli",
    "export": "gpufleet.serve.export_cli",
    "doctor": "gpufleet.doctor.cli",
    "cleanup": "gpufleet.procs",
    "checkpoint": "gpufleet.train.migrate",
    "tokens": "gpufleet.hf.cli",
    "report": "gpufleet.monitor.report_cli",
    "top": "gpufleet.monitor.top",
    "tune": "gpufleet.monitor.tune",
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
            return _cmd_train(args, rest)
        if args.command == "tune":  # the rest are the train arguments to tune
            args.train_args = rest
            return importlib.import_module(COMMANDS["tune"]).run(args)
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
              "--master-port 29500"]
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
    from gpufleet.train.rundir import as_new_run

    base = None
    if args.config:
        # A run's own config.toml starts a new run; overrides (--run-dir too) apply on top.
        base, note = as_new_run(load_config(args.config), args.config)
        if note:
            print(f"gpufleet: {note}", file=sys.stderr)
    return load_config(overrides=overrides, base=base)


def _cmd_train(args: argparse.Namespace, rest: Sequence[str]) -> int:
    cfg = parse_train_config(args, rest)
    result = run_training(cfg)
    if result is not None:
        _print_summary(result)
        if result.preempted:
            raise RunStopped(_stopped(result.preempted, result.run_dir),
                             exit_status(getattr(signal, result.preempted)))
    return 0


def _stopped(signal_name: str, run_dir: str) -> str:
    """What a run stopped by a signal says: where it can continue from, and how."""
    from gpufleet.train.checkpoint import list_checkpoints

    found = list_checkpoints(run_dir)
    newest = f"the newest checkpoint is {found[-1]}" if found else "no checkpoint was written"
    return (f"stopped by {signal_name} after finishing the current step; {newest}. "
            f"Continue with the same command plus --resume latest (or --run-dir {run_dir} "
            "--resume latest).")


def run_training(cfg: Config, worker: Any = None, extra: tuple = (), job: Any = None) -> Any:
    """Train here, or start the ranks and train there; returns rank 0's FitResult.

    Args:
        cfg: the run's config.
        worker: what each rank runs, ``worker(cfg_dict, *extra)`` (default: the job the
            config names, :func:`gpufleet.api.run_worker`).
        extra: further arguments for ``worker``, sent to every rank (picklable).
        job: the model, data and loss the preflight checks (a
            :class:`gpufleet.job.Job`); None builds the job the config names.
    """
    from gpufleet.api import run_worker
    from gpufleet.config import Machine, resolve
    from gpufleet.launch import DistEnv, launch
    from gpufleet.procs import forget_process, record_process
    from gpufleet.train import runlock
    from gpufleet.train.rundir import named
    from gpufleet.train.start import check_picklable, preflight_job

    worker = worker or run_worker
    cfg = named(cfg)  # e.g. gpt-stdlib: every rank and node then agrees on it
    env = DistEnv.detect()
    if env.is_distributed:  # torchrun, SLURM, horovodrun, mpirun or our launcher
        result = worker(config_to_dict(cfg), *extra)
        if result.preempted and not env.is_main:  # every rank exits "requeue"
            raise RunStopped(f"rank {env.rank} stopped by {result.preempted}.",
                             exit_status(getattr(signal, result.preempted)))
        return result if env.is_main else None  # one summary per job, from rank 0
    dist = cfg.dist
    traits = strategy_traits(cfg)
    if traits.ranks_started_elsewhere and dist.nproc > 1:
        name = cfg.parallel.strategy
        raise ConfigError(
            f"--nproc {dist.nproc} with --strategy {name}: its ranks are started by "
            f"horovodrun, not by gpufleet. Run: horovodrun -np {dist.nproc} gpufleet train "
            f"--strategy {name} ... (without --nproc).")
    nproc = dist.nproc or _visible_gpus(cfg)
    max_nodes = int(dist.nnodes.split(":")[-1])
    multi_node = max_nodes > 1
    launcher = dist.launcher
    if launcher == "auto":
        needs_agent = nproc > 1 or multi_node or dist.max_restarts > 0
        launcher = "elastic" if needs_agent else "none"
    if launcher == "none" and (nproc > 1 or multi_node):
        raise ConfigError(f"dist.launcher = 'none' runs one process, but {nproc} rank(s) "
                          f"on {dist.nnodes} node(s) were asked for. Use "
                          "--launcher elastic (or spawn), or --nproc 1.")
    # Check the whole config here, once, before any rank starts: a mistake then reads as
    # one message instead of a traceback per rank (and per restart).
    resolve(cfg, Machine.detect(), world_size=nproc * max_nodes, local_world_size=nproc)
    cfg = dataclasses.replace(cfg, dist=dataclasses.replace(dist, nproc=nproc,
                                                            launcher=launcher))
    if launcher == "none":
        return worker(config_to_dict(cfg), *extra)  # rank 0 locks the run directory
    # Before any rank starts: what the ranks are sent, and one batch through the job.
    check_picklable(extra, nproc)
    preflight_job(cfg, job)
    if multi_node:
        from gpufleet.api import setup_logging

        setup_logging(cfg.log.level, env)  # the agent says which interface and store host
    run_id_before, lock, made = os.environ.get(runlock.RUN_ID_ENV), None, []
    try:
        # Its run id goes to the ranks' env; ``made``: the folders this launch creates.
        cfg, lock, made = _plan_and_lock(cfg, multi_node)
        record_process(cfg.run.dir, "launcher")  # for `gpufleet cleanup RUN_DIR`
        results = launch(
            worker, (config_to_dict(cfg), *extra), nproc=nproc, launcher=launcher,
            nnodes=dist.nnodes, node_rank=dist.node_rank, master_addr=dist.master_addr,
            master_port=dist.master_port, rdzv_endpoint=dist.rdzv_endpoint,
            rdzv_backend=dist.rdzv_backend, rdzv_id=dist.rdzv_id or cfg.run.name,
            max_restarts=dist.max_restarts, rdzv_timeout=dist.rdzv_timeout,
            rdzv_last_call_s=dist.rdzv_last_call_s, rdzv_keep_alive_s=dist.rdzv_keep_alive_s)
        forget_process(cfg.run.dir)
    except RunStopped as e:  # the agent got the signal: the ranks' results are lost
        raise RunStopped(_stopped(e.signal, cfg.run.dir), e.exit_code, e.signal) from None
    except BaseException:
        if made:  # e.g. the ranks never met: leave nothing half-written
            forget_process(cfg.run.dir)
            if lock is not None:
                lock.release()
                lock = None
                runlock.remove_lock_file(cfg.run.dir)
            _remove_if_empty(made)
        raise
    finally:
        if lock is not None:
            lock.release()
        if run_id_before is None:  # this process may start other runs later
            os.environ.pop(runlock.RUN_ID_ENV, None)
        else:
            os.environ[runlock.RUN_ID_ENV] = run_id_before
    # On a node without global rank 0, a rank of this node says how the run ended.
    return results.get(0) or next((r for r in results.values() if r is not None), None)


def _plan_and_lock(cfg: Config, multi_node: bool) -> tuple[Config, Any, list[Path]]:
    """The launcher's run directory, locked for this run (see gpufleet.train.runlock),
    and the folders that did not exist before (a multi-node run's directory, which a
    launch whose ranks never met removes again)."""
    from gpufleet.procs import RECORDS_DIR
    from gpufleet.train import runlock
    from gpufleet.train.checkpoint import check_loadable, mark_verified
    from gpufleet.train.rundir import plan_and_lock

    dist = cfg.dist
    if multi_node:
        # Every node must agree on the run directory without talking to each other.
        if not cfg.run.dir:
            if not dist.rdzv_id:
                raise ConfigError(
                    "a multi-node run needs a run directory that every node agrees on. "
                    "Pass --rdzv-id NAME (the run writes to <out_dir>/<name>-NAME) or "
                    "--run-dir PATH, on a file system all nodes share.")
            run_dir = f"{cfg.run.out_dir}/{cfg.run.name}-{dist.rdzv_id}"
            cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=run_dir))
        # Every node of this run shares the lock: they agree on the rendezvous.
        where = dist.rdzv_endpoint or f"{dist.master_addr}:{dist.master_port}"
        os.environ[runlock.RUN_ID_ENV] = f"{dist.rdzv_id or cfg.run.name}@{where}"
        run_dir = Path(cfg.run.dir)
        made = [d for d in (run_dir / RECORDS_DIR, run_dir, *run_dir.parents)
                if not d.exists()]
        return cfg, runlock.acquire(run_dir), made
    os.environ[runlock.RUN_ID_ENV] = runlock.run_id()  # the ranks share the lock
    cfg, resume_from, lock = plan_and_lock(cfg)  # one directory for every rank and restart
    try:
        if resume_from is not None:
            check_loadable(resume_from)  # refused here, once, not in a traceback per rank
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    if resume_from is not None and resume_from.is_file():
        mark_verified(resume_from)  # checked just now: rank 0 need not hash it again
    return cfg, lock, []


def strategy_traits(cfg: Config) -> Any:
    """What the config's strategy asks of the run (``auto`` is ``ddp`` here: it asks for
    every visible GPU)."""
    from gpufleet.parallel import strategy_class

    name = cfg.parallel.strategy
    return strategy_class("ddp" if name == "auto" else name).traits


def _remove_if_empty(folders: list[Path]) -> None:
    for folder in folders:  # deepest first
        try:
            folder.rmdir()  # only empty folders go
        except OSError:
            pass


def _visible_gpus(cfg: Config) -> int:
    traits = strategy_traits(cfg)
    if traits.ranks_started_elsewhere:
        return 1  # one process here; horovodrun -np N starts more
    if cfg.run.device == "cpu":
        return 1
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if traits.one_process:
        return 1  # dp: one process drives every GPU; single: one process, one GPU
    return max(1, count)


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
