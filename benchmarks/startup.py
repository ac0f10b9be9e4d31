"""Start-up cost, side by side: a 2-rank script under torchrun, and the same training
started by gpufleet.

Each way trains the DDP-tutorial regression of ``examples/ddp_regression.py`` (the
same model, data and recipe) for a few steps on 2 CPU ranks:

* ``torchrun``: the plain-PyTorch loop, ``torchrun --nproc-per-node 2``;
* ``gpufleet.fit``: the script hands the same objects to ``gpufleet.fit`` with
  ``dist.nproc = 2`` (gpufleet checks one batch, then starts the ranks);
* ``gpufleet train``: the command line, with the model, data and optimizer named as
  factories (the optimizer's first step writes the mark);
* ``gpufleet run``: the plain loop moved to ``gpufleet.Fleet`` (when it exists here).

``--job minilm`` starts the MiniLM fine-tune of ``examples/finetune_transformers.py``
instead: its plain loop under torchrun against its ``gpufleet.fit`` on 2 ranks, started
by fit, and started torchrun's way (``gpufleet run --nproc 2 SCRIPT``: each rank runs the
script, and fit trains that rank's share).

Python keeps the compiled bytecode of gpufleet, the examples and the scripts between
starts, as an installed package has it (``--compile-each-start``: every process compiles
them, as with PYTHONDONTWRITEBYTECODE=1).

A rank writes the wall-clock time at the end of its first optimizer step to a file; the
figure is that time minus the moment the command was started ("first step"), and the
command's whole wall time ("total"). The ways take turns (``--repeats`` rounds) so a noisy
machine slows them alike; the medians are printed with the ratio to torchrun.

    python benchmarks/startup.py               # 3 rounds
    python benchmarks/startup.py --repeats 5
    python benchmarks/startup.py --job minilm     # the MiniLM fine-tune
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from gpufleet.core.machine import machine_summary

ROOT = Path(__file__).resolve().parents[1]
STEPS = 20

# The rank-side code every way shares: the example's model, data and recipe, and a mark
# written at the end of the first optimizer step.
COMMON = textwrap.dedent(f"""
    import os, sys, time
    sys.path.insert(0, {str(ROOT / "examples")!r})
    import torch
    from torch.nn import functional as F
    import ddp_regression as ex

    STEPS = {STEPS}

    def mark():
        path = os.environ["STARTUP_MARK"] + "." + os.environ.get("RANK", "0")
        with open(path, "w") as f:
            f.write(repr(time.time()))
""")

PLAIN = COMMON + textwrap.dedent("""
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = ex.build_model()
    data = ex.build_data()
    sampler = DistributedSampler(data, shuffle=False)
    loader = DataLoader(data, batch_size=8, sampler=sampler, drop_last=True)
    net = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = ex.build_optimizer(model.parameters())
    for step, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        F.mse_loss(net(x), y).backward()
        optimizer.step()
        if step == 0:
            mark()
        if step + 1 == STEPS:
            break
    dist.destroy_process_group()
""")

FIT = COMMON + textwrap.dedent("""
    import gpufleet

    class FirstStep(gpufleet.Callback):
        def on_step_end(self, view, step):
            if step == 1:
                mark()

    def model():
        torch.manual_seed(0)
        return ex.build_model()

    if __name__ == "__main__":
        gpufleet.fit(model(), ex.build_data(), loss_fn=F.mse_loss,
                     optimizer=ex.build_optimizer, callbacks=[FirstStep()],
                     overrides={"run.max_steps": STEPS, "data.batch_size": 8,
                                "data.shuffle": False, "dist.nproc": 2,
                                "run.eval_every": 0, "log.progress": "off",
                                "run.out_dir": os.environ["STARTUP_RUNS"]})
""")

FLEET = COMMON + textwrap.dedent("""
    import gpufleet
    from torch.utils.data import DataLoader

    fleet = gpufleet.Fleet()
    torch.manual_seed(0)
    model, optimizer = ex.build_model(), None
    optimizer = ex.build_optimizer(model.parameters())
    model, optimizer = fleet.setup(model, optimizer)
    loader = fleet.setup_dataloaders(DataLoader(ex.build_data(), batch_size=8,
                                                drop_last=True))
    for step, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        fleet.backward(F.mse_loss(model(x), y))
        optimizer.step()
        if step == 0:
            mark()
        if step + 1 == STEPS:
            break
