"""gpufleet beside the loops users compare it with, step for step in one process.

Every loop trains the same model with the same recipe on the same batches in the same
order: a hand-written PyTorch loop, Lightning Fabric, Accelerate and the Lightning
Trainer (each when installed: ``pip install -e '.[bench]'``), gpufleet with its
defaults, with monitoring off, and bare (also without the non-finite guard and the
watchdog), and the hand-written loop on ``gpufleet.Fleet`` (defaults, and monitoring
off), changed where Fabric's is. Each loop runs in a thread of its own and the loops
take turns a step at a time (a baton passes after every step), so a noisy machine slows
them alike; the order of the turns is shuffled every round (seeded), as a step right
after a given other loop's pays for what that loop left behind (its garbage, the caches
it took: about 20-35 µs of CPU per step here when one loop always follows the
hand-written one). ``--turn-steps 50`` passes the baton after every block of 50 steps
instead: each loop then runs warm, as a run trains alone, and the comparison still
shares the machine's moments a block at a time. A step is timed from the moment its
loop gets the baton (or its previous step ended) to the end of its step, on the wall
clock and on the loop thread's CPU clock; the figure is the median over blocks of 50
steps of the block's mean. Also printed: the time from a loop's first
line to the end of its first step, with each framework's entry module imported before
(``lightning.fabric``, ``accelerate``, ``lightning``, ``gpufleet.api``: what a user's
``import`` line pays, itself timed in a fresh process and printed first) and what it
imports later counted.

    python benchmarks/peers.py                      # MLP 256-256-10, batch 32, SGD
    python benchmarks/peers.py --job gpt --steps 300   # the built-in GPT's recipe
    python benchmarks/peers.py --turn-steps 50      # warm: turns of a block each
    python benchmarks/peers.py --turn-steps 50 --breakdown   # + where gpufleet's µs go
    python benchmarks/peers.py --device cuda --precision bf16 --turn-steps 50   # a GPU

On a GPU every loop runs on one device at the named precision (each framework's own
switch: Fabric's and the Trainer's ``precision``, Accelerate's ``mixed_precision``,
gpufleet's ``precision.mode``, autocast in the hand-written loop). The device is
synchronized at the end of every turn, inside the turn's last timed step, so a loop never
hands its queued kernels to the next one: a block's mean is then the loop's throughput,
its host work hidden behind the GPU's as far as the loop lets it be.

``--breakdown`` adds gpufleet loops that each leave out one part of the defaults (the
watchdog, the non-finite guard, monitoring; on CUDA the side-stream prefetch and the
pinned batches), one with a metrics line every 50 steps instead of 10, and prints what
each part costs a step against the defaults, in µs and as a share of Fabric's step:
where the distance to Fabric sits.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpufleet
from gpufleet.core.machine import machine_summary
from gpufleet.models.gpt import build_gpt
from gpufleet.train.optim import OptimConfig, fill_optimizer_defaults, lr_factor

BLOCK = 50  # steps per timing block


@dataclass
class Job:
    """The model, data and recipe every loop trains."""

    name: str
    batch: int
    steps: int
    make_model: Callable[[], nn.Module]
    data: TensorDataset
    make_opt: Callable[[Any], torch.optim.Optimizer]
    make_sched: Callable[[torch.optim.Optimizer], Any] | None
    clip: float  # clip the gradient norm to this (0: no clip)
    loss: Callable[[nn.Module, Any], torch.Tensor]
    gpufleet: dict[str, Any] = field(default_factory=dict)  # the same recipe as config
    device: str = "cpu"
    precision: str = "fp32"  # or "bf16": mixed, autocast to bfloat16

    def autocast(self) -> Any:
        """The hand-written loop's autocast for ``precision`` (a no-op for fp32)."""
        return torch.autocast(self.device, dtype=torch.bfloat16,
                              enabled=self.precision == "bf16")


def mlp_job(steps: int) -> Job:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8192, 256, generator=g)
    y = (x @ torch.randn(256, 10, generator=g)).argmax(-1)
    return Job("mlp 256-256-10, batch 32, SGD lr 0.01 (no clip, schedule, momentum)",
               32, steps,
               lambda: nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)),
               TensorDataset(x, y), lambda p: torch.optim.SGD(p, lr=0.01), None, 0.0,
               lambda m, b: F.cross_entropy(m(b[0]), b[1]),
               {"optim.name": "sgd", "optim.lr": 0.01})


