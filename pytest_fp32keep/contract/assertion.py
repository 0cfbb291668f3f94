"""The precision contract, checked end to end on one model in every rank of a mesh.

:func:`assert_fp32_keep_contract` builds the model twice from the same weights: an FSDP2-sharded
copy made by the implementation under test (by default ``fp32keep``'s keep-aware cast, wrapping
and loader) and an unsharded reference cast the correct keep-aware way. It runs forward and
backward in both, in the same context, and checks every item of the contract in
``shared/docs/design.md``:

* ``stored``: every kept tensor's local shard (or buffer) is FP32; every other tensor is stored
  exactly as the reference stores it, or, under ``master_dtype=torch.float32`` (FP32 master
  weights, :mod:`.master`), every trainable parameter in FP32;
* ``materialized``: kept parameters are all-gathered in FP32; the others in what plain FSDP2
  gives them (the policy's ``param_dtype``);
* ``boundary``: the activation input/output dtypes of every kept module (and, when the policy does
  not cast forward inputs, of every module) equal the reference's;
* ``operators``: the operators run inside kept modules, with their dtypes, equal the reference's;
* ``parity``: logits and loss bit-identical; every gradient bit-identical, or — where a control
  with the implementation's own units, at the same world size, sharded with the correct policy
  (:mod:`.control`) is not bit-identical for that parameter either (averaging over 3 ranks
  rounds; T5's shared position bias makes autograd accumulate in another order) — no further
  from the reference than the control is (``docs/contract.md`` gives the argument);
* ``round trip``: loading a low-precision full state dict and gathering it back is exact, and the
  destination dtype wins for every alias.

The implementation under test is pluggable (``cast``, ``shard``, ``load``) so that a training
framework can check its own wrapping, and so that known-wrong implementations (the negative
controls) can prove the check fails.

This module is the orchestrator only: it builds the two models, runs them (:mod:`.steps`), hands
the runs to the checks (one module per family under :mod:`.checks`, the gradient bounds in
:mod:`.parity_policy` from the control in :mod:`.control`) and collects their findings into a
:class:`~.report.ContractReport`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import fp32keep
from fp32keep import KeepPlan
from fp32keep.layout import WrapSpec
from pytest_fp32keep.contract.checks.boundary import check_boundary, check_operators, kept_modules
from pytest_fp32keep.contract.checks.parity import check_parity
from pytest_fp32keep.contract.checks.round_trip import check_round_trip
from pytest_fp32keep.contract.checks.storage import check_materialized, check_stored
from pytest_fp32keep.contract.control import control_gradients, unit_layout
from pytest_fp32keep.contract.master import as_master_grads, validate_master_dtype
from pytest_fp32keep.contract.parity_policy import control_errors
from pytest_fp32keep.contract.reference import build_unsharded_reference, seeded
from pytest_fp32keep.contract.report import ContractReport, ContractViolation, Finding, KeptTensor
from pytest_fp32keep.contract.steps import (
    CastFn,
    LoadFn,
    Run,
    ShardFn,
    default_cast,
    default_load,
    default_shard,
    describe_context,
    device_of,
    forward_backward,
    master_cast,
    set_prefetch,
    to_device,
)


@dataclasses.dataclass(frozen=True)
class _Models:
    """The model under test and its reference, built from the same weights."""

    model: nn.Module  # cast and sharded by the implementation under test
    reference: nn.Module  # unsharded, cast the correct keep-aware way
    plan: KeepPlan
    pristine: dict[str, torch.Tensor]  # the weights as built, before any cast
    device: torch.device


def _build_models(
    model_factory: Callable[[], nn.Module],
    *,
    mesh: DeviceMesh,
    dtype: torch.dtype,
    policy: MixedPrecisionPolicy,
    wrap: WrapSpec | None,
    forward_prefetch: bool,
    seed: int,
    cast: CastFn,
    shard: ShardFn,
) -> _Models:
    """Build the model under ``seed``, copy it into the reference, cast both and shard one."""
    device = device_of(mesh)
    with seeded(seed):
        model = model_factory().to(device)
    pristine = {name: t.detach().clone() for name, t in model.state_dict().items()}
    plan = fp32keep.resolve_keep_plan(model, dtype)
    reference = build_unsharded_reference(model)
    fp32keep.keep_aware_cast(reference, dtype, plan=plan)  # the oracle is always cast correctly
    cast(model, dtype, plan)
    shard(model, mesh=mesh, mp_policy=policy, plan=plan, wrap=wrap)
    set_prefetch(model, forward_prefetch)
    return _Models(model, reference, plan, pristine, device)


def _run_both(
    models: _Models,
    batch: Any,
    *,
    autocast: bool,
    dtype: torch.dtype,
    loss_fn: Callable[[Any], torch.Tensor] | None,
) -> tuple[Run, Run]:
    """Forward and backward in the model under test, then in the reference."""
    run = functools.partial(
        forward_backward,
        batch=batch,
        autocast=autocast,
        device=models.device,
        dtype=dtype,
        loss_fn=loss_fn,
    )
    return run(models.model), run(models.reference)


def _compare_runs(
    models: _Models,
    observed: Run,
    expected: Run,
    *,
    policy: MixedPrecisionPolicy,
    control: Callable[[], Mapping[str, float]],
) -> tuple[list[Finding], list[str], dict[str, str]]:
    """The materialized, boundary, operators and parity findings, the notes, and the dtype each
    parameter was all-gathered in."""
    findings, seen = check_materialized(observed.probe, models.model, models.plan, policy)
    kept = kept_modules(models.reference, models.plan)
    findings += check_boundary(
        expected.probe, observed.probe, None if not policy.cast_forward_inputs else kept
    )
    findings += check_operators(expected.probe, observed.probe, kept)
    parity, notes = check_parity(observed, expected, control)
    findings += parity
    return findings, notes, seen


def _kept_rows(
    plan: KeepPlan, findings: Sequence[Finding], seen: Mapping[str, str]
) -> tuple[KeptTensor, ...]:
    """One row per kept tensor: its plan entry, and its stored and all-gathered dtypes."""
    return tuple(
        KeptTensor(
            fqn=name,
            entry=(plan.match_for(name) or fp32keep.KeepMatch("?", "regular")).entry,
            list_kind=(plan.match_for(name) or fp32keep.KeepMatch("?", "regular")).list_kind,
            stored=next(
                (f.observed for f in findings if f.check == "stored" and f.subject == name), "-"
            ),
            materialized=seen.get(name, "-"),
        )
        for name in sorted(plan.names)
    )


def assert_fp32_keep_contract(
    model_factory: Callable[[], nn.Module],
    batch_factory: Callable[[nn.Module], Any],
    *,
    mesh: DeviceMesh,
    dtype: torch.dtype,
    autocast: bool = False,
    forward_prefetch: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
    wrap: WrapSpec | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    check_state_dict: bool = True,
    seed: int = 0,
    cast: CastFn = default_cast,
    shard: ShardFn = default_shard,
    load: LoadFn = default_load,
    master_dtype: torch.dtype | None = None,
) -> ContractReport:
    """Check the FP32-keep contract for one model; call it in every rank of ``mesh``.

    Args:
        model_factory: builds the model (FP32, unsharded) from scratch; called under ``seed``.
        batch_factory: builds one batch from the unsharded reference, already cast keep-aware
            (kept tensors FP32, the others in ``dtype``, whatever ``master_dtype``), e.g. reading
            its config or its dtype: a mapping of keyword arguments, a tuple of
            positional arguments, or one tensor. Every rank must build the same batch.
        mesh: the 1-D data-parallel mesh (the ``fsdp2_mesh`` fixture).
        dtype: the low-precision dtype: the compute dtype, and the storage dtype of the tensors
            that are not kept (unless ``master_dtype`` says otherwise).
        autocast: run forward under ``torch.autocast(dtype=dtype)`` (else directly).
        forward_prefetch: let each FSDP2 unit prefetch the next one (and the previous in
            backward).
        mp_policy: the policy to shard with; default
            ``MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
            cast_forward_inputs=False)`` (FSDP2's input cast would make models that pass FP32
            tensors between layers differ from any unsharded reference).
        wrap: standard wrap targets (default: ``_no_split_modules``).
        loss_fn: loss from the model output; default: ``output.loss`` if present, else the mean
            square of the logits (first floating output).
        check_state_dict: also check the full-state-dict round trip.
        seed: seed for building the model.
        cast, shard, load: the implementation under test; default: ``fp32keep``'s (under
            ``master_dtype=torch.float32`` the default cast is keep-aware followed by
            ``fp32keep.upcast_to_fp32_master``).
        master_dtype: the storage convention judged: ``None`` (parameters the plan does not
            keep stored in ``dtype``) or ``torch.float32`` (FP32 master weights: every
            trainable parameter stored in FP32, the policy's ``param_dtype`` casts for compute;
            gradients are expected in FP32). Kept tensors are judged the same way under both.

    Returns:
        The :class:`ContractReport` (every finding, passing ones included).

    Raises:
        ContractViolation: an ``AssertionError`` whose message is a table of what broke, for
            which tensor, expected against observed.
        ValueError: ``master_dtype`` is neither ``None`` nor ``torch.float32`` (raised before
            anything is built).
    """
    master_dtype = validate_master_dtype(master_dtype)
    if cast is default_cast and master_dtype is not None:
        cast = master_cast
    policy = mp_policy or MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    models = _build_models(
        model_factory,
        mesh=mesh,
        dtype=dtype,
        policy=policy,
        wrap=wrap,
        forward_prefetch=forward_prefetch,
        seed=seed,
        cast=cast,
        shard=shard,
    )
    batch = to_device(batch_factory(models.reference), models.device)
    findings = check_stored(models.model, models.reference, models.plan, master_dtype)
    observed, expected = _run_both(models, batch, autocast=autocast, dtype=dtype, loss_fn=loss_fn)
    expected.grads = as_master_grads(expected.grads, models.plan, master_dtype)

    def control() -> dict[str, float]:
        grads = control_gradients(
            model_factory,
            batch,
            units=unit_layout(models.model),
            mesh=mesh,
            dtype=dtype,
            master_dtype=master_dtype,
            plan=models.plan,
            policy=policy,
            autocast=autocast,
            loss_fn=loss_fn,
            seed=seed,
        )
        return control_errors(grads, expected.grads)

    compared, notes, seen = _compare_runs(
        models, observed, expected, policy=policy, control=control
    )
    findings += compared
    if check_state_dict:
        findings += check_round_trip(models.model, models.pristine, dtype, load)

    report = ContractReport(
        model_name=type(models.reference).__name__,
        dtype=dtype,
        context=describe_context(autocast, forward_prefetch),
        kept=_kept_rows(models.plan, findings, seen),
        findings=tuple(findings),
        notes=tuple(notes),
    )
    if not report.ok:
        raise ContractViolation(report)
    return report
