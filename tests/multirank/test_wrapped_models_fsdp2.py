"""Wrapped real models and nested kept units in the ranks (issue 13), on real Transformers classes
from the zoo's tiny configs (no downloads), gloo on CPU, 2 ranks by default.

* PEFT: ``peft.get_peft_model(model, LoraConfig(...))`` with LoRA on the attention projections of
  T5 (regular ``["wo"]``, kept under fp16) and Ernie4_5_Moe (strict router, kept under bf16 too):
  the whole contract passes with the PEFT model as the factory's model. Negative control: a
  resolver that reads the declarations of the top module only (PEFT's classes declare none: an
  empty plan) fails ``stored`` on every ``wo``. LoRA on the kept ``wo`` with its adapters cast
  to fp16 beside the FP32 base weight: refused on every rank naming the adapters only; with FP32
  adapters (PEFT's default) sharded.
* A value-head critic (TRL's ``AutoModelForCausalLMWithValueHead`` shape: the causal LM under
  ``pretrained_model``, a Linear value head beside it, the value in the loss): the contract passes.
* Blip2 under fp16: the kept ``qformer`` is one kept unit, and the wrap targets inside it (its
  ``Blip2QFormerMultiHeadAttention`` modules, from ``_no_split_modules``) are kept units of their
  own nested in it, each all-gathered when it runs, not with the qformer. Negative control: the
  qformer sharded as one unit gathers every attention of the subtree at once. ``query_tokens``,
  a root-owned kept parameter (trainable, it makes the root an FP32 unit:
  tests/multirank/test_root_and_tied_units_fsdp2.py), is frozen here, so it is replicated in
  FP32 and the root keeps the caller's policy.

The PEFT, plan and cast facts that need no ranks are in tests/test_plan_wrappers.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import fp32keep
from fp32keep import KeepLayoutError, KeepPlan
from fp32keep.shard.apply import kept_unit_policy
from pytest_fp32keep import ContractViolation, assert_fp32_keep_contract
from pytest_fp32keep.check.zoo import ZOO
from pytest_fp32keep.check.zoo.batches import causal_lm_batch
from pytest_fp32keep.contract.control import unit_layout
from pytest_fp32keep.contract.fsdp_state import unit_of
from tests.error_bounds import LIBRARY_BOUND_S
from tests.multirank.refusals import refused_on_every_rank
from tests.untouched import assert_unchanged, snapshot
from tests.zoo_entries import available_or_skip

pytestmark = pytest.mark.fsdp2

FP16, BF16 = torch.float16, torch.bfloat16
PEFT_PREFIX = "base_model.model"
#: The zoo entry, the LoRA targets (its attention projections) and the dtype that keeps something.
PEFT_CASES = {
    "t5": (["q", "v"], FP16),
    "ernie4_5_moe": (["q_proj", "v_proj"], BF16),
}


def peft_factory(name: str) -> Callable[[], nn.Module]:
    """The zoo model ``name`` wrapped by PEFT with LoRA on its attention projections."""

    def build() -> nn.Module:
        from peft import LoraConfig, get_peft_model

        targets, _ = PEFT_CASES[name]
        config = LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=targets)
        model: nn.Module = get_peft_model(ZOO[name].build(), config)
        return model

    return build


def peft_batch(name: str) -> Callable[[nn.Module], Any]:
    # The zoo's batch for the wrapped model (PeftModel forwards ``.config`` to it).
    return lambda model: ZOO[name].make_batch(model, 0)


@pytest.mark.parametrize("name", list(PEFT_CASES))
def test_peft_lora_model_keeps_the_whole_contract(mesh: DeviceMesh, name: str) -> None:
    available_or_skip(name)
    _, dtype = PEFT_CASES[name]
    report = assert_fp32_keep_contract(
        peft_factory(name), peft_batch(name), mesh=mesh, dtype=dtype, autocast=True
    )
    inner = fp32keep.resolve_keep_plan(ZOO[name].build(), dtype)
    # The same base tensors the unwrapped model keeps, under PEFT's prefix, stored and
    # all-gathered in FP32.
    assert {row.fqn for row in report.kept} == {f"{PEFT_PREFIX}.{n}" for n in inner.names}
    assert report.kept and {row.stored for row in report.kept} == {"float32"}
    assert {row.materialized for row in report.kept} - {"-"} == {"float32"}
    # LoRA adapters on the attention projections are not kept: stored as the reference stores
    # them (low precision, tests/test_plan_wrappers.py), their gradients compared in parity.
    assert not any(".lora_" in row.fqn for row in report.kept)


def top_module_only(plan: KeepPlan) -> KeepPlan:
    """What a resolver that reads the top module's own class only finds in a PeftModel: nothing."""
    return dataclasses.replace(
        plan,
        regular_entries=(),
        strict_entries=(),
        param_names=frozenset(),
        buffer_names=frozenset(),
        matches={},
        declared_by=("",),
    )


