"""Batches keep their container types when gpufleet moves or marks their tensors."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, UserDict, defaultdict, namedtuple
from collections.abc import Mapping

import torch

from gpufleet.core.tree import batch_size_of, map_tensors

Pair = namedtuple("Pair", "inputs labels")


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    name: str = "b"
    shape: tuple = dataclasses.field(init=False, default=(0,))


class Encoding(UserDict):
    """Like Transformers' BatchEncoding: a UserDict with attributes of its own."""

    def __init__(self, data=None, tag="enc"):
        super().__init__(data)
        self.tag = tag


class Fixed(Mapping):
    """A read-only mapping with a constructor of its own: comes back as a dict."""

    def __init__(self, a, b):
        self._d = {"a": a, "b": b}

    def __getitem__(self, k):
        return self._d[k]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return 2


def _double(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def test_namedtuples_dataclasses_and_mapping_types_keep_their_type():
    one = torch.ones(3)
    pair = map_tensors(Pair(one, [one, 7]), _double)
    assert type(pair) is Pair and pair.inputs.tolist() == [2, 2, 2]
    assert pair.labels[1] == 7 and pair.labels[0].tolist() == [2, 2, 2]

    frozen = map_tensors(Frozen(one), _double)
    assert type(frozen) is Frozen and frozen.x.tolist() == [2, 2, 2] and frozen.name == "b"

    ordered = map_tensors(OrderedDict(b=one, a=2), _double)
    assert type(ordered) is OrderedDict and list(ordered) == ["b", "a"]

    counts = defaultdict(list, {"x": one})
    mapped = map_tensors(counts, _double)
    assert type(mapped) is defaultdict and mapped.default_factory is list
    assert mapped["x"].tolist() == [2, 2, 2] and counts["x"] is one  # the input is untouched

    enc = map_tensors(Encoding({"ids": one}, tag="t"), _double)
    assert type(enc) is Encoding and enc.tag == "t" and enc["ids"].tolist() == [2, 2, 2]

    fixed = map_tensors(Fixed(one, 1), _double)
    assert fixed == {"a": fixed["a"], "b": 1} and type(fixed) is dict


def test_a_dataclass_batch_has_a_size():
    assert batch_size_of(Frozen(torch.zeros(5, 2))) == 5
