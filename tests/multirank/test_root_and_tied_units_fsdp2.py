"""Two layouts FSDP2 can represent once laid out right (issue 23), in the ranks.

* A root that owns kept parameters (Blip2's ``query_tokens``): every child and the input
  embedding the root calls itself get units, then the root is sharded as an FP32 kept unit.
* A kept tensor tied between modules of different units (hy_v4's tied word embeddings): one
  kept unit holding both modules.

Each runs the whole contract; each has its negative control: the known-wrong layout (the root
unit with the caller's low-precision ``param_dtype``; the tied aliases split) makes the contract
fail or the forward crash. The expectations come from the models' code (which tensor a forward
reads, in which dtype), never from the layout under test.
"""

from __future__ import annotations

import copy
import importlib.metadata
from collections.abc import Callable
from typing import Any

import pytest
import torch
from packaging.version import Version
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import fp32keep
from fp32keep import KeepPlan, WrapSpec
from fp32keep.shard.apply import kept_unit_policy
from pytest_fp32keep import ContractViolation, assert_fp32_keep_contract
from pytest_fp32keep.check.zoo import ZOO
from tests.core.root_toys import QueryStack, TiedKeptStack
from tests.zoo_entries import available_or_skip

pytestmark = pytest.mark.fsdp2

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
SEMANTICS = "5.10.4"
EXACT_POLICY = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, cast_forward_inputs=False)


def ids() -> torch.Tensor:
    return torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(7))


def built(cls: type[nn.Module]) -> tuple[nn.Module, nn.Module, KeepPlan]:
    """A keep-aware cast model, its unsharded reference, and the plan."""
    torch.manual_seed(0)
    model = cls()
    plan = fp32keep.resolve_keep_plan(model, BF16, transformers_version=SEMANTICS)
    fp32keep.keep_aware_cast(model, BF16, plan=plan)
    return model, copy.deepcopy(model), plan


def step(model: nn.Module) -> torch.Tensor:
    logits = model(ids())
    logits.float().logsumexp(-1).mean().backward()
    return logits


def assert_same_grads(model: nn.Module, reference: nn.Module) -> None:
    want = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    got = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad
            got[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    assert set(got) == set(want)
    for name, grad in want.items():
        assert got[name].dtype == grad.dtype and torch.equal(got[name], grad), name


def query_dtype_seen_by_qformer(model: nn.Module) -> list[tuple[bool, torch.dtype]]:
    """What the root hands its Q-Former: whether ``query_tokens`` is all-gathered, its dtype."""
    seen: list[tuple[bool, torch.dtype]] = []
    model.qformer.register_forward_pre_hook(  # type: ignore[union-attr]
        lambda m, a: seen.append(
            (isinstance(model.query_tokens, DTensor), model.query_tokens.dtype)  # type: ignore[union-attr]
        )
    )
    return seen


def contract(factory: Callable[[], nn.Module], mesh: DeviceMesh, **kwargs: Any) -> Any:
    return assert_fp32_keep_contract(
        factory,
        lambda model: ids(),
        mesh=mesh,
        dtype=BF16,
        autocast=True,
        mp_policy=EXACT_POLICY,
        **kwargs,
    )


# --- a root that owns kept parameters -----------------------------------------------------


def test_root_owning_kept_tokens_is_an_fp32_unit_and_matches_the_unsharded_model(
    mesh: DeviceMesh,
) -> None:
    model, reference, plan = built(QueryStack)
    seen = query_dtype_seen_by_qformer(model)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=EXACT_POLICY, plan=plan)
    assert isinstance(model.query_tokens, DTensor)  # sharded at rest, not replicated
    assert model.query_tokens.dtype == FP32
    assert torch.equal(step(model), step(reference))
    assert seen == [(False, FP32)]  # gathered by the root's own unit, in FP32
    assert_same_grads(model, reference)


def test_root_owning_kept_tokens_keeps_the_whole_contract(mesh: DeviceMesh) -> None:
    report = contract(QueryStack, mesh)
    rows = {row.fqn: row for row in report.kept}
    assert (rows["query_tokens"].stored, rows["query_tokens"].materialized) == ("float32",) * 2
    assert report.ok


