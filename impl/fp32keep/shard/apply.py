"""Fail-closed FSDP2 wrapping: validate the whole layout, then shard children before parents."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from fp32keep.devices import collective_device
from fp32keep.errors import (
    Fp32KeepRuntimeError,
    Fp32KeepTypeError,
    Fp32KeepValueError,
    KeepLayoutError,
    SourceFallbackWarning,
    hidden_in_tracebacks,
)
from fp32keep.layout.planning import KeptGrouping, plan_layout
from fp32keep.layout.targets import WrapSpec, check_wrap
from fp32keep.layout.units import Layout
from fp32keep.plan.keep_plan import KeepPlan, resolve_keep_plan
from fp32keep.plan.use import check_plan_fits, check_plan_for_policy, storage_dtype
from fp32keep.shard.gathered import register_gathered_methods
from fp32keep.shard.keep_policy import KeepBy, choose_keeping, keep_policy, reduces_below_fp32
from fp32keep.tensors import check_float_dtype, check_module, dtype_name, is_castable_float
from fp32keep.uses.agree import agreed_observation as agreed_observation  # its home before
from fp32keep.uses.agree import observation_refusal as observation_refusal  # the uses/ split
from fp32keep.uses.observe import ParameterUse
from fp32keep.uses.source import unseen_uses

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks

# fully_shard(ignored_params=...) arrived after torch 2.6; without it a frozen kept parameter
# that no unit can isolate is refused like a trainable one.
_SUPPORTS_IGNORED_PARAMS = "ignored_params" in inspect.signature(fully_shard).parameters


def infer_low_precision_dtype(model: nn.Module, mp_policy: MixedPrecisionPolicy) -> torch.dtype:
    """The dtype a keep plan should be resolved for when none is given.

    The storage dtype when the model's floating parameters are fp16 or bf16; otherwise the
    policy's ``param_dtype`` (FP32 master weights under a bf16 policy still honour the strict
    list); ``torch.float32`` when neither is low precision.
    """
    low = {
        param.dtype
        for param in model.parameters()
        if param.dtype in (torch.float16, torch.bfloat16)
    }
    if len(low) > 1:
        raise Fp32KeepValueError(
            f"{type(model).__name__} stores parameters in both {dtype_name(torch.float16)} and "
            f"{dtype_name(torch.bfloat16)}; pass "
            "plan=fp32keep.resolve_keep_plan(model, dtype) with the dtype you train in"
        )
    if low:
        return low.pop()
    if mp_policy.param_dtype is not None and is_castable_float(mp_policy.param_dtype):
        return mp_policy.param_dtype
    return torch.float32


def kept_unit_policy(mp_policy: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    """The policy of a kept unit: the caller's, minus everything that would change FP32 math.

    * ``param_dtype=None``: all-gathered in the FP32 storage dtype, and (FSDP2 casts inputs only
      to a ``param_dtype``) the module's inputs are not cast;
    * ``output_dtype=None``: the module hands back what its own code makes (a kept router's FP32
      logits under accelerate's ``output_dtype=bf16``), as it does unsharded;
    * ``reduce_dtype``: kept when it is FP32 or wider, otherwise ``None`` (reduce-scatter in the
      FP32 gradient dtype): FP32 gradients averaged in bf16 would lose their low bits;
    * every other field (``cast_forward_inputs``) unchanged.
    """
    reduce_dtype = None if reduces_below_fp32(mp_policy) else mp_policy.reduce_dtype
    return dataclasses.replace(
        mp_policy, param_dtype=None, reduce_dtype=reduce_dtype, output_dtype=None
    )


def _check_callable_state(model: nn.Module, mesh: DeviceMesh, mp_policy: object) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise Fp32KeepRuntimeError(
            "apply_fsdp2 needs an initialised process group: call "
            "torch.distributed.init_process_group(...) (or launch with torchrun) and build the "
            "mesh with torch.distributed.device_mesh.init_device_mesh first"
        )
    if not isinstance(mesh, DeviceMesh):
        raise Fp32KeepTypeError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {mesh!r}"
        )
    if mesh.ndim not in (1, 2):
        raise Fp32KeepValueError(
            f"apply_fsdp2 needs a 1-D mesh (FSDP) or a 2-D one (HSDP: replicate x shard), got a "
            f"{mesh.ndim}-D mesh of shape {tuple(mesh.shape)}; pass the data-parallel sub-mesh, "
            "e.g. mesh['dp']."
        )
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise Fp32KeepTypeError(
            "mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got "
            f"{type(mp_policy).__name__}"
        )
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        value = getattr(mp_policy, field)
        if value is not None:
            check_float_dtype(value, what=f"mp_policy.{field}")
    sharded = [
        fqn or "<root>" for fqn, module in model.named_modules() if isinstance(module, FSDPModule)
    ]
    if sharded:
        raise Fp32KeepValueError(
            f"{type(model).__name__} is already sharded: {sharded[:5]} "
            f"{'…' if len(sharded) > 5 else ''}is an FSDPModule. Call apply_fsdp2 once, on an "
            "unsharded model."
        )


def apply_fsdp2(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    plan: KeepPlan | None = None,
    wrap: WrapSpec | None = None,
    reshard_after_forward: bool | int | None = None,
    offload_policy: OffloadPolicy | None = None,
    group_kept: KeptGrouping = False,
    observed: ParameterUse | None = None,
    keep_by: KeepBy = "auto",
    example_inputs: Mapping[str, Any] | tuple[Any, ...] | None = None,
) -> nn.Module:
    """Shard ``model`` with FSDP2 so that the plan's parameters stay FP32, or refuse.

    The whole layout is validated before the first ``fully_shard``; a layout FSDP2 cannot
    represent raises :class:`fp32keep.KeepLayoutError` naming every offending parameter, and then
    no module is an ``FSDPModule`` and no parameter changed.

    Units, sharded children before parents:

    * kept units: the topmost modules whose floating parameters are all kept (containers with no
      forward of their own resolve to their callable descendants; wrap targets inside one are
      kept units of their own, nested), and modules that directly own only kept parameters but
      have children that are not kept (attention ``sinks``: the children get units with the
      caller's policy first). Each is sharded with :func:`kept_unit_policy`: all-gathered in
      FP32, inputs not cast, no ``output_dtype``, a ``reduce_dtype`` below FP32 dropped;
    * standard units: ``wrap`` (module classes, class names or a predicate; default: the classes
      named by the model's ``_no_split_modules``), minus anything inside a kept unit;
    * the root, with ``mp_policy``.

    A kept parameter that is frozen and whose module also owns parameters that are not kept (a
    router's correction bias) cannot get a unit of its own; it is left out of FSDP2
    (``ignored_params``) and stays whole and FP32 on every rank (``Layout.replicated``). So is a
    frozen kept module that an ancestor reads without calling it (Voxtral's ``embed_positions``:
    FSDP2 would never all-gather it); a trainable one goes with its reader's kept unit where the
    reader is its parent and owns only kept parameters, else it is refused
    (``read-not-called``). The methods other than ``forward`` that run a unit's parameters
    (``tokenizer.encode(...)``) are registered (:mod:`fp32keep.shard.gathered`), so FSDP2 gathers
    the unit around them too, outermost call only. Both are observed: apply_fsdp2 runs one forward
    of the unsharded model on ``example_inputs`` (or takes the caller's ``observed``). Without
    either, reads are taken from the source of the ancestors' classes (one syntax-tree rule,
    :mod:`fp32keep.uses.source`), no method is registered, and a
    :class:`fp32keep.SourceFallbackWarning` names what the source shows but the rule cannot
    judge (``self.codec.encode(...)``, a child handed to a function).

    Args:
        model: the unsharded model, cast keep-aware (:func:`fp32keep.keep_aware_cast`).
        mesh: the data-parallel device mesh.
        mp_policy: the caller's mixed-precision policy.
        plan: the keep plan; resolved with :func:`infer_low_precision_dtype` when omitted.
        wrap: standard targets, as above.
        reshard_after_forward: passed to every ``fully_shard`` call when not None.
        offload_policy: passed to every ``fully_shard`` call when not None.
        group_kept: how kept modules are grouped into units (fewer units, fewer collectives):
            ``False``, one unit per kept module; ``True`` or ``"block"``, a block's kept modules
            together; ``"model"``, all kept modules of the model in one unit that is not
            resharded after forward (one all-gather and one reduce-scatter per step for every
            kept parameter; each rank holds them unsharded during the step). Grouping needs a
            torch whose grouped ``fully_shard`` finishes groups whose modules did not all run.
        observed: what a forward of the unsharded model used, and where
            (:func:`fp32keep.observe_parameter_use`), made on every rank of ``mesh``. The ranks'
            observations are merged (every use any rank saw) in one collective over the mesh,
            so every rank lays out the same units: pass one on every rank or on none (``None``:
            read the source; no collective). Not together with ``example_inputs``.
        keep_by: how the kept parameters stay FP32. ``"auto"`` (default): by the policy where it
            can keep them, else in kept units. By the policy (torch 2.15's
            ``param_dtype_override_fn``, :func:`fp32keep.keep_policy`): the caller's own units
            (``wrap`` targets, then the root), each with the caller's policy plus an override
            that all-gathers the plan's parameters in FP32: no unit or collective of
            fp32keep's; it needs torch >= 2.15, every trainable parameter stored in FP32 (FP32
            master weights) and a ``reduce_dtype`` of FP32 or ``None``, and ``"auto"`` takes it
            only under a low-precision ``param_dtype`` without ``group_kept``. ``"units"``: kept
            units as above. ``"policy"``: the policy or an error naming what stands in the way
            (the torch version, the storage, the reduce dtype). :func:`sharded_layout` gives
            the layout used, whose ``describe()`` says which and why.
        example_inputs: inputs of one forward, as in training: a mapping of keyword arguments
            (``{"input_ids": ids}``, ``model(**inputs)``) or a tuple of positional ones
            (``(ids,)``, ``model(*inputs)``), on the model's device. Every rank whose model
            holds real tensors runs that forward unsharded, observed
            (:func:`fp32keep.observe_parameter_use`; under ``no_grad``, random state restored),
            and the observations are merged over the mesh as for ``observed``; a rank whose
            model is on the meta device runs nothing and takes the others' (rank 0 real, the
            rest on meta: rank 0 observes). Pass them on every rank or on none: on a meta rank
            they are not run. A forward that raises on any rank raises on every rank, naming it.

    Raises:
        KeepLayoutError: the layout cannot keep the plan (nothing sharded).
        KeepPlanError: ``plan`` names tensors ``model`` does not have, or ``mp_policy``'s
            ``param_dtype`` is fp16 or bf16 and the plan was resolved for neither it nor the
            low-precision dtype the model is stored in (a plan for the storage dtype is what
            ``from_pretrained`` applies, whatever the compute dtype); a ``param_dtype`` of
            ``None`` or FP32 accepts any plan (:func:`fp32keep.plan.use.check_plan_for_policy`).
            Nothing sharded.
        Fp32KeepValueError: ``keep_by`` is not one of ``"auto"``, ``"units"``, ``"policy"``,
            or is ``"policy"`` where the policy cannot keep the plan (nothing sharded).
        ValueError: ``observed`` is of another model, or is still recording; the example
            forward raised, or every rank's model is on meta; both ``observed`` and
            ``example_inputs`` given; or (given either) the ranks' keep plans differ (on any
            rank: raised on every rank of the mesh, before anything is sharded).
        TypeError: ``observed`` is not a :class:`fp32keep.ParameterUse`, ``example_inputs``
            neither a mapping nor a tuple (likewise).

    Returns:
        ``model``, now an ``FSDPModule``.
    """
    check_module(model, where="apply_fsdp2")
    check_wrap(wrap)  # argument types first: they need no process group
    _check_callable_state(model, mesh, mp_policy)
    resolved_here = plan is None
    if plan is None:
        plan = resolve_keep_plan(model, infer_low_precision_dtype(model, mp_policy))
    else:
        check_plan_fits(model, plan)
    check_plan_for_policy(
        plan,
        mp_policy.param_dtype,
        stored=storage_dtype(model, plan),
        resolved_here=resolved_here,
    )
    keeps, why = choose_keeping(
        model, plan, mp_policy, keep_by=keep_by, grouped=group_kept is not False
    )
    observed = agreed_observation(model, observed, mesh, plan, example_inputs=example_inputs)
    layout = None
    if keeps == "policy":
        layout = _policy_layout(model, plan, wrap, observed, refuse=keep_by == "policy")
        why = why if layout is not None else "the caller's own units are refused"
    if layout is not None:
        policy = keep_policy(mp_policy, plan, model)
        layout = dataclasses.replace(layout, keeps="policy", why=why)
    else:
        policy = mp_policy
        layout = plan_layout(
            model,
            plan,
            wrap=wrap,
            group_kept=group_kept,
            replicate_frozen=_SUPPORTS_IGNORED_PARAMS,
            observed=observed,
        )
        layout = dataclasses.replace(layout, why=why)
    if observed is None:
        _warn_unseen(model, layout)
    _shard(model, layout, mesh, policy, reshard_after_forward, offload_policy)
    _SHARDED[model] = layout
    return model


def _warn_unseen(model: nn.Module, layout: Layout) -> None:
    """The :class:`fp32keep.SourceFallbackWarning` for what the source fallback cannot judge
    about the modules of ``layout``'s units."""
    unseen = unseen_uses(model, {fqn for unit in layout.units for fqn in unit.module_fqns})
    if unseen:
        shown = "; ".join(unseen[:5]) + (f"; and {len(unseen) - 5} more" if len(unseen) > 5 else "")
        warnings.warn(
            f"apply_fsdp2: {type(model).__name__} laid out from its source (no example_inputs=, "
            f"no observed=), which cannot see whether these run a unit's parameters: {shown}. "
            "A method that does runs sharded (not gathered), a module handed on is taken as "
            "called. Pass example_inputs=(a batch of your training) so that apply_fsdp2 "
            "observes one forward instead",
            SourceFallbackWarning,
            stacklevel=3,
        )


_SHARDED: weakref.WeakKeyDictionary[nn.Module, Layout] = weakref.WeakKeyDictionary()


def sharded_layout(model: nn.Module) -> Layout | None:
    """The layout :func:`apply_fsdp2` sharded ``model`` with (its ``describe()`` says how the
    kept parameters stay FP32 and why that way), or ``None`` for a model it did not shard."""
    return _SHARDED.get(check_module(model, where="sharded_layout"))


def _policy_layout(
    model: nn.Module,
    plan: KeepPlan,
    wrap: WrapSpec | None,
    observed: ParameterUse | None,
    *,
    refuse: bool,
) -> Layout | None:
    """The caller's own units (``wrap`` targets, tied units, the root) with nothing kept apart,
    for :func:`~fp32keep.keep_policy.keep_policy` to keep the plan in; where that layout is
    refused, ``None`` (the kept units' layout is then tried, and refuses or keeps), or, with
    ``refuse``, the refusal."""
    nothing = dataclasses.replace(
        plan,
        regular_entries=(),
        strict_entries=(),
        param_names=frozenset(),
        buffer_names=frozenset(),
        matches={},
    )
    try:
        layout = plan_layout(
            model, nothing, wrap=wrap, replicate_frozen=_SUPPORTS_IGNORED_PARAMS, observed=observed
        )
    except KeepLayoutError:
        if refuse:
            raise
        return None
    # A unit of the caller's whose parameters are all kept (a kept wrap target) gets the kept
    # policy, as in the kept units' layout: the caller's input and output casts at its boundary
    # would change what a kept module receives and returns.
    owned: dict[str, set[str]] = {}
    for name, label in layout.owner.items():
        owned.setdefault(label, set()).add(name)
    units = tuple(
        dataclasses.replace(unit, kind="kept")
        if owned.get(unit.label) and owned[unit.label] <= plan.param_names
        else unit
        for unit in layout.units
    )
    return dataclasses.replace(layout, units=units)


def _shard(
    model: nn.Module,
    layout: Layout,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool | int | None,
    offload_policy: OffloadPolicy | None,
) -> None:
    modules = dict(model.named_modules(remove_duplicate=False))
    kept_policy = kept_unit_policy(mp_policy)
    common: dict[str, Any] = {"mesh": mesh}
    # Older torch releases reject None for these; pass them only when the caller set them.
    if reshard_after_forward is not None:
        common["reshard_after_forward"] = reshard_after_forward
    if offload_policy is not None:
        common["offload_policy"] = offload_policy
    if layout.replicated:
        parameters = dict(model.named_parameters(remove_duplicate=False))
        common["ignored_params"] = {parameters[name] for name in layout.replicated}
    for unit in layout.units:
        targets = [modules[fqn] for fqn in unit.module_fqns]
        policy = kept_policy if unit.kind == "kept" else mp_policy
        options = dict(common, reshard_after_forward=False) if unit.stays_gathered else common
        fully_shard(targets if len(targets) > 1 else targets[0], mp_policy=policy, **options)
    register_gathered_methods(model, [u.module_fqns for u in layout.units], layout.forward_methods)
    if layout.replicated:
        _to_mesh_device(common["ignored_params"], mesh)


def _to_mesh_device(params: set[nn.Parameter], mesh: DeviceMesh) -> None:
    """Move replicated (ignored) parameters to the mesh's device, as FSDP2 moves its own.

    ``fully_shard`` leaves ignored parameters where they are, so a model built on the CPU would
    keep them there and fail at the first forward on CUDA. Moved in place (``.data``): the
    ``Parameter`` objects, and so ties and optimizers, stay. A meta parameter stays meta: the
    loader materialises it on the collective's device.
    """
    device = collective_device(mesh)
    with torch.no_grad():
        for param in params:
            if not param.is_meta and param.device != device:
                param.data = param.data.to(device)
