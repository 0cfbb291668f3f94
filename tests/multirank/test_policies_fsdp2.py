"""The contract under the policies frameworks shard with: no false alarm on a correct path, and
the framework-shaped defects still caught with the right row (issue 34).

The reference runs the caller's policy as a correct implementation applies it
(``pytest_fp32keep/contract/policy.py``), so fp32keep's own path passes under each policy below
on real Transformers families (decoder, MoE, encoder-decoder), under both storage conventions.
The negative controls are framework-shaped: a kept unit whose policy casts its output (a
``boundary`` row, not a parity one), and every block one unit over FP32 masters, which keeps the
kept tensors in the blocks' units (``materialized``, and gradient ``parity`` judged against a
control that keeps them in units of their own).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from fp32keep import KeepPlan
from pytest_fp32keep import ContractReport, ContractViolation, assert_fp32_keep_contract
from pytest_fp32keep.check.zoo import ZOO
from pytest_fp32keep.contract.checks.boundary import kept_modules

pytestmark = pytest.mark.fsdp2  # every test runs in the ranks (2 by default)

FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32


def accelerate_like(dtype: torch.dtype) -> MixedPrecisionPolicy:
    """What ``Accelerator(mixed_precision=...)`` builds for FSDP2 out of the box (accelerate
    1.15): parameters, gradient reduction and outputs in the low dtype, inputs cast at every
    unit (FSDP2's default)."""
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype, output_dtype=dtype)


def transformers_like(dtype: torch.dtype) -> MixedPrecisionPolicy:
    """What ``from_pretrained(..., distributed_config=DistributedConfig(fsdp_mixed_precision=
    True))`` shards with whatever the storage dtype: bf16 compute, FP32 reduction, inputs
    cast."""
    return MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)


POLICIES: dict[str, Callable[[torch.dtype], MixedPrecisionPolicy]] = {
    "accelerate": accelerate_like,
    "transformers": transformers_like,
}
MODELS = {"t5": FP16, "gpt_oss": FP16, "ernie4_5_moe": BF16}
"""An encoder-decoder (kept ``wo``, three tied embeddings), a decoder (every norm kept) and an
MoE (kept router), each at the dtype its lists keep something under."""
STORAGE = {"low": None, "master": FP32}
DEFAULT_TIER = {
    ("accelerate", "t5", "master"),  # accelerate's own convention: FP32 masters
    ("accelerate", "gpt_oss", "low"),
    ("transformers", "t5", "low"),  # bf16 compute over fp16 storage
    ("transformers", "ernie4_5_moe", "master"),
}


def _contract(mesh: DeviceMesh, model: str, **options: object) -> ContractReport:
    entry = ZOO[model]
    return assert_fp32_keep_contract(
        entry.build,
        functools.partial(entry.make_batch, seed=0),
        mesh=mesh,
        dtype=MODELS[model],
        **options,  # type: ignore[arg-type]
    )


def _cases() -> list[object]:
    return [
        pytest.param(
            policy,
            model,
            storage,
            marks=() if (policy, model, storage) in DEFAULT_TIER else pytest.mark.slow,
            id=f"{policy}-{model}-{storage}",
        )
        for policy in POLICIES
        for model in MODELS
        for storage in STORAGE
        # FP32 masters store nothing in fp16, so a bf16 policy over them runs in bf16, and
        # the fp16 plan is refused (KeepPlanError: tests/multirank/test_plan_use_fsdp2.py)
        if not (
            storage == "master" and POLICIES[policy](MODELS[model]).param_dtype != MODELS[model]
        )
    ]


@pytest.mark.parametrize("autocast", [True, False], ids=["autocast", "direct"])
@pytest.mark.parametrize(("policy", "model", "storage"), _cases())
def test_fp32keep_passes_under_the_frameworks_policy(
    mesh: DeviceMesh, policy: str, model: str, storage: str, autocast: bool
) -> None:
    dtype = MODELS[model]
    report = _contract(
        mesh,
        model,
        mp_policy=POLICIES[policy](dtype),
        master_dtype=STORAGE[storage],
        autocast=autocast,
    )
    assert report.ok
    assert report.kept, "the model keeps something at this dtype: the case is not vacuous"
    assert {row.materialized for row in report.kept} == {"float32"}


def kept_units_with(
    kept_policy: Callable[[MixedPrecisionPolicy], MixedPrecisionPolicy],
) -> Callable[..., None]:
    """A wrong ``shard``: every topmost kept module its own unit with ``kept_policy(the
    caller's policy)``, then every block and the root with the caller's policy."""

    def shard(
        model: nn.Module,
        *,
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy,
        plan: KeepPlan,
        **_: object,
    ) -> None:
        kept = kept_modules(model, plan)
        topmost = [k for k in kept if not any(k.startswith(o + ".") for o in kept if o != k)]
        for fqn in topmost:
            fully_shard(model.get_submodule(fqn), mesh=mesh, mp_policy=kept_policy(mp_policy))
        _blocks_then_root(model, mesh=mesh, mp_policy=mp_policy)

    return shard


_output_cast_kept_units = kept_units_with(
    lambda policy: MixedPrecisionPolicy(param_dtype=None, output_dtype=policy.param_dtype)
)
"""Wrong: kept units all-gathered in FP32, but with the caller's ``output_dtype``: their FP32
result cast down at their own boundary."""


def _blocks_then_root(
    model: nn.Module, *, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy, **_: object
) -> None:
    """Every ``_no_split_modules`` block one unit, then the root, all with the caller's policy:
    the layout most frameworks build (nemo-automodel, torchtitan's HF backend)."""
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def test_a_kept_units_own_output_cast_is_a_boundary_row(mesh: DeviceMesh) -> None:
    # T5's `wo` returns FP32 in direct mode; the wrong unit hands back fp16 at its boundary
    with pytest.raises(ContractViolation) as caught:
        _contract(mesh, "t5", mp_policy=accelerate_like(FP16), shard=_output_cast_kept_units)
    failed = list(caught.value.report.failures)
    boundary = [f for f in failed if f.check == "boundary"]
    assert boundary, [f"{f.check} {f.subject}" for f in failed]
    assert all(".wo call" in f.subject and f.observed == "float16" for f in boundary), boundary
    assert all(f.expected == "float32" for f in boundary)
    assert not [f for f in failed if f.check in ("stored", "materialized")]


def test_framework_blocks_over_fp32_masters_are_judged_against_kept_units(
    mesh: DeviceMesh,
) -> None:
    # every block one unit with the caller's policy: the kept `wo` is all-gathered in fp16; the
    # control gives `wo` units of its own, so its gradients are judged against a correct keep
    with pytest.raises(ContractViolation) as caught:
        _contract(
            mesh,
            "t5",
            mp_policy=accelerate_like(FP16),
            master_dtype=FP32,
            shard=_blocks_then_root,
            autocast=False,
        )
    report = caught.value.report
    failed = {(f.check, f.subject) for f in report.failures}
    assert any(c == "materialized" and ".wo.weight" in s for c, s in failed), failed
    kept_grads = [s for c, s in failed if c == "parity" and s.startswith("grad ") and ".wo." in s]
    assert kept_grads, f"no gradient evidence for the kept `wo`: {sorted(failed)}"
    assert any("units of their own" in note for note in report.notes), report.notes