def shard_root_with_the_callers_policy(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    plan: KeepPlan,
    wrap: WrapSpec | None,
) -> None:
    """fp32keep's units for the model, but the root's with the caller's policy: the known-wrong
    root unit (``query_tokens`` all-gathered in the policy's ``param_dtype``)."""
    layout = fp32keep.plan_layout(model, plan, wrap=wrap)
    modules = dict(model.named_modules())
    for unit in layout.units:
        policy = (
            kept_unit_policy(mp_policy)
            if unit.kind == "kept" and unit.module_fqns != ("",)
            else mp_policy
        )
        targets = [modules[fqn] for fqn in unit.module_fqns]
        fully_shard(targets if len(targets) > 1 else targets[0], mesh=mesh, mp_policy=policy)


def test_negative_control_root_unit_with_the_callers_param_dtype(mesh: DeviceMesh) -> None:
    model, _, plan = built(QueryStack)
    seen = query_dtype_seen_by_qformer(model)
    shard_root_with_the_callers_policy(
        model, mesh=mesh, mp_policy=EXACT_POLICY, plan=plan, wrap=None
    )
    step(model)
    assert seen == [(False, BF16)]  # the same units: query_tokens reaches the Q-Former in bf16
    with pytest.raises(ContractViolation) as error:
        contract(QueryStack, mesh, shard=shard_root_with_the_callers_policy)
    broken = {f.subject for f in error.value.report.findings if not f.ok}
    assert any("query_tokens" in subject for subject in broken), str(error.value)


def blip2_trainable() -> nn.Module:
    """The zoo's Blip2 (OPT language model, tied ``lm_head``), ``query_tokens`` trainable."""
    return ZOO["blip2"].build()


def blip2_batch(model: nn.Module) -> Any:
    return ZOO["blip2"].make_batch(model, 0)


def test_blip2_fp16_with_trainable_query_tokens_keeps_the_whole_contract(
    mesh: DeviceMesh,
) -> None:
    available_or_skip("blip2")
    report = assert_fp32_keep_contract(
        blip2_trainable, blip2_batch, mesh=mesh, dtype=FP16, autocast=True
    )
    rows = {row.fqn: row for row in report.kept}
    # Blip2's declaration ["query_tokens", "qformer"] under fp16: the root's query_tokens and
    # every Q-Former tensor, stored and all-gathered in FP32.
    assert (rows["query_tokens"].stored, rows["query_tokens"].materialized) == ("float32",) * 2
    assert all(fqn == "query_tokens" or fqn.startswith("qformer.") for fqn in rows)
    assert {(row.stored, row.materialized) for row in report.kept} == {("float32", "float32")}
    assert report.ok, report.table(failures_only=True)


def test_negative_control_blip2_root_unit_with_fp16_param_dtype(mesh: DeviceMesh) -> None:
    available_or_skip("blip2")
    with pytest.raises(ContractViolation) as error:
        assert_fp32_keep_contract(
            blip2_trainable,
            blip2_batch,
            mesh=mesh,
            dtype=FP16,
            autocast=True,
            shard=shard_root_with_the_callers_policy,
        )
    broken = {f.subject for f in error.value.report.findings if not f.ok}
    assert any("query_tokens" in subject for subject in broken), str(error.value)


# --- a kept tensor tied across units -------------------------------------------------------


def test_kept_tie_across_units_is_one_kept_unit_and_matches_the_unsharded_model(
    mesh: DeviceMesh,
) -> None:
    model, reference, plan = built(TiedKeptStack)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=EXACT_POLICY, plan=plan)
    assert model.head.weight is model.embed.weight  # still tied after sharding
    assert isinstance(model.embed.weight, DTensor) and model.embed.weight.dtype == FP32
    assert torch.equal(step(model), step(reference))
    assert_same_grads(model, reference)


def test_kept_tie_across_units_keeps_the_whole_contract(mesh: DeviceMesh) -> None:
    report = contract(TiedKeptStack, mesh)
    rows = {row.fqn: row for row in report.kept}
    assert {"embed.weight", "head.weight"} <= set(rows)
    assert report.ok, report.table(failures_only=True)


