"""The reference follows the implementation where the contract allows either (issue 34).

Two correct paths used to be false alarms: verl's whole-module ``module.to(torch.float32)``
under FP32 master weights (its buffers and frozen parameters FP32, the rotary ``inv_freq``
included, where the reference held them in ``dtype``), and a model frozen in the
implementation's own cast (trl's teacher), judged against a reference that still trained. Each
passes now, on real Transformers models in real gloo ranks; the negative controls prove that
what is not a free choice still fails: a kept buffer left in the low dtype, a trainable
parameter in the low dtype under master weights, a buffer in fp16 where the run is bf16, and a
frozen model whose kept tensors are all-gathered in bf16.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fp32keep
from fp32keep import KeepPlan
from pytest_fp32keep import ContractReport, ContractViolation, assert_fp32_keep_contract
from pytest_fp32keep.check.zoo import available_entries
from pytest_fp32keep.contract.checks.parity import FORWARD_ONLY
from tests.core.toys import stack_class
from tests.frameworks import harness

pytestmark = pytest.mark.fsdp2  # every test runs in the ranks (2 by default)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
ROTARY = "model.rotary_emb.inv_freq"


def on_zoo(name: str, mesh: DeviceMesh, dtype: torch.dtype, **plugged: Any) -> ContractReport:
    """The frameworks' harness call (zoo model ``name``, forward under autocast, ``plugged``
    its options), skipped where the installed Transformers lacks the model."""
    if name in available_entries([name]).unavailable:
        pytest.skip(f"{name} is not in the installed Transformers")
    return harness.on_zoo(mesh, name, dtype, **plugged)


def failures(
    error: pytest.ExceptionInfo[ContractViolation], row: str
) -> dict[str, tuple[str, str]]:
    return {
        f.subject: (f.expected, f.observed) for f in error.value.report.failures if f.check == row
    }


# --- the implementation's casts ------------------------------------------------------------


def whole_module_fp32(model: nn.Module, dtype: torch.dtype, plan: KeepPlan) -> None:
    """verl's cast: ``module.to(torch.float32)``, buffers and frozen parameters included."""
    model.to(FP32)


def freeze_then_keep_aware(model: nn.Module, dtype: torch.dtype, plan: KeepPlan) -> None:
    """trl's teacher: frozen (``requires_grad_(False)``, ``eval()``) in its own preparation,
    then cast keep-aware."""
    model.requires_grad_(False).eval()
    fp32keep.keep_aware_cast(model, dtype, plan=plan)


def rotary_in_fp16(model: nn.Module, dtype: torch.dtype, plan: KeepPlan) -> None:
    """Negative control: the whole-module upcast, then the not-kept rotary buffer in fp16."""
    model.to(FP32)
    rotary = model.get_submodule("model.rotary_emb")
    rotary.inv_freq.data = rotary.inv_freq.data.to(FP16)


def low_then_masters(model: nn.Module, dtype: torch.dtype, plan: KeepPlan) -> None:
    """Negative control: a blanket ``model.to(dtype)`` (kept buffer lowered too), then the
    trainable parameters upcast to FP32 masters."""
    model.to(dtype)
    fp32keep.upcast_to_fp32_master(model)


def first_layer_low(model: nn.Module, dtype: torch.dtype, plan: KeepPlan) -> None:
    """Negative control: the whole-module upcast, but the first decoder layer (trainable,
    nothing kept in it, a unit of its own) left in ``dtype``."""
    model.to(FP32)
    model.get_submodule("model.layers.0").to(dtype)


def one_unit(
    model: nn.Module, *, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy, **_: object
) -> None:
    """Negative control: trl's ``prepare_fsdp``, the whole model one unit with the caller's
    policy, kept tensors included (all-gathered in its ``param_dtype``)."""
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def freezing_shard(model: Any, **options: Any) -> None:
    """fp32keep's sharding of a model frozen in the shard step (its embeddings)."""
    model.get_input_embeddings().requires_grad_(False)
    fp32keep.apply_fsdp2(model, **options)


# --- FP32 master weights: buffers and frozen parameters in `dtype` or FP32 ------------------


def test_whole_module_fp32_upcast_passes_under_master_weights(mesh: DeviceMesh) -> None:
    """verl's ``module.to(torch.float32)`` on Ernie4.5-MoE (bf16: kept router, rotary
    ``inv_freq``): the buffers in FP32 are followed, parity compares like with like."""
    report = on_zoo("ernie4_5_moe", mesh, BF16, cast=whole_module_fp32, master_dtype=FP32)
    assert report.ok
    assert {row.stored for row in report.kept} == {"float32"}
    assert any("FP32 master weights" in n and ROTARY in n for n in report.notes), report.notes
    parity = {f.subject: f.ok for f in report.findings if f.check == "parity"}
    assert parity["logits"] and parity["loss"]


def test_frozen_parameters_may_be_stored_in_either_dtype_under_fsdp2(mesh: DeviceMesh) -> None:
    """A partly frozen model under master weights: its frozen parameters stored FP32 (the
    whole-module upcast) or in ``dtype`` (accelerate's upcast of the trainable ones) both pass,
    sharded by FSDP2, with the trainable ones' gradients judged."""
    cls = stack_class(strict=["wo", "norm"])

    def frozen_factory() -> nn.Module:
        model = cls()
        model.layers[1].requires_grad_(False)
        return model

    def batch(model: nn.Module) -> torch.Tensor:
        return torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(3))

    for cast in (whole_module_fp32, None):
        options: dict[str, Any] = {"cast": cast} if cast is not None else {}
        report = assert_fp32_keep_contract(
            frozen_factory, batch, mesh=mesh, dtype=BF16, master_dtype=FP32, **options
        )
        assert report.ok
        assert FORWARD_ONLY not in report.notes
        upcast = [n for n in report.notes if "FP32 master weights" in n]
        assert bool(upcast) == (cast is not None), report.notes
        if upcast:
            assert "layers.1.attn.weight" in upcast[0]


