"""``gpufleet sbatch``: write (and with ``--submit`` submit) a Slurm batch script that runs
``gpufleet train`` with one ``srun`` task per rank, survives preemption and requeues.

The script asks for SIGUSR1 90 s before the time limit (``--signal=USR1@90``), lets Slurm
requeue the job (``--requeue``), appends every start's output to one file, runs
``srun gpufleet train ... --resume auto`` (the newest checkpoint if any, else a fresh
start) in a run directory named after the job, and requeues itself when the ranks exit
with status 75 (preempted or signalled: try again). Only the standard library is
imported here, so building the CLI's parser stays fast.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from collections.abc import Sequence

from gpufleet.errors import REQUEUE_EXIT


def batch_script(train_args: Sequence[str], *, nodes: int, ntasks_per_node: int,
                 gpus_per_node: int = 0, time_limit: str = "", job_name: str = "gpufleet",
                 signal_s: int = 90, command: str = "gpufleet", output: str = "") -> str:
    """The text of the batch script.

    Example:
        >>> text = batch_script(["--max-steps", "100"], nodes=2, ntasks_per_node=8)
        >>> "srun gpufleet train --max-steps 100" in text, "#SBATCH --requeue" in text
        (True, True)
    """
    if nodes < 1 or ntasks_per_node < 1:
        raise ValueError(f"gpufleet sbatch: --nodes {nodes} and --ntasks-per-node "
                         f"{ntasks_per_node} must be at least 1.")
    header = [f"--job-name={job_name}", f"--nodes={nodes}",
              f"--ntasks-per-node={ntasks_per_node}"]
    if gpus_per_node:
        header.append(f"--gpus-per-node={gpus_per_node}")
    if time_limit:
        header.append(f"--time={time_limit}")
    header += ["--requeue", f"--signal=USR1@{signal_s}", "--open-mode=append",
               f"--output={output or job_name + '-%j.out'}"]
    args = [shlex.quote(a) for a in train_args]
    if not any(a in ("--run-dir", "--run.dir") or a.startswith(("--run-dir=", "--run.dir="))
               for a in train_args):
        # One directory per job: a requeued start finds its own checkpoints.
        args += ["--run-dir", f'"runs/{job_name}-${{SLURM_JOB_ID}}"']
    if not any(a == "--resume" or a.startswith(("--resume=", "--checkpoint.resume"))
               for a in train_args):
        args += ["--resume", "auto"]
    lines = ["#!/bin/bash", *(f"#SBATCH {h}" for h in header),
             "# One task per rank; gpufleet reads its rank from srun's step variables.",
             f"srun {command} train {' '.join(args)}",
             "code=$?",
             f"# {REQUEUE_EXIT}: preempted or signalled before the time limit, a checkpoint "
             "was written: go again.",
             f'if [ "$code" -eq {REQUEUE_EXIT} ]; then scontrol requeue "$SLURM_JOB_ID"; fi',
             'exit "$code"']
    return "\n".join(lines) + "\n"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``gpufleet sbatch`` to the CLI's subparsers."""
    p = sub.add_parser(
        "sbatch", help="print (or --submit) a Slurm batch script that runs gpufleet train",
        description="Print a Slurm batch script that runs `gpufleet train ARGS` with one "
                    "srun task per rank, SIGUSR1 before the time limit, requeue on exit "
                    "status 75 and --resume auto; --submit hands it to sbatch. Arguments "
                    "it does not know go to gpufleet train.")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--ntasks-per-node", type=int, default=1, metavar="N",
                   help="ranks per node (one per GPU; default 1)")
    p.add_argument("--gpus-per-node", type=int, default=0, metavar="N",
                   help="GPUs to ask for on each node (default: none asked)")
    p.add_argument("--time", default="", help="time limit, e.g. 24:00:00")
    p.add_argument("--job-name", default="gpufleet", help="job name (default gpufleet)")
    p.add_argument("--signal-before", type=int, default=90, metavar="S",
                   help="seconds before the time limit that SIGUSR1 comes (default 90)")
    p.add_argument("--output", default="", help="output file (default JOBNAME-%%j.out)")
    p.add_argument("--gpufleet", dest="gpufleet_command", default="gpufleet", metavar="CMD",
                   help="how the nodes start gpufleet (default: gpufleet; e.g. "
                        "'python -m gpufleet')")
    p.add_argument("--submit", action="store_true",
                   help="submit the script with sbatch and print the job id")


def run(args: argparse.Namespace) -> int:
    """Print the script, or submit it and print the job id."""
    try:
        text = batch_script(args.train_args, nodes=args.nodes,
                            ntasks_per_node=args.ntasks_per_node,
                            gpus_per_node=args.gpus_per_node, time_limit=args.time,
                            job_name=args.job_name, signal_s=args.signal_before,
                            command=args.gpufleet_command, output=args.output)
    except ValueError as e:
        print(f"gpufleet: error: {e}", file=sys.stderr)
        return 2
    if not args.submit:
        sys.stdout.write(text)
        return 0
    try:
        done = subprocess.run(["sbatch", "--parsable"], input=text, text=True,
                              capture_output=True)
    except FileNotFoundError:
        print("gpufleet: error: sbatch is not on PATH: run on a Slurm login node, or drop "
              "--submit and save the script.", file=sys.stderr)
        return 1
    if done.returncode != 0:
        print(f"gpufleet: error: sbatch refused the script: {done.stderr.strip()}",
              file=sys.stderr)
        return done.returncode
    print(done.stdout.strip().split(";")[0])
    return 0
