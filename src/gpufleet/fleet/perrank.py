"""Values of a ``Fleet.save`` state that differ between ranks: found, kept per rank, and
given back to their own rank.

A loop's state holds more than models and optimizers: a step count (the same on every
rank), but also a batch read ahead, an LSTM's hidden state, a rank's own counter (each
rank its own). At save every rank hashes each of its plain values and the ranks compare
the hashes (one all-gather of a short string per value); a value whose hashes differ is
gathered from every rank and saved as one per rank, and at load each rank takes its own.
Models, optimizers and objects with a ``state_dict`` (schedulers) are not compared:
the strategy keeps models and optimizers in step. A set-up loader's position is
compared: it is global, the same on ranks in step, but a rank that read ahead, or a
loader of your own that keeps its own state, holds its own.

At another world size a per-rank value has no rank to go to: ``load`` refuses it,
naming the key (``strict=False`` leaves the value as it is, and a warning names it).

Example:
    >>> digest({"step": 3, "h": torch.zeros(2)}) == digest({"h": torch.zeros(2), "step": 3})
    True
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Mapping
from typing import Any

import torch

from gpufleet.core.tree import map_tensors
from gpufleet.errors import ConfigError
from gpufleet.launch import gather_objects


def digest(value: Any) -> str:
    """A SHA-256 of ``value``'s content: tensors by dtype, shape and bytes (wherever
    they live: a device's are copied to the host, a synchronisation), dicts whatever
    their order, other values by their pickle (addresses and devices left out)."""
    h = hashlib.sha256()
    _feed(h, value)
    return h.hexdigest()


def _feed(h: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if hasattr(t, "to_local"):  # a DTensor: this rank's part
            t = t.to_local()
        t = t.cpu().contiguous()
        h.update(f"tensor {t.dtype} {tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, Mapping):
        h.update(f"dict {len(value)}|".encode())
        for key in sorted(value, key=repr):
            h.update(repr(key).encode())
            _feed(h, value[key])
    elif isinstance(value, (list, tuple)):
        h.update(f"{type(value).__name__} {len(value)}|".encode())
        for item in value:
            _feed(h, item)
    elif isinstance(value, (set, frozenset)):  # each rank may order a set its own way
        h.update(f"set {len(value)}|".encode())
        for part in sorted(digest(item) for item in value):
            h.update(part.encode())
    else:
        try:
            h.update(pickle.dumps(value, protocol=4))
        except Exception:  # not picklable: what it shows of itself
            h.update(repr(value).encode())


def differing(values: Mapping[str, Any]) -> list[str]:
    """The keys of ``values`` whose value is not the same on every rank.

    COLLECTIVE: every rank calls it (one all-gather of a digest per key); without a
    process group, none.

    Raises:
        ConfigError: on every rank, when the ranks' keys differ.
    """
    mine = {key: digest(value) for key, value in values.items()}
    every = gather_objects(mine)  # COLLECTIVE: 64 characters a key a rank
    keys = {frozenset(d) for d in every}
    if len(keys) > 1:  # every rank sees it, so every rank raises
        some = sorted(frozenset.union(*keys) - frozenset.intersection(*keys))
        raise ConfigError(f"Fleet.save: the ranks saved different keys: "
                          f"{', '.join(map(repr, some))} only on some. Save the same keys "
                          "on every rank.")
    return [key for key in mine if len({d[key] for d in every}) > 1]


def gather_per_rank(values: Mapping[str, Any], keys: list[str]) -> dict[str, list[Any]]:
    """Every rank's value of each of ``keys``, in rank order, their tensors on the host.

    COLLECTIVE: every rank calls it with the same ``keys`` (one all-gather each)."""
    return {key: gather_objects(map_tensors(values[key], lambda t: t.detach().cpu()))
            for key in keys}
