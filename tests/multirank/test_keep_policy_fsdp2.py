"""Keeping FP32 by policy (torch 2.15's ``param_dtype_override_fn``) inside the caller's own
units, judged by the contract; and, on an older torch, the refusal naming the version (issue 38).

The policy path needs torch >= 2.15: those tests skip with a reason naming the installed torch
on 2.13 (the default tier) and run in ``nox -s keep-policy`` (torch 2.15). The refusals of an
older torch run where that torch is installed, and the choices that do not depend on torch run
everywhere.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

import fp32keep
from fp32keep import Fp32KeepNotImplementedError, Fp32KeepValueError, KeepLayoutError, KeepPlan
from fp32keep.shard.keep_policy import OVERRIDE_SUPPORTED
from pytest_fp32keep import ContractReport, ContractViolation, assert_fp32_keep_contract
from pytest_fp32keep.check.families import entries
from pytest_fp32keep.check.families.batches import family_batch
from pytest_fp32keep.check.zoo import ZOO
from tests.error_bounds import LIBRARY_BOUND_S, within
from tests.multirank.test_policies_fsdp2 import _blocks_then_root

pytestmark = pytest.mark.fsdp2  # every test runs in the ranks (2 by default)

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32
NEEDS_OVERRIDE = pytest.mark.skipif(
    not OVERRIDE_SUPPORTED,
    reason=f"torch {torch.__version__} has no MixedPrecisionPolicy.param_dtype_override_fn "
    "(torch 2.15 added it): run nox -s keep-policy",
)
OLD_TORCH = pytest.mark.skipif(
    OVERRIDE_SUPPORTED, reason=f"torch {torch.__version__} has param_dtype_override_fn"
)
MODELS = {"t5": FP16, "gpt_oss": FP16, "deepseek_v3": BF16, "ernie4_5_moe": BF16}
"""T5 (kept ``wo``), GptOss (every norm), DeepSeek-V3 (router weight and buffer), Ernie4.5-MoE
(router): what torch 2.15's override was measured on."""


def policy(dtype: torch.dtype, **fields: object) -> MixedPrecisionPolicy:
    """A framework's policy over FP32 masters: compute in ``dtype``, reduce in FP32, inputs not
    cast (so the FP32 activations kept modules make reach the next unit as they do unsharded)."""
    options: dict[str, object] = {"reduce_dtype": FP32, "cast_forward_inputs": False, **fields}
    return MixedPrecisionPolicy(param_dtype=dtype, **options)  # type: ignore[arg-type]


def master_model(model: str) -> tuple[nn.Module, KeepPlan]:
    """Zoo ``model`` cast keep-aware, then FP32 master weights (every trainable parameter)."""
    built = ZOO[model].build()
    plan = fp32keep.resolve_keep_plan(built, MODELS[model])
    fp32keep.keep_aware_cast(built, MODELS[model], plan=plan)
    fp32keep.upcast_to_fp32_master(built)
    return built, plan


def _contract(mesh: DeviceMesh, model: str, **options: object) -> ContractReport:
    entry = ZOO[model]
    return assert_fp32_keep_contract(
        entry.build,
        functools.partial(entry.make_batch, seed=0),
        mesh=mesh,
        dtype=MODELS[model],
        master_dtype=FP32,
        **options,  # type: ignore[arg-type]
    )


def _own_units_with(
    keep: Callable[[MixedPrecisionPolicy, KeepPlan, nn.Module], MixedPrecisionPolicy],
) -> Callable[..., None]:
    """A framework's ``shard``: every block one unit, then the root, each with
    ``keep(the caller's policy, plan, model)``: the one-line fix is ``fp32keep.keep_policy``."""

    def shard(
        model: nn.Module,
        *,
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy,
        plan: KeepPlan,
        **_: object,
    ) -> None:
        _blocks_then_root(model, mesh=mesh, mp_policy=keep(mp_policy, plan, model))

    return shard