""")


# The MiniLM fine-tune of examples/finetune_transformers.py: the example's own plain
# loop and gpufleet.fit call; AdamW's first step (in every rank) writes the mark.
MINILM = COMMON.replace("ddp_regression", "finetune_transformers") + textwrap.dedent("""
    _step = torch.optim.AdamW.step

    def _marked_step(self, *args, **kwargs):
        out = _step(self, *args, **kwargs)
        if not getattr(self, "_marked", False):
            self._marked = True
            mark()
        return out

    torch.optim.AdamW.step = _marked_step

    if __name__ == "__main__":
        if "RANK" in os.environ and not os.environ.get("STARTUP_FIT_ON_RANKS"):
            ex.train_plain(STEPS, 8)
        else:  # gpufleet.fit starts 2 ranks, or trains this one's share of 2
            ex.train_gpufleet(STEPS, 8, nproc=2, overrides={
                "log.progress": "off", "monitor.report": False,
                "run.out_dir": os.environ["STARTUP_RUNS"]})
""")


def _minilm_ways(work: Path) -> dict[str, list[str]]:
    (work / "minilm.py").write_text(MINILM)
    py = sys.executable
    return {"torchrun": [py, "-m", "torch.distributed.run", "--standalone",
                         "--nproc-per-node", "2", str(work / "minilm.py")],
            "gpufleet.fit": [py, str(work / "minilm.py")],
            # the script started per rank, torchrun's way, and fit trains each rank's share
            "gpufleet run + fit": ["env", "STARTUP_FIT_ON_RANKS=1", py, "-m", "gpufleet",
                                   "run", "--nproc", "2", str(work / "minilm.py")]}


def _ways(work: Path) -> dict[str, list[str]]:
    """The command of each way, with its script written under ``work``."""
    for name, text in (("plain.py", PLAIN), ("fit.py", FIT), ("fleet.py", FLEET)):
        (work / name).write_text(text)
    (work / "job.py").write_text(COMMON + textwrap.dedent("""
        class MarkedSGD(torch.optim.SGD):
            \"\"\"The example's SGD; its first step writes the mark.\"\"\"

            def step(self, closure=None):
                out = super().step(closure)
                if not getattr(self, "_marked", False):
                    self._marked = True
                    mark()
                return out

        def model(**kwargs):
            return ex.build_model()

        def data(**kwargs):
            return ex.build_data()

        def optimizer(params):
            return MarkedSGD(params, lr=0.01, momentum=0.9)

        def loss(output, target):
            return F.mse_loss(output, target)
    """))
    py = sys.executable
    ways = {
        "torchrun": [py, "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node", "2", str(work / "plain.py")],
        "gpufleet.fit": [py, str(work / "fit.py")],
        "gpufleet train": [py, "-m", "gpufleet", "train", "--nproc", "2",
                           "--model", "job:model", "--data", "job:data",
                           "--optim.factory", "job:optimizer", "--model.loss", "job:loss",
                           "--max-steps", str(STEPS),
                           "--batch-size", "8", "--data.shuffle", "false",
                           "--run.eval_every", "0", "--log.progress", "off",
                           "--run.out_dir", str(work / "runs")],
    }
    fleet = subprocess.run([py, "-c", "import gpufleet; gpufleet.Fleet"], capture_output=True)
    if fleet.returncode == 0:
        ways["gpufleet run (Fleet)"] = [py, "-m", "gpufleet", "run", "--nproc", "2",
                                        str(work / "fleet.py")]
    return ways


# What torch's gloo sometimes does as a rank's process ends (a C++ thread still joinable
# at exit), under torchrun as under gpufleet: the start is repeated and counted.
ABORT_AT_EXIT = "terminate called without an active exception"
aborts: dict[str, int] = {}


def _env(work: Path, compile_each_start: bool, src: Path = ROOT / "src") -> dict[str, str]:
    """The environment of every way, with gpufleet's sources from ``src``. Unless
    ``compile_each_start``, Python keeps the compiled bytecode of gpufleet, the examples
    and the scripts (under ``work``), as an installed package has it, whatever
    PYTHONDONTWRITEBYTECODE says here."""
    env = {**os.environ, "STARTUP_RUNS": str(work / "runs"),
           "PYTHONPATH": os.pathsep.join([str(work), str(src),
                                          os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    if not compile_each_start:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(src),
                        str(ROOT / "examples"), str(work)], env=env, check=True,
                       capture_output=True)
    return env


def _once(command: list[str], work: Path, tag: str, env: dict[str, str],
          name: str) -> tuple[float, float]:
    """``(first step, total)`` seconds of one start of ``command``."""
    for _ in range(3):
        marks = work / f"mark-{tag}"
        for old in work.glob(f"mark-{tag}.*"):
            old.unlink()
        start = time.time()
        done = subprocess.run(command, cwd=work, env={**env, "STARTUP_MARK": str(marks)},
                              capture_output=True, text=True)
        total = time.time() - start
        if done.returncode == 0 or ABORT_AT_EXIT not in done.stdout + done.stderr:
            break
        aborts[name] = aborts.get(name, 0) + 1
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}"
                         f"{done.stderr[-4000:]}")
    firsts = [float(p.read_text()) for p in work.glob(f"mark-{tag}.*")]
    if not firsts:
        raise SystemExit(f"{' '.join(command)} wrote no first-step mark")
    return max(firsts) - start, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--job", choices=("regression", "minilm"), default="regression",
                        help="the DDP-tutorial regression, or the MiniLM fine-tune")
    parser.add_argument("--compile-each-start", action="store_true",
                        help="compile gpufleet's sources in every process, as Python does "
                             "with PYTHONDONTWRITEBYTECODE=1 (default: keep the bytecode, "
                             "as an installed package does)")
    parser.add_argument("--warmup", type=int, default=1, metavar="N",
                        help="untimed starts of each way first (the files they read come "
                             "into the page cache, for the first timed way as for the rest)")
    parser.add_argument("--compare-src", type=Path, metavar="DIR",
                        help="also time gpufleet's ways with the gpufleet sources in DIR "
                             "(e.g. an older checkout's src/), interleaved with these")
    args = parser.parse_args()
    print(machine_summary())
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the start; "
          + ("every process compiles gpufleet's sources" if args.compile_each_start
             else "bytecode cached, as an installed package has it"))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ways = _ways(work) if args.job == "regression" else _minilm_ways(work)
        env = _env(work, args.compile_each_start)
        envs = dict.fromkeys(ways, env)
        if args.compare_src:
            other = _env(work, args.compile_each_start, args.compare_src.resolve())
            for name in [n for n in ways if n != "torchrun"]:
                ways[f"{name} [{args.compare_src}]"] = ways[name]
                envs[f"{name} [{args.compare_src}]"] = other
        for i, (name, command) in enumerate(ways.items()):  # files read once, not timed
            for round_ in range(args.warmup):
                _once(command, work, f"warmup-{round_}-{i}", envs[name], name)
        seen: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
        for round_ in range(args.repeats):
            for i, (name, command) in enumerate(ways.items()):
                seen[name].append(_once(command, work, f"{round_}-{i}", envs[name], name))
    base_first = statistics.median(f for f, _ in seen["torchrun"])
    base_total = statistics.median(t for _, t in seen["torchrun"])
    print(f"\n{args.job}: 2 CPU ranks, {STEPS} steps, median of {args.repeats} interleaved "
          f"starts after {args.warmup} untimed\n")
    width = max(22, *(len(name) + 2 for name in seen))
    print(f"{'way':<{width}}{'first step s':>13}{'vs torchrun':>13}{'total s':>10}"
          f"{'vs torchrun':>13}")
    for name, runs in seen.items():
        first = statistics.median(f for f, _ in runs)
        total = statistics.median(t for _, t in runs)
        print(f"{name:<{width}}{first:>13.2f}{first - base_first:>+12.2f}s"
              f"{total:>10.2f}{total - base_total:>+12.2f}s")
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end")
    for name, count in aborts.items():
        print(f"{name}: {count} start(s) repeated after torch's gloo aborted a rank at "
              f"exit ({ABORT_AT_EXIT!r})")


if __name__ == "__main__":
    main()
