"""Throughput and MFU of the default GPT under gpufleet, per precision and with compile.

Rows: fp32, bf16-mixed, bf16-mixed + torch.compile. Each row trains the model with
gpufleet.fit on generated tokens (a fixed random bigram chain, so the loss has something
to learn; no download) and reports the median step time after warm-up, tokens/s and MFU:
the model FLOPs of a step (PaLM formula, checked against torch's FLOP counter) over the
step time, as a share of the GPU's dense peak for the precision the matmuls run in (bf16
peak for bf16 rows, tf32 peak for fp32 rows with TF32 on). On CUDA every row also runs a
hand-written loop with the same settings in lockstep with the gpufleet loop (one step of
each in turn, so clock and thermal drift hit both) and reports the step-time ratio;
target: within 2%. Then the fp32 and bf16 loss curves over the first --curve-steps steps
are compared.

    python benchmarks/mfu.py                            # GPT-2 124M class on CUDA
    python benchmarks/mfu.py --device cpu --no-compile  # tiny config, ~1 minute
    python benchmarks/mfu.py --steps 100 --out mfu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

import gpufleet
from gpufleet.core.callbacks import Callback
from gpufleet.core.machine import cpu_model
from gpufleet.models.gpt import GPT, build_gpt
from gpufleet.monitor.flops import count_flops, gpt_train_flops, matmul_precision, mfu, peak_flops

SEED = 1337
LR, WARMUP_LR_STEPS, CLIP = 6e-4, 20, 1.0
LOG_EVERY = 50  # gpufleet's log interval (one host sync each); the hand loop does the same


@dataclass
class Shape:
    n_layer: int
    n_head: int
    n_embd: int
    seq: int
    batch: int
    vocab: int


# -- data and model ---------------------------------------------------------------------

def bigram_tokens(n_seq: int, seq: int, vocab: int, fanout: int = 4) -> TensorDataset:
    """``(x, y)`` windows from a fixed random chain: each token has ``fanout`` equally
    likely successors, so the best possible loss is log(fanout)."""
    g = torch.Generator().manual_seed(0)
    successors = torch.randint(0, vocab, (vocab, fanout), generator=g)
    tokens = torch.empty(n_seq, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (n_seq,), generator=g)
    for t in range(seq):
        pick = torch.randint(0, fanout, (n_seq,), generator=g)
        tokens[:, t + 1] = successors[tokens[:, t], pick]
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def make_model(s: Shape) -> GPT:
    torch.manual_seed(SEED)  # the same initial weights in every run
    return build_gpt(n_layer=s.n_layer, n_head=s.n_head, n_embd=s.n_embd, block_size=s.seq,
                     vocab_size=s.vocab)


def flops_per_step(s: Shape, device: torch.device) -> tuple[int, float]:
    """(counted by torch's FLOP counter, analytic) FLOPs of one forward + backward."""
    model = make_model(s).to(device)
    idx = torch.randint(0, s.vocab, (s.batch, s.seq), device=device)
    counted = count_flops(lambda: model(idx, targets=idx).backward())
    n = model.num_params() - model.wpe.weight.numel()  # all but the position table
    analytic = gpt_train_flops(n, s.n_layer, s.n_embd, s.seq, tokens=s.batch * s.seq)
    return counted, analytic


# -- the hand-written reference loop ------------------------------------------------------

def lr_lambda(step: int, total: int, min_ratio: float = 0.1) -> float:
    if step < WARMUP_LR_STEPS:
        return (step + 1) / WARMUP_LR_STEPS
    progress = min(1.0, (step - WARMUP_LR_STEPS) / max(1, total - 1 - WARMUP_LR_STEPS))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def hand_written(s: Shape, data: TensorDataset, device: torch.device, precision: str,
                 compile_mode: str | None, tf32: bool, steps: int) -> Iterator[None]:
    """What a careful user writes by hand with the same settings; yields after each step."""
    torch.backends.cuda.matmul.allow_tf32 = tf32
    model = make_model(s).to(device)
    if compile_mode is not None:
        model.compile(mode=None if compile_mode == "default" else compile_mode)
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.param_groups(weight_decay=0.1), lr=LR, betas=(0.9, 0.95),
                            **fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: lr_lambda(i, steps))
    g = torch.Generator().manual_seed(SEED)
    loader = DataLoader(data, batch_size=s.batch, sampler=RandomSampler(data, generator=g),
                        drop_last=True, pin_memory=device.type == "cuda")
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16)
                if precision == "bf16-mixed" else contextlib.nullcontext())
    loss_sum = torch.zeros((), device=device)
    step, batches = 0, iter(loader)
    while step < steps:
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast:
            loss = model(x, targets=y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        step += 1
        if step % LOG_EVERY == 0:
            _ = loss_sum.item() / LOG_EVERY  # SYNC: the log line a user prints
            loss_sum.zero_()
        yield


# -- timing -----------------------------------------------------------------------------

class _StepTimer(Callback):
    """Times each gpufleet step; with a hand-written loop, runs one of its steps after
    each gpufleet step and times it too. On CUDA it synchronizes around each timed span
    (the only syncs the benchmark adds), so a step's time is its GPU time."""

    def __init__(self, device: torch.device, hand: Iterator[None] | None) -> None:
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.hand = hand
        self.ours: list[float] = []
        self.theirs: list[float] = []
        self.resumed = 0.0

    def on_fit_start(self, trainer: Any) -> None:
        self.sync()
        self.resumed = time.perf_counter()

    def on_step_end(self, trainer: Any, step: int) -> None:
        self.sync()
        self.ours.append(time.perf_counter() - self.resumed)
        if self.hand is not None:
            start = time.perf_counter()
            next(self.hand)
            self.sync()
            self.theirs.append(time.perf_counter() - start)
        self.resumed = time.perf_counter()


def fit(s: Shape, data: TensorDataset, device: torch.device, precision: str,
        compile_mode: str | None, tf32: bool, steps: int, out_dir: str, log_every: int,
        callbacks: list[Callback]) -> Any:
    return gpufleet.fit(make_model(s), data, callbacks=callbacks, overrides={
        "run.device": device.type, "run.max_steps": steps, "run.seed": SEED,
        "run.out_dir": out_dir, "run.eval_every": 0, "checkpoint.save_final": False,
        "data.batch_size": s.batch, "data.num_workers": 0,
        "optim.lr": LR, "optim.warmup_steps": WARMUP_LR_STEPS, "optim.clip_norm": CLIP,
        "precision.mode": precision, "perf.compile": compile_mode is not None,
        "perf.compile_mode": compile_mode or "default", "perf.tf32": tf32,
        "log.every": log_every, "log.progress": "off", "log.level": "WARNING"})


def time_row(s: Shape, data: TensorDataset, device: torch.device, precision: str,
             compile_mode: str | None, args: argparse.Namespace, out_dir: str,
             hand: bool) -> dict[str, Any]:
    reference = (hand_written(s, data, device, precision, compile_mode, args.tf32, args.steps)
                 if hand else None)
    timer = _StepTimer(device, reference)
    fit(s, data, device, precision, compile_mode, args.tf32, args.steps, out_dir, LOG_EVERY,
        [timer])
    row: dict[str, Any] = {"step_s": statistics.median(timer.ours[args.warmup:])}
    if hand:
        row["hand_step_s"] = statistics.median(timer.theirs[args.warmup:])
        ratios = [o / t for o, t in zip(timer.ours[args.warmup:], timer.theirs[args.warmup:])]
        row["ratio"] = statistics.median(ratios)
    return row


def loss_curve(s: Shape, data: TensorDataset, device: torch.device, precision: str,
               args: argparse.Namespace, out_dir: str) -> list[float]:
    result = fit(s, data, device, precision, None, args.tf32, args.curve_steps, out_dir,
                 log_every=1, callbacks=[])
    return [loss for _, loss in result.losses]


# -- report -----------------------------------------------------------------------------

def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--n-layer", type=int, help="default: 12 on CUDA, 2 on CPU")
    p.add_argument("--n-head", type=int, help="default: 12 on CUDA, 2 on CPU")
    p.add_argument("--n-embd", type=int, help="default: 768 on CUDA, 64 on CPU")
    p.add_argument("--seq", type=int, help="default: 1024 on CUDA, 64 on CPU")
    p.add_argument("--batch", type=int, help="default: 16 on CUDA, 4 on CPU")
    p.add_argument("--vocab", type=int, help="default: 50304 on CUDA (GPT-2 class), 256 on CPU")
    p.add_argument("--steps", type=int, default=None, help="timed run length per row "
                   "(default: 120 on CUDA, 150 on CPU)")
    p.add_argument("--warmup", type=int, default=20, help="first steps left out of timing")
    p.add_argument("--curve-steps", type=int, default=200)
    p.add_argument("--compile-mode", default="default",
                   choices=("default", "reduce-overhead", "max-autotune"))
    p.add_argument("--no-compile", action="store_true", help="skip the compiled row")
    p.add_argument("--no-tf32", dest="tf32", action="store_false",
                   help="fp32 matmuls in full fp32 (then the fp32 peak applies)")
    p.add_argument("--hand", choices=("auto", "on", "off"), default="auto",
                   help="run the hand-written loop in lockstep (auto: on CUDA)")
    p.add_argument("--peak", type=float, help="peak FLOP/s to use for every row")
    p.add_argument("--out", help="write every number as JSON to this file")
    args = p.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = args.device == "cuda"
    for name, on_gpu, on_cpu in (("n_layer", 12, 2), ("n_head", 12, 2), ("n_embd", 768, 64),
                                 ("seq", 1024, 64), ("batch", 16, 4), ("vocab", 50304, 256),
                                 ("steps", 120, 150)):
        if getattr(args, name) is None:
            setattr(args, name, on_gpu if gpu else on_cpu)
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    return args


def main() -> None:
    args = parse_args()
    logging.getLogger("gpufleet").setLevel("WARNING")
    device = torch.device(args.device)
    s = Shape(args.n_layer, args.n_head, args.n_embd, args.seq, args.batch, args.vocab)
    hand = args.hand == "on" or (args.hand == "auto" and device.type == "cuda")
    name = machine(device)
    report: dict[str, Any] = {
        "device": name, "torch": torch.__version__, "cuda": torch.version.cuda,
        "shape": asdict(s), "tf32": args.tf32, "steps": args.steps, "warmup": args.warmup}
    print(f"device: {name} ({device.type}), torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}, {os.cpu_count()} CPU cores")
    print(f"GPT: {s.n_layer} layers, {s.n_head} heads, {s.n_embd} wide, seq {s.seq}, "
          f"batch {s.batch}, vocab {s.vocab}; {args.steps} steps per row, first "
          f"{args.warmup} not timed")
    if device.type != "cuda":
        print("NOTE: CPU run. The MFU targets apply to GPUs; on a CPU there is no peak in "
              "the table (pass --peak to set one), so MFU shows n/a.")

    counted, analytic = flops_per_step(s, device)
    report.update(flops_counted=counted, flops_analytic=analytic)
    print(f"\nFLOPs per step: counted {counted:.4e}, formula {analytic:.4e}, counted/formula "
          f"{counted / analytic:.3f} (the counter adds the attention backward's "
          "recomputation; MFU uses the formula)")

    data = bigram_tokens(max(args.steps, args.curve_steps) * s.batch, s.seq, s.vocab)
    rows = [("fp32", None), ("bf16-mixed", None)]
    if not args.no_compile:
        rows.append(("bf16-mixed", args.compile_mode))
    report["rows"] = []
    hand_head = f" {'hand ms':>9} {'ratio':>6}" if hand else ""
    print(f"\n{'config':<32} {'ms/step':>9} {'tokens/s':>11} {'TFLOP/s':>8} "
          f"{'peak TFLOP/s':>12} {'MFU':>7}{hand_head}")
    with tempfile.TemporaryDirectory() as tmp:
        for precision, compile_mode in rows:
            label = precision + (f" + compile ({compile_mode})" if compile_mode else "")
            row = time_row(s, data, device, precision, compile_mode, args, tmp, hand)
            matmul = matmul_precision(precision, args.tf32 and device.type == "cuda")
            peak = peak_flops(name, matmul, args.peak) if device.type == "cuda" or args.peak \
                else None
            achieved = analytic / row["step_s"]
            row.update(config=label, precision=precision, compile=compile_mode,
                       tokens_per_s=s.batch * s.seq / row["step_s"], flops_per_s=achieved,
                       peak_precision=matmul, peak_flops=peak,
                       mfu=mfu(analytic, row["step_s"], peak) if peak else None,
                       mfu_counted=mfu(counted, row["step_s"], peak) if peak else None)
            report["rows"].append(row)
            mfu_text = f"{row['mfu']:.1%}" if peak else "n/a"
            peak_text = f"{peak / 1e12:.1f} {matmul}" if peak else "n/a"
            hand_text = (f" {row['hand_step_s'] * 1e3:>9.2f} {row['ratio']:>6.3f}"
                         if hand else "")
            print(f"{label:<32} {row['step_s'] * 1e3:>9.2f} {row['tokens_per_s']:>11,.0f} "
                  f"{achieved / 1e12:>8.3f} {peak_text:>12} {mfu_text:>7}{hand_text}",
                  flush=True)
        if hand:
            print("ratio = gpufleet / hand-written median step time (target: within 2%)")

        curves = {p: loss_curve(s, data, device, p, args, tmp) for p in ("fp32", "bf16-mixed")}
    diffs = [abs(a - b) for a, b in zip(curves["fp32"], curves["bf16-mixed"])]
    report["curves"] = {**curves, "max_abs_diff": max(diffs),
                        "mean_abs_diff": statistics.fmean(diffs)}
    print(f"\nloss curves over {len(diffs)} steps, fp32 vs bf16-mixed (same seed, data, init): "
          f"max |diff| {max(diffs):.4f}, mean |diff| {statistics.fmean(diffs):.4f}")
    print(f"{'step':>6} {'fp32':>8} {'bf16':>8} {'diff':>8}")
    for i in [0, *range(19, len(diffs), 20)]:
        a, b = curves["fp32"][i], curves["bf16-mixed"][i]
        print(f"{i + 1:>6} {a:>8.4f} {b:>8.4f} {b - a:>+8.4f}")

    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