def test_negative_control_peft_model_under_a_top_module_plan_fails_stored(
    mesh: DeviceMesh,
) -> None:
    def cast(model: nn.Module, dtype: torch.dtype, plan: KeepPlan) -> None:
        fp32keep.keep_aware_cast(model, dtype, plan=top_module_only(plan))

    def shard(
        model: nn.Module,
        *,
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy,
        plan: KeepPlan,
        wrap: Any,
    ) -> None:
        fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=mp_policy, plan=top_module_only(plan))

    with pytest.raises(ContractViolation, match="stored") as error:
        assert_fp32_keep_contract(
            peft_factory("t5"),
            peft_batch("t5"),
            mesh=mesh,
            dtype=FP16,
            cast=cast,
            shard=shard,
            check_state_dict=False,
        )
    stored = {f.subject for f in error.value.report.failures if f.check == "stored"}
    assert len(stored) == 4 and all(s.endswith("DenseReluDense.wo.weight") for s in stored)
    assert all(s.startswith(f"{PEFT_PREFIX}.") for s in stored)


def t5_wo_lora(adapter_dtype: torch.dtype) -> tuple[nn.Module, KeepPlan]:
    """LoRA on T5's kept ``wo``, cast keep-aware for fp16 (base and adapters FP32), then the
    adapters cast to ``adapter_dtype``, as a trainer casting its trainable parameters does."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["wo"])
    model: nn.Module = get_peft_model(ZOO["t5"].build(), config)
    plan = fp32keep.resolve_keep_plan(model, FP16)
    fp32keep.keep_aware_cast(model, FP16, plan=plan)
    for name, module in model.named_modules():
        if name.endswith((".lora_A", ".lora_B")):
            module.to(adapter_dtype)
    return model, plan


def test_peft_fp16_adapters_of_a_kept_module_are_refused_on_every_rank_naming_them(
    mesh: DeviceMesh,
) -> None:
    available_or_skip("t5")
    model, plan = t5_wo_lora(FP16)
    before = snapshot(model)
    policy = MixedPrecisionPolicy(param_dtype=FP16, reduce_dtype=torch.float32)
    error = refused_on_every_rank(
        lambda: fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=policy, plan=plan),
        KeepLayoutError,
        "nothing was sharded",
        bound=LIBRARY_BOUND_S,
    )
    adapters = {name for name, _ in model.named_parameters() if ".wo.lora_" in name}
    assert len(adapters) == 8  # lora_A and lora_B of T5's four `wo`
    assert {(p.fqn, p.reason) for p in error.problems} == {
        (name, "mixed-dtype-unit") for name in adapters
    }
    assert "autocast_adapter_dtype=True" in str(error) and "torch.float16" in str(error)
    assert_unchanged(model, before)
    # Negative control: the same model with FP32 adapters (PEFT's default) is sharded, the
    # adapters in their `wo`'s kept unit, stored FP32.
    model, plan = t5_wo_lora(torch.float32)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=policy, plan=plan)
    lora = model.get_submodule(f"{PEFT_PREFIX}.encoder.block.0.layer.1.DenseReluDense.wo.lora_A")
    assert isinstance(lora.default.weight, DTensor) and lora.default.weight.dtype == torch.float32


# --- a value-head critic ---------------------------------------------------------------------


class CausalLMWithValueHead(nn.Module):
    """TRL's value-head model (also verl's critic shape): a causal LM and a scalar head on its
    last hidden state; the forward returns the LM's logits and loss and the values."""

    def __init__(self, model: Any) -> None:  # a Transformers model (untyped)
        super().__init__()
        self.pretrained_model = model
        self.v_head = nn.Linear(int(model.config.hidden_size), 1)

    def forward(self, **batch: torch.Tensor) -> dict[str, torch.Tensor]:
        """The LM's ``logits`` and ``loss`` and one ``value`` per token."""
        out = self.pretrained_model(**batch, output_hidden_states=True)
        value = self.v_head(out.hidden_states[-1]).squeeze(-1)
        return {"logits": out.logits, "loss": out.loss, "value": value}


def value_head_critic() -> nn.Module:
    from transformers import AutoModelForCausalLM

    config = ZOO["gpt_oss"].build().config  # the zoo's tiny config; weights come from the seed
    return CausalLMWithValueHead(AutoModelForCausalLM.from_config(config))


def critic_loss(output: Mapping[str, torch.Tensor]) -> torch.Tensor:
    # The LM loss plus a value loss, so the value head and the LM under it both get gradients.
    return output["loss"] + output["value"].float().square().mean()


def test_value_head_critic_keeps_the_whole_contract(mesh: DeviceMesh) -> None:
    available_or_skip("gpt_oss")
    report = assert_fp32_keep_contract(
        value_head_critic,
        lambda model: causal_lm_batch(model.pretrained_model, 0),  # type: ignore[arg-type]
        mesh=mesh,
        dtype=FP16,
        autocast=True,
        loss_fn=critic_loss,
    )
    inner = fp32keep.resolve_keep_plan(ZOO["gpt_oss"].build(), FP16)
    assert {row.fqn for row in report.kept} == {f"pretrained_model.{n}" for n in inner.names}
    assert report.kept and {row.stored for row in report.kept} == {"float32"}
    assert not any(row.fqn.startswith("v_head.") for row in report.kept)


