"""Who holds whose snapshot: the ring of partners, the exchange, and the assembly.

Each rank sends its snapshot to one partner on the next node and receives one from the
previous node (:func:`ring_targets`): rank ``r`` on node ``n`` sends to the same local
rank on node ``(n + 1) % nnodes``; on one node, to the next rank. Every rank then holds
exactly two states, its own and one partner's, and a single lost node leaves a copy of
each of its ranks' states on the next node.

:class:`RingExchange` does the sending over a gloo process group of its own, made once
at the start of training: its point-to-point messages never queue behind, or reorder,
the training's collectives (nccl or gloo), and it runs from a background thread.

:func:`newest_complete` is what recovery reads: given what the surviving ranks hold, the
newest step of which every rank's state can be put together, and where each one is.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gpufleet.fault.host_state import HostState

log = logging.getLogger(__name__)


def ring_targets(placement: Sequence[tuple[int, int]]) -> list[int]:
    """The rank each rank sends its snapshot to, from every rank's ``(node, local
    rank)``.

    With the same number of ranks on every node, rank ``(n, l)`` sends to ``(n + 1, l)``
    (node order wrapping around); on one node, rank ``l`` to ``l + 1``. Nodes with
    different rank counts: the ranks are ordered by (local rank, node) and each sends to
    the next, so that every rank still sends to one and receives from one (a partner
    then shares the node only where a node has more ranks than the others).

    Example:
        >>> ring_targets([(0, 0), (0, 1), (1, 0), (1, 1)])
        [2, 3, 0, 1]
        >>> ring_targets([(0, 0), (0, 1), (0, 2)])
        [1, 2, 0]
    """
    world = len(placement)
    nodes = sorted({node for node, _ in placement})
    if len(nodes) == 1:
        return [placement.index((nodes[0], (local + 1) % world)) if world > 1 else 0
                for _, local in placement]
    per_node = {n: sorted(loc for node, loc in placement if node == n) for n in nodes}
    counts = {len(ranks) for ranks in per_node.values()}
    where = {p: r for r, p in enumerate(placement)}
    if len(counts) == 1 and all(per_node[n] == per_node[nodes[0]] for n in nodes):
        following = {n: nodes[(i + 1) % len(nodes)] for i, n in enumerate(nodes)}
        return [where[(following[node], local)] for node, local in placement]
    order = sorted(range(world), key=lambda r: (placement[r][1], placement[r][0]))
    targets = [0] * world
    for i, r in enumerate(order):
        targets[r] = order[(i + 1) % world]
    return targets


def sources_of(targets: Sequence[int]) -> list[int]:
    """The rank each rank receives from (the inverse of :func:`ring_targets`)."""
    sources = [0] * len(targets)
    for rank, target in enumerate(targets):
        sources[target] = rank
    return sources


class RingExchange:
    """Sends this rank's snapshot to its target and receives its source's, over a gloo
    group of its own.

    Args:
        rank / target / source: this rank and its two partners (global ranks).
        group: the gloo process group of every rank (made by :meth:`start`).
    """

    def __init__(self, rank: int, target: int, source: int, group: Any) -> None:
        self.rank, self.target, self.source, self.group = rank, target, source, group

    @classmethod
    def start(cls, node_rank: int, local_rank: int, timeout_s: float) -> RingExchange:
        """COLLECTIVE (every rank of the default group, once, in the same order as any
        other group): make the snapshot group, learn every rank's place, pick partners.
        ``timeout_s`` bounds a send or receive (a partner that died)."""
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        placement: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(placement, (node_rank, local_rank), group=group)
        targets = ring_targets([tuple(p) for p in placement])
        rank = dist.get_rank()
        return cls(rank, targets[rank], sources_of(targets)[rank], group)

    def swap(self, own: HostState, partner: HostState) -> None:
        """Send ``own`` (complete) to the target while receiving the source's state into
        ``partner``: a header of sizes, the layout, then the buffer. ``partner`` is
        complete when this returns; its buffer is reused when the size is unchanged.

        Raises:
            RuntimeError: the partner did not answer within the group's timeout, or sent
                a header this rank cannot make sense of.
        """
        layout = own.layout_bytes()
        header = torch.tensor([own.step, len(layout), own.nbytes], dtype=torch.int64)
        theirs = torch.zeros(3, dtype=torch.int64)
        self._both(header, theirs)
        step, layout_len, nbytes = (int(v) for v in theirs)
        if layout_len <= 0 or nbytes < 0:
            raise RuntimeError(f"rank {self.source} sent a snapshot header {theirs.tolist()} "
                               "(step, layout bytes, buffer bytes) that is not valid")
        received = torch.empty(layout_len, dtype=torch.uint8)
        self._both(torch.frombuffer(bytearray(layout), dtype=torch.uint8), received)
        partner.adopt(received.numpy().tobytes(), nbytes)
        if own.nbytes or nbytes:
            self._both(own.buffer if own.nbytes else None,
                       partner.buffer if nbytes else None)
        if partner.pending_step != step:
            raise RuntimeError(f"rank {self.source}'s snapshot layout is of step "
                               f"{partner.pending_step}, its header said {step}")
        partner.done()

    def _both(self, send: torch.Tensor | None, recv: torch.Tensor | None) -> None:
        """Send to the target and receive from the source at the same time (a ring of
        blocking sends would wait on itself)."""
        works = []
        if send is not None:
            works.append(dist.isend(send, self.target, group=self.group))
        if recv is not None:
            works.append(dist.irecv(recv, self.source, group=self.group))
        for work in works:
            work.wait()


@dataclass(frozen=True)
class Held:
    """One complete copy of a rank's state: whose (``owner``), of which ``step``, held
    by which rank (``holder``; the owner itself for its own copy)."""

    holder: int
    owner: int
    step: int


@dataclass(frozen=True)
class Assembly:
    """The newest step of which the survivors hold every rank's state: ``sources[r]`` is
    the rank that holds rank ``r``'s copy (``r`` itself when it survived)."""

    step: int
    sources: dict[int, int]


