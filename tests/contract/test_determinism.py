"""Parity where torch cannot be deterministic: the control runs twice, its spread bounds.

On the CPU every kernel the contract runs is deterministic, so the multi-rank tests make
non-determinism happen in the model: a kept ``wo`` whose weight goes through an autograd function
that, like an atomics-based CUDA kernel, hands back a slightly different gradient on some runs
(every second backward: the implementation's and the second control's, never the reference's
or the first control's), and that runs ``put_``, an operator torch has no deterministic
implementation of, so torch's own alert says so. Three facts, in 2 gloo ranks:

* without the alert (the contract cannot know the run is not deterministic) the control runs
  once, is bit-identical, and fp32keep fails ``parity`` on that gradient: what a bit-identical
  judge does to a non-deterministic model (and what the contract did to every model before it
  ran the control twice);
* with it, the control runs twice, each gradient's bound widens by the spread of the two runs,
  and fp32keep passes, the report naming the operator and the spread;
* kept gradients scaled by ``1 + 2**-10`` (the ``parity`` negative control) still fail, on that
  very gradient, although its bound was widened.

The pure tests: the deterministic block turns torch's flag on and restores the caller's,
records the alerts and passes every other warning on; the spread and the bounds it widens.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pytest_fp32keep import ContractViolation, assert_fp32_keep_contract
from pytest_fp32keep.contract.determinism import (
    alerted_operator,
    cublas_alert,
    deterministic,
    second_run_reason,
)
from pytest_fp32keep.contract.parity_policy import ControlMeasure, control_spread, gradient_bounds
from tests.contract.wrong import scaled_kept_gradients
from tests.core.toys import stack_class

BF16 = torch.bfloat16
JITTER = 2**-16
"""How far the jittered runs' kept gradient lands: far above FP32 roundoff (2**-24), far below
the negative control's 2**-10."""

# --- pure ----------------------------------------------------------------------------------------


def _put() -> None:
    torch.zeros(2).put_(torch.tensor([0, 1]), torch.ones(2))  # no deterministic put_: an alert


@pytest.mark.parametrize(
    ("mode", "warn_only"), [(False, False), (True, False), (True, True)], ids=["off", "on", "warn"]
)
def test_the_block_turns_determinism_on_and_restores_the_callers(
    mode: bool, warn_only: bool
) -> None:
    torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    try:
        alerts: list[str] = []
        with deterministic(alerts):
            assert torch.are_deterministic_algorithms_enabled()
            assert torch.is_deterministic_algorithms_warn_only_enabled()  # never raises
            _put()
            _put()
        assert alerts == ["put_"]  # once, however often
        assert torch.are_deterministic_algorithms_enabled() is mode
        assert torch.is_deterministic_algorithms_warn_only_enabled() is warn_only
    finally:
        torch.use_deterministic_algorithms(False)


def _warn_alert_and_crash(alerts: list[str]) -> None:
    with deterministic(alerts):
        warnings.warn("the model's own warning", UserWarning, stacklevel=1)
        _put()
        raise ZeroDivisionError


def test_the_block_restores_the_setting_after_a_crash_and_passes_other_warnings_on() -> None:
    alerts: list[str] = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(ZeroDivisionError):
            _warn_alert_and_crash(alerts)
    assert not torch.are_deterministic_algorithms_enabled()
    assert alerts == ["put_"]
    assert [str(w.message) for w in seen] == ["the model's own warning"]


def test_the_alerts_are_read_from_torchs_messages() -> None:
    assert alerted_operator("index_add_cuda_ does not have a deterministic implementation, but")
    assert alerted_operator("put_ does not have a deterministic implementation, but") == "put_"
    assert alerted_operator("... this operation is not deterministic because it uses CuBLAS")
    assert alerted_operator("TypedStorage is deprecated") is None