def shard_tie_apart(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    plan: KeepPlan,
    wrap: WrapSpec | None,
) -> None:
    """The aliases' modules as two kept units (the layout before grouping them), the rest as
    fp32keep lays it out: the known-wrong split."""
    kept = kept_unit_policy(mp_policy)
    fully_shard(model.embed, mesh=mesh, mp_policy=kept)
    fully_shard(model.head, mesh=mesh, mp_policy=kept)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def assert_the_split_tie_broke_the_contract(error: ContractViolation, tied: set[str]) -> None:
    """The known-wrong split broke the contract, in one of the two ways torch lets it break:

    * torch 2.13 and 2.14 refuse it: the root's lazy init (``_validate_no_duplicate_params``)
      raises "... is shared with a parameter already managed by another FSDP group", which the
      contract reports as its forward step's crash;
    * torch 2.9.1 has no such check: the first unit swaps its module's alias for its sharded
      parameter, the second shards the original tensor again as a parameter of its own; the
      tie is gone, the steps run, and each copy's gradient holds only its own module's part
      (0.75 and 1 relative off, seen): the contract's parity check fails on that gradient.

    A split that kept the contract fails this control through ``pytest.raises`` (no
    ``ContractViolation``); one that broke it some third way fails here.
    """
    text = " ".join(str(error).split())  # the table wraps the observed cell
    if "already managed by another FSDP group" in text:
        return
    off = {f.subject for f in error.report.failures if f.check == "parity"}
    assert off & {f"grad {name}" for name in tied}, text


def test_negative_control_kept_tie_split_across_two_units(mesh: DeviceMesh) -> None:
    with pytest.raises(ContractViolation) as error:
        contract(TiedKeptStack, mesh, shard=shard_tie_apart)
    assert_the_split_tie_broke_the_contract(error.value, {"embed.weight", "head.weight"})


def _transformers_at_least(version: str) -> bool:
    try:
        return Version(importlib.metadata.version("transformers")) >= Version(version)
    except importlib.metadata.PackageNotFoundError:
        return False


def hy_v4_tied() -> nn.Module:
    """The families' tiny hy_v4 (``HYV4ForCausalLM``) with ``tie_word_embeddings=True``: its
    strict ``["lm_head"]`` keeps the head, so the embedding tied to it is kept too."""
    from transformers import HYV4Config, HYV4ForCausalLM

    from pytest_fp32keep.check.families.overrides import OVERRIDES
    from pytest_fp32keep.check.families.shrink import tiny_config
    from pytest_fp32keep.check.zoo.building import build_seeded

    config = tiny_config(HYV4Config, {**OVERRIDES.get("hy_v4", {}), "tie_word_embeddings": True})
    model = build_seeded(HYV4ForCausalLM, config)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as configured
    return model


@pytest.mark.skipif(
    not _transformers_at_least("5.24"),
    reason="hy_v4 arrived in Transformers 5.24; the installed release has no such family",
)
def test_hy_v4_with_tied_word_embeddings_keeps_the_whole_contract(mesh: DeviceMesh) -> None:
    from pytest_fp32keep.check.families.batches import family_batch

    report = assert_fp32_keep_contract(
        hy_v4_tied, lambda model: family_batch(model, 0), mesh=mesh, dtype=BF16, autocast=True
    )
    rows = {row.fqn: row for row in report.kept}
    for name in ("lm_head.weight", "model.embed_tokens.weight"):  # one tensor, both names
        assert (rows[name].stored, rows[name].materialized) == ("float32", "float32"), name
    assert report.ok, report.table(failures_only=True)


@pytest.mark.skipif(
    not _transformers_at_least("5.24"),
    reason="hy_v4 arrived in Transformers 5.24; the installed release has no such family",
)
def test_negative_control_hy_v4_tie_split_across_two_kept_units(mesh: DeviceMesh) -> None:
    # fp32keep's units for hy_v4, but the tied head and embedding as two kept units: FSDP2
    # cannot hand one parameter to two units (refused, or the gradient split between them).
    def split(
        model: nn.Module,
        *,
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy,
        plan: KeepPlan,
        wrap: WrapSpec | None,
    ) -> None:
        layout = fp32keep.plan_layout(model, plan, wrap=wrap)
        modules = dict(model.named_modules())
        for unit in layout.units:
            policy = kept_unit_policy(mp_policy) if unit.kind == "kept" else mp_policy
            parts = (
                [[fqn] for fqn in unit.module_fqns]
                if "lm_head" in unit.module_fqns
                else [list(unit.module_fqns)]
            )
            for fqns in parts:
                targets = [modules[fqn] for fqn in fqns]
                fully_shard(
                    targets if len(targets) > 1 else targets[0], mesh=mesh, mp_policy=policy
                )

    from pytest_fp32keep.check.families.batches import family_batch

    with pytest.raises(ContractViolation) as error:
        assert_fp32_keep_contract(
            hy_v4_tied,
            lambda model: family_batch(model, 0),
            mesh=mesh,
            dtype=BF16,
            autocast=True,
            shard=split,
        )
    tied = {"model.embed_tokens.weight", "lm_head.weight"}
    assert_the_split_tie_broke_the_contract(error.value, tied)