# --- nested kept units on a real Blip2 -------------------------------------------------------


def blip2() -> Any:
    """The zoo's Blip2 with ``query_tokens`` frozen: replicated, the rest can be sharded."""
    model = ZOO["blip2"].build()
    model.query_tokens.requires_grad_(False)
    return model


def blip2_fp16() -> tuple[Any, KeepPlan, MixedPrecisionPolicy]:
    """:func:`blip2` cast keep-aware to fp16, its plan, and the policy its units get (fp16
    compute, FP32 reduce); skipped where the installed release has no Blip2."""
    available_or_skip("blip2")
    model = blip2()
    plan = fp32keep.resolve_keep_plan(model, FP16)
    fp32keep.keep_aware_cast(model, FP16, plan=plan)
    return model, plan, MixedPrecisionPolicy(param_dtype=FP16, reduce_dtype=torch.float32)


def qformer_attentions(model: Any) -> dict[str, nn.Module]:
    """The qformer's wrap targets (``_no_split_modules``): every layer's attention modules.

    Call it before sharding: ``fully_shard`` renames a unit's class (``FSDP`` + its name).
    """
    return {
        f"qformer.{fqn}": module
        for fqn, module in model.qformer.named_modules()
        if type(module).__name__ == "Blip2QFormerMultiHeadAttention"
    }


def gathered_when_first_runs(model: nn.Module, attentions: Mapping[str, Any]) -> list[str]:
    """Which attention modules hold all-gathered (not DTensor) weights when the first one runs."""
    first, *_ = attentions.values()
    seen: list[str] = []

    def record(module: nn.Module, args: object) -> None:
        seen.extend(
            fqn
            for fqn, attention in attentions.items()
            if not isinstance(attention.query.weight, DTensor)
        )

    handle = first.register_forward_pre_hook(record)
    with torch.autocast("cpu", dtype=FP16):
        model(**ZOO["blip2"].make_batch(model, 0))
    handle.remove()
    return seen


def fsdp_policy(module: nn.Module) -> MixedPrecisionPolicy:
    """The policy ``fully_shard`` gave ``module``'s unit (FSDP2's state, as ``unit_layout``)."""
    policy = unit_of(module).policy
    assert policy is not None
    return policy


def test_blip2_qformer_attentions_are_nested_kept_units(mesh: DeviceMesh) -> None:
    model, plan, policy = blip2_fp16()
    attentions = qformer_attentions(model)
    assert len(attentions) == 2 * len(model.qformer.encoder.layer)  # self- and cross-attention
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=policy, plan=plan)
    units = {unit.modules: unit.params for unit in unit_layout(model)}
    nested = {(fqn,): units[(fqn,)] for fqn in attentions}
    for (fqn,), params in nested.items():  # each attention's own parameters, and only those
        assert params == {name for name in plan.param_names if name.startswith(fqn + ".")}, fqn
    in_qformer = {name for name in plan.param_names if name.startswith("qformer.")}
    # The qformer's unit holds the rest of the subtree; no other unit holds a qformer parameter.
    assert units[("qformer",)] == in_qformer - set().union(*nested.values())
    assert {key for key, params in units.items() if params & in_qformer} == {
        ("qformer",),
        *nested,
    }
    for fqn in ("qformer", *attentions):  # all kept units: all-gathered in FP32, no output cast
        assert fsdp_policy(model.get_submodule(fqn)) == kept_unit_policy(policy), fqn
    assert not isinstance(model.query_tokens, DTensor) and model.query_tokens.dtype == torch.float32
    # Each attention is all-gathered by its own unit when it runs: only the first is, then.
    assert gathered_when_first_runs(model, attentions) == [next(iter(attentions))]


def test_negative_control_blip2_qformer_as_one_unit_gathers_every_attention(
    mesh: DeviceMesh,
) -> None:
    model, _, policy = blip2_fp16()  # the same model, cast and policy as the test above
    attentions = qformer_attentions(model)
    # The layout before nesting: the qformer one kept unit, the rest as fp32keep lays it out.
    fully_shard(model.qformer, mesh=mesh, mp_policy=kept_unit_policy(policy))
    for module in model.vision_model.encoder.layers:
        fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params={model.query_tokens})
    assert gathered_when_first_runs(model, attentions) == list(attentions)


def test_blip2_with_nested_kept_units_keeps_the_whole_contract(mesh: DeviceMesh) -> None:
    available_or_skip("blip2")
    report = assert_fp32_keep_contract(
        blip2, lambda model: ZOO["blip2"].make_batch(model, 0), mesh=mesh, dtype=FP16, autocast=True
    )
    qformer = [row for row in report.kept if row.fqn.startswith("qformer.")]
    assert qformer and {row.stored for row in report.kept} == {"float32"}
    assert {row.materialized for row in qformer} == {"float32"}
    assert "query_tokens" in {row.fqn for row in report.kept}