@NEEDS_OVERRIDE
@pytest.mark.parametrize("model", list(MODELS))
def test_apply_fsdp2_keeps_by_policy_in_the_callers_units(mesh: DeviceMesh, model: str) -> None:
    report = _contract(mesh, model, mp_policy=policy(MODELS[model]))
    assert report.ok
    gathered = {row.materialized for row in report.kept} - {"-"}  # "-": a kept buffer
    assert gathered <= {"float32"}  # DeepSeek-V3 keeps only a buffer in some releases
    built, plan = master_model(model)
    fp32keep.apply_fsdp2(built, mesh=mesh, mp_policy=policy(MODELS[model]), plan=plan)
    layout = fp32keep.sharded_layout(built)
    assert layout is not None and layout.keeps == "policy", layout
    assert not [u for u in layout.units if u.kind == "kept"]
    assert "by the policy's override" in layout.describe()


@NEEDS_OVERRIDE
@pytest.mark.parametrize("model", ["t5", "ernie4_5_moe"])
def test_the_one_line_fix_in_a_frameworks_own_sharding(mesh: DeviceMesh, model: str) -> None:
    fixed = _own_units_with(fp32keep.keep_policy)
    report = _contract(mesh, model, mp_policy=policy(MODELS[model]), shard=fixed)
    assert report.ok
    # the negative control: the same units and policy without the override
    with pytest.raises(ContractViolation) as caught:
        _contract(
            mesh,
            model,
            mp_policy=policy(MODELS[model]),
            shard=_own_units_with(lambda mp_policy, plan, module: mp_policy),
        )
    assert "materialized" in {f.check for f in caught.value.report.failures}


@NEEDS_OVERRIDE
def test_a_bf16_reduction_takes_kept_units_or_is_refused(mesh: DeviceMesh) -> None:
    low_reduce = policy(FP16, reduce_dtype=FP16)
    built, plan = master_model("t5")
    fp32keep.apply_fsdp2(built, mesh=mesh, mp_policy=low_reduce, plan=plan)
    layout = fp32keep.sharded_layout(built)
    assert layout is not None and layout.keeps == "units"
    assert "reduces gradients in torch.float16" in layout.why
    built, plan = master_model("t5")
    with pytest.raises(Fp32KeepValueError, match=r"reduces gradients in torch\.float16"):
        fp32keep.apply_fsdp2(built, mesh=mesh, mp_policy=low_reduce, plan=plan, keep_by="policy")
    assert not isinstance(built, FSDPModule)
    with pytest.raises(Fp32KeepValueError, match=r"reduce_dtype=torch\.float32"):
        fp32keep.keep_policy(low_reduce, plan, built)


def test_low_precision_storage_keeps_by_units_saying_why(mesh: DeviceMesh) -> None:
    built = ZOO["t5"].build()
    plan = fp32keep.resolve_keep_plan(built, FP16)
    fp32keep.keep_aware_cast(built, FP16, plan=plan)
    with (
        within(LIBRARY_BOUND_S),
        pytest.raises(Fp32KeepValueError, match=r"keep_by='policy'") as caught,
    ):
        fp32keep.apply_fsdp2(built, mesh=mesh, mp_policy=policy(FP16), plan=plan, keep_by="policy")
    assert "torch 2.15" in str(caught.value) or "stored in low precision" in str(caught.value)
    assert not isinstance(built, FSDPModule)
    fp32keep.apply_fsdp2(built, mesh=mesh, mp_policy=policy(FP16), plan=plan)
    layout = fp32keep.sharded_layout(built)
    assert layout is not None and layout.keeps == "units"
    assert [u for u in layout.units if u.kind == "kept"]
    assert layout.describe().startswith("kept parameters stay FP32 in kept units: ")


def test_an_unknown_keep_by_is_refused_naming_it(mesh: DeviceMesh) -> None:
    built, plan = master_model("t5")
    with (
        within(LIBRARY_BOUND_S),
        pytest.raises(Fp32KeepValueError, match=r"apply_fsdp2\(keep_by='both'\): expected"),
    ):
        fp32keep.apply_fsdp2(built, mesh=mesh, mp_policy=policy(FP16), plan=plan, keep_by="both")  # type: ignore[arg-type]
    assert not isinstance(built, FSDPModule)


