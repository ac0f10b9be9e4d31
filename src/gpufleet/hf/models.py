"""Load and save Transformers models and tokenizers: the folder-to-folder side of
``gpufleet tokens add``, and a model factory for ``gpufleet train``."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpufleet.errors import GpufleetError
from gpufleet.hf import require_transformers
from gpufleet.hf.vocab import AddTokensResult, add_tokens

log = logging.getLogger(__name__)


class ModelFolderError(GpufleetError, OSError):
    """A model folder that cannot be read or written."""


def model_class(path: str | Path, auto_class: str | None = None) -> Any:
    """The Transformers class to load ``path`` with.

    ``auto_class`` names any class of the ``transformers`` package
    (``AutoModelForSequenceClassification``, ``BertForMaskedLM``, ...). Without it, the
    class the folder was saved from (``architectures`` in its config.json) is used, so
    a language-model head or a classifier is kept; ``AutoModel`` when that is unknown.
    """
    transformers = require_transformers("loading a Transformers model")
    if auto_class:
        cls = getattr(transformers, auto_class, None)
        if cls is None or not hasattr(cls, "from_pretrained"):
            raise ModelFolderError(
                f"auto_class = {auto_class!r} is not a model class of transformers "
                f"{transformers.__version__}. Use e.g. AutoModel, AutoModelForMaskedLM, "
                "AutoModelForCausalLM or AutoModelForSequenceClassification.")
        return cls
    config = transformers.AutoConfig.from_pretrained(str(path))
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModel


def load_pretrained(path: str | Path, auto_class: str | None = None,
                    **kwargs: Any) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` from a folder written by ``save_pretrained``.

    Args:
        path: the model folder (config.json, weights, tokenizer files).
        auto_class: the Transformers class to use (see :func:`model_class`).
        **kwargs: passed to the model's ``from_pretrained`` (e.g. ``num_labels=2``).

    Example:
        >>> model, tokenizer = load_pretrained("models/minilm")  # doctest: +SKIP
    """
    transformers = require_transformers("loading a Transformers model")
    check_model_folder(path)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        with reports_on_rank0():
            model = model_class(path, auto_class).from_pretrained(str(path), **kwargs)
    except OSError as e:
        raise ModelFolderError(f"cannot load a model and tokenizer from {str(path)!r}: {e}. "
                               "Give a folder written by save_pretrained.") from e
    return model, tokenizer


def pretrained(path: str, auto_class: str = "AutoModel", **kwargs: Any) -> Any:
    """Model factory for the trainer: ``gpufleet train --model gpufleet.hf:pretrained``.

    Args:
        path: the model folder.
        auto_class: the Transformers class, e.g. ``AutoModelForSequenceClassification``.
        **kwargs: passed to ``from_pretrained`` (``num_labels = 2``, dropout settings).

    Example:
        ``gpufleet train --model gpufleet.hf:pretrained --model.kwargs="{path = 'out',
        auto_class = 'AutoModelForSequenceClassification', num_labels = 2}"
        --data mypkg.data:build``
    """
    check_model_folder(path)
    try:
        with reports_on_rank0():
            return model_class(path, auto_class).from_pretrained(str(path), **kwargs)
    except OSError as e:
        raise ModelFolderError(f"cannot load a model from {str(path)!r}: {e}. Give a folder "
                               "written by save_pretrained.") from e


@contextlib.contextmanager
def reports_on_rank0() -> Iterator[None]:
    """Transformers' warnings (the load report of missing and unexpected weights) from
    rank 0 only: every rank loads the same folder and would print the same report.
    Errors still show on every rank.

    Example:
        >>> with reports_on_rank0():  # doctest: +SKIP
        ...     model = AutoModelForSequenceClassification.from_pretrained(path)
    """
    from gpufleet.launch.env import DistEnv

    logger = logging.getLogger("transformers")
    if DistEnv.detect().rank == 0:
        yield
        return
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def default_sample(tokens: Sequence[str]) -> str:
    """A sentence that uses every token, to show how tokenizing it changes.

    Example:
        >>> default_sample(["[ENT_START]", "[ENT_END]"])
        'A sample with [ENT_START] and [ENT_END] in it.'
    """
    tokens = list(tokens)
    listed = tokens[0] if len(tokens) == 1 else ", ".join(tokens[:-1]) + f" and {tokens[-1]}"
    return f"A sample with {listed} in it."


def extend_vocabulary(model_dir: str | Path, out_dir: str | Path, tokens: Sequence[str], *,
                      special: bool = False,
                      init: str | Sequence[str] | Mapping[str, str] = "random",
                      sample: str | None = None,
                      auto_class: str | None = None) -> AddTokensResult:
    """Load a model folder, add ``tokens`` (see :func:`~gpufleet.hf.vocab.add_tokens`) and
    save tokenizer and model together into ``out_dir``.

    ``AutoTokenizer.from_pretrained(out_dir)`` and the model class's
    ``from_pretrained(out_dir)`` then give back exactly the tensors in memory here.

    Args:
        model_dir: folder to read.
        out_dir: folder to write (created; files of the same name are replaced).
        tokens / special / init: as for :func:`~gpufleet.hf.vocab.add_tokens`.
        sample: sentence tokenized before and after (default: one using every token).
        auto_class: Transformers class to load with (default: the saved architecture).

    Example:
        >>> r = extend_vocabulary("minilm", "minilm-markers", ["[ENT_START]", "[ENT_END]"],
        ...                       special=True, init="mean:entity marker")  # doctest: +SKIP
        >>> r.new_vocab_size  # doctest: +SKIP
        30524
    """
    model, tokenizer = load_pretrained(model_dir, auto_class)
    result = add_tokens(model, tokenizer, tokens, special=special, init=init,
                        sample=default_sample(tokens) if sample is None else sample)
    save_together(model, tokenizer, out_dir)
    return result


def save_together(model: Any, tokenizer: Any, out_dir: str | Path) -> Path:
    """Save tokenizer and model into one folder, so that ``from_pretrained(out_dir)``
    loads both with the same vocabulary.

    Example:
        >>> save_together(model, tokenizer, "out/minilm-markers")  # doctest: +SKIP
    """
    out = Path(out_dir)
    rows = model.get_input_embeddings().weight.shape[0]
    if rows < len(tokenizer):
        raise ModelFolderError(
            f"the tokenizer has {len(tokenizer)} tokens but the model only {rows} embedding "
            "rows; ids past the end would fail. Add tokens with gpufleet.hf.add_tokens "
            "(it resizes the model), or call model.resize_token_embeddings(len(tokenizer)).")
    try:
        out.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(out))
        model.save_pretrained(str(out))
    except OSError as e:
        raise ModelFolderError(f"cannot write the model to {str(out)!r}: {e}. Pick a folder "
                               "you can write to.") from e
    log.info("saved tokenizer (%d tokens) and model to %s", len(tokenizer), out)
    return out


def check_model_folder(path: str | Path) -> None:
    """Raise a :class:`ModelFolderError` unless ``path`` is a folder with a config.json."""
    folder = Path(path)
    if not folder.is_dir():
        raise ModelFolderError(f"model folder {str(path)!r} does not exist. Give the folder "
                               "that holds config.json and the weights.")
    if not (folder / "config.json").is_file():
        raise ModelFolderError(f"{str(path)!r} has no config.json: it is not a folder written "
                               "by save_pretrained. Give the model's own folder.")
