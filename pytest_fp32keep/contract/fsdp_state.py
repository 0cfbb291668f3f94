"""What the contract reads of FSDP2's private per-module state, in one place.

The parity control (:mod:`.control`) must shard a second model into exactly the units the
implementation under test made: which modules each ``fully_shard`` call took, which parameters
(and under which attribute names) it manages, and whether it reshards after forward. torch has
no public API for any of that (``FSDPModule`` offers ``unshard``, ``reshard``, the prefetch and
gradient-sync setters, nothing that lists what a unit holds), so this module reads FSDP2's
private state, and nothing else in this project does (``tests/test_architecture.py`` checks).

Every private attribute read here is named in :data:`PRIVATE_READS`, and the torch releases the
reads were verified on in :data:`VERIFIED_TORCH`. When torch changes a shape this module knows,
the read raises :class:`FsdpStateError` naming the attribute, the object it was read from and the
installed torch, instead of an ``AttributeError`` three frames deep.

Several parameter groups per unit: since torch 2.13 a ``fully_shard`` call whose
``shard_placement_fn`` puts parameters on different process groups (``ShardPlacementResult``
with another mesh, e.g. MoE experts on an expert-parallel mesh) makes one ``FSDPParamGroup`` per
process group, in ``FSDPState._fsdp_param_groups``; the old singular ``_fsdp_param_group`` is
a compatibility property there that raises when a state holds more than one. Earlier releases
hold one group (or ``None``) in ``_fsdp_param_group``. This module reads the list where it
exists and the single group otherwise, and reports every group.

The call's policy: up to torch 2.14 every ``FSDPParamGroup`` holds the ``MixedPrecisionPolicy``
the call was given (``mp_policy``). torch 2.15 dropped that attribute (a policy may now carry a
per-parameter ``param_dtype_override_fn``, resolved into each ``FSDPParam.mp_policy``); the call's
policy is ``FSDPState._mp_policy`` there, which ``FSDPState.init`` stores with
``param_dtype_override_fn`` set to ``None``. This module reads the group's where it exists and the
state's otherwise; a 2.15 override function is not part of the view.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
from packaging.version import Version
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

__all__ = [
    "PRIVATE_READS",
    "VERIFIED_TORCH",
    "FsdpStateError",
    "ManagedParameter",
    "ParamGroupView",
    "UnitView",
    "fsdp_units",
    "torch_release",
    "unit_of",
    "unit_view",
]

VERIFIED_TORCH: Mapping[str, str] = MappingProxyType(
    {
        "2.9": "2.9.1+cu128 (PyPI's CUDA build, run on CPU): tests/contract/ default tier "
        "passes, test_fsdp_state.py's two-group cases skipped (no ShardPlacementResult); one "
        "group per state, `_fsdp_param_group` a plain attribute, the group's `mp_policy`",
        "2.13": "2.13.0+cpu: tests/contract/test_fsdp_state.py, a unit with two param groups "
        "included",
        "2.14": "2.14.1: tests/contract/test_fsdp_state.py in a side venv; 2.14.1+cu130 (PyPI's "
        "CUDA build, run on CPU): tests/contract/ default tier passes, test_fsdp_state.py's "
        "two-group units included",
        "2.15": "2.15.0+cu132 (PyPI's CUDA build, run on CPU): tests/contract/ default tier "
        "passes, test_fsdp_state.py's two-group units included; the call's policy read from "
        "`FSDPState._mp_policy` (2.15 has no `FSDPParamGroup.mp_policy`)",
    }
)
"""The torch releases (``major.minor``) the reads below were verified on, and how (the runs, with
their dates and counts: bench/RESULTS.md, "The FSDP2 shims on the PyTorch axis")."""

PRIVATE_READS: tuple[str, ...] = (
    "fully_shard.state(module)",  # torch.distributed._composable.contract's per-module state
    "FSDPState._fsdp_param_groups",  # torch >= 2.13: every param group of the call
    "FSDPState._fsdp_param_group",  # torch < 2.13: the one group, or None
    "FSDPState._modules",  # the modules of the call
    "FSDPParamGroup.fsdp_params",
    "FSDPParamGroup.mp_policy",  # torch <= 2.14: the MixedPrecisionPolicy the call was given
    "FSDPState._mp_policy",  # torch >= 2.15 (no group policy): the call's, no override function
    "FSDPParamGroup.post_forward_mesh_info",  # None: not resharded after forward
    "FSDPParam._module_info",  # .module, .param_name, .shared_modules, .shared_param_names
)
"""Every private attribute this module reads, as ``Class.attribute``."""


class FsdpStateError(RuntimeError):
    """FSDP2's private state does not have the shape :mod:`.fsdp_state` reads (torch changed)."""


