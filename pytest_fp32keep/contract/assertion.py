"""The precision contract, checked end to end on one model in every rank of a mesh.

:func:`assert_fp32_keep_contract` builds the model twice: an FSDP2-sharded copy made by the
implementation under test (by default ``fp32keep``'s keep-aware cast, wrapping and loader) and an
unsharded reference cast the correct keep-aware way. With the round trip on, the sharded copy
loads, before its first forward, a checkpoint of weights it was not built with
(:mod:`.weights`), and the reference holds the same ones, so the forward proves the model
computes with what it loaded. It runs forward and backward in both, in the same context, and
checks every item of the contract in ``shared/docs/design.md``:

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
  from the reference than the control is, plus, where a run is not known to be deterministic
  (:mod:`.determinism`), the spread of two control runs (``docs/contract.md`` gives the
  argument);
* ``round trip``: loading a low-precision full state dict and gathering it back is exact, and the
  destination dtype wins for every alias;
* ``crashed``: no step raised. Each step (build, batch, reference, cast, shard, load, forward,
  backward) runs on every rank and the ranks agree, in one bounded collective, on whether it
  raised anywhere (:mod:`.verdicts`); a crash is a row on every rank, naming the step, the
  exception and the ranks, and the steps that need it do not run.

The implementation under test is pluggable (``cast``, ``shard``, ``load``) so that a training
framework can check its own wrapping, and so that known-wrong implementations (the negative
controls) can prove the check fails.

This module is the orchestrator only: it builds the two models, runs the steps through the
ranks' agreement (:mod:`.verdicts`, :mod:`.steps`), hands
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
from fp32keep import KeepPlan, WrapSpec
from pytest_fp32keep.contract.checks.boundary import check_boundary, check_operators, kept_modules
from pytest_fp32keep.contract.checks.parity import check_parity
from pytest_fp32keep.contract.checks.round_trip import check_round_trip
from pytest_fp32keep.contract.checks.storage import check_materialized, check_stored
from pytest_fp32keep.contract.control import control_run, measure_control, unit_layout
from pytest_fp32keep.contract.master import (
    as_master_grads,
    expected_storage,
    validate_master_dtype,
)
from pytest_fp32keep.contract.parity_policy import ControlMeasure
from pytest_fp32keep.contract.reference import build_unsharded_reference, seeded
from pytest_fp32keep.contract.report import ContractReport, ContractViolation, Finding, KeptTensor
from pytest_fp32keep.contract.steps import (
    CastFn,
    LoadFn,
    Pass,
    Run,
    ShardFn,
    accepts_observed,
    default_cast,
    default_load,
    default_shard,
    describe_context,
    device_of,
    finite_reference,
    master_cast,
    set_prefetch,
    to_device,
)
from pytest_fp32keep.contract.verdicts import (
    STEPS,
    Agreement,
    batch_fingerprint,
    batch_problem,
    plan_account,
    plan_problem,
)
from pytest_fp32keep.contract.weights import loaded_weights, loading, low_precision


@dataclasses.dataclass(frozen=True)
class _Models:
    """The model under test and its reference, holding the same weights once loaded."""

    model: nn.Module  # cast, sharded and loaded by the implementation under test
    reference: nn.Module  # unsharded, cast the correct keep-aware way, the checkpoint loaded
    plan: KeepPlan
    checkpoint: dict[str, torch.Tensor] | None  # what `load` gets a copy of; None: no load
    factory: Callable[[], nn.Module]  # builds what the control starts from
    device: torch.device


def _build_models(
    model_factory: Callable[[], nn.Module],
    *,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    check_state_dict: bool,
) -> _Models:
    """Build the model under ``seed``, copy it into the reference (cast keep-aware) and, when
    the round trip is checked, load the reference with weights the model was not built with."""
    with seeded(seed):
        model = model_factory().to(device)
    plan = fp32keep.resolve_keep_plan(model, dtype)
    reference = build_unsharded_reference(model)
    fp32keep.keep_aware_cast(reference, dtype, plan=plan)  # the oracle is always cast correctly
    if not check_state_dict:
        return _Models(model, reference, plan, None, model_factory, device)
    checkpoint = low_precision(loaded_weights(model_factory, model, seed, device), dtype)
    reference.load_state_dict(checkpoint)  # each tensor copied into its destination dtype
    return _Models(model, reference, plan, checkpoint, loading(model_factory, checkpoint), device)


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What every step needs: the arguments of one contract call, after validation."""

    mesh: DeviceMesh
    dtype: torch.dtype
    autocast: bool
    forward_prefetch: bool
    policy: MixedPrecisionPolicy
    wrap: WrapSpec | None
    loss_fn: Callable[[Any], torch.Tensor] | None
    master_dtype: torch.dtype | None
    seed: int
    cast: CastFn
    shard: ShardFn
    load: LoadFn
    measure_spread: bool


