"""Every outcome of the contract is a verdict (issue 14).

Crashes in a step become a ``crashed`` row on every rank, agreed within seconds; the round trip
loads weights the model was not built with, before the first forward, so a loader whose weights
FSDP2 never computes with fails; ranks that build different batches are refused by name.

The pure tests run here; the ``fsdp2`` ones in 2 real torchrun ranks (gloo), on the toy decoder.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, distribute_tensor

import fp32keep
from fp32keep import KeepPlan
from pytest_fp32keep import ContractReport, ContractViolation, assert_fp32_keep_contract
from pytest_fp32keep.contract.probe import DtypeProbe
from pytest_fp32keep.contract.report import Finding
from pytest_fp32keep.contract.steps import Run, non_finite
from pytest_fp32keep.contract.verdicts import (
    Crash,
    batch_fingerprint,
    batch_problem,
    crash_findings,
)
from pytest_fp32keep.contract.weights import loaded_weights
from tests.core.toys import stack_class
from tests.error_bounds import LIBRARY_BOUND_S
from tests.multirank.refusals import refused_on_every_rank as shared_refused_on_every_rank

BF16 = torch.bfloat16

#: Every rank raises the same error within the library bound (tests/multirank/refusals.py).
refused_on_every_rank = functools.partial(shared_refused_on_every_rank, bound=LIBRARY_BOUND_S)


def factory() -> nn.Module:
    return stack_class(strict=["wo", "norm"])()


def batch(model: nn.Module) -> dict[str, torch.Tensor]:
    return {"ids": torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(3))}


def rows(report: ContractReport, check: str) -> list[Finding]:
    return [f for f in report.findings if f.check == check]


def failing(report: ContractReport) -> set[str]:
    return {f.check for f in report.failures}


# --- pure ---------------------------------------------------------------------------------------


def test_the_fingerprint_names_the_entry_that_differs() -> None:
    ids = torch.arange(12).reshape(2, 6)
    same = batch_fingerprint({"ids": ids, "mask": torch.ones(2, 6, dtype=BF16), "n": 3})
    assert (
        batch_fingerprint({"ids": ids.clone(), "mask": torch.ones(2, 6, dtype=BF16), "n": 3})
        == same
    )
    other = batch_fingerprint({"ids": ids + 1, "mask": torch.ones(2, 6, dtype=BF16), "n": 3})
    problem = batch_problem([same, same, other], [0, 1, 2])
    assert problem is not None
    assert "rank 2 built a different batch: ids differ" in problem
    assert "rank 1" not in problem and "seed your batch_factory" in problem
    assert batch_problem([same, same], [0, 1]) is None
    # A dtype alone, or a tuple position, is a difference too.
    half = batch_fingerprint((ids.to(BF16),))
    assert batch_problem([batch_fingerprint((ids.float(),)), half], [0, 1]) is not None
    assert "[0] differ" in (batch_problem([batch_fingerprint((ids.float(),)), half], [0, 1]) or "")


def test_a_batch_differing_on_a_thousand_ranks_names_five() -> None:
    """The message names five ranks and counts the rest (it listed every rank); the negative
    control is the first five ranks, which are all named."""
    ids = torch.arange(6)
    same, other = batch_fingerprint({"ids": ids}), batch_fingerprint({"ids": ids + 1})
    problem = batch_problem([same] + [other] * 1000, list(range(1001))) or ""
    assert "rank 5 built a different batch" in problem and "rank 6 built" not in problem
    assert "; and 995 more ranks (compared with rank 0's)" in problem and len(problem) < 4096
    assert "rank 5 built" in (batch_problem([same] + [other] * 5, list(range(6))) or "")


def test_crash_rows_group_the_ranks_of_one_exception() -> None:
    crashes = [
        Crash("shard", "RuntimeError", "no mesh here", 1),
        Crash("shard", "RuntimeError", "no mesh here", 3),
        Crash("shard", "ValueError", "bad", 2),
    ]
    found = {(f.subject, f.observed) for f in crash_findings(crashes)}
    assert found == {
        ("shard", "RuntimeError: no mesh here (ranks [1, 3])"),
        ("shard", "ValueError: bad (rank 2)"),
    }
    assert not any(f.ok for f in crash_findings(crashes))


def _run(loss: float, grads: dict[str, torch.Tensor | None]) -> Run:
    return Run(torch.zeros(2, 3), torch.tensor(loss), grads, DtypeProbe(nn.Identity()))


def test_a_non_finite_reference_is_named_loss_first_then_gradients_by_name() -> None:
    finite = {"b.weight": torch.ones(2), "a.weight": torch.zeros(2), "unused": None}
    assert non_finite(_run(1.0, finite)) is None  # the negative control: nothing to name
    nan_grads = {**finite, "b.weight": torch.tensor([1.0, float("nan")])}
    assert non_finite(_run(1.0, nan_grads)) == "grad b.weight holds NaN"
    both = {**nan_grads, "a.weight": torch.tensor([float("inf"), 0.0])}
    assert non_finite(_run(1.0, both)) == "grad a.weight holds inf (and 1 more tensors)"
    assert non_finite(_run(float("inf"), both)) == "loss holds inf (and 2 more tensors)"
    integer = {"steps": torch.tensor([3])}  # integers cannot be NaN: not floating, not judged
    assert non_finite(_run(1.0, integer)) is None


def test_checks_a_crash_kept_from_running_are_not_run_not_passed() -> None:
    crashed = Finding("crashed", "load", "no exception", "OSError: gone (ranks [0, 1])", False)
    stored = Finding("stored", "layers.0.wo.weight", "float32", "float32", True)
    report = ContractReport("Toy", BF16, "direct", (), (stored, crashed))
    checked = report.checked()
    assert checked["stored"] is True and checked["crashed"] is False
    assert checked["parity"] is None and checked["round trip"] is None
    assert report.status()["parity"] is True  # status() alone cannot tell "not run" apart
    assert "  parity       - (0 observations)" in report.summary()


def test_the_loaded_weights_differ_from_the_built_ones_and_stay_tied() -> None:
    def build() -> nn.Module:
        model = factory()
        model.head.weight = model.embed.weight  # type: ignore[union-attr]
        return model

    torch.manual_seed(0)
    built = build()
    weights = loaded_weights(build, built, 0, torch.device("cpu"))
    assert weights.keys() == built.state_dict().keys()
    for name, param in built.named_parameters(remove_duplicate=False):
        assert not torch.equal(weights[name].to(BF16), param.detach().to(BF16)), name
    assert torch.equal(weights["head.weight"], weights["embed.weight"])


# --- in 2 ranks ---------------------------------------------------------------------------------


def _full_dict(state_dict: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Rank 0's dict on every rank (what Transformers' loader has: the files on every rank)."""
    shared: list[object] = [dict(state_dict) if state_dict is not None else None]
    dist.broadcast_object_list(shared, src=0)
    full = shared[0]
    assert isinstance(full, dict)
    return full


