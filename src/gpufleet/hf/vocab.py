"""Add tokens to a Transformers tokenizer and give the model sensible rows for them.

Four steps, each easy to get wrong by hand, done in one call by :func:`add_tokens`:

1. add the tokens to the tokenizer (normal or special; ones it already has are skipped
   and reported, never added twice);
2. resize the model's input embedding matrix and its output layer, tied or untied
   (``resize_token_embeddings``);
3. initialise the new rows, per token, by one of :data:`STRATEGIES`, under
   ``torch.no_grad()`` so autograd records nothing;
4. (:func:`gpufleet.hf.models.extend_vocabulary`) save tokenizer and model together.

Every strategy and source token is checked before anything changes, so a mistake
leaves tokenizer and model as they were.
"""

from __future__ import annotations

import difflib
import inspect
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gpufleet.errors import GpufleetError, closest_first, did_you_mean

log = logging.getLogger(__name__)

# How a new row can be initialised; the forms users write.
STRATEGIES = ("random", "zeros", "copy:<token>", "mean:<description>", "mean-all")
_KINDS = ("random", "zeros", "copy", "mean", "mean-all")


class VocabularyError(GpufleetError, ValueError):
    """A token, an initialisation strategy or a source token that cannot be used."""


@dataclass(frozen=True)
class InitSpec:
    """How to initialise one new token's rows.

    Attributes:
        kind: ``random`` (what ``resize_token_embeddings`` draws: the library default),
            ``zeros``, ``copy`` (the row of an existing token), ``mean`` (the mean of the
            rows of a description's sub-tokens) or ``mean-all`` (the mean of all rows
            that existed before).
        arg: the source token for ``copy``, the description for ``mean``.

    Example:
        >>> InitSpec.parse("mean:entity start marker")
        InitSpec(kind='mean', arg='entity start marker')
        >>> str(InitSpec.parse("copy:[SEP]"))
        'copy:[SEP]'
    """

    kind: str
    arg: str = ""

    @classmethod
    def parse(cls, text: str) -> InitSpec:
        """Read ``random``, ``zeros``, ``copy:<token>``, ``mean:<description>`` or
        ``mean-all``; anything else is a :class:`VocabularyError` naming the choices."""
        kind, sep, arg = str(text).partition(":")
        kind = kind.strip()
        if kind in ("copy", "mean") and sep:
            arg = arg.strip()
            if not arg:
                what = "an existing token" if kind == "copy" else "a description"
                raise VocabularyError(
                    f"init strategy {text!r} names no source: write {kind}:<{what}>, e.g. "
                    + ("copy:[SEP]." if kind == "copy" else "'mean:entity start marker'."))
            return cls(kind, arg)
        if kind in ("random", "zeros", "mean-all") and not sep:
            return cls(kind)
        if kind in ("copy", "mean"):  # "mean" without its description
            guess = f"{kind}:<...>"
        elif sep and kind in _KINDS:  # "zeros:x": these take no source
            guess = kind
        elif sep:  # "cpy:[SEP]": a typo in the kind, keep the source
            close = did_you_mean(kind, ("copy", "mean"))
            guess = f"{close}:{arg.strip()}" if close else None
        else:
            guess = did_you_mean(kind, _KINDS)
            guess = f"{guess}:<...>" if guess in ("copy", "mean") else guess
        hint = f" Did you mean {guess!r}?" if guess else ""
        raise VocabularyError(
            f"init strategy {text!r} is not known.{hint} Valid: "
            f"{', '.join(closest_first(kind, STRATEGIES))}. Give one strategy for all new "
            "tokens, or one per token (--init after each --token).")

    def __str__(self) -> str:
        return f"{self.kind}:{self.arg}" if self.arg else self.kind


@dataclass
class AddTokensResult:
    """What :func:`add_tokens` did.

    Attributes:
        added: new token -> its id, in the order given.
        skipped: token -> why it was not added (already in the vocabulary, or repeated).
        inits: new token -> the strategy that initialised its rows.
        old_vocab_size / new_vocab_size: ``len(tokenizer)`` before and after.
        old_rows / new_rows: rows of the input embedding matrix before and after.
        output_layer: ``"tied"`` (shares the input matrix), ``"untied"`` (its own rows,
            initialised the same way) or ``"none"`` (the model has no output layer).
        sample / sample_before / sample_after: a sentence and its tokens before and
            after (when ``sample`` was given).
    """

    added: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    inits: dict[str, str] = field(default_factory=dict)
    old_vocab_size: int = 0
    new_vocab_size: int = 0
    old_rows: int = 0
    new_rows: int = 0
    output_layer: str = "none"
    sample: str | None = None
    sample_before: list[str] = field(default_factory=list)
    sample_after: list[str] = field(default_factory=list)


