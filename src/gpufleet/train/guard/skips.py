"""What a skipped step's record says: which ranks saw a non-finite loss or gradients, the
first bad parameter, the fp16 loss scale after the skip, and the one line that tells it
(:func:`describe`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SkipRecord:
    """One skipped step, as every rank saw it."""

    step: int
    loss_ranks: list[int]  # ranks whose own loss was not finite
    grad_ranks: list[int]  # ranks whose gradients were not finite
    first_bad_param: str | None
    bad_params: int
    loss_scale: float | None = None


def record_of(seen: list[tuple[bool, str | None, int]], scale: float | None) -> SkipRecord:
    """The record of a step every rank skipped, from each rank's view of it (its loss
    was not finite, its first bad parameter, how many were bad), in rank order."""
    return SkipRecord(
        step=0, loss_ranks=[r for r, s in enumerate(seen) if s[0]],
        grad_ranks=[r for r, s in enumerate(seen) if s[2]],
        first_bad_param=next((s[1] for s in seen if s[1]), None),
        bad_params=max(s[2] for s in seen), loss_scale=scale)


def describe(record: SkipRecord) -> str:
    """One line for a skipped step: which ranks, which parameter, the loss scale."""
    parts = []
    if record.loss_ranks:
        parts.append(f"non-finite loss on rank {_ranks(record.loss_ranks)}")
    if record.grad_ranks:
        parts.append(f"non-finite gradients on rank {_ranks(record.grad_ranks)} in "
                     f"{record.bad_params} parameter(s), first: {record.first_bad_param}")
    if record.loss_scale is not None:
        collapsed = " (collapsed: the model itself overflows fp16)" \
            if record.loss_scale < 1.0 else ""
        parts.append(f"fp16 loss scale now {record.loss_scale:g}{collapsed}")
    return "; ".join(parts) or "non-finite values"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))
