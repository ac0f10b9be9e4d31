"""Adding tokens to the real pretrained MiniLM: tokenization, resizing, each
initialisation strategy, tied and untied output layers, skipped tokens, errors, and the
save -> load round trip."""

from __future__ import annotations

import pytest
import torch

from gpufleet.errors import GpufleetError
from gpufleet.hf import VocabularyError, add_tokens, save_together

from .conftest import MARKERS, SENTENCE, tiny_lm

OLD = 30522  # MiniLM's vocabulary (bert-base-uncased's WordPiece)


def _rows(model) -> torch.Tensor:
    return model.get_input_embeddings().weight


def test_markers_are_single_tokens_after_and_the_matrix_grows(fresh_minilm):
    model, tokenizer = fresh_minilm
    for marker, word in zip(MARKERS, ["start", "end"]):
        # Before: the lower-casing WordPiece tokenizer splits each marker into 6 pieces.
        assert tokenizer.tokenize(marker) == ["[", "en", "##t", "_", word, "]"]
    assert len(tokenizer) == OLD and _rows(model).shape == (OLD, 384)

    result = add_tokens(model, tokenizer, MARKERS, special=True, sample=SENTENCE)

    assert result.added == {"[ENT_START]": OLD, "[ENT_END]": OLD + 1}
    assert (result.old_vocab_size, result.new_vocab_size) == (OLD, OLD + 2)
    assert len(tokenizer) == OLD + 2
    assert _rows(model).shape == (OLD + 2, 384) and model.config.vocab_size == OLD + 2
    assert (result.old_rows, result.new_rows, result.output_layer) == (OLD, OLD + 2, "none")
    for marker in MARKERS:
        assert tokenizer.tokenize(marker) == [marker]
    # 4 markers x 6 pieces before, 4 x 1 after; the words around them are unchanged.
    assert len(result.sample_before) == 33 and len(result.sample_after) == 13
    assert result.sample_after == ["two", "[ENT_START]", "cars", "[ENT_END]", "collided",
                                   "in", "a", "[ENT_START]", "tunnel", "[ENT_END]", "this",
                                   "morning", "."]
    ids = tokenizer(SENTENCE)["input_ids"]
    assert ids.count(OLD) == 2 and ids.count(OLD + 1) == 2
    # Special tokens are dropped when decoding with skip_special_tokens.
    assert "ent" not in tokenizer.decode(ids, skip_special_tokens=True)


def _expected_row(old: torch.Tensor, tokenizer, strategy: str) -> torch.Tensor | None:
    if strategy == "zeros":
        return torch.zeros(old.shape[1])
    if strategy == "copy:[SEP]":
        return old[tokenizer.convert_tokens_to_ids("[SEP]")]
    if strategy.startswith("mean:"):
        ids = tokenizer(strategy[5:], add_special_tokens=False)["input_ids"]
        assert len(ids) > 1  # a real mean over several sub-tokens
        return old[ids].mean(0)
    if strategy == "mean-all":
        return old.mean(0)
    return None  # random


@pytest.mark.parametrize("strategy", ["zeros", "copy:[SEP]", "mean:entity start marker",
                                      "mean-all", "random"])
def test_each_strategy_gives_the_expected_rows_and_leaves_the_others(fresh_minilm, strategy):
    model, tokenizer = fresh_minilm
    old = _rows(model).detach().clone()
    expected = _expected_row(old, tokenizer, strategy)

    result = add_tokens(model, tokenizer, MARKERS, special=True, init=strategy)

    weight = _rows(model)
    assert result.inits == {m: strategy for m in MARKERS}
    assert torch.equal(weight[:OLD], old)  # every existing row unchanged
    # The initialisation is not recorded by autograd: the weight is still a trainable leaf.
    assert weight.is_leaf and weight.grad_fn is None and weight.requires_grad
    new = weight[OLD:].detach()
    if expected is None:  # random: drawn around the old rows' mean, different per token
        assert torch.isfinite(new).all() and not torch.equal(new[0], new[1])
        assert new.abs().sum(1).min() > 0
        assert (new - old.mean(0)).norm(dim=1).max() < 2 * old.norm(dim=1).max()
    else:
        for row in new:
            torch.testing.assert_close(row, expected, rtol=1e-6, atol=1e-7)
    if strategy == "zeros":
        assert torch.count_nonzero(new) == 0


def test_one_strategy_per_token_as_list_or_mapping(fresh_minilm):
    model, tokenizer = fresh_minilm
    old = _rows(model).detach().clone()
    add_tokens(model, tokenizer, MARKERS, init=["copy:[CLS]", "zeros"])
    assert torch.equal(_rows(model)[OLD], old[tokenizer.cls_token_id])
    assert torch.count_nonzero(_rows(model)[OLD + 1]) == 0

    result = add_tokens(model, tokenizer, ["[E3]", "[E4]"], init={"[E4]": "copy:car"})
    assert result.inits == {"[E3]": "random", "[E4]": "copy:car"}
    assert torch.equal(_rows(model)[OLD + 3], old[tokenizer.convert_tokens_to_ids("car")])
    assert torch.equal(_rows(model)[:OLD], old)