def add_tokens(model: nn.Module, tokenizer: Any, tokens: Sequence[str], *,
               special: bool = False,
               init: str | Sequence[str] | Mapping[str, str] = "random",
               sample: str | None = None) -> AddTokensResult:
    """Add ``tokens`` to ``tokenizer``, resize ``model``'s embeddings and initialise them.

    Args:
        model: a Transformers ``PreTrainedModel`` (changed in place).
        tokenizer: its tokenizer (changed in place).
        tokens: the tokens to add. Ones the tokenizer already reads as a single token
            (``[SEP]``, ``cars``) and repeats are skipped and listed in ``skipped``.
        special: add them as special tokens (never split, never lower-cased, dropped by
            ``decode(..., skip_special_tokens=True)``), as entity markers usually are.
        init: one strategy for every token, one per token (a list in the order of
            ``tokens``), or a ``{token: strategy}`` mapping (tokens left out get
            ``random``). Strategies: ``random``, ``zeros``, ``copy:<existing token>``,
            ``mean:<description>`` (mean of the rows of the description's sub-tokens),
            ``mean-all`` (mean of all old rows).
        sample: a sentence to tokenize before and after (shown by the CLI).

    Returns:
        An :class:`AddTokensResult`.

    Raises:
        VocabularyError: an unknown strategy, a ``copy:`` source the tokenizer does not
            have, a description with no tokens, or a wrong number of strategies.
            Nothing is changed then.

    Example:
        >>> result = add_tokens(model, tokenizer, ["[ENT_START]", "[ENT_END]"],
        ...                     special=True, init="mean:entity marker")  # doctest: +SKIP
        >>> result.old_vocab_size, result.new_vocab_size  # doctest: +SKIP
        (30522, 30524)
    """
    tokens = [tokens] if isinstance(tokens, str) else list(tokens)
    if not tokens:
        raise VocabularyError("no tokens given: pass at least one (--token TEXT).")
    specs = _specs_for(tokens, init)
    result = AddTokensResult(old_vocab_size=len(tokenizer), sample=sample)
    if sample is not None:
        result.sample_before = tokenizer.tokenize(sample)
    new: list[str] = []
    for token in tokens:
        reason = _why_not_new(tokenizer, token, new)
        if reason:
            result.skipped[token] = reason
            log.warning("not adding %r: %s", token, reason)
        else:
            new.append(token)
    # Resolve every source with the tokenizer as it is now, before anything changes (also
    # for skipped tokens: a mistyped source is a mistake either way).
    sources = {t: _source_ids(tokenizer, spec) for t, spec in specs.items()}
    embeddings = model.get_input_embeddings()
    result.old_rows = result.new_rows = embeddings.weight.shape[0]
    if new:
        _extend_tokenizer(tokenizer, new, special)
        result.added = {t: tokenizer.convert_tokens_to_ids(t) for t in new}
        if len(tokenizer) > result.old_rows:
            # Draws the new rows (the `random` strategy) and resizes a tied or untied
            # output layer with them; the other rows keep their values.
            model.resize_token_embeddings(len(tokenizer))
        embeddings = model.get_input_embeddings()
        result.new_rows = embeddings.weight.shape[0]
        result.inits = {t: str(specs[t]) for t in new}
        _initialise(model, result, specs, sources, old_rows=result.old_vocab_size)
    result.output_layer = _output_kind(model)
    result.new_vocab_size = len(tokenizer)
    if sample is not None:
        result.sample_after = tokenizer.tokenize(sample)
    log.info("vocabulary %d -> %d; added %s; skipped %s", result.old_vocab_size,
             result.new_vocab_size, list(result.added), list(result.skipped))
    return result


def _specs_for(tokens: list[str], init: str | Sequence[str] | Mapping[str, str],
               ) -> dict[str, InitSpec]:
    if isinstance(init, str):
        return {t: InitSpec.parse(init) for t in tokens}
    if isinstance(init, Mapping):
        unknown = [t for t in init if t not in tokens]
        if unknown:
            raise VocabularyError(f"init names {unknown}, which are not among the tokens to "
                                  f"add {tokens}. Give strategies only for those tokens.")
        return {t: InitSpec.parse(init.get(t, "random")) for t in tokens}
    init = list(init)
    if len(init) == 1:
        return {t: InitSpec.parse(init[0]) for t in tokens}
    if len(init) != len(tokens):
        raise VocabularyError(
            f"{len(init)} init strategies for {len(tokens)} tokens: give one strategy for "
            "all tokens, or exactly one per token in the same order (--init once, or once "
            "after each --token).")
    specs: dict[str, InitSpec] = {}
    for token, text in zip(tokens, init):
        specs.setdefault(token, InitSpec.parse(text))  # a repeated token keeps its first
    return specs


