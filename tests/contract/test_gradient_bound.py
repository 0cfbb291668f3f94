"""How far each gradient may drift, decided from the control's errors (pure)."""

from __future__ import annotations

import pytest
import torch

from pytest_fp32keep.contract import CONTROL_ERROR_LIMIT, gradient_bounds
from pytest_fp32keep.contract.parity_policy import control_errors, relative_error


def test_bit_identical_control_leaves_no_room() -> None:
    bounds, findings, _ = gradient_bounds({"a": 0.0, "b": 0.0})
    assert bounds == {"a": 0.0, "b": 0.0}
    assert findings == []


def test_each_gradient_gets_the_controls_own_error_not_the_worst_one() -> None:
    # 3 ranks: the kept router's FP32 average rounds, the bf16 gradients average exactly.
    bounds, findings, notes = gradient_bounds({"gate": 5.56e-8, "up": 0.0, "norm": 2.0e-8})
    assert bounds == {"gate": 5.56e-8, "up": 0.0, "norm": 2.0e-8}
    assert findings == []
    assert "2 of 3 gradient(s) not bit-identical" in notes[0]


def test_a_few_gradients_far_off_are_noise_not_a_broken_control() -> None:
    # InstructBLIP's key biases: zero gradients in exact arithmetic, all roundoff in practice.
    bounds, findings, _ = gradient_bounds({"a": 0.0, "b": 0.0, "c": 0.001, "bias": 2.64})
    assert bounds["bias"] == 2.64
    assert findings == []


@pytest.mark.parametrize("median", [CONTROL_ERROR_LIMIT * 1.01, 1.0])
def test_control_that_is_plainly_wrong_is_a_finding_and_widens_nothing(median: float) -> None:
    # torch 2.7 on gloo: FSDP2 sums gradients over 2 ranks, every gradient off by 1.0.
    bounds, findings, notes = gradient_bounds({"a": median, "b": median, "c": 0.0})
    assert bounds == {}
    assert [(f.check, f.ok) for f in findings] == [("parity", False)]
    assert findings[0].observed == f"median {median:.3g} relative over 3 gradients"
    assert "does not reproduce the unsharded model" in notes[0]
    # torch is named as the cause only conditionally: the framework's own layout may be what
    # the control cannot reproduce (issue 34)
    assert "the installed torch's FSDP2 is wrong" not in notes[0]
    assert "fail the same way" in notes[0]


def test_control_that_crashed_is_a_finding_naming_the_error() -> None:
    bounds, findings, notes = gradient_bounds("RuntimeError: expected m1 and m2 …")
    assert bounds == {}
    assert findings[0].observed == "RuntimeError: expected m1 and m2 …"
    assert not findings[0].ok
    assert "RuntimeError" in notes[0]


def test_control_errors_are_per_parameter_and_a_missing_gradient_is_infinite() -> None:
    want = torch.tensor([1.0, -2.0])
    errors = control_errors(
        {"same": want.clone(), "off": want * (1 + 2**-10)},
        {"same": want, "off": want, "gone": want, "frozen": None},
    )
    assert errors == {"same": 0.0, "off": pytest.approx(2**-10), "gone": float("inf")}


def test_relative_error_is_relative_to_the_gradients_scale() -> None:
    got = relative_error(torch.tensor([4.0, 1e-9]), torch.tensor([4.0, 0.0]))
    assert got == pytest.approx(1e-9 / 4)  # float32 1e-9, not its float64
    assert relative_error(torch.zeros(2), torch.zeros(3)) == float("inf")
