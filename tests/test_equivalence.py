"""The weights-equivalence rule of tests/equivalence.py tells reordered sums from faults."""

from __future__ import annotations

import pytest
import torch

from equivalence import assert_same_weights


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 64, generator=g) * 0.02, "b": torch.zeros(64)}


def test_round_off_of_another_summation_order_passes_even_with_one_far_element():
    want = _weights()
    got = {k: v.clone() for k, v in want.items()}
    # Round-off spread over the tensor, plus one coordinate moved as Adam can move a
    # near-zero-gradient weight: 1.23e-5 (the element that failed an element-wise bound).
    got["w"] += torch.randn_like(got["w"]) * 2e-7
    got["w"][3, 5] += 1.23e-5
    assert_same_weights(got, want)


@pytest.mark.parametrize("fault", ["one_step_lost", "tensor_untrained", "nan"])
def test_a_fault_fails_naming_the_tensor(fault):
    want = _weights()
    got = {k: v.clone() for k, v in want.items()}
    if fault == "one_step_lost":  # every coordinate off by an Adam step of lr 3e-4
        got["w"] -= 3e-4 * torch.sign(torch.randn_like(got["w"]))
    elif fault == "tensor_untrained":
        got["w"] = _weights(seed=1)["w"]
    else:
        got["w"][0, 0] = float("nan")
    with pytest.raises(AssertionError, match="w: "):
        assert_same_weights(got, want)


def test_rtol_zero_means_bit_for_bit():
    want = _weights()
    got = {k: v.clone() for k, v in want.items()}
    assert_same_weights(got, want, rtol=0)
    got["b"][0] = 1e-12
    with pytest.raises(AssertionError, match="b: not bit for bit"):
        assert_same_weights(got, want, rtol=0)
