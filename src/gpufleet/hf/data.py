"""Tokenized text as a Dataset the trainer can batch: dicts of model arguments.

A Transformers model called as ``model(**batch)`` with ``labels`` in the batch returns
its loss, which is what the trainer uses when no loss function is given (see
:func:`gpufleet.train.engine.batches.make_loss_fn`). :class:`TextDataset` keeps each sample
unpadded and pads a batch only to its longest sample (:func:`pad_batch`); its
``lengths`` also allow ``data.batching = "tokens"``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

# Labels of padded positions (token-level labels): ignored by Transformers' losses.
IGNORE_INDEX = -100


def pad_batch(samples: Sequence[Mapping[str, Any]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Collate dict samples into a dict of tensors, padding sequences to the longest.

    ``input_ids`` are padded with ``pad_id``, ``labels`` lists with -100 (ignored by the
    loss), every other sequence (``attention_mask``, ``token_type_ids``) with 0. Scalar
    values (a class label) are stacked.

    Example:
        >>> b = pad_batch([{"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": 1},
        ...                {"input_ids": [5, 6], "attention_mask": [1, 1], "labels": 0}])
        >>> b["input_ids"].tolist(), b["attention_mask"].tolist(), b["labels"].tolist()
        ([[5, 6, 7], [5, 6, 0]], [[1, 1, 1], [1, 1, 0]], [1, 0])
    """
    if not samples:
        raise ValueError("pad_batch got no samples; a batch needs at least one.")
    batch: dict[str, torch.Tensor] = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        if isinstance(values[0], (int, float, bool)) or (
                isinstance(values[0], torch.Tensor) and values[0].ndim == 0):
            batch[key] = torch.tensor([int(v) if isinstance(v, bool) else v for v in values])
            continue
        fill = pad_id if key == "input_ids" else IGNORE_INDEX if key == "labels" else 0
        longest = max(len(v) for v in values)
        batch[key] = torch.tensor([list(v) + [fill] * (longest - len(v)) for v in values])
    return batch


class TextDataset(Dataset):
    """Texts (or text pairs) tokenized once, with optional labels, batched by padding.

    Each item is a dict of lists (``input_ids``, ``attention_mask``, ...) plus ``labels``
    when given; ``collate_fn`` (used by the trainer's loaders) pads a batch to its
    longest sample and ``lengths`` holds every sample's token count.

    Args:
        tokenizer: a Transformers tokenizer.
        texts: the texts.
        labels: one label per text (an int class, a float, or a list per token), or None.
        text_pairs: second segments for pair tasks, or None.
        max_length: longer samples are truncated to this many tokens.

    Example:
        >>> data = TextDataset(tokenizer, ["a [ENT_START] car [ENT_END]"], [0])  # doctest: +SKIP
        >>> gpufleet.fit(model, data, overrides={"data.batch_size": 8})  # doctest: +SKIP
    """

    def __init__(self, tokenizer: Any, texts: Sequence[str], labels: Sequence[Any] | None = None,
                 *, text_pairs: Sequence[str] | None = None, max_length: int = 128) -> None:
        texts = list(texts)
        if labels is not None and len(labels) != len(texts):
            raise ValueError(f"{len(labels)} labels for {len(texts)} texts: give one label "
                             "per text, or labels=None.")
        if text_pairs is not None and len(text_pairs) != len(texts):
            raise ValueError(f"{len(text_pairs)} text pairs for {len(texts)} texts: give one "
                             "second segment per text.")
        encoded = tokenizer(texts, list(text_pairs) if text_pairs is not None else None,
                            truncation=True, max_length=max_length)
        keys = list(encoded.keys())
        self.samples: list[dict[str, Any]] = [
            {k: list(encoded[k][i]) for k in keys} for i in range(len(texts))]
        if labels is not None:
            for sample, label in zip(self.samples, labels):
                sample["labels"] = label
        self.lengths = [len(s["input_ids"]) for s in self.samples]
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.samples[index]

    def collate_fn(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        """Pad ``samples`` into one batch (see :func:`pad_batch`)."""
        return pad_batch(samples, self.pad_id)