def torch_release(version: str | None = None) -> str:
    """``major.minor`` of ``version`` (default: the installed torch), the key of
    :data:`VERIFIED_TORCH`."""
    parsed = Version(version or torch.__version__)
    return f"{parsed.major}.{parsed.minor}"


def _changed(what: str, attribute: str, found: object = None) -> FsdpStateError:
    seen = "" if found is None else f" (found {type(found).__name__})"
    verified = ", ".join(VERIFIED_TORCH)
    return FsdpStateError(
        f"torch {torch.__version__}: FSDP2's {what}.{attribute} is missing or changed{seen}; "
        "pytest_fp32keep.contract.fsdp_state reads it to rebuild the implementation's units for "
        f"the parity control (verified on torch {verified}). Use a verified torch, or update "
        "fsdp_state.py for this release"
    )


def _read(owner: object, attribute: str, what: str) -> Any:
    try:
        return getattr(owner, attribute)
    except AttributeError:
        raise _changed(what, attribute) from None


def _sequence(value: object, what: str, attribute: str) -> Sequence[Any]:
    if not isinstance(value, (list, tuple)):
        raise _changed(what, attribute, value)
    return value


def _param_groups(state: object) -> Sequence[Any]:
    """Every ``FSDPParamGroup`` of one ``fully_shard`` call's state."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:  # torch >= 2.13: several groups where the call made several
        return _sequence(groups, "FSDPState", "_fsdp_param_groups")
    if not hasattr(state, "_fsdp_param_group"):
        raise _changed("FSDPState", "_fsdp_param_groups (torch >= 2.13) / _fsdp_param_group")
    single = state._fsdp_param_group  # torch < 2.13
    return [] if single is None else [single]


@dataclasses.dataclass(frozen=True)
class ManagedParameter:
    """One parameter a unit manages: the module attribute FSDP2 found it in, and every other
    module attribute that holds the same parameter (a tie FSDP2 keeps in step)."""

    owner: nn.Module
    name: str
    shared: tuple[tuple[nn.Module, str], ...] = ()

    @property
    def parameter(self) -> nn.Parameter:
        """The parameter as the owning module holds it now."""
        found: nn.Parameter = getattr(self.owner, self.name)
        return found

    @property
    def attributes(self) -> tuple[tuple[nn.Module, str], ...]:
        """``(module, attribute)`` of the owner first, then of every tied holder."""
        return ((self.owner, self.name), *self.shared)


@dataclasses.dataclass(frozen=True)
class ParamGroupView:
    """One ``FSDPParamGroup``: the parameters it all-gathers and reduces together."""

    params: tuple[ManagedParameter, ...]
    reshards_after_forward: bool
    policy: MixedPrecisionPolicy


@dataclasses.dataclass(frozen=True)
class UnitView:
    """One ``fully_shard`` call: its modules (several for a grouped call) and its groups."""

    modules: tuple[nn.Module, ...]
    groups: tuple[ParamGroupView, ...]

    @property
    def params(self) -> tuple[ManagedParameter, ...]:
        """Every parameter of every group."""
        return tuple(param for group in self.groups for param in group.params)

    @property
    def policy(self) -> MixedPrecisionPolicy | None:
        """The policy the call was given (``None``: the call manages no parameter)."""
        return self.groups[0].policy if self.groups else None

    @property
    def reshards_after_forward(self) -> bool:
        """Whether the call reshards after forward (a call with no parameters: ``True``, what
        ``fully_shard`` defaults to)."""
        return all(group.reshards_after_forward for group in self.groups)


def _managed(fsdp_param: object) -> ManagedParameter:
    info = _read(fsdp_param, "_module_info", "FSDPParam")
    owner = _read(info, "module", "ParamModuleInfo")
    name = _read(info, "param_name", "ParamModuleInfo")
    shared_modules = _sequence(
        _read(info, "shared_modules", "ParamModuleInfo"), "ParamModuleInfo", "shared_modules"
    )
    shared_names = _sequence(
        _read(info, "shared_param_names", "ParamModuleInfo"),
        "ParamModuleInfo",
        "shared_param_names",
    )
    if len(shared_modules) != len(shared_names):
        raise _changed("ParamModuleInfo", "shared_param_names", shared_names)
    return ManagedParameter(owner, name, tuple(zip(shared_modules, shared_names, strict=True)))


def _call_policy(state: object, group: object) -> MixedPrecisionPolicy:
    """The ``MixedPrecisionPolicy`` the ``fully_shard`` call that made ``group`` was given."""
    if hasattr(group, "mp_policy"):  # torch <= 2.14: every group holds the call's policy
        owner, attribute = "FSDPParamGroup", "mp_policy"
        policy = group.mp_policy
    elif hasattr(state, "_mp_policy"):  # torch >= 2.15: the groups hold none, the state does
        owner, attribute = "FSDPState", "_mp_policy"
        policy = state._mp_policy
    else:
        raise _changed(
            "FSDPParamGroup", "mp_policy (torch <= 2.14) / FSDPState._mp_policy (torch >= 2.15)"
        )
    if not isinstance(policy, MixedPrecisionPolicy):
        raise _changed(owner, attribute, policy)
    return policy


def _group_view(state: object, group: object) -> ParamGroupView:
    fsdp_params = _sequence(
        _read(group, "fsdp_params", "FSDPParamGroup"), "FSDPParamGroup", "fsdp_params"
    )
    post_forward = _read(group, "post_forward_mesh_info", "FSDPParamGroup")
    policy = _call_policy(state, group)
    return ParamGroupView(tuple(_managed(p) for p in fsdp_params), post_forward is not None, policy)


def unit_view(state: object) -> UnitView:
    """What one ``fully_shard`` call's state (``fully_shard.state(module)``) holds."""
    modules = _sequence(_read(state, "_modules", "FSDPState"), "FSDPState", "_modules")
    return UnitView(tuple(modules), tuple(_group_view(state, g) for g in _param_groups(state)))


def _state(module: nn.Module | FSDPModule) -> object:
    state_of = getattr(fully_shard, "state", None)
    if state_of is None:
        raise _changed("fully_shard", "state")
    return state_of(module)


def unit_of(module: nn.Module | FSDPModule) -> UnitView:
    """The unit of the ``fully_shard`` call that took ``module`` (an ``FSDPModule``)."""
    if not isinstance(module, FSDPModule):
        raise TypeError(f"{type(module).__name__} is not an FSDPModule: fully_shard never took it")
    return unit_view(_state(module))


def fsdp_units(model: nn.Module) -> tuple[UnitView, ...]:
    """Every FSDP2 unit of ``model`` (sharded by anyone), one per ``fully_shard`` call, in the
    order of ``model.modules()`` (a grouped call's state appears once)."""
    units: list[UnitView] = []
    seen: set[int] = set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = _state(module)
        if id(state) in seen:
            continue  # a grouped call: every module of the group shares one state
        seen.add(id(state))
        units.append(unit_view(state))
    return tuple(units)