def test_existing_and_repeated_tokens_are_skipped_and_reported(fresh_minilm, caplog):
    model, tokenizer = fresh_minilm
    result = add_tokens(model, tokenizer, ["[SEP]", "Cars", "[ENT_START]", "[ENT_START]"],
                        special=True)
    assert list(result.added) == ["[ENT_START]"]
    assert result.skipped["[SEP]"] == "already in the vocabulary (id 102)"
    assert result.skipped["Cars"].startswith("already in the vocabulary as 'cars'")
    assert result.skipped["[ENT_START]"] == "given more than once"
    assert "not adding '[SEP]': already in the vocabulary" in caplog.text
    assert len(tokenizer) == OLD + 1 and _rows(model).shape[0] == OLD + 1

    again = add_tokens(model, tokenizer, ["[ENT_START]"], special=True)
    assert again.added == {} and "already in the vocabulary" in again.skipped["[ENT_START]"]
    assert (again.old_vocab_size, again.new_vocab_size) == (OLD + 1, OLD + 1)
    assert _rows(model).shape[0] == OLD + 1


@pytest.mark.parametrize("init, words", [
    ("zero", ["'zero'", "Did you mean 'zeros'?", "Valid: zeros"]),
    ("cpy:[SEP]", ["'cpy:[SEP]'", "Did you mean 'copy:[SEP]'?", "copy:<token>"]),
    ("mean", ["Did you mean 'mean:<...>'?", "mean:<description>"]),
    ("copy:", ["names no source", "copy:[SEP]"]),
    ("copy:[ENT_STRAT]", ["'[ENT_STRAT]' is not a token of this tokenizer", "7 pieces",
                          "copy:[SEP]", "mean:<description>"]),
    (["zeros", "zeros", "zeros"], ["3 init strategies for 2 tokens"]),
])
def test_bad_strategies_are_clear_errors_and_change_nothing(fresh_minilm, init, words):
    model, tokenizer = fresh_minilm
    old = _rows(model).detach().clone()
    with pytest.raises(VocabularyError) as info:
        add_tokens(model, tokenizer, MARKERS, init=init)
    assert isinstance(info.value, GpufleetError)
    for word in words:
        assert word in str(info.value)
    assert len(tokenizer) == OLD and torch.equal(_rows(model), old)


def test_save_then_load_gives_identical_tensors_and_tokenizer(fresh_minilm, tmp_path):
    from transformers import AutoModel, AutoTokenizer

    model, tokenizer = fresh_minilm
    add_tokens(model, tokenizer, [*MARKERS, "[E3]"], special=True,
               init=["mean:entity start", "copy:[SEP]", "random"])
    save_together(model, tokenizer, tmp_path / "out")

    loaded_tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    loaded = AutoModel.from_pretrained(tmp_path / "out")
    assert len(loaded_tok) == OLD + 3
    assert loaded_tok.tokenize(SENTENCE) == tokenizer.tokenize(SENTENCE)
    assert loaded_tok(SENTENCE)["input_ids"] == tokenizer(SENTENCE)["input_ids"]
    expected, got = model.state_dict(), loaded.state_dict()
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
@pytest.mark.parametrize("tie", [True, False])
def test_tied_and_untied_output_layers(minilm, kind, tie):
    tokenizer = minilm[1].__class__.from_pretrained(minilm[1].name_or_path)
    model = tiny_lm(kind, len(tokenizer), tie)
    old_in = _rows(model).detach().clone()
    old_out = model.get_output_embeddings().weight.detach().clone()
    bias = getattr(model.get_output_embeddings(), "bias", None)
    old_bias = None if bias is None else bias.detach().clone()
    sep = tokenizer.sep_token_id
    desc = tokenizer("entity start", add_special_tokens=False)["input_ids"]

    result = add_tokens(model, tokenizer, ["[A]", "[B]", "[C]", "[D]"],
                        init=["zeros", "copy:[SEP]", "mean:entity start", "mean-all"])

    out = model.get_output_embeddings()
    assert result.output_layer == ("tied" if tie else "untied")
    assert (out.weight is _rows(model)) == tie
    assert out.weight.shape[0] == _rows(model).shape[0] == OLD + 4
    for new_rows, old in [(_rows(model), old_in), (out.weight, old_out)] + (
            [(out.bias, old_bias)] if old_bias is not None else []):
        new_rows = new_rows.detach()
        assert torch.equal(new_rows[:OLD], old)
        assert torch.count_nonzero(new_rows[OLD]) == 0
        assert torch.equal(new_rows[OLD + 1], old[sep])
        torch.testing.assert_close(new_rows[OLD + 2], old[desc].mean(0))
        torch.testing.assert_close(new_rows[OLD + 3], old.mean(0))
    assert out.weight.grad_fn is None and out.weight.requires_grad