def _setattr_after_lazy_init(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None, *, as_dtensor: bool
) -> None:
    """A wrong loader, as Transformers' is: FSDP2's lazy init has run (it runs at the first
    forward), then every parameter is replaced by a new one holding the loaded values, which
    FSDP2 never all-gathers: it keeps computing with the shards it made at ``fully_shard``.

    The lazy init is made to run through public API: ``FSDPModule.unshard`` initialises each
    unit's parameter group (where FSDP2 adopts the module's current parameters as its shards),
    ``reshard`` frees the gathered copies again."""
    assert isinstance(model, FSDPModule)
    for unit in [m for m in model.modules() if isinstance(m, FSDPModule)]:
        unit.unshard()
        unit.reshard()
    full = _full_dict(state_dict)
    for fqn, module in model.named_modules():
        for name, old in list(module.named_parameters(recurse=False)):
            key = f"{fqn}.{name}" if fqn else name
            value = full[key].to(old.dtype)
            if as_dtensor and isinstance(old, DTensor):
                value = distribute_tensor(value, old.device_mesh, old.placements)
            setattr(module, name, nn.Parameter(value, requires_grad=old.requires_grad))


@pytest.mark.fsdp2
@pytest.mark.parametrize("as_dtensor", [False, True], ids=["tensors", "dtensors"])
def test_a_loader_fsdp2_never_computes_with_fails_parity(
    fsdp2_mesh: DeviceMesh, as_dtensor: bool
) -> None:
    load = functools.partial(_setattr_after_lazy_init, as_dtensor=as_dtensor)
    with pytest.raises(ContractViolation, match="parity") as error:
        assert_fp32_keep_contract(factory, batch, mesh=fsdp2_mesh, dtype=BF16, load=load)
    report = error.value.report
    # The gather-back alone is blind to it (what the contract used to check, after the forward).
    assert rows(report, "round trip") and all(f.ok for f in rows(report, "round trip"))
    logits = next(f for f in rows(report, "parity") if f.subject == "logits")
    assert not logits.ok and logits.observed.startswith("max |diff|")