@dataclasses.dataclass
class _Steps:
    """The steps of one contract call, each run through the ranks' :class:`Agreement`."""

    setup: _Setup
    agreement: Agreement
    models: _Models
    findings: list[Finding] = dataclasses.field(default_factory=list)
    batch: Any = None
    expected: Run | None = None
    observed: Run | None = None
    used: fp32keep.ParameterUse | None = None  # what the reference's forward used, and where

    def _pass(self, model: nn.Module) -> Pass:
        s = self.setup
        return Pass(
            model,
            self.batch,
            autocast=s.autocast,
            device=self.models.device,
            dtype=s.dtype,
            loss_fn=s.loss_fn,
        )

    def make_batch(self, batch_factory: Callable[[nn.Module], Any]) -> None:
        """``batch``: built from the reference; every rank's must be the same (else raise)."""
        device = self.models.device
        self.batch, fingerprints = self.agreement.step(
            "batch",
            lambda: to_device(batch_factory(self.models.reference), device),
            batch_fingerprint,
        )
        problem = batch_problem(fingerprints, self.agreement.ranks) if fingerprints else None
        if problem is not None:  # raised on every rank, before anything else runs
            raise ValueError(problem)

    def run_reference(self) -> None:
        """``reference``: the reference's forward observed (``used``: which module calls and
        methods use each parameter, merged over the ranks, for the implementation's layout and
        the control's), then its forward and backward (the gradients as masters)."""
        if not self.agreement.runs("reference"):
            return
        reference = self._pass(self.models.reference)

        def run() -> Run:
            self.used = reference.observe()
            reference.forward()
            return finite_reference(reference.backward(), self.setup.dtype)

        # every rank's observation travels with the step's agreement (bounded), so the shard
        # and the control get the same merged one on every rank
        expected, observations = self.agreement.step("reference", run, lambda _: self.used)
        if self.used is not None and observations:
            others = [o for o in observations if isinstance(o, fp32keep.ParameterUse)]
            self.used = self.used.merged(others)
        if expected is not None:
            expected.grads = as_master_grads(
                expected.grads, self.models.plan, self.setup.master_dtype
            )
        self.expected = expected

    def prepare(self) -> None:
        """``cast``, ``shard`` and ``load`` (with the round trip), then what is stored."""
        s, m = self.setup, self.models
        if self.agreement.runs("cast"):
            self.agreement.step("cast", lambda: s.cast(m.model, s.dtype, m.plan))
        sharded = False
        if self.agreement.runs("shard"):

            def shard() -> None:
                observed = {"observed": self.used} if accepts_observed(s.shard) else {}
                s.shard(
                    m.model, mesh=s.mesh, mp_policy=s.policy, plan=m.plan, wrap=s.wrap, **observed
                )
                set_prefetch(m.model, s.forward_prefetch)

            self.agreement.step("shard", shard)
            sharded = not self.agreement.crashed or self.agreement.crashes[0].step != "shard"
        checkpoint = m.checkpoint
        # what the convention stores, from the reference and the plan: never from the model
        expected = expected_storage(m.reference, m.plan, s.master_dtype)
        if checkpoint is not None and self.agreement.runs("load"):
            trip, _ = self.agreement.step(
                "load", lambda: check_round_trip(m.model, checkpoint, s.load, expected)
            )
            self.findings += trip or []
        if sharded:  # at rest after cast, shard and load
            self.findings += check_stored(m.model, expected, m.plan)

    def run_model(self) -> None:
        """``forward`` and ``backward`` of the model under test, each its own step."""
        if not self.agreement.runs("forward"):
            return
        under_test = self._pass(self.models.model)
        self.agreement.step("forward", under_test.forward)
        if self.agreement.runs("backward"):
            self.observed, _ = self.agreement.step("backward", under_test.backward)

    def compare(self) -> tuple[list[str], dict[str, str]]:
        """The findings that compare the two runs (none unless both completed)."""
        s, m, expected, observed = self.setup, self.models, self.expected, self.observed
        if expected is None or observed is None:
            return [], {}

        def control() -> ControlMeasure:
            units = unit_layout(m.model)
            run = functools.partial(
                control_run,
                m.factory,
                self.batch,
                units=units,
                mesh=s.mesh,
                dtype=s.dtype,
                master_dtype=s.master_dtype,
                plan=m.plan,
                policy=s.policy,
                autocast=s.autocast,
                loss_fn=s.loss_fn,
                seed=s.seed,
                observed=self.used,
            )
            return measure_control(
                run,
                expected,
                observed,
                units=units,
                device=m.device,
                measure_spread=s.measure_spread,
                on_any_rank=functools.partial(
                    self.agreement.on_any_rank, "parity control (second run)"
                ),
            )

        compared, notes, seen = _compare_runs(
            m,
            observed,
            expected,
            policy=s.policy,
            control=control,
            on_any_rank=functools.partial(self.agreement.on_any_rank, "parity control"),
            measure_spread=s.measure_spread,
        )
        self.findings += compared
        alerts = ", ".join(dict.fromkeys((*expected.alerts, *observed.alerts)))
        if alerts:
            notes.append(
                f"torch has no deterministic implementation of {alerts} (run with "
                "use_deterministic_algorithms(True, warn_only=True)): the gradients are bounded "
                "by the spread of two control runs where they are not bit-identical; logits and "
                "loss must still be"
            )
        return notes, seen


