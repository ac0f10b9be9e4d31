"""The part of a model one pipeline stage holds, built on the meta device.

The built-in GPT is split by its units (the embeddings, each block, the final norm and
head) with the split that balances parameters, as the pipeline strategy splits a
sequential model (:func:`gpufleet.parallel.pipeline_split.balanced_split`); with more
than one stage the last stage holds its own copy of the head (the tie with the token
embedding cannot cross ranks). Any ``nn.Sequential`` is split the way the pipeline
strategy splits it. Each stage knows the input it takes, so the planner can run one
micro-batch through it without data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpufleet.errors import ConfigError
from gpufleet.models.gpt import GPT
from gpufleet.parallel.pipeline_split import (
    balanced_split,
    plan_stages,
    sequential_units,
    stage_module,
)


class GPTStage(nn.Module):
    """Blocks ``start:stop`` of a :class:`~gpufleet.models.gpt.GPT`, with the embeddings
    on the first stage and the final norm, head and loss on the last."""

    def __init__(self, gpt: GPT, start: int, stop: int, first: bool, last: bool,
                 share_head: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe = gpt.wte, gpt.wpe
        self.blocks = nn.ModuleList(gpt.blocks[start:stop])
        if last:
            self.ln_f = gpt.ln_f
            if share_head:
                self.lm_head = gpt.lm_head  # tied to wte: one tensor
            else:  # the last stage's own copy of the tied weight
                self.lm_head = nn.Linear(gpt.config.n_embd, gpt.config.padded_vocab_size,
                                         bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.first:
            x = self.wte(x) + self.wpe.weight[: x.shape[1]]
        for block in self.blocks:
            x = block(x)
        if not self.last:
            return x
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


@dataclass
class Stage:
    """One stage's module and the micro-batch it takes.

    Attributes:
        module: the layers this stage holds (the whole model with one stage).
        inputs: positional inputs of one micro-batch, on the meta device.
        blocks: the repeated blocks it holds (what FSDP shards one by one).
        width: the hidden size that crosses a stage boundary and a tensor parallel
            all-reduce (None when the planner cannot tell, for models other than GPT).
        tokens: tokens (or samples) per micro-batch that carry ``width`` values each.
    """

    module: nn.Module
    inputs: tuple[Any, ...]
    blocks: list[nn.Module]
    width: int | None
    tokens: int


def gpt_stage(gpt: GPT, stage: int, stages: int, micro_batch: int) -> Stage:
    """Stage ``stage`` of ``stages`` of the built-in GPT for a micro-batch of
    ``micro_batch`` sequences of ``block_size`` tokens."""
    cfg = gpt.config
    embed = gpt.wte.weight.numel() + gpt.wpe.weight.numel()
    block = sum(p.numel() for p in gpt.blocks[0].parameters())
    head = cfg.n_embd * cfg.padded_vocab_size + gpt.ln_f.weight.numel()
    units = cfg.n_layer + 2
    if stages > units:
        raise ConfigError(f"parallel.pp = {stages}: the GPT has {units} units to split "
                          f"(embeddings, {cfg.n_layer} blocks, head). Use at most {units} "
                          "stages, or a deeper model.")
    starts = [*balanced_split([embed, *[block] * cfg.n_layer, head], stages), units]
    lo, hi = starts[stage], starts[stage + 1]
    first, last = lo == 0, hi == units
    module = GPTStage(gpt, max(lo - 1, 0), min(hi - 1, cfg.n_layer), first, last,
                      share_head=stages == 1)
    T, meta = cfg.block_size, torch.device("meta")
    if first:
        x: torch.Tensor = torch.zeros(micro_batch, T, dtype=torch.long, device=meta)
    else:
        x = torch.zeros(micro_batch, T, cfg.n_embd, device=meta)
    targets = torch.zeros(micro_batch, T, dtype=torch.long, device=meta) if last else None
    inputs = (x, targets) if last else (x,)
    return Stage(module, inputs, list(module.blocks), cfg.n_embd, micro_batch * T)


def sequential_stage(model: nn.Module, stage: int, stages: int, pipeline_split: str,
                     sample: tuple[torch.Tensor, ...]) -> Stage:
    """Stage ``stage`` of an ``nn.Sequential`` (the whole model with one stage); the
    first stage takes ``sample``, later ones the previous stage's output on meta."""
    from gpufleet.parallel.blocks import find_blocks

    if stages == 1:
        modules = dict(model.named_modules())
        return Stage(model, sample, [modules[n] for n in find_blocks(model)], None, 0)
    units = sequential_units(model)
    starts = [*plan_stages(units, stages, pipeline_split), len(units)]
    inputs = sample
    with torch.no_grad():  # the earlier stages only give the input's shape
        for s in range(stage):
            out = stage_module(model, units, starts[s], starts[s + 1])(*inputs)
            inputs = (out,)
    module = stage_module(model, units, starts[stage], starts[stage + 1])
    return Stage(module, inputs, [m for _, m in units[starts[stage]:starts[stage + 1]]],
                 None, 0)