def newest_complete(held: Iterable[Held], targets: Sequence[int],
                    survivors: Iterable[int]) -> Assembly | None:
    """The newest snapshot of the whole job that the ``survivors`` can put together.

    ``held`` lists every complete copy the survivors report (each survivor's own and its
    partner's); ``targets`` is the ring (:func:`ring_targets`: rank ``r``'s copy went to
    ``targets[r]``). A snapshot of rank ``r`` counts as complete only when both its own
    copy and its partner's copy of the same step are in, wherever the rank holding them
    survived: a step whose exchange had not finished is not used, so that all ranks
    restore one step together. A rank whose node was lost is taken from its partner's
    copy, a survivor from its own.

    Returns:
        The step and, for every rank, the survivor to take its state from; None when no
        step is complete for every rank (both copies of some rank lost, or the newest
        exchange cut short): recovery then needs a durable checkpoint.
    """
    alive = set(survivors)
    copies: dict[int, dict[int, int]] = {}  # owner -> {holder: step}
    for h in held:
        if h.holder in alive:
            copies.setdefault(h.owner, {})[h.holder] = h.step
    step: int | None = None
    for owner, target in enumerate(targets):
        expected = {owner, target} & alive  # who must hold a copy of it
        have = copies.get(owner, {})
        steps = {have.get(holder) for holder in expected}
        if not expected or len(steps) != 1 or None in steps:
            return None  # both copies lost, or a copy missing or of another step
        (owner_step,) = steps
        if step is not None and owner_step != step:
            return None  # the ranks' snapshots are of different steps
        step = owner_step
    if step is None:
        return None
    sources = {owner: owner if owner in alive else target
               for owner, target in enumerate(targets)}
    return Assembly(step, sources)


def newest_replicated(held: Iterable[Held], survivors: Iterable[int]) -> Assembly | None:
    """:func:`newest_complete` for a replicated state (ddp: every rank holds the same
    model and optimizer state, and the data position is global): the survivors need no
    lost rank's copy to go on at a smaller world size, only their own copies of one
    step. Each survivor restores its own copy (``sources`` maps it to itself).

    Returns:
        None when a survivor holds no complete copy of its own, or the survivors' copies
        are of different steps.

    Example:
        >>> newest_replicated([Held(0, 0, 6), Held(0, 1, 5)], survivors=[0])
        Assembly(step=6, sources={0: 0})
    """
    alive = sorted(set(survivors))
    own = {h.owner: h.step for h in held if h.holder == h.owner and h.holder in alive}
    steps = {own.get(rank) for rank in alive}
    if not alive or len(steps) != 1 or None in steps:
        return None
    (step,) = steps
    return Assembly(step, {rank: rank for rank in alive})  # type: ignore[arg-type]


def newest_sharded(held: Iterable[Held], survivors: Iterable[int],
                   positions: Sequence[int]) -> Assembly | None:
    """:func:`newest_complete` for a sharded state (fsdp, hsdp): ``positions[r]`` is old
    rank ``r``'s place along the shard dimension, and one copy per place makes the whole
    state (hsdp's replicas of a place hold the same shards). The newest step of which
    the survivors hold a complete copy for every place; ``sources`` maps one owner per
    place (a survivor itself before a partner's copy) to the survivor holding it.

    Example:
        >>> newest_sharded([Held(0, 0, 6), Held(0, 1, 6)], survivors=[0], positions=[0, 1])
        Assembly(step=6, sources={0: 0, 1: 0})
    """
    alive = set(survivors)
    copies: dict[int, dict[int, int]] = {}  # step -> {owner: holder}
    for h in sorted(held, key=lambda h: h.holder != h.owner):  # own copies first
        if h.holder in alive:
            copies.setdefault(h.step, {}).setdefault(h.owner, h.holder)
    places = set(positions)
    for step in sorted(copies, reverse=True):
        chosen: dict[int, int] = {}  # place -> owner
        for owner in sorted(copies[step], key=lambda r: (r not in alive, r)):
            chosen.setdefault(positions[owner], owner)
        if set(chosen) == places:
            return Assembly(step, {owner: copies[step][owner] for owner in chosen.values()})
    return None
