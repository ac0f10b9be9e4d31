"""Batches and states keep their container types when gpufleet moves or copies their
tensors, and the originals are left as they were."""

from __future__ import annotations

import dataclasses
from collections import Counter, OrderedDict, UserDict, defaultdict, namedtuple
from collections.abc import Mapping, MutableMapping

import torch

from gpufleet.core.tree import batch_size_of, each_tensor, map_tensors

Pair = namedtuple("Pair", "inputs labels")


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    name: str = "b"


@dataclasses.dataclass
class Masked:
    """Runs code at construction and has a field set after it."""

    x: torch.Tensor
    scale: dataclasses.InitVar[float]
    mask: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self, scale: float) -> None:
        self.mask = self.x > scale


class Encoding(UserDict):
    """Like Transformers' BatchEncoding: a UserDict with attributes of its own."""

    def __init__(self, data=None, tag="enc"):
        super().__init__(data)
        self.tag = tag


class Output(OrderedDict):
    """Like Transformers' ModelOutput: items may be set, update() refuses."""

    def update(self, *args, **kwargs):
        raise Exception("You cannot use ``update`` on a Output instance.")


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


class Shared(MutableMapping):
    """A mutable mapping whose shallow copy would share its storage."""

    def __init__(self, d):
        self._d = d

    def __getitem__(self, k):
        return self._d[k]

    def __setitem__(self, k, v):
        self._d[k] = v

    def __delitem__(self, k):
        del self._d[k]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)


def _double(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def test_sequences_and_dataclasses_keep_their_type():
    one = torch.ones(3)
    pair = map_tensors(Pair(one, [one, 7]), _double)
    assert type(pair) is Pair and pair.inputs.tolist() == [2, 2, 2]
    assert pair.labels[1] == 7 and pair.labels[0].tolist() == [2, 2, 2]

    frozen = map_tensors(Frozen(one), _double)
    assert type(frozen) is Frozen and frozen.x.tolist() == [2, 2, 2] and frozen.name == "b"

    masked = Masked(torch.tensor([0.0, 2.0]), scale=1.0)
    moved = map_tensors(masked, _double)  # no __init__ or __post_init__ runs again
    assert moved.x.tolist() == [0, 4] and moved.mask.tolist() == [0, 2]
    assert masked.x.tolist() == [0, 2]  # the original is untouched


def test_mappings_keep_their_type_and_the_original_is_untouched():
    one = torch.ones(3)
    ordered = map_tensors(OrderedDict(b=one, a=2), _double)
    assert type(ordered) is OrderedDict and list(ordered) == ["b", "a"]

    counts = defaultdict(list, {"x": one})
    mapped = map_tensors(counts, _double)
    assert type(mapped) is defaultdict and mapped.default_factory is list
    assert mapped["x"].tolist() == [2, 2, 2] and counts["x"] is one

    # A scheduler's milestones (a Counter) in a checkpoint: counts are kept, not added.
    milestones = map_tensors({"milestones": Counter({30: 1, 80: 1})}, _double)["milestones"]
    assert type(milestones) is Counter and milestones == Counter({30: 1, 80: 1})

    enc = map_tensors(Encoding({"ids": one}, tag="t"), _double)
    assert type(enc) is Encoding and enc.tag == "t" and enc["ids"].tolist() == [2, 2, 2]

    out = map_tensors(Output(loss=one, logits=one), _double)
    assert type(out) is Output and out["loss"].tolist() == [2, 2, 2]

    fixed = map_tensors(Fixed(one, 1), _double)
    assert type(fixed) is dict and fixed["b"] == 1 and fixed["a"].tolist() == [2, 2, 2]

    storage = {"x": one}
    shared = map_tensors(Shared(storage), _double)
    assert type(shared) is dict and storage["x"] is one


def test_the_tensors_of_a_batch_are_walked_without_building_anything():
    a, b, c = torch.zeros(5, 2), torch.ones(1), torch.ones(2)
    batch = {"pair": Pair(a, [b]), "frozen": Frozen(c), "n": 3}
    assert [t is u for t, u in zip(each_tensor(batch), (a, b, c))] == [True] * 3
    assert batch_size_of(batch) == 5
    assert batch_size_of(Frozen(torch.zeros(4, 2))) == 4
