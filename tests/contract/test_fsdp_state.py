"""The one place that reads FSDP2's private state (``contract/fsdp_state.py``).

In one process: the shim's record of verified torch releases covers the installed torch (this
test runs in every torch-axis nox session: ``torch-2.9``, ``torch-newest``), and a state whose
shape changed fails naming the attribute and the installed torch. In 2 ranks: a unit whose
``shard_placement_fn`` puts some parameters on another process group holds two param groups
(torch 2.13's ``_fsdp_param_groups``; the singular ``_fsdp_param_group`` the control used to read
raises there), is read whole, and the contract's control rebuilds it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

import fp32keep
from fp32keep import KeepPlan
from pytest_fp32keep import assert_fp32_keep_contract
from pytest_fp32keep.contract.control import unit_layout
from pytest_fp32keep.contract.fsdp_state import (
    VERIFIED_TORCH,
    FsdpStateError,
    fsdp_units,
    torch_release,
    unit_view,
)
from tests.core.toys import stack_class
from tests.error_bounds import LIBRARY_BOUND_S, within

BF16 = torch.bfloat16

# Several param groups per unit need a ShardPlacementResult naming another mesh; torch exports
# it only from this private module (fully_shard's docstring documents it). torch 2.13 has it.
try:
    _fsdp_common: Any = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_common")
except ImportError:  # pragma: no cover - a torch that moved it: the two-group tests skip
    _fsdp_common = None
PER_PARAM_MESHES = hasattr(_fsdp_common, "ShardPlacementResult")


def test_verified_releases_cover_the_installed_torch() -> None:
    release = torch_release()
    assert release in VERIFIED_TORCH, (
        f"torch {torch.__version__} (release {release}) is not among the releases "
        f"contract/fsdp_state.py was verified on ({', '.join(VERIFIED_TORCH)}): run "
        "tests/contract/test_fsdp_state.py on it and record it in VERIFIED_TORCH"
    )


def test_torch_release_is_major_minor() -> None:
    assert torch_release("2.14.1+cu130") == "2.14"
    assert torch_release("2.9.1") == "2.9"
    assert torch_release("2.13.0a0+git1234") == "2.13"


LEFT_OUT = object()


def _group(**fields: object) -> SimpleNamespace:
    """A param group as torch 2.13 shapes it, with ``fields`` replaced (``LEFT_OUT``: absent)."""
    shape: dict[str, object] = {
        "fsdp_params": [],
        "post_forward_mesh_info": None,
        "mp_policy": MixedPrecisionPolicy(),
    }
    shape.update(fields)
    return SimpleNamespace(**{k: v for k, v in shape.items() if v is not LEFT_OUT})


@pytest.mark.parametrize(
    ("state", "attribute"),
    [
        (SimpleNamespace(_fsdp_param_groups=[]), "FSDPState._modules"),
        (SimpleNamespace(_modules=()), "FSDPState._fsdp_param_groups"),
        (SimpleNamespace(_modules=(), _fsdp_param_groups="?"), "FSDPState._fsdp_param_groups"),
        (
            SimpleNamespace(_modules=(), _fsdp_param_groups=[_group(fsdp_params=LEFT_OUT)]),
            "FSDPParamGroup.fsdp_params",
        ),
        (
            SimpleNamespace(_modules=(), _fsdp_param_groups=[_group(mp_policy="bf16")]),
            "FSDPParamGroup.mp_policy",
        ),
        (
            SimpleNamespace(
                _modules=(), _fsdp_param_groups=[_group(fsdp_params=[SimpleNamespace()])]
            ),
            "FSDPParam._module_info",
        ),
    ],
    ids=["no-modules", "no-groups", "groups-not-a-list", "no-params", "policy", "no-module-info"],
)
def test_a_changed_state_fails_naming_the_attribute_and_the_torch(
    state: object, attribute: str
) -> None:
    with within(LIBRARY_BOUND_S), pytest.raises(FsdpStateError) as error:
        unit_view(state)
    message = str(error.value)
    assert attribute in message
    assert f"torch {torch.__version__}" in message
    assert "verified on torch" in message


def test_the_single_group_shape_of_earlier_torch_is_read() -> None:
    """Before 2.13 a state held one group (or None) in ``_fsdp_param_group``."""
    module = nn.Linear(2, 2)
    info = SimpleNamespace(
        module=module, param_name="weight", shared_modules=[], shared_param_names=[]
    )
    group = _group(fsdp_params=[SimpleNamespace(_module_info=info)], post_forward_mesh_info=1)
    one = unit_view(SimpleNamespace(_modules=(module,), _fsdp_param_group=group))
    assert [p.parameter for p in one.params] == [module.weight]
    assert one.reshards_after_forward
    empty = unit_view(SimpleNamespace(_modules=(module,), _fsdp_param_group=None))
    assert empty.groups == ()
    assert empty.reshards_after_forward


def test_the_policy_of_torch_2_15_is_read_from_the_state() -> None:
    """torch 2.15 dropped ``FSDPParamGroup.mp_policy``: the call's policy is the state's
    ``_mp_policy``; up to 2.14 the group's wins (the two are the same object there)."""
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    group = _group(mp_policy=LEFT_OUT)
    view = unit_view(SimpleNamespace(_modules=(), _fsdp_param_groups=[group], _mp_policy=policy))
    assert view.policy is policy
    assert [g.policy for g in view.groups] == [policy]
    older = _group(mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    earlier = unit_view(
        SimpleNamespace(_modules=(), _fsdp_param_group=older, _mp_policy=MixedPrecisionPolicy())
    )
    assert earlier.policy is older.mp_policy


@pytest.mark.parametrize(
    ("state", "attribute"),
    [
        (
            SimpleNamespace(_modules=(), _fsdp_param_groups=[_group(mp_policy=LEFT_OUT)]),
            "FSDPParamGroup.mp_policy (torch <= 2.14) / FSDPState._mp_policy (torch >= 2.15)",
        ),
        (
            SimpleNamespace(
                _modules=(), _fsdp_param_groups=[_group(mp_policy=LEFT_OUT)], _mp_policy="bf16"
            ),
            "FSDPState._mp_policy",
        ),
    ],
    ids=["no-policy-anywhere", "state-policy-not-a-policy"],
)
def test_a_policy_in_neither_place_fails_naming_both(state: object, attribute: str) -> None:
    with pytest.raises(FsdpStateError) as error:
        unit_view(state)
    assert attribute in str(error.value)
    assert f"torch {torch.__version__}" in str(error.value)


# --- in 2 ranks ---------------------------------------------------------------------------------


def _on_another_group(mesh: DeviceMesh, pick: Callable[[nn.Module], list[nn.Parameter]]) -> Any:
    """A shard function: fp32keep's layout for the toy by hand (kept ``wo`` units with the
    kept policy, one unit per block, the root), each block's ``pick`` parameters placed on a
    second process group over the same ranks, so every block unit holds two param groups."""
    ranks = mesh.mesh.flatten().tolist()
    other = DeviceMesh.from_group(dist.new_group(ranks), mesh.device_type)
    placement = _fsdp_common.ShardPlacementResult(Shard(0), _fsdp_common.FSDPMeshInfo(other, 0))

    def shard(
        model: nn.Module,
        *,
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy,
        plan: KeepPlan,
        wrap: object,
    ) -> None:
        for layer in model.layers:
            fully_shard(
                layer.wo, mesh=mesh, mp_policy=fp32keep.shard.apply.kept_unit_policy(mp_policy)
            )
            moved = {id(p) for p in pick(layer)}
            fully_shard(
                layer,
                mesh=mesh,
                mp_policy=mp_policy,
                shard_placement_fn=lambda p, moved=moved: placement if id(p) in moved else None,
            )
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)

    return shard


