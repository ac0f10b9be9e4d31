"""A training state held in one host byte buffer that is reused from snapshot to snapshot.

An in-memory snapshot (:mod:`gpufleet.fault.snapshot`) copies a rank's state, a nested
dict of tensors and plain values, into a :class:`HostState`: every tensor goes into one
``uint8`` buffer (pinned on CUDA, so that device-to-host copies run asynchronously on a
side stream), at an offset its :class:`Leaf` records; the plain values stay in a
*skeleton* of the state in which each tensor is replaced by a marker. The buffer is
allocated once and reused as long as the state's tensors keep their dtypes and shapes
(they change only when an optimizer creates its state on its first step).

The skeleton and the leaves travel as :func:`encode_layout` bytes (``torch.save``, read
back with ``weights_only=True``: a received layout cannot run code), the buffer as it is:
together they are everything a partner needs to hold the state and give it back
(:meth:`HostState.state`).

Example:
    >>> held = HostState()
    >>> tensors = held.fit({"w": torch.ones(2), "step": 3}, "cpu")
    >>> held.copy(tensors)
    >>> held.state()
    {'w': tensor([1., 1.]), 'step': 3}
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

# A tensor's place in the skeleton: {MARK: index into the leaves}.
MARK = "\x00snapshot-tensor"
# A shard, in a state read with pieces=True: {PIECE: this owner's local tensor}.
PIECE = "\x00shard-piece"
_ALIGN = 64  # every tensor starts on a 64-byte boundary (any dtype's view is aligned)


@dataclass(frozen=True)
class Leaf:
    """Where one tensor lives in the buffer.

    Attributes:
        offset / nbytes: its bytes in the buffer.
        dtype / shape: what the bytes are (the dtype by name, e.g. ``"float32"``).
        sharded: it was a DTensor; the buffer holds this rank's local shard.
    """

    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    sharded: bool = False

    def as_tuple(self) -> tuple[int, int, str, tuple[int, ...], bool]:
        return (self.offset, self.nbytes, self.dtype, self.shape, self.sharded)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or this rank's shard of a DTensor (what lives on this rank)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def split_state(state: Any, tensors: list[torch.Tensor]) -> Any:
    """The skeleton of ``state``: dicts, lists and tuples rebuilt, every tensor moved to
    ``tensors`` (in walk order) and replaced by its marker; plain values kept."""
    if isinstance(state, torch.Tensor):
        tensors.append(state)
        return {MARK: len(tensors) - 1}
    if isinstance(state, Mapping):
        return {k: split_state(v, tensors) for k, v in state.items()}
    if isinstance(state, list):
        return [split_state(v, tensors) for v in state]
    if isinstance(state, tuple):
        return tuple(split_state(v, tensors) for v in state)
    return state


def join_state(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`split_state`: the markers replaced by ``tensors``."""
    if isinstance(skeleton, dict):
        if len(skeleton) == 1 and MARK in skeleton:
            return tensors[skeleton[MARK]]
        return {k: join_state(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [join_state(v, tensors) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(join_state(v, tensors) for v in skeleton)
    return skeleton


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"a snapshot layout names the dtype {name!r}, which this torch "
                         f"({torch.__version__}) does not have; both ranks must run the "
                         "same torch version.")
    return dtype


def layout_of(tensors: list[torch.Tensor]) -> list[Leaf]:
    """Each tensor's place in a buffer holding them all, in order, each aligned."""
    leaves, offset = [], 0
    for t in tensors:
        local = local_tensor(t)
        nbytes = local.numel() * local.element_size()
        leaves.append(Leaf(offset, nbytes, str(local.dtype).removeprefix("torch."),
                           tuple(local.shape), local is not t))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return leaves


def encode_layout(step: int, owner: int, skeleton: Any, leaves: list[Leaf]) -> bytes:
    """The layout of a held state as bytes (tensors, plain data and strings only)."""
    out = io.BytesIO()
    torch.save({"step": step, "owner": owner, "skeleton": skeleton,
                "leaves": [leaf.as_tuple() for leaf in leaves]}, out)
    return out.getvalue()


def decode_layout(data: bytes) -> tuple[int, int, Any, list[Leaf]]:
    """``(step, owner, skeleton, leaves)`` from :func:`encode_layout`'s bytes, read with
    ``weights_only=True``."""
    layout = torch.load(io.BytesIO(data), weights_only=True)
    leaves = [Leaf(o, n, d, tuple(s), bool(sh)) for o, n, d, s, sh in layout["leaves"]]
    return layout["step"], layout["owner"], layout["skeleton"], leaves


class HostState:
    """One rank's state at one step, in a host buffer reused across snapshots.

    Attributes:
        step: the step the held state is of; None while nothing complete is held (never
            written, or being overwritten).
        owner: the rank whose state it is (-1 before any).
        buffer: the bytes of every tensor (``uint8``, pinned when copied from CUDA).
        skeleton / leaves: the plain values with markers, and each tensor's place.
        allocations: how many times a buffer was allocated (reuse keeps it at 1).
    """

    def __init__(self) -> None:
        self.step: int | None = None
        self.owner = -1
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.skeleton: Any = None
        self.leaves: list[Leaf] = []
        self.allocations = 0
        self._pinned = False
        self._next: tuple[int | None, int] = (None, -1)

    @property
    def nbytes(self) -> int:
        """Host memory this copy holds (its buffer)."""
        return self.buffer.numel()

    def reserve(self, nbytes: int, pinned: bool = False) -> None:
        """Make the buffer ``nbytes`` long, reusing it when it already is: the old buffer
        is let go before a new one is allocated, so at most one is ever held."""
        if self.buffer.numel() == nbytes and self._pinned == pinned:
            return
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self._pinned = pinned
        self.allocations += 1

    def fit(self, state: Any, device_type: str, step: int | None = None,
            owner: int = -1) -> list[torch.Tensor]:
        """Lay ``state`` out in the buffer (reallocated only when its size changes) and
        mark what is held as incomplete; returns the tensors to :meth:`copy` in. ``step``
        and ``owner`` are what :meth:`done` will record."""
        self.step = None
        tensors: list[torch.Tensor] = []
        self.skeleton = split_state(state, tensors)
        self.leaves = layout_of(tensors)
        end = self.leaves[-1].offset + self.leaves[-1].nbytes if self.leaves else 0
        self.reserve(end, pinned=device_type == "cuda")
        self._next = (step, owner)
        return tensors

    def view(self, i: int) -> torch.Tensor:
        """The buffer's bytes of leaf ``i`` as a tensor of its dtype and shape."""
        leaf = self.leaves[i]
        raw = self.buffer[leaf.offset:leaf.offset + leaf.nbytes]
        return raw.view(_dtype(leaf.dtype)).view(leaf.shape)

    def copy(self, tensors: list[torch.Tensor], indices: range | list[int] | None = None,
             non_blocking: bool = False) -> None:
        """Copy ``tensors`` (all, or those at ``indices``) into their places. On CUDA with
        ``non_blocking`` the copies are queued on the current stream (the buffer is
        pinned); the caller synchronizes."""
        for i in range(len(tensors)) if indices is None else indices:
            self.view(i).copy_(local_tensor(tensors[i]).detach(), non_blocking=non_blocking)

    def done(self) -> None:
        """Every tensor is in: the held state is complete for the step given to
        :meth:`fit`."""
        self.step, self.owner = self._next

    def layout_bytes(self) -> bytes:
        """The layout of the held state (for a partner to hold it too)."""
        assert self.step is not None, "only a complete state is sent"
        return encode_layout(self.step, self.owner, self.skeleton, self.leaves)

    @property
    def pending_step(self) -> int | None:
        """The step being copied or received (what :meth:`done` will record)."""
        return self._next[0]

    def adopt(self, data: bytes, nbytes: int) -> None:
        """Take the layout a partner sent and make the buffer ``nbytes`` long for the
        bytes that follow; the held state is incomplete until :meth:`done`.

        Raises:
            ValueError: the layout's tensors do not fit in ``nbytes``.
        """
        self.step = None
        step, owner, skeleton, leaves = decode_layout(data)
        end = max((leaf.offset + leaf.nbytes for leaf in leaves), default=0)
        if end > nbytes:
            raise ValueError(f"the snapshot layout of rank {owner} needs {end} bytes, its "
                             f"header announced {nbytes}")
        self.skeleton, self.leaves, self._next = skeleton, leaves, (step, owner)
        self.reserve(nbytes)

    def state(self, pieces: bool = False) -> Any:
        """The held state: its plain values, and its tensors as views of the buffer
        (clone them to keep them past the next snapshot). A DTensor comes back as this
        owner's local shard (``leaves[i].sharded`` says which); with ``pieces``, wrapped
        as ``{PIECE: shard}`` (:mod:`gpufleet.train.recovery.reshard` joins them)."""
        if self.step is None:
            raise RuntimeError("no complete state is held (none taken yet, or the copy "
                               "in progress is not finished)")
        views: list[Any] = [self.view(i) for i in range(len(self.leaves))]
        if pieces:
            views = [{PIECE: v} if leaf.sharded else v for v, leaf in zip(views, self.leaves)]
        return join_state(self.skeleton, views)