def gpt_job(steps: int) -> Job:
    """The default job's GPT and its preset: AdamW 3e-3 (0.9, 0.95), decay 0.1 on
    matrices, clip 1.0, 20 warm-up steps, cosine to 0.1."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (4096, 129), generator=g)
    cfg = fill_optimizer_defaults(OptimConfig(preset="gpt"), build_gpt(1, 1, 8, 8))

    def make_model() -> nn.Module:
        return build_gpt(n_layer=4, n_head=4, n_embd=128, block_size=128)

    def make_opt(params: Any) -> torch.optim.Optimizer:
        params = list(params)
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, cfg.beta2), fused=True)

    return Job("built-in GPT (4 x 128, 128 tokens), batch 16, the gpt preset", 16, steps,
               make_model, TensorDataset(tokens[:, :-1], tokens[:, 1:]), make_opt,
               lambda opt: torch.optim.lr_scheduler.LambdaLR(
                   opt, lambda s: lr_factor(s, cfg, steps)), cfg.clip_norm,
               lambda m, b: m(b[0], targets=b[1]), {"optim.preset": "gpt"})


class Baton:
    """Lets one loop run at a time, ``steps`` steps each, in turn: in the given order in
    the first round, then in a new random order (seeded) every round.

    One step a turn (the default) gives every loop the same moment of the machine, but
    each step then starts with the caches the other loops left: it measures a cold step.
    Turns of a block of steps (``steps`` = :data:`BLOCK`) measure the loops as a run
    trains, warm after a turn's first step, still interleaved a block at a time."""

    def __init__(self, names: list[str], seed: int = 0, steps: int = 1,
                 sync: Callable[[], None] | None = None) -> None:
        self.names, self.turn, self.steps, self.sync = names, 0, steps, sync
        self._order, self._pos = list(range(len(names))), 0
        self._rng = random.Random(seed)
        self.active = [True] * len(names)
        self.cv = threading.Condition()
        self.wall: list[list[float]] = [[] for _ in names]
        self.cpu: list[list[float]] = [[] for _ in names]
        self.first: list[float] = [0.0] * len(names)
        self.errors: dict[int, str] = {}  # loop -> why it stopped before its last step
        self._t0 = [0.0] * len(names)
        self._c0 = [0.0] * len(names)
        self._started = [0.0] * len(names)

    def start(self, i: int) -> None:
        self._wait(i)
        self._started[i] = self._t0[i]

    def step_done(self, i: int) -> None:
        first = not self.wall[i] and not self.first[i]
        if self.sync and (len(self.wall[i]) + (1 if first else 2)) % self.steps == 0:
            self.sync()  # the turn ends: its queued device work is its own
        wall, cpu = time.perf_counter(), time.thread_time()
        if first:
            self.first[i] = wall - self._started[i]
        else:
            self.wall[i].append(wall - self._t0[i])
            self.cpu[i].append(cpu - self._c0[i])
        if (len(self.wall[i]) + 1) % self.steps:  # the turn goes on (the first step is
            self._t0[i], self._c0[i] = time.perf_counter(), time.thread_time()  # untimed)
            return
        self._pass(i)
        self._wait(i)

    def finish(self, i: int) -> None:
        if self.sync:
            with contextlib.suppress(Exception):  # a loop that broke the device still
                self.sync()  # hands the baton on
        with self.cv:
            self.active[i] = False
        self._pass(i)

    def _wait(self, i: int) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.turn == i)
        self._t0[i], self._c0[i] = time.perf_counter(), time.thread_time()

    def _pass(self, i: int) -> None:
        with self.cv:
            self._pos += 1
            while True:
                if self._pos >= len(self._order):  # a new round, in a new order
                    self._order = [j for j, on in enumerate(self.active) if on]
                    self._rng.shuffle(self._order)
                    self._pos = 0
                    if not self._order:
                        break
                if self.active[self._order[self._pos]]:
                    self.turn = self._order[self._pos]
                    break
                self._pos += 1
            self.cv.notify_all()


def loader(job: Job) -> DataLoader:
    return DataLoader(job.data, batch_size=job.batch, shuffle=False, drop_last=True)


def _steps(job: Job, model: nn.Module, opt: Any, sched: Any, data: Any,
           backward: Callable[[torch.Tensor], None], clip: Callable[[], None],
           done: Callable[[], None]) -> None:
    """The loop every hand-driven framework runs: ``job.steps`` steps over ``data``."""
    step = 0
    while step < job.steps:
        for batch in data:
            backward(job.loss(model, batch))
            if job.clip:
                clip()
            opt.step()
            if sched:
                sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            done()
            if step == job.steps:
                return


def _parts(job: Job, device: str = "cpu") -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(0)
    model = job.make_model().to(device)
    opt = job.make_opt(model.parameters())
    return model, opt, job.make_sched(opt) if job.make_sched else None