def _compare_runs(
    models: _Models,
    observed: Run,
    expected: Run,
    *,
    policy: MixedPrecisionPolicy,
    control: Callable[[], ControlMeasure],
    on_any_rank: Callable[[bool], bool],
    measure_spread: bool,
) -> tuple[list[Finding], list[str], dict[str, str]]:
    """The materialized, boundary, operators and parity findings, the notes, and the dtype each
    parameter was all-gathered in."""
    findings, seen = check_materialized(observed.probe, models.model, models.plan, policy)
    kept = kept_modules(models.reference, models.plan)
    findings += check_boundary(
        expected.probe, observed.probe, None if not policy.cast_forward_inputs else kept
    )
    findings += check_operators(expected.probe, observed.probe, kept)
    parity, notes = check_parity(
        observed, expected, control, on_any_rank, measure_spread=measure_spread
    )
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
    measure_spread: bool = False,
) -> ContractReport:
    """Check the FP32-keep contract for one model; call it in every rank of ``mesh``.

    Args:
        model_factory: builds the model (FP32, unsharded) from scratch; called under ``seed``.
        batch_factory: builds one batch from the unsharded reference, already cast keep-aware
            (kept tensors FP32, the others in ``dtype``, whatever ``master_dtype``), e.g. reading
            its config or its dtype: a mapping of keyword arguments, a tuple of
            positional arguments, or one tensor. Every rank must build the same batch: the
            ranks compare a hash of each entry's shape, dtype and bytes before anything runs.
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
        check_state_dict: also check the full-state-dict round trip: before the first forward,
            ``load`` gets (on rank 0; ``None`` elsewhere) a fresh copy of a low-precision
            checkpoint of other weights (the factory under ``seed + 1``, every parameter that
            came out equal shifted), which it may rewrite: it is never read back. The reference
            and the control hold the same weights, so the forward, ``parity`` and ``stored``
            rows hold only if the model computes with what it loaded. ``False``: nothing is
            loaded and both compute with the weights built under ``seed``.
        seed: seed for building the model.
        cast, shard, load: the implementation under test; default: ``fp32keep``'s (under
            ``master_dtype=torch.float32`` the default cast is keep-aware followed by
            ``fp32keep.upcast_to_fp32_master``).
        master_dtype: the storage convention judged: ``None`` (parameters the plan does not
            keep stored in ``dtype``) or ``torch.float32`` (FP32 master weights: every
            trainable parameter stored in FP32, the policy's ``param_dtype`` casts for compute;
            gradients are expected in FP32). Kept tensors are judged the same way under both.
        measure_spread: run the parity control, twice, whatever the gradients, and report how
            far its two runs differ (``docs/contract.md``, "Determinism"); a diagnostic (CI's
            GPU check), never needed for a verdict: the control runs twice by itself wherever
            the runs are not known to be deterministic.

    Every forward and backward (the reference's, the implementation's, the control's) runs with
    ``torch.use_deterministic_algorithms(True, warn_only=True)``, the caller's setting restored
    after; the operators torch says it has no deterministic implementation of are named in the
    report's notes, and make the control run twice, each gradient's bound widened by the spread
    of the two runs. On CUDA set ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` before CUDA starts
    (``fp32keep check`` does in its ranks).

    Every outcome is a verdict: an exception in a step (building the models, the batch, the
    reference's run, ``cast``, ``shard``, ``load`` with the gather back, the model's forward or
    backward), on any rank, is a ``crashed`` finding on every rank (subject: the step;
    observed: the exception's type, its first line and the ranks that raised it), agreed after
    each step in one collective bounded by
    :data:`~pytest_fp32keep.contract.verdicts.AGREE_TIMEOUT_S`; the steps that need the crashed
    one are not run (the report's notes name them) and the violation is chained to the
    exception on the ranks that raised it.

    Returns:
        The :class:`ContractReport` (every finding, passing ones included).

    Raises:
        ContractViolation: an ``AssertionError`` whose message is a table of what broke, for
            which tensor, expected against observed (a crash included), on every rank.
        KeepLayoutError: the default ``shard`` refused the layout on every rank (the contract's
            answer to a layout FSDP2 cannot keep, re-raised as is).
        ValueError: ``master_dtype`` is neither ``None`` nor ``torch.float32`` (raised before
            anything is built); or the ranks built different batches ("rank 1 built a
            different batch: input_ids differ; ... seed your batch_factory") or keep plans,
            raised on every rank before the model under test is cast.
    """
    master_dtype = validate_master_dtype(master_dtype)
    if cast is default_cast and master_dtype is not None:
        cast = master_cast
    policy = mp_policy or MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    setup = _Setup(
        mesh,
        dtype,
        autocast,
        forward_prefetch,
        policy,
        wrap,
        loss_fn,
        master_dtype,
        seed,
        cast,
        shard,
        load,
        measure_spread,
    )
    planned = [step for step in STEPS if step != "load" or check_state_dict]
    agreement = Agreement(mesh, planned)
    device = device_of(mesh)
    models, plans = agreement.step(
        "build",
        lambda: _build_models(
            model_factory, device=device, dtype=dtype, seed=seed, check_state_dict=check_state_dict
        ),
        plan_account,
    )
    problem = plan_problem(plans, agreement.ranks) if plans else None
    if problem is not None:  # raised on every rank, before anything is cast
        raise ValueError(problem)
    findings: list[Finding] = []
    notes: list[str] = []
    seen: dict[str, str] = {}
    if models is not None:
        steps = _Steps(setup, agreement, models)
        steps.make_batch(batch_factory)
        steps.run_reference()
        steps.prepare()
        steps.run_model()
        notes, seen = steps.compare()
        findings = steps.findings
    findings += agreement.findings()
    notes += agreement.notes()
    name = getattr(model_factory, "__name__", type(model_factory).__name__)
    report = ContractReport(
        model_name=type(models.reference).__name__ if models is not None else name,
        dtype=dtype,
        context=describe_context(autocast, forward_prefetch),
        kept=_kept_rows(models.plan, findings, seen) if models is not None else (),
        findings=tuple(findings),
        notes=tuple(notes),
    )
    if not report.ok:
        raise ContractViolation(report) from agreement.error
    return report
