"""report.html written at a run's end (:func:`write_at_end`), and ``gpufleet report
RUN_DIR``, which rebuilds it and prints the diagnosis. The renderer is imported only
when a report is written."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def write_at_end(run_dir: str | Path) -> None:
    """report.html for a run that just ended (not essential: a failure is logged, not
    raised)."""
    from gpufleet.monitor.report import write_report

    try:
        write_report(run_dir)  # logs where it went
    except Exception as e:
        log.error("the HTML report could not be written: %s: %s", type(e).__name__, e)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``gpufleet report`` to the CLI's subparsers.

    Example:
        >>> parser = argparse.ArgumentParser(prog="gpufleet")
        >>> add_parser(parser.add_subparsers(dest="command"))
        >>> parser.parse_args(["report", "runs/gpt-1"]).run_dir
        'runs/gpt-1'
    """
    p = sub.add_parser(
        "report", help="rebuild a run's report.html and print its diagnosis",
        description="Rebuild <RUN_DIR>/report.html (self-contained: GPU utilisation and "
                    "memory timelines, step time per rank, throughput, loss, the "
                    "diagnosis) from what the run recorded, and print the diagnosis.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory")


def run(args: argparse.Namespace) -> int:
    """Write the report, print where it is and the findings; returns the exit code."""
    from gpufleet.monitor.diagnose import findings_for_run, format_findings
    from gpufleet.monitor.report import write_report

    path = write_report(args.run_dir)  # ReportError (a GpufleetError) for a wrong path
    print(format_findings(findings_for_run(path.parent)))
    print(f"report: {path}")
    return 0