def hand(job: Job, done: Callable[[], None]) -> None:
    model, opt, sched = _parts(job, job.device)
    loss_fn = job.loss

    def loss_on_device(m: nn.Module, batch: Any) -> torch.Tensor:
        with job.autocast():
            return loss_fn(m, [t.to(job.device, non_blocking=True) for t in batch])

    job = dataclasses.replace(job, loss=loss_on_device)
    _steps(job, model, opt, sched, loader(job), lambda loss: loss.backward(),
           lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), job.clip), done)


def fabric(job: Job, done: Callable[[], None]) -> None:
    from lightning.fabric import Fabric

    f = Fabric(accelerator=job.device, devices=1,
               precision="bf16-mixed" if job.precision == "bf16" else "32-true")
    model, opt, sched = _parts(job)
    model, opt = f.setup(model, opt)
    _steps(job, model, opt, sched, f.setup_dataloaders(loader(job)), f.backward,
           lambda: f.clip_gradients(model, opt, max_norm=job.clip), done)


def accelerate(job: Job, done: Callable[[], None]) -> None:
    from accelerate import Accelerator

    acc = Accelerator(cpu=job.device == "cpu",
                      mixed_precision="bf16" if job.precision == "bf16" else "no")
    model, opt, sched = _parts(job)
    model, opt, data = acc.prepare(model, opt, loader(job))
    _steps(job, model, opt, sched, data, acc.backward,
           lambda: acc.clip_grad_norm_(model.parameters(), job.clip), done)


def lightning_trainer(job: Job, done: Callable[[], None]) -> None:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = job.make_model()

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            return job.loss(self.net, batch)

        def configure_optimizers(self) -> Any:
            opt = job.make_opt(self.net.parameters())
            if job.make_sched is None:
                return opt
            return {"optimizer": opt,
                    "lr_scheduler": {"scheduler": job.make_sched(opt), "interval": "step"}}

    class Turns(L.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            done()

    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="gpu" if job.device == "cuda" else "cpu", devices=1,
                        precision="bf16-mixed" if job.precision == "bf16" else "32-true",
                        max_steps=job.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=job.clip or None,
                        callbacks=[Turns()], num_sanity_val_steps=0)
    trainer.fit(Module(), loader(job))


MONITORING_OFF = {"monitor.phases": False, "monitor.diagnose": False,
                  "monitor.system_interval_s": 0, "monitor.report": False,
                  "monitor.link_probe": False}
BARE = {**MONITORING_OFF, "fault.skip_nonfinite": False, "fault.watchdog": False}
#: --breakdown: each loop leaves one part of the defaults out (name: overrides)
#: (monitoring's whole part is the "gpufleet monitoring off" loop, always run; its
#: pieces follow; on CUDA the phase times also sample one step per log line with events)
PARTS = {"watchdog": {"fault.watchdog": False},
         "non-finite guard": {"fault.skip_nonfinite": False},
         "log lines every 10 steps, not 50": {"log.every": 50},
         "  of monitoring: phase times": {"monitor.phases": False},
         "  of monitoring: system sampler": {"monitor.system_interval_s": 0},
         "  of monitoring: diagnosis": {"monitor.diagnose": False}}


#: --breakdown on CUDA: the input path's parts (a CPU run has neither). Each is a few CUDA
#: calls a step on the host (a pinned copy made by the loader, the side stream's wait
#: and record_stream), against a copy that takes microseconds for small batches.
CUDA_PARTS = {"  of the input: side-stream prefetch": {"data.device_prefetch": False},
              "  of the input: pinned batches": {"data.pin_memory": False}}


#: --breakdown: your own loop on Fleet without its guard (Fleet's guard: the row's gap)
FLEET_NO_GUARD = "gpufleet Fleet - non-finite guard"


def _mode(job: Job) -> str:
    return "bf16-mixed" if job.precision == "bf16" else "fp32"


def gpufleet_loop(extra: dict[str, Any]) -> Callable[[Job, Callable[[], None]], None]:
    def run(job: Job, done: Callable[[], None]) -> None:
        class Turns(gpufleet.Callback):
            def on_step_end(self, view: Any, step: int) -> None:
                done()

        torch.manual_seed(0)
        with tempfile.TemporaryDirectory() as tmp:
            gpufleet.fit(job.make_model(), job.data, callbacks=[Turns()],
                         loss_fn=None if job.name.startswith("built-in") else F.cross_entropy,
                         overrides={"run.max_steps": job.steps, "data.batch_size": job.batch,
                                    "data.shuffle": False, "data.num_workers": 0,
                                    "run.eval_every": 0, "log.progress": "off",
                                    "log.level": "WARNING", "checkpoint.save_final": False,
                                    "run.out_dir": tmp, "run.device": job.device,
                                    "precision.mode": _mode(job), **job.gpufleet,
                                    **extra})
    return run