def _mlp(layer: nn.Module) -> list[nn.Parameter]:
    return list(layer.mlp.parameters())


def factory() -> nn.Module:
    return stack_class(strict=["wo"])()


def batch(model: nn.Module) -> torch.Tensor:
    return torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(3))


@pytest.mark.fsdp2
@pytest.mark.skipif(not PER_PARAM_MESHES, reason="this torch has no per-parameter meshes")
def test_a_unit_with_two_param_groups_is_read_whole(fsdp2_mesh: DeviceMesh) -> None:
    model = factory()
    plan = fp32keep.resolve_keep_plan(model, BF16)
    fp32keep.keep_aware_cast(model, BF16, plan=plan)
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    _on_another_group(fsdp2_mesh, _mlp)(
        model, mesh=fsdp2_mesh, mp_policy=policy, plan=plan, wrap=None
    )
    views = {id(view.modules[0]): view for view in fsdp_units(model)}
    assert len(views[id(model.layers[0])].groups) == 2  # what the old singular read raised on
    units = {unit.modules: unit for unit in unit_layout(model)}
    block = units[("layers.0",)]
    assert block.groups == 2
    assert block.params == {
        "layers.0.attn.weight",
        "layers.0.attn.bias",
        "layers.0.input_layernorm.weight",
        "layers.0.mlp.0.weight",
        "layers.0.mlp.0.bias",
        "layers.0.post_attention_layernorm.weight",
    }
    assert units[("layers.0.wo",)].params == {"layers.0.wo.weight"}
    assert units[("",)].params == {"embed.weight", "norm.weight", "head.weight"}


@pytest.mark.fsdp2
@pytest.mark.skipif(not PER_PARAM_MESHES, reason="this torch has no per-parameter meshes")
def test_the_control_rebuilds_a_unit_with_two_param_groups(fsdp2_mesh: DeviceMesh) -> None:
    """``measure_spread`` runs the control whatever the gradients: it reads the two-group units,
    shards them again and lands on the implementation's gradients."""
    report = assert_fp32_keep_contract(
        factory,
        batch,
        mesh=fsdp2_mesh,
        dtype=BF16,
        shard=_on_another_group(fsdp2_mesh, _mlp),
        measure_spread=True,
    )
    assert report.ok
    notes = " ".join(report.notes)
    assert "2 param groups" in notes
    assert "reproducible" in notes
