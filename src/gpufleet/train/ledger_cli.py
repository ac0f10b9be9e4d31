"""``gpufleet data audit RUN_DIR``: proves from the run's data ledger that every sample
of each finished epoch was consumed once, or names the duplicated and missing indices.

This module imports only the standard library at the top (the CLI builds its parser
from it); the audit itself, which needs torch, is imported when the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gpufleet.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``gpufleet data audit`` to the CLI's subparsers.

    Example:
        >>> parser = argparse.ArgumentParser(prog="gpufleet")
        >>> add_parser(parser.add_subparsers(dest="command"))
        >>> parser.parse_args(["data", "audit", "runs/x"]).run_dir
        'runs/x'
    """
    p = sub.add_parser("data", help="the run's data ledger: `gpufleet data audit RUN_DIR`",
                       description="Check what a run's ranks read, from its data ledger.")
    actions = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    audit = actions.add_parser(
        "audit", help="prove every sample of each finished epoch was consumed once",
        description="Read RUN_DIR/ledger (every rank's record of the sample positions each "
                    "step consumed), keep what counts after resumes and recoveries, and "
                    "check that every sample of each finished epoch was consumed exactly "
                    "once. Exits 1 naming the duplicated and missing indices otherwise.")
    audit.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory")


def run(args: argparse.Namespace) -> int:
    """Run ``gpufleet data audit``: prints the report, returns 0 if it passed, else 1."""
    from gpufleet.data.audit import audit  # defers torch until the command runs

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"run directory {str(run_dir)!r} does not exist. Give the "
                          "directory of a run (it holds config.toml and ledger/).")
    try:
        report = audit(run_dir)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from e
    for line in report.lines():
        print(line)
    print("audit passed" if report.ok else "audit FAILED")
    return 0 if report.ok else 1
