"""A small decoder-only GPT: the model the default job trains.

Byte-level by default (256 token ids). Pre-LayerNorm blocks, causal self-attention through
``scaled_dot_product_attention`` (flash / memory-efficient kernels where the device has
them), a 4x GELU MLP, and an output head tied to the token embedding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpufleet.errors import ConfigError


@dataclass
class GPTConfig:
    """Shape of a :class:`GPT`.

    Example:
        >>> GPTConfig(vocab_size=100).padded_vocab_size
        128
    """

    vocab_size: int = 256  # token ids the data uses; 256 = raw bytes
    block_size: int = 128  # longest sequence (context length) in tokens
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads per block; must divide n_embd
    n_embd: int = 128  # width of the residual stream
    dropout: float = 0.0  # dropout probability in training (0: off)
    bias: bool = False  # biases in Linear and LayerNorm layers

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"GPTConfig.{name} = {value!r}: must be a positive integer.")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"GPTConfig: n_embd = {self.n_embd} is not divisible by n_head = {self.n_head}. "
                f"Pick n_embd as a multiple of n_head (e.g. {self.n_head * 32}).")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"GPTConfig.dropout = {self.dropout!r}: must be in [0, 1).")

    @property
    def padded_vocab_size(self) -> int:
        """``vocab_size`` rounded up to a multiple of 64, for tensor-core-friendly matmuls.

        The extra ids never occur in the data; their logits are trained towards zero
        probability like any other wrong answer.
        """
        return -(-self.vocab_size // 64) * 64


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only sees positions <= t."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v at once
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.c_attn(x)
        # Widths come from c_attn's output: under tensor parallelism it holds only this
        # rank's heads (q, k, v of n_head / tp heads each), see gpufleet.parallel.tensor.
        C = qkv.size(-1) // 3
        heads = C // self.head_dim
        q, k, v = qkv.split(C, dim=2)
        # [B, T, C] -> [B, heads, T, head_dim]
        q = q.view(B, T, heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward layer: widen 4x, GELU, project back."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer language model.

    Example:
        >>> model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32))
        >>> idx = torch.randint(0, 256, (2, 16))
        >>> model(idx).shape
        torch.Size([2, 16, 256])
        >>> model(idx, targets=idx).shape  # scalar mean cross-entropy
        torch.Size([])
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.n_embd)  # token embedding
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)  # learned position embedding
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.padded_vocab_size, bias=False)
        # Weight tying: the output head reuses the token embedding (one tensor, two uses).
        self.lm_head.weight = self.wte.weight
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02) everywhere, zero biases, and the projections that write
        into the residual stream scaled by 1/sqrt(2 * n_layer) (two per block), so the
        stream's variance does not grow with depth."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.c_proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.c_proj.weight, mean=0.0, std=residual_std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, T, padded_vocab_size]``, or the mean cross-entropy when ``targets``
        (``[B, T]`` token ids) are given.

        Raises:
            ValueError: ``idx`` is not ``[B, T]`` or ``T`` exceeds ``block_size``.
        """
        if idx.ndim != 2:
            raise ValueError(f"GPT expects token ids of shape [batch, time], got "
                             f"{tuple(idx.shape)}. Add a batch dimension with idx[None].")
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size "
                             f"{self.config.block_size}. Feed at most {self.config.block_size} "
                             "tokens or build the model with a larger block_size.")
        # Rows 0..T-1 of the position table (the same as looking up arange(T), and a
        # traced or exported model keeps no device of its own for the positions).
        x = self.drop(self.wte(idx) + self.wpe.weight[:T])  # [B, T, C]; broadcasts
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # [B, T, padded_vocab_size]
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

    def pipeline_units(self) -> list[tuple[str, nn.Module]]:
        """The layers in the order forward runs them, for a pipeline split
        (:mod:`gpufleet.parallel.pipeline`): ``embed`` (token and position embeddings),
        ``blocks.0`` .. ``blocks.N-1``, ``head`` (final norm and output head)."""
        return [("embed", nn.ModuleList([self.wte, self.wpe])),
                *((f"blocks.{i}", b) for i, b in enumerate(self.blocks)),
                ("head", self.ln_f)]

    def pipeline_stage(self, units: list[str]) -> nn.Module:
        """The stage that runs ``units`` (consecutive names of :meth:`pipeline_units`),
        with this model's state-dict names (``blocks.3.mlp.c_fc.weight``)."""
        return GPTStage(self, units)

    def pipeline_ties(self) -> list[tuple[str, str]]:
        """Parameter names that are one tensor in the whole model: the output head is
        the token embedding. Stages that hold one each keep their gradients summed."""
        return [("wte.weight", "lm_head.weight")]

    @staticmethod
    def pipeline_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss :meth:`forward` computes from its logits, for a pipeline's last stage
        (which returns the logits): a run without a loss function of its own trains the
        same loss under ``pipeline`` as under every other strategy. A static method, so
        the stages do not keep the whole model alive."""
        return lm_loss(logits, targets)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters, each tensor counted once (the tied head is the embedding).

        Args:
            exclude_embeddings: leave out the token and position embeddings (the
                "non-embedding" count that scaling laws use).

        Example:
            >>> m = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=8))
            >>> m.num_params() - m.num_params(exclude_embeddings=True)
            8448
        """
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.wte.weight.numel() + self.wpe.weight.numel()
        return n

    def param_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """Optimizer groups: weight decay on matrices (ndim >= 2), none on biases and norms.

        Every trainable parameter is in exactly one group; the tied embedding/head weight
        appears once.

        Example:
            >>> m = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=8))
            >>> opt = torch.optim.AdamW(m.param_groups(weight_decay=0.1), lr=1e-3)
        """
        params = [p for p in self.parameters() if p.requires_grad]  # de-duplicated
        return [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]


class GPTStage(nn.Module):
    """A run of consecutive :class:`GPT` layers: one pipeline stage.

    The first stage embeds token ids, the last ends with the logits; the ones between
    take and return the residual stream ``[B, T, n_embd]``. A last stage without the
    embedding keeps its own copy of the tied head weight (equal at the start; the
    pipeline sums the two gradients, see :meth:`GPT.pipeline_ties`).
    """

    def __init__(self, gpt: GPT, units: list[str]) -> None:
        super().__init__()
        self.first, self.last = "embed" in units, "head" in units
        if self.first:
            self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop
        # Keyed by the block's index in the whole model: the state-dict names stay.
        self.blocks = nn.ModuleDict({u.split(".")[1]: gpt.blocks[int(u.split(".")[1])]
                                     for u in units if u.startswith("blocks.")})
        if self.last:
            self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head
            if not self.first:  # the tie crosses stages: a copy of its own
                self.lm_head.weight = nn.Parameter(gpt.wte.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.drop(self.wte(x) + self.wpe.weight[:x.shape[1]])
        for block in self.blocks.values():
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``[B, T, V]`` logits against ``[B, T]`` ids: the
    loss :meth:`GPT.forward` computes, for a loop that calls the model for logits (a
    pipeline's last stage uses it through :meth:`GPT.pipeline_loss`)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def build_gpt(n_layer: int, n_head: int, n_embd: int, block_size: int,
              dropout: float = 0.0, vocab_size: int = 256) -> GPT:
    """Build a :class:`GPT` from its main sizes.

    Example:
        >>> model = build_gpt(n_layer=2, n_head=2, n_embd=64, block_size=32)
        >>> model.config.padded_vocab_size
        256
    """
    return GPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer,
                         n_head=n_head, n_embd=n_embd, dropout=dropout))