@OLD_TORCH
def test_before_torch_2_15_the_policy_is_refused_naming_the_version(mesh: DeviceMesh) -> None:
    built, plan = master_model("t5")
    installed = re.escape(torch.__version__)
    with pytest.raises(Fp32KeepNotImplementedError, match=rf"torch {installed} has no .*2\.15"):
        fp32keep.keep_policy(policy(FP16), plan, built)
    with pytest.raises(Fp32KeepValueError, match=rf"torch {installed} has no"):
        fp32keep.apply_fsdp2(built, mesh=mesh, mp_policy=policy(FP16), plan=plan, keep_by="policy")
    fp32keep.apply_fsdp2(built, mesh=mesh, mp_policy=policy(FP16), plan=plan)
    layout = fp32keep.sharded_layout(built)
    assert layout is not None and layout.keeps == "units"
    assert f"torch {torch.__version__} has no" in layout.why


@NEEDS_OVERRIDE
def test_a_kept_unit_of_the_callers_keeps_its_boundary(mesh: DeviceMesh) -> None:
    # every Linear its own unit: T5's kept `wo` is then a unit of the caller's whose parameters
    # are all kept; under a policy that casts inputs its FP32 input must not be cast to fp16
    by_policy = functools.partial(fp32keep.apply_fsdp2, keep_by="policy")
    report = _contract(
        mesh,
        "t5",
        mp_policy=policy(FP16, cast_forward_inputs=True),
        shard=by_policy,
        wrap=["T5Block", "Linear"],
    )
    assert report.ok


@NEEDS_OVERRIDE
def test_a_mixed_unit_refusal_is_kept_by_policy_over_fp32_masters(mesh: DeviceMesh) -> None:
    # Rwkv under fp16: `time_decay` and `time_first` are kept beside parameters that are not,
    # in one module: over low-precision storage no unit can hold them (refused, mixed-unit);
    # over FP32 masters the policy keeps them FP32 inside the caller's units
    entry = ZOO["rwkv"]
    contract = functools.partial(
        assert_fp32_keep_contract,
        entry.build,
        functools.partial(entry.make_batch, seed=0),
        mesh=mesh,
        dtype=FP16,
    )
    report = contract(master_dtype=FP32)
    assert report.ok and report.kept
    with pytest.raises(KeepLayoutError, match="mixed-unit"):
        contract()


@NEEDS_OVERRIDE
def test_a_kept_parameter_beside_unkept_children_is_judged_in_the_callers_unit(
    mesh: DeviceMesh,
) -> None:
    # OpenAI Privacy Filter's attention owns its kept `sinks` and the projections (not kept) as
    # children, inside the caller's block. The control cannot give the attention a unit of its
    # own (fully_shard would take the projections too, a layout nobody made), so over FP32
    # masters it keeps the block as it is and gathers `sinks` in FP32 by torch's override, as
    # the policy path does (before, it stopped on a layout it could not reproduce: parity FAIL)
    build = functools.partial(entries.build_family_model, "openai_privacy_filter")
    contract = functools.partial(
        assert_fp32_keep_contract,
        build,
        lambda model: family_batch(model, 0),
        mesh=mesh,
        dtype=BF16,
        autocast=True,
        master_dtype=FP32,
    )
    report = contract()
    assert report.ok and {row.fqn.rpartition(".")[2] for row in report.kept} == {"sinks"}
    assert any("param_dtype_override_fn" in note for note in report.notes), report.notes
    # the negative control: the caller's blocks without the override gather `sinks` in bf16
    with pytest.raises(ContractViolation) as caught:
        contract(shard=_blocks_then_root)
    failed = {(f.check, f.subject) for f in caught.value.report.failures}
    assert any(c == "materialized" and ".sinks (call" in s for c, s in failed), failed
    assert any(c == "parity" and s.startswith("grad ") and ".sinks" in s for c, s in failed), failed
