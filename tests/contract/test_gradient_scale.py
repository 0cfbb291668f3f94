"""The contract's arguments for a framework's own set-up, refused before anything is built: a
``gradient_divide_factor`` that is no positive finite number, and a ``mesh`` that is no
``DeviceMesh``. No rank is needed: nothing past the validation runs (the factory says so if
it is called). The judging itself is tested in tests/multirank/test_contract_scale_fsdp2.py."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from pytest_fp32keep import assert_fp32_keep_contract
from pytest_fp32keep.contract.scale import validate_gradient_divide_factor
from tests.cli.targets import toy_batch
from tests.error_bounds import LIBRARY_BOUND_S, within


def _never_built() -> nn.Module:
    raise AssertionError("the model was built before the arguments were validated")


def _contract(**arguments: Any) -> None:
    """The contract on a factory that fails if it is ever called, timed against the bound."""
    with within(LIBRARY_BOUND_S):
        assert_fp32_keep_contract(_never_built, toy_batch, dtype=torch.float16, **arguments)


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(0, id="zero"),
        pytest.param(-2.0, id="negative"),
        pytest.param(math.inf, id="inf"),
        pytest.param(math.nan, id="nan"),
        pytest.param(True, id="bool"),
        pytest.param("sum", id="string"),
    ],
)
def test_a_bad_gradient_divide_factor_is_refused_before_anything_is_built(value: object) -> None:
    with pytest.raises(
        ValueError,
        match=r"gradient_divide_factor=.*expected None \(FSDP2's default: the mean over the "
        r"data-parallel ranks\) or a positive finite number",
    ):
        _contract(mesh=None, gradient_divide_factor=value)  # the mesh is never reached


@pytest.mark.parametrize("value", [None, 1, 1.0, 2, 0.5, 3.0])
def test_a_good_gradient_divide_factor_is_kept_as_a_float(value: float | None) -> None:
    validated = validate_gradient_divide_factor(value)
    assert validated == value and (value is None or type(validated) is float)


def test_a_mesh_that_is_no_device_mesh_is_refused_before_anything_is_built() -> None:
    with pytest.raises(TypeError, match=r"mesh=None\): expected a torch DeviceMesh"):
        _contract(mesh=None)