def test_cublas_without_its_workspace_config_is_an_alert(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert cublas_alert(torch.device("cpu")) is None
    alert = cublas_alert(torch.device("cuda", 0))
    assert alert is not None
    assert "CUBLAS_WORKSPACE_CONFIG=None" in alert
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert cublas_alert(torch.device("cuda", 0)) is None
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_the_control_runs_twice_only_where_a_run_is_not_known_to_be_deterministic() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert second_run_reason((), cpu, asked=False) == ""
    assert "put_" in second_run_reason(("put_",), cpu, asked=False)
    assert "cuda" in second_run_reason((), cuda, asked=False)
    assert second_run_reason((), cpu, asked=True) == "measure_spread=True"


def test_the_spread_widens_only_the_gradients_whose_control_runs_differ() -> None:
    reference = {"w": torch.tensor([2.0, -4.0]), "b": torch.tensor([1.0]), "frozen": None}
    first = {"w": torch.tensor([2.0, -4.0]), "b": torch.tensor([1.0])}
    second = {"w": torch.tensor([2.0, -4.0 * (1 + 2**-16)]), "b": torch.tensor([1.0])}
    spread = control_spread(first, second, reference)
    assert spread == {"w": pytest.approx(2**-16), "b": 0.0}
    measure = ControlMeasure({"w": 1e-7, "b": 0.0}, spread, "torch has no deterministic put_")
    bounds, findings, notes = gradient_bounds(measure)
    assert bounds == {"w": pytest.approx(1e-7 + 2**-16), "b": 0.0}
    assert findings == []
    assert "control not reproducible (torch has no deterministic put_): 1 of 2" in notes[-1]
    same = gradient_bounds(ControlMeasure({"w": 0.0, "b": 0.0}, {"w": 0.0, "b": 0.0}, "asked"))
    assert same[0] == {"w": 0.0, "b": 0.0}
    assert "control reproducible" in same[2][-1]


def test_a_broken_control_widens_nothing_even_with_a_spread() -> None:
    bounds, findings, _ = gradient_bounds(ControlMeasure({"w": 1.0, "b": 1.0}, {"w": 0.5}, "x"))
    assert bounds == {}
    assert not findings[0].ok


# --- in 2 ranks ----------------------------------------------------------------------------------

_BACKWARDS = [0]
"""Backward calls of the jittered weight in this rank: 0 the reference's, 1 the
implementation's, 2 and 3 the control's two runs."""


class _Jitter(torch.autograd.Function):
    """The identity on a weight whose gradient comes back ``1 + JITTER`` times too large on
    every second backward, as a kernel summing with atomics in another order might."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, alert: bool) -> torch.Tensor:
        ctx.alert = alert
        return weight.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        call = _BACKWARDS[0]
        _BACKWARDS[0] += 1
        if ctx.alert:
            _put()
        return (grad * (1 + JITTER) if call % 2 else grad), None


class _JitteredLinear(nn.Linear):
    alert = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, _Jitter.apply(self.weight, self.alert), self.bias)


class _SilentJitteredLinear(_JitteredLinear):
    alert = False


def _jittered(linear: type[_JitteredLinear]) -> Any:
    def factory() -> nn.Module:
        model = stack_class(strict=["wo"])()
        width = model.layers[1].wo.in_features
        model.layers[1].wo = linear(width, width, bias=False)
        return model

    return factory


def batch(model: nn.Module) -> torch.Tensor:
    return torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(3))


def _contract(mesh: DeviceMesh, linear: type[_JitteredLinear], **options: Any) -> Any:
    _BACKWARDS[0] = 0
    return assert_fp32_keep_contract(
        _jittered(linear), batch, mesh=mesh, dtype=BF16, check_state_dict=False, **options
    )


JITTERED = "grad layers.1.wo.weight"


@pytest.mark.fsdp2
def test_a_non_deterministic_gradient_fails_a_bit_identical_judge(fsdp2_mesh: DeviceMesh) -> None:
    with pytest.raises(ContractViolation) as error:
        _contract(fsdp2_mesh, _SilentJitteredLinear)
    report = error.value.report
    failing = {f.subject: f for f in report.failures}
    assert set(failing) == {JITTERED}, report.table()
    assert failing[JITTERED].expected == "bit-identical (control)"
    assert not any("control not reproducible" in note for note in report.notes)


@pytest.mark.fsdp2
def test_with_torchs_alert_the_control_runs_twice_and_fp32keep_passes(
    fsdp2_mesh: DeviceMesh,
) -> None:
    report = _contract(fsdp2_mesh, _JitteredLinear)
    assert report.ok
    assert _BACKWARDS[0] == 4  # the reference, the implementation, two control runs
    (spread,) = [note for note in report.notes if "control not reproducible" in note]
    assert "torch has no deterministic implementation of put_" in spread
    assert "1 of" in spread
    assert "layers.1.wo.weight" in spread
    (finding,) = [f for f in report.findings if f.subject == JITTERED]
    assert "+ spread" in finding.expected


@pytest.mark.fsdp2
def test_a_known_wrong_implementation_still_fails_with_the_spread_bound(
    fsdp2_mesh: DeviceMesh,
) -> None:
    with pytest.raises(ContractViolation) as error:
        _contract(fsdp2_mesh, _JitteredLinear, shard=scaled_kept_gradients)
    report = error.value.report
    failing = {f.subject: f for f in report.failures}
    assert JITTERED in failing, report.table()
    assert "+ spread" in failing[JITTERED].expected  # widened, and still not enough
    assert {f.check for f in report.failures} == {"parity"}