def test_rotary_buffer_in_fp16_still_fails_stored(mesh: DeviceMesh) -> None:
    """Negative control: a not-kept buffer in fp16 where the run is bf16 is neither convention."""
    with pytest.raises(ContractViolation) as error:
        on_zoo("ernie4_5_moe", mesh, BF16, cast=rotary_in_fp16, master_dtype=FP32)
    assert failures(error, "stored")[ROTARY] == ("bfloat16", "float16")


def _require_kept(name: str, dtype: torch.dtype, tensor: str) -> None:
    """Skip, naming the installed Transformers, where its plan of zoo model ``name`` at
    ``dtype`` does not keep ``tensor``: the test's premise (4.56 drops DeepSeek-V3's regular
    list at bf16)."""
    import transformers

    from pytest_fp32keep.check.zoo import ZOO

    if name in available_entries([name]).unavailable:
        pytest.skip(f"{name} is not in the installed Transformers")
    if tensor not in fp32keep.resolve_keep_plan(ZOO[name].build(), dtype):
        pytest.skip(f"transformers {transformers.__version__} does not keep {tensor} at {dtype}")


def test_kept_buffer_in_the_low_dtype_still_fails_stored(mesh: DeviceMesh) -> None:
    """Negative control: DeepSeek-V3's kept router buffer lowered to bf16 by a blanket cast,
    under master weights: ``stored`` expects FP32 whatever the convention."""
    _require_kept("deepseek_v3", BF16, "model.layers.1.mlp.gate.e_score_correction_bias")
    with pytest.raises(ContractViolation) as error:
        on_zoo("deepseek_v3", mesh, BF16, cast=low_then_masters, master_dtype=FP32)
    stored = failures(error, "stored")
    assert stored["model.layers.1.mlp.gate.e_score_correction_bias"] == ("float32", "bfloat16")
    assert ROTARY not in stored  # not kept, in `dtype`: one of the two conventions


def test_trainable_parameter_in_the_low_dtype_still_fails_under_master_weights(
    mesh: DeviceMesh,
) -> None:
    """Negative control: the whole-module upcast with a trainable layer left in bf16."""
    with pytest.raises(ContractViolation) as error:
        on_zoo("ernie4_5_moe", mesh, BF16, cast=first_layer_low, master_dtype=FP32)
    stored = failures(error, "stored")
    assert stored["model.layers.0.self_attn.q_proj.weight"] == ("float32", "bfloat16")
    assert "model.layers.1.self_attn.q_proj.weight" not in stored


# --- a model frozen by the implementation ----------------------------------------------------


@pytest.mark.parametrize("master_dtype", [None, FP32], ids=["low", "masters"])
def test_model_frozen_in_cast_is_judged_forward_only(
    mesh: DeviceMesh, master_dtype: torch.dtype | None
) -> None:
    """trl's teacher frozen in the implementation's cast: the reference follows, forward only,
    and the report says what was not judged and what was followed."""
    report = on_zoo(
        "ernie4_5_moe",
        mesh,
        BF16,
        cast=freeze_then_keep_aware,
        master_dtype=master_dtype,
        check_state_dict=False,
    )
    assert report.ok
    assert FORWARD_ONLY in report.notes
    assert any("frozen that the model factory builds trainable" in n for n in report.notes)
    assert not any(f.check == "parity" and f.subject.startswith("grad") for f in report.findings)


def test_model_frozen_in_shard_is_followed(mesh: DeviceMesh) -> None:
    """Freezing in ``shard`` is read before the first forward and followed too: the frozen
    embeddings have no gradient on either side, every other gradient is judged."""
    report = on_zoo("ernie4_5_moe", mesh, BF16, shard=freezing_shard)
    assert report.ok
    assert FORWARD_ONLY not in report.notes
    assert any("model.embed_tokens.weight" in n for n in report.notes), report.notes
    assert any(f.subject == "every gradient" for f in report.findings if f.ok)


def test_frozen_model_with_kept_tensors_gathered_in_bf16_still_fails(mesh: DeviceMesh) -> None:
    """Negative control: the model frozen in cast, sharded as one unit with the caller's bf16
    policy: the kept router is all-gathered in bf16 (``materialized``), or, where the release's
    router casts its input to FP32 itself (4.56), its matmul of that input with the bf16 weight
    crashes the forward (``crashed``): the contract fails either way."""
    with pytest.raises(ContractViolation) as error:
        on_zoo(
            "ernie4_5_moe",
            mesh,
            BF16,
            cast=freeze_then_keep_aware,
            shard=one_unit,
            check_state_dict=False,
        )
    crashed = failures(error, "crashed").get("forward")
    if crashed is not None:
        assert "BFloat16" in crashed[1], crashed  # the gathered bf16 weight met an FP32 input
        return
    gathered = {s.split(" ")[0]: o for s, (_, o) in failures(error, "materialized").items()}
    assert gathered["model.layers.1.mlp.gate.weight"] == "bfloat16"
    assert FORWARD_ONLY in error.value.report.notes
