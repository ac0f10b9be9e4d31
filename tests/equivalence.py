"""One rule for "these two runs trained the same weights", used by every test that
compares a parallel layout (or launcher, or accumulation) with a reference run.

Why not an element-wise tolerance: two layouts add the same numbers in another order
(a ring all-reduce, a tensor-parallel split of a matmul, micro-batches summed one by
one). In fp32 each such sum differs from the reference by a relative amount of the
order of sqrt(n) * eps (eps = 2**-23 ~ 1.2e-7), and training carries the difference on.
Adam then divides each gradient by its own running magnitude, so for the few
coordinates whose gradient stays near zero a relative difference of 1e-7 in the
gradient can move the weight by a noticeable share of the learning rate. Which
coordinates those are, and how far they move, depends on the CPU's kernels (the
vector width the matmul uses, hence the order of its sums): an element-wise bound
that holds on one machine fails one element in a thousand on another.

What reordering cannot do is move the tensor as a whole: its normwise relative
difference stays near the accumulated round-off. Measured for the 20-step
DDP 2 x TP 4 GPT against one process (tests/parallel/test_parallelize.py), the worst
tensor was at 1.35e-5 (its largest single element at 6.1e-6 on an AMD EPYC, at 1.23e-5
on an Intel Xeon), while any real fault (a missing all-reduce, a wrong shard, a wrong
loss scale, a skipped step) moves every trained tensor by a share of lr * steps, i.e.
1e-2 relative and more. ``RTOL = 1e-4`` sits between the two with a margin of about
7x above the round-off. Runs whose arithmetic is the same in the same order (a resume,
two launchers of one layout) are compared exactly with ``rtol=0``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

RTOL = 1e-4  # normwise, per tensor: see the module docstring for where it comes from


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in float64 (0 when both are zero)."""
    diff = (got.double() - want.double()).norm().item()
    scale = want.double().norm().item()
    return diff / scale if scale > 0 else diff


def assert_same_weights(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor],
                        rtol: float = RTOL) -> None:
    """Fail unless ``got`` has ``want``'s names, shapes and dtypes, only finite values,
    and every tensor within ``rtol`` of ``want``'s normwise (``rtol=0``: bit for bit).

    The message lists every tensor over the bound with its normwise and largest
    element-wise difference, so a failure on another machine can be read.
    """
    assert got.keys() == want.keys(), f"names differ: {sorted(set(got) ^ set(want))}"
    bad = []
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape and g.dtype == w.dtype, (
            f"{name}: {tuple(g.shape)} {g.dtype} against {tuple(w.shape)} {w.dtype}")
        if not g.is_floating_point():
            assert torch.equal(g, w), f"{name}: integer values differ"
            continue
        assert torch.isfinite(g).all(), f"{name}: non-finite values"
        if rtol == 0:
            if not torch.equal(g, w):
                bad.append(f"{name}: not bit for bit (largest difference "
                           f"{(g.double() - w.double()).abs().max().item():.3g})")
            continue
        rel = relative_difference(g, w)
        if rel > rtol:
            bad.append(f"{name}: normwise {rel:.3g} > {rtol:g} (largest element "
                       f"difference {(g.double() - w.double()).abs().max().item():.3g})")
    assert not bad, "weights differ:\n" + "\n".join(bad)
