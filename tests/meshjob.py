"""A tiny GPT job for the mesh tests (tensor parallelism splits its heads); importable
by launched ranks like toyjob."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from gpufleet.models.gpt import GPT, GPTConfig

VOCAB, BLOCK = 64, 8


def make_gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=4, n_embd=32))


def make_tokens(n: int = 128, n_eval: int = 0):
    """``(tokens, next tokens)`` pairs of a fixed random sequence: the GPT computes its
    own loss from them."""
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, VOCAB, (n + n_eval, BLOCK + 1), generator=g)
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    train = TensorDataset(x[:n], y[:n])
    return (train, TensorDataset(x[n:], y[n:])) if n_eval else train
