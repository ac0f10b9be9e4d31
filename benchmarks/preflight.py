"""What the preflight adds before ranks start: building the job the config names and one
batch of 2 samples through model and loss on the CPU (``gpufleet.train.preflight``).

Run: ``python benchmarks/preflight.py [--repeats 3]``. Prints, per repeat, the seconds
spent building the job and running the batch, for the default job (GPT on the stdlib
corpus, corpus cache warmed first) and for the same job with a 12-layer, 768-wide GPT.
"""

from __future__ import annotations

import argparse
import statistics
import time

from gpufleet.config import load_config
from gpufleet.core.machine import machine_summary
from gpufleet.job import build_job
from gpufleet.train.preflight import preflight

JOBS = {
    "default gpt (4x128)": {},
    "gpt 12x768": {"model.n_layer": 12, "model.n_head": 12, "model.n_embd": 768},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(machine_summary())
    build_job(load_config())  # the stdlib corpus cache: built once, as on a second run
    print(f"{'job':22} {'build s':>8} {'batch s':>8}   per repeat (build+batch)")
    for name, overrides in JOBS.items():
        cfg = load_config(overrides=overrides)
        builds, batches = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            job = build_job(cfg)
            t1 = time.perf_counter()
            preflight(job.model, job.train_data, job.loss_fn, cfg)
            t2 = time.perf_counter()
            builds.append(t1 - t0)
            batches.append(t2 - t1)
        each = " ".join(f"{a + b:.2f}" for a, b in zip(builds, batches, strict=True))
        print(f"{name:22} {statistics.median(builds):8.2f} {statistics.median(batches):8.3f}"
              f"   {each}")


if __name__ == "__main__":
    main()