@pytest.mark.fsdp2
def test_dcp_broadcast_loader_that_rewrites_its_dict_passes(
    fsdp2_mesh: DeviceMesh, fsdp2_rank: int
) -> None:
    # set_model_state_dict(broadcast_from_rank0=True) puts DTensors in the dict it is given; the
    # round trip used to compare them with tensors and rank 0 died. Now it compares with its own
    # copy, and DCP (dtype-aligned on this toy) passes every row.
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    handed: list[dict[str, torch.Tensor]] = []

    def load(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None) -> None:
        given = dict(state_dict) if state_dict is not None else {}
        handed.append(given)
        set_model_state_dict(model, given, options=options)  # type: ignore[arg-type]

    report = assert_fp32_keep_contract(factory, batch, mesh=fsdp2_mesh, dtype=BF16, load=load)
    assert report.ok and rows(report, "round trip") and not rows(report, "crashed")
    if fsdp2_rank == 0:  # the scenario is real: DCP rewrote what it was given
        assert any(isinstance(value, DTensor) for value in handed[0].values())


@pytest.mark.fsdp2
def test_a_loader_that_raises_is_a_crashed_load_row(fsdp2_mesh: DeviceMesh) -> None:
    def load(model: nn.Module, state_dict: object) -> None:
        raise OSError("checkpoint shard 3 is gone\nsecond line")

    violation = refused_on_every_rank(
        lambda: assert_fp32_keep_contract(factory, batch, mesh=fsdp2_mesh, dtype=BF16, load=load),
        ContractViolation,
        "crashed",
    )
    report = violation.report
    (crashed,) = rows(report, "crashed")
    assert crashed.subject == "load"
    assert crashed.observed == "OSError: checkpoint shard 3 is gone (ranks [0, 1])"
    assert isinstance(violation.__cause__, OSError)
    assert not rows(report, "parity") and not rows(report, "round trip")  # not run, not passed
    assert any("not run after the crashed load: forward, backward" in n for n in report.notes)
    assert rows(report, "stored")  # cast and shard ran: what they stored is still judged


class SqrtOfZero(nn.Module):
    """Finite logits and loss, a NaN gradient: d/dw sqrt(w - w) is 0 * inf; with ``nan``
    false the gain is added plainly (finite everywhere)."""

    def __init__(self, nan: bool) -> None:
        super().__init__()
        self.nan = nan
        self.proj = nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offset = torch.sqrt(self.gain - self.gain) if self.nan else self.gain - self.gain
        return self.proj(x) + offset