def fleet_loop(extra: dict[str, Any]) -> Callable[[Job, Callable[[], None]], None]:
    """The hand-driven loop on ``gpufleet.Fleet`` (your own loop; the lines Fabric's
    row changes, changed the same way)."""
    def run(job: Job, done: Callable[[], None]) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            f = gpufleet.Fleet(accelerator=job.device, devices=1, precision=_mode(job),
                               run_dir=tmp, overrides={"log.level": "WARNING", **extra})
            model, opt, _ = _parts(job)
            model, opt = f.setup(model, opt)  # rebuilt on the placed parameters
            sched = job.make_sched(opt) if job.make_sched else None
            _steps(job, model, opt, sched, f.setup_dataloaders(loader(job)), f.backward,
                   lambda: f.clip_gradients(model, opt, max_norm=job.clip), done)
            f.finish()
    return run


def run_in_turns(job: Job, loops: dict[str, Any], turn_steps: int = 1) -> Baton:
    """Run every loop of ``loops`` on ``job``, each in a thread named after it,
    ``turn_steps`` steps at a time in turn; the :class:`Baton` holds their timings."""
    names = list(loops)
    baton = Baton(names, steps=turn_steps,
                  sync=torch.cuda.synchronize if job.device == "cuda" else None)

    def worker(i: int) -> None:
        baton.start(i)
        try:
            loops[names[i]](job, lambda: baton.step_done(i))
        except Exception as e:  # one loop failing leaves the others' comparison
            baton.errors[i] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:150]}"
        finally:
            baton.finish(i)

    threads = [threading.Thread(target=worker, args=(i,), name=n, daemon=True)
               for i, n in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return baton


def block_median(xs: list[float], warmup: int) -> float:
    """The median over blocks of :data:`BLOCK` steps of the block's mean, after the first
    ``warmup`` steps."""
    xs = xs[warmup:]
    means = [statistics.fmean(xs[k:k + BLOCK]) for k in range(0, len(xs) - BLOCK + 1, BLOCK)]
    return statistics.median(means) if means else float("nan")


def installed(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False


def import_seconds(module: str) -> float | None:
    """Seconds ``import module`` takes in a fresh process that imported torch first
    (what the user's import line pays for the framework itself), or None when it fails."""
    code = ("import time, torch; t = time.perf_counter(); import " + module +
            "; print(time.perf_counter() - t)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    try:
        return float(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", choices=("mlp", "gpt"), default="mlp")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=50, help="steps left out of the timing")
    p.add_argument("--turn-steps", type=int, default=1,
                   help="steps a loop runs before passing the baton (1: cold steps; "
                        f"{BLOCK}: warm, a block a turn)")
    p.add_argument("--breakdown", action="store_true",
                   help="also run gpufleet without each part of its defaults, and print "
                        "what each part costs a step")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: each framework's bf16 mixed precision (autocast)")
    p.add_argument("--json", metavar="PATH", help="also write the table here as JSON")
    p.add_argument("--no-import-times", action="store_true",
                   help="do not time each entry module's import in a fresh process")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible here")
    job = dataclasses.replace((mlp_job if args.job == "mlp" else gpt_job)(args.steps),
                              device=args.device, precision=args.precision)
    loops: dict[str, Any] = {"hand-written": hand}
    missing = []
    for name, module, fn in (("Lightning Fabric", "lightning.fabric", fabric),
                             ("Accelerate", "accelerate", accelerate),
                             ("Lightning Trainer", "lightning", lightning_trainer)):
        if installed(module):
            loops[name] = fn
        else:
            missing.append(name)
    importlib.import_module("gpufleet.api")  # gpufleet.fit's module, as the peers' above
    loops["gpufleet defaults"] = gpufleet_loop({})
    loops["gpufleet monitoring off"] = gpufleet_loop(MONITORING_OFF)
    loops["gpufleet bare"] = gpufleet_loop(BARE)
    loops["gpufleet Fleet"] = fleet_loop({})
    loops["gpufleet Fleet mon. off"] = fleet_loop(MONITORING_OFF)
    parts = {**PARTS, **(CUDA_PARTS if args.device == "cuda" else {})}
    if args.breakdown:
        for part, extra in parts.items():
            loops[f"gpufleet - {part}"] = gpufleet_loop(extra)
        loops[FLEET_NO_GUARD] = fleet_loop(PARTS["non-finite guard"])
    print(machine_summary())
    print(f"load average (1, 5, 15 min): {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    if sys.flags.dont_write_bytecode:
        print("note: PYTHONDONTWRITEBYTECODE is set: a module without a cached .pyc is "
              "compiled at import, which a first step that imports lazily pays for")
    if not args.no_import_times:
        entries = [m for n, m in (("Lightning Fabric", "lightning.fabric"),
                                  ("Accelerate", "accelerate"),
                                  ("Lightning Trainer", "lightning")) if n in loops]
        took = {m: import_seconds(m) for m in [*entries, "gpufleet.api"]}
        print("import of each entry module, fresh process, torch imported first: " +
              ", ".join(f"{m} {t:.2f} s" if t is not None else f"{m} failed"
                        for m, t in took.items()))
    turns = "one step" if args.turn_steps == 1 else f"{args.turn_steps} steps"
    where = "CPU" if job.device == "cpu" else torch.cuda.get_device_name()
    print(f"job: {job.name}; {args.steps} steps each, turns of {turns}, first "
          f"{args.warmup} not timed, blocks of {BLOCK}; 1 torch thread; on {where}, "
          f"{job.precision}")
    if missing:
        print("not installed, left out: " + ", ".join(missing) + " (pip install -e '.[bench]')")
    names = list(loops)
    baton = run_in_turns(job, loops, args.turn_steps)

    def blocks(xs: list[float]) -> float:
        return block_median(xs, args.warmup)

    hw, hc = blocks(baton.wall[0]), blocks(baton.cpu[0])
    width = max(26, *(len(n) + 2 for n in names))
    print(f"\n{'loop':<{width}}{'wall us/step':>13}{'vs hand':>9}{'+us':>8}{'cpu us/step':>13}"
          f"{'vs hand':>9}{'first step s':>14}")
    for i, name in enumerate(names):
        w, c = blocks(baton.wall[i]), blocks(baton.cpu[i])
        print(f"{name:<{width}}{w * 1e6:>13.1f}{w / hw:>9.3f}{(w - hw) * 1e6:>8.1f}"
              f"{c * 1e6:>13.1f}{c / hc:>9.3f}{baton.first[i]:>14.3f}")
    for i, why in baton.errors.items():
        print(f"{names[i]} failed: {why}")
    if args.breakdown and "Lightning Fabric" in loops:
        fabric_i, defaults_i = names.index("Lightning Fabric"), names.index("gpufleet defaults")
        without = {"monitoring": "gpufleet monitoring off",
                   **{part: f"gpufleet - {part}" for part in parts}}
        times = {n: (blocks(baton.wall[i]), blocks(baton.cpu[i])) for i, n in enumerate(names)}
        print_breakdown(times, names[fabric_i], names[defaults_i], without)
        print_breakdown(times, names[fabric_i], "gpufleet Fleet",
                        {"non-finite guard": FLEET_NO_GUARD})
    print(f"load average at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    if args.json:
        rows = [{"loop": n, "wall_us": blocks(baton.wall[i]) * 1e6,
                 "cpu_us": blocks(baton.cpu[i]) * 1e6, "first_s": baton.first[i],
                 "error": baton.errors.get(i)} for i, n in enumerate(names)]
        with open(args.json, "w") as f:
            json.dump({"machine": machine_summary(), "job": job.name, "device": where,
                       "precision": job.precision, "steps": args.steps,
                       "turn_steps": args.turn_steps, "rows": rows}, f, indent=1)


def print_breakdown(times: dict[str, tuple[float, float]], fabric: str, defaults: str,
                    without: dict[str, str]) -> None:
    """What each part of gpufleet's defaults costs a step: the defaults' time less the
    time of the loop without it (``without``: part -> loop), in µs and as a share of
    Fabric's step (wall, CPU)."""
    fw, fc = times[fabric]
    dw, dc = times[defaults]
    print(f"\nwhere {defaults}'s time over Fabric's goes ({(dw - fw) * 1e6:+.1f} µs wall, "
          f"{(dc - fc) * 1e6:+.1f} µs CPU a step):")
    print(f"{'part':<40}{'wall us':>9}{'% Fabric':>10}{'cpu us':>9}{'% Fabric':>10}")
    for part, loop in without.items():
        w, c = times[loop]
        print(f"{part:<40}{(dw - w) * 1e6:>9.1f}{(dw - w) / fw * 100:>10.1f}"
              f"{(dc - c) * 1e6:>9.1f}{(dc - c) / fc * 100:>10.1f}")


if __name__ == "__main__":
    main()
