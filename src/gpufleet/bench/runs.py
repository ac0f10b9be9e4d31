"""For benchmarks that time whole ``gpufleet train`` runs against each other."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def small_gpt_job(steps: int, batch_size: int = 8, n_embd: int = 128,
                  n_layer: int = 4) -> list[str]:
    """The command of a short run of the built-in GPT on the stdlib corpus (block 128,
    no evaluation, no checkpoint or report at the end); add ``--run-dir`` and the
    launcher's or strategy's options."""
    return [sys.executable, "-m", "gpufleet", "train", "--max-steps", str(steps),
            "--log.every", "10", "--batch-size", str(batch_size),
            "--model.n_embd", str(n_embd), "--model.n_layer", str(n_layer),
            "--model.n_head", "4", "--model.block_size", "128", "--run.eval_every", "0",
            "--data.num_workers", "0", "--checkpoint.save_final", "false",
            "--monitor.report", "false"]


def median_step_time(run_dir: Path) -> float:
    """Median ``step_time_s`` of a run's log intervals, the first (start-up) left out."""
    records = [r for r in map(json.loads, open(Path(run_dir) / "metrics.jsonl"))
               if r["kind"] == "train"]
    return statistics.median(r["step_time_s"] for r in records[1:])