@pytest.mark.fsdp2
@pytest.mark.parametrize("nan", [True, False], ids=["nan-reference", "finite-reference"])
def test_a_reference_that_computes_nan_is_a_crashed_reference_row_not_parity(
    fsdp2_mesh: DeviceMesh, nan: bool
) -> None:
    def build() -> nn.Module:
        return SqrtOfZero(nan)  # nan=False is the negative control: finite, it passes

    def inputs(model: nn.Module) -> torch.Tensor:
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
        return x.to(model.proj.weight.dtype)

    def run() -> ContractReport:
        return assert_fp32_keep_contract(
            build, inputs, mesh=fsdp2_mesh, dtype=BF16, loss_fn=lambda out: out.float().sum()
        )

    if not nan:
        assert run().ok
        return
    report = refused_on_every_rank(run, ContractViolation, "crashed").report
    (crashed,) = rows(report, "crashed")
    assert crashed.subject == "reference"
    assert crashed.observed.startswith(
        "NonFiniteReference: grad gain holds NaN in torch.bfloat16 in the unsharded reference"
    )
    assert crashed.observed.endswith("(ranks [0, 1])")
    assert not rows(report, "parity")  # nothing judged against a NaN: not run, not failed


@pytest.mark.fsdp2
def test_a_shard_that_raises_on_one_rank_is_a_crashed_shard_row_on_every_rank(
    fsdp2_mesh: DeviceMesh, fsdp2_rank: int
) -> None:
    def shard(
        model: nn.Module,
        *,
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy,
        plan: KeepPlan,
        wrap: object,
    ) -> None:
        if dist.get_rank() == 1:
            raise RuntimeError("this framework cannot shard on rank 1")
        fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=mp_policy, plan=plan)

    violation = refused_on_every_rank(
        lambda: assert_fp32_keep_contract(factory, batch, mesh=fsdp2_mesh, dtype=BF16, shard=shard),
        ContractViolation,
        "crashed",
    )
    (crashed,) = rows(violation.report, "crashed")
    assert (crashed.subject, crashed.observed) == (
        "shard",
        "RuntimeError: this framework cannot shard on rank 1 (rank 1)",
    )
    assert failing(violation.report) == {"crashed"}
    assert any("load, forward, backward" in note for note in violation.report.notes)
    assert isinstance(violation.__cause__, RuntimeError) == (fsdp2_rank == 1)


@pytest.mark.fsdp2
def test_ranks_that_build_different_batches_are_refused_naming_the_entry(
    fsdp2_mesh: DeviceMesh,
) -> None:
    def unseeded(model: nn.Module) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(dist.get_rank())  # a different draw per rank
        return {"ids": torch.randint(0, 16, (2, 6), generator=generator)}

    refused_on_every_rank(
        lambda: assert_fp32_keep_contract(factory, unseeded, mesh=fsdp2_mesh, dtype=BF16),
        ValueError,
        r"rank 1 built a different batch: ids differ.*seed your batch_factory",
    )


def factory_off_on_rank_1() -> nn.Module:
    """The toy, with one kept weight nudged on rank 1 only: there the reference (built and loaded
    from this factory) differs from the model under test (loaded from rank 0), elsewhere not."""
    model = factory()
    if dist.get_rank() == 1:
        with torch.no_grad():
            model.get_submodule("layers.0.wo").weight.add_(2.0**-4)
    return model


@pytest.mark.fsdp2
def test_gradients_off_on_one_rank_only_run_the_control_on_every_rank(
    fsdp2_mesh: DeviceMesh, fsdp2_rank: int
) -> None:
    # The control runs FSDP2 collectives; deciding on local gradients alone sent rank 1 into the
    # control while rank 0 returned, and gloo aborted on the mismatched collectives.
    started = time.monotonic()
    if fsdp2_rank == 1:
        with pytest.raises(ContractViolation, match="parity") as error:
            assert_fp32_keep_contract(factory_off_on_rank_1, batch, mesh=fsdp2_mesh, dtype=BF16)
        assert any(not f.ok and f.subject.startswith("grad ") for f in error.value.report.failures)
    else:
        report = assert_fp32_keep_contract(
            factory_off_on_rank_1, batch, mesh=fsdp2_mesh, dtype=BF16
        )
        assert report.ok
    assert time.monotonic() - started < LIBRARY_BOUND_S * 6  # a hang would meet gloo's 30 min
