"""How far keep-aware gradients may drift, decided from the plain-FSDP2 control (pure)."""

from __future__ import annotations

import pytest
import torch

from pytest_fp32keep.contract import CONTROL_ERROR_LIMIT, GRADIENT_NOISE_ULPS, gradient_bound

BF16 = torch.bfloat16
ROUNDOFF = GRADIENT_NOISE_ULPS * torch.finfo(BF16).eps


def test_bit_identical_control_leaves_no_room() -> None:
    bound, findings, _ = gradient_bound([0.0, 0.0], BF16)
    assert bound == 0.0
    assert findings == []


@pytest.mark.parametrize("worst", [ROUNDOFF / 4, ROUNDOFF * 2, CONTROL_ERROR_LIMIT])
def test_noisy_control_widens_the_bound_to_the_larger_of_its_worst_and_roundoff(
    worst: float,
) -> None:
    bound, findings, _ = gradient_bound([0.0, worst, 0.0], BF16)
    assert bound == max(worst, ROUNDOFF)
    assert findings == []


def test_a_few_gradients_far_off_are_noise_not_a_broken_control() -> None:
    # InstructBLIP's key biases: zero gradients in exact arithmetic, all roundoff in practice.
    bound, findings, _ = gradient_bound([0.0, 0.0, 0.001, 2.64], BF16)
    assert bound == 2.64
    assert findings == []


def test_control_that_is_plainly_wrong_is_a_finding_and_does_not_widen_the_bound() -> None:
    # torch 2.7 on gloo: plain FSDP2 sums gradients over 2 ranks, every gradient off by 1.0.
    bound, findings, notes = gradient_bound([1.0, 1.0, 1.0, 0.0], BF16)
    assert bound == ROUNDOFF
    assert [(f.check, f.subject, f.ok) for f in findings] == [
        ("parity", "plain FSDP2 control (nothing kept)", False)
    ]
    assert findings[0].observed == "median 1 relative over 4 gradients"
    assert "does not reproduce the unsharded model" in notes[0]


def test_control_that_crashed_is_a_finding_naming_the_error() -> None:
    bound, findings, notes = gradient_bound("RuntimeError: expected m1 and m2 …", BF16)
    assert bound == ROUNDOFF
    assert findings[0].observed == "RuntimeError: expected m1 and m2 …"
    assert not findings[0].ok
    assert "RuntimeError" in notes[0]