def _why_not_new(tokenizer: Any, token: str, new: list[str]) -> str:
    """Why ``token`` is not added (empty when it should be)."""
    if not token or token != token.strip():
        raise VocabularyError(f"token {token!r} is empty or has spaces at its ends; "
                              "give the token text itself, e.g. --token '[ENT_START]'.")
    if token in new:
        return "given more than once"
    vocab = tokenizer.get_vocab()
    if token in vocab:
        return f"already in the vocabulary (id {vocab[token]})"
    pieces = tokenizer.tokenize(token)
    if len(pieces) == 1 and pieces[0] in vocab and pieces[0] != tokenizer.unk_token:
        # e.g. "Cars" for a lower-casing tokenizer: it already reads as one token.
        return f"already in the vocabulary as {pieces[0]!r} (id {vocab[pieces[0]]})"
    return ""


def _source_ids(tokenizer: Any, spec: InitSpec) -> list[int]:
    """The existing rows a strategy reads (none for random, zeros, mean-all)."""
    if spec.kind == "copy":
        vocab = tokenizer.get_vocab()
        if spec.arg in vocab:
            return [vocab[spec.arg]]
        pieces = tokenizer.tokenize(spec.arg)
        if len(pieces) == 1 and pieces[0] in vocab and pieces[0] != tokenizer.unk_token:
            return [vocab[pieces[0]]]
        close = difflib.get_close_matches(spec.arg, list(vocab), n=3, cutoff=0.6)
        hint = f" Close tokens: {', '.join(close)}." if close else ""
        raise VocabularyError(
            f"init strategy {str(spec)!r}: {spec.arg!r} is not a token of this tokenizer (it "
            f"splits into {len(pieces)} pieces: {pieces}).{hint} Copy an existing token, "
            "e.g. copy:[SEP], or use mean:<description> to average its pieces.")
    if spec.kind == "mean":
        ids = tokenizer(spec.arg, add_special_tokens=False)["input_ids"]
        if not ids:
            raise VocabularyError(f"init strategy {str(spec)!r}: the description has no "
                                  "tokens. Describe the new token in a few words.")
        return list(ids)
    return []


def _extend_tokenizer(tokenizer: Any, new: list[str], special: bool) -> None:
    if not special:
        tokenizer.add_tokens(new)
        return
    # Transformers 5 calls the extra special tokens "extra_special_tokens", 4.x
    # "additional_special_tokens"; either way the ones already there are kept.
    params = inspect.signature(tokenizer.add_special_tokens).parameters
    if "replace_extra_special_tokens" in params:
        tokenizer.add_special_tokens({"extra_special_tokens": new},
                                     replace_extra_special_tokens=False)
    else:
        tokenizer.add_special_tokens({"additional_special_tokens": new},
                                     replace_additional_special_tokens=False)


def _output_kind(model: nn.Module) -> str:
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out is None or getattr(out, "weight", None) is None:
        return "none"
    tied = out.weight is model.get_input_embeddings().weight
    return "tied" if tied else "untied"


def _initialise(model: nn.Module, result: AddTokensResult, specs: dict[str, InitSpec],
                sources: dict[str, list[int]], old_rows: int) -> None:
    """Set the new rows of every vocabulary-sized tensor: the input matrix, an untied
    output matrix and an output bias. Autograd records none of it."""
    tensors = [model.get_input_embeddings().weight]
    if _output_kind(model) == "untied":
        tensors.append(model.get_output_embeddings().weight)
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    bias = getattr(out, "bias", None)
    if isinstance(bias, torch.Tensor) and bias.ndim == 1 and bias.shape[0] == result.new_rows:
        tensors.append(bias)
    with torch.no_grad():
        for tensor in tensors:
            for token, new_id in result.added.items():
                spec = specs[token]
                if spec.kind == "random":
                    continue  # keep what resize_token_embeddings drew
                if spec.kind == "zeros":
                    tensor[new_id] = 0
                elif spec.kind == "mean-all":
                    tensor[new_id] = _mean(tensor[:old_rows])
                else:  # copy (one source row) or mean (the description's rows)
                    tensor[new_id] = _mean(tensor[sources[token]])


def _mean(rows: torch.Tensor) -> torch.Tensor:
    """Mean over the first dimension, summed in float32 for half-precision models."""
    return rows.float().mean(0).to(rows.dtype)
