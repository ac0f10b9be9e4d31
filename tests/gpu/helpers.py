"""Helpers of the CUDA-path tests: a tiny learnable token task, a GPT small enough to
train in seconds, and a callback that keeps the trainer and its logged metrics."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import TensorDataset

from gpufleet.core.callbacks import Callback
from gpufleet.models.gpt import build_gpt

VOCAB, SEQ = 64, 32



def counting_tokens(n: int = 512, seq: int = SEQ, vocab: int = VOCAB) -> TensorDataset:
    """``(x, y)`` windows of ``start, start+1, ...`` (mod vocab): the next token is always
    the current one plus one, so the loss falls fast from ln(vocab) toward 0."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    tokens = (start + torch.arange(seq + 1)) % vocab
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def tiny_gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_gpt(n_layer=2, n_head=2, n_embd=64, block_size=SEQ, vocab_size=VOCAB)


class Capture(Callback):
    """Keeps the trainer (``on_fit_start``) and every logged metrics dict."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.logs: list[dict[str, Any]] = []

    def on_fit_start(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_log(self, trainer: Any, step: int, metrics: dict[str, Any]) -> None:
        self.logs.append(metrics)


def assert_learned(result: Any, drop: float = 0.5) -> None:
    """The logged training loss fell by at least ``drop`` (a share of the first one)."""
    losses = [loss for _, loss in result.losses]
    assert len(losses) >= 2, f"too few log intervals: {result.losses}"
    assert all(torch.isfinite(torch.tensor(losses))), f"non-finite loss: {losses}"
    assert losses[-1] < (1 - drop) * losses[0], f"the loss did not fall enough: {losses}"
