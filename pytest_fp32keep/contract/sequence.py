"""One call of the contract: the two models, and the steps that run them in order.

:func:`~pytest_fp32keep.contract.assertion.assert_fp32_keep_contract` validates its arguments
into a :class:`Setup`, builds the :class:`Models` (the model under test and its unsharded
reference, holding the same weights) and runs the :class:`Steps`, each through the ranks'
:class:`~.verdicts.Agreement`:

1. ``batch``: built from the reference, the same on every rank;
2. ``reference`` (first part): what the reference's forward uses, observed, for the
   implementation's layout and the control's;
3. ``cast``, ``shard``, ``load`` (with the round trip), and what is stored at rest;
4. ``reference`` (second part): the reference's forward and backward under the caller's policy
   as a correct implementation applies it at the units just made (:mod:`.policy`);
5. ``forward``, ``backward`` of the model under test;
6. the comparison of the two runs (materialized, boundary, operators, parity with the control).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
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
from pytest_fp32keep.contract.control import (
    Unit,
    control_run,
    keeping_units,
    keeps_in_mixed_units,
    measure_control,
    unit_layout,
)
from pytest_fp32keep.contract.follow import (
    Choices,
    follow,
    read_choices,
    stored_fp32,
    values_of,
)
from pytest_fp32keep.contract.master import expected_storage
from pytest_fp32keep.contract.parity_policy import ControlMeasure
from pytest_fp32keep.contract.policy import cast_for_compute, expected_grads, unit_casts
from pytest_fp32keep.contract.reference import build_unsharded_reference, seeded
from pytest_fp32keep.contract.report import Finding
from pytest_fp32keep.contract.scale import gradient_scale
from pytest_fp32keep.contract.steps import (
    CastFn,
    LoadFn,
    Pass,
    Run,
    ShardFn,
    accepts_observed,
    finite_reference,
    set_prefetch,
    to_device,
)
from pytest_fp32keep.contract.verdicts import Agreement, batch_fingerprint, batch_problem
from pytest_fp32keep.contract.weights import loaded_weights, loading, low_precision

__all__ = ["Models", "Setup", "Steps", "build_models"]


@dataclasses.dataclass(frozen=True)
class Models:
    """The model under test and its reference, holding the same weights once loaded."""

    model: nn.Module  # cast, sharded and loaded by the implementation under test
    reference: nn.Module  # unsharded, cast the correct keep-aware way, the checkpoint loaded
    plan: KeepPlan
    checkpoint: dict[str, torch.Tensor] | None  # what `load` gets a copy of; None: no load
    factory: Callable[[], nn.Module]  # builds what the control starts from
    device: torch.device


def build_models(
    model_factory: Callable[[], nn.Module],
    *,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    check_state_dict: bool,
) -> Models:
    """Build the model under ``seed``, copy it into the reference (cast keep-aware) and, when
    the round trip is checked, load the reference with weights the model was not built with."""
    with seeded(seed):
        model = model_factory().to(device)
    plan = fp32keep.resolve_keep_plan(model, dtype)
    reference = build_unsharded_reference(model)
    fp32keep.keep_aware_cast(reference, dtype, plan=plan)  # the oracle is always cast correctly
    if not check_state_dict:
        return Models(model, reference, plan, None, model_factory, device)
    checkpoint = low_precision(loaded_weights(model_factory, model, seed, device), dtype)
    reference.load_state_dict(checkpoint)  # each tensor copied into its destination dtype
    return Models(model, reference, plan, checkpoint, loading(model_factory, checkpoint), device)


@dataclasses.dataclass(frozen=True)
class Setup:
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
    load_on_every_rank: bool = False
    gradient_divide_factor: float | None = None  # None: FSDP2's mean (:mod:`.scale`)


@dataclasses.dataclass
class Steps:
    """The steps of one contract call, each run through the ranks' :class:`Agreement`."""

    setup: Setup
    agreement: Agreement
    models: Models
    findings: list[Finding] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    batch: Any = None
    expected: Run | None = None
    observed: Run | None = None
    used: fp32keep.ParameterUse | None = None  # what the reference's forward used, and where
    storage: dict[str, torch.dtype] = dataclasses.field(default_factory=dict)
    units: tuple[Unit, ...] = ()  # the implementation's FSDP2 units, read after `shard`
    choices: Choices | None = None  # what the reference follows (:mod:`.follow`)

    def __post_init__(self) -> None:
        # what the convention stores, from the reference and the plan: never from the model
        m = self.models
        self.storage = expected_storage(m.reference, m.plan, self.setup.master_dtype)

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

    def observe_reference(self) -> None:
        """``reference``, first part: which module calls and methods of the reference use each
        parameter (one observed forward), merged over the ranks, for the implementation's
        layout and the control's."""
        if not self.agreement.runs("reference"):
            return
        reference = self._pass(self.models.reference)

        def observe() -> fp32keep.ParameterUse:
            self.used = reference.observe()
            return self.used

        # every rank's observation travels with the step's agreement (bounded), so the shard
        # and the control get the same merged one on every rank
        _, observations = self.agreement.step("reference", observe, lambda used: used)
        if self.used is not None and observations:
            others = [o for o in observations if isinstance(o, fp32keep.ParameterUse)]
            self.used = self.used.merged(others)

    def prepare(self) -> None:
        """``cast``, ``shard`` and ``load`` (with the round trip), then what is stored."""
        s, m = self.setup, self.models
        if self.agreement.runs("cast"):
            self.agreement.step("cast", lambda: s.cast(m.model, s.dtype, m.plan))
        candidates = frozenset[str]()
        if self.agreement.runs("shard"):  # the storage chosen by the cast, before sharding
            candidates = stored_fp32(m.model, m.reference, m.plan, s.dtype)
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
        if sharded:
            self.agreement.step("reference", lambda: self._follow(candidates))
        checkpoint = m.checkpoint
        if checkpoint is not None and self.agreement.runs("load"):
            trip, _ = self.agreement.step(
                "load",
                lambda: check_round_trip(
                    m.model, checkpoint, s.load, self.storage, every_rank=s.load_on_every_rank
                ),
            )
            self.findings += trip or []
        if sharded:  # at rest after cast, shard and load
            self.findings += check_stored(m.model, self.storage, m.plan)

    def _follow(self, candidates: frozenset[str]) -> None:
        """The reference follows what the implementation chose where the contract allows
        either (:mod:`.follow`); the storage the rows expect is read off it again."""
        s, m = self.setup, self.models
        master = s.master_dtype is not None
        choices = read_choices(m.model, m.reference, candidates, master)
        values: dict[str, torch.Tensor] = {}
        if choices.fp32:  # their values as built and loaded, never rounded through `dtype`
            with seeded(s.seed):
                values = values_of(m.factory().to(m.device), choices.fp32)
        self.notes += choices.notes(m.reference)
        follow(m.reference, choices, values)
        self.choices = choices
        self.storage = expected_storage(m.reference, m.plan, s.master_dtype)

    def run_reference(self) -> None:
        """``reference``, second part: the reference's forward and backward under the caller's
        policy as a correct implementation applies it (:mod:`.policy`: FP32 for kept parameters,
        the policy's ``param_dtype`` for the others, its input and output casts at the
        implementation's units), its gradients held as each parameter is stored. Only when the
        model under test will run too (nothing it needs crashed)."""
        if not (self.agreement.runs("reference") and self.agreement.runs("forward")):
            return
        s, m = self.setup, self.models

        def run() -> Run:
            self.units = unit_layout(m.model)
            cast_for_compute(m.reference, m.plan, s.policy, self.storage)
            reference = self._pass(m.reference)
            layout = [(unit.modules, unit.params) for unit in self.units]
            with unit_casts(m.reference, layout, m.plan, s.policy) as missing:
                reference.forward()
                done = finite_reference(reference.backward(), s.dtype)
            if missing:
                self.notes.append(
                    f"the reference has no module {', '.join(sorted(missing)[:3])} of the "
                    "implementation's FSDP2 units: the policy's input and output casts there "
                    "are not modelled"
                )
            return done

        expected, _ = self.agreement.step("reference", run)
        if expected is not None:
            scale = gradient_scale(s.mesh, s.gradient_divide_factor)
            expected.grads = expected_grads(expected.grads, self.storage, scale)
        self.expected = expected

    def run_model(self) -> None:
        """``forward`` and ``backward`` of the model under test, each its own step."""
        if not (self.agreement.runs("forward") and self.expected is not None):
            return
        under_test = self._pass(self.models.model)
        self.agreement.step("forward", under_test.forward)
        if self.agreement.runs("backward"):
            self.observed, _ = self.agreement.step("backward", under_test.backward)

    def compare(self) -> dict[str, str]:
        """The findings and notes that compare the two runs (none unless both completed);
        returns the dtype each parameter was all-gathered in."""
        s, m, expected, observed = self.setup, self.models, self.expected, self.observed
        if expected is None or observed is None:
            return {}
        control_units, kept_apart = keeping_units(
            self.units,
            m.reference,
            m.plan,
            in_place=keeps_in_mixed_units(s.master_dtype, s.policy),
        )

        def control() -> ControlMeasure:
            run = functools.partial(
                control_run,
                m.factory,
                self.batch,
                units=control_units,
                mesh=s.mesh,
                dtype=s.dtype,
                master_dtype=s.master_dtype,
                plan=m.plan,
                policy=s.policy,
                autocast=s.autocast,
                loss_fn=s.loss_fn,
                seed=s.seed,
                observed=self.used,
                divide_factor=s.gradient_divide_factor,
                choices=self.choices,
            )
            return measure_control(
                run,
                expected,
                observed,
                units=control_units,
                device=m.device,
                measure_spread=s.measure_spread,
                on_any_rank=functools.partial(
                    self.agreement.on_any_rank, "parity control (second run)"
                ),
                notes=kept_apart,
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
        self.notes += notes
        alerts = ", ".join(dict.fromkeys((*expected.alerts, *observed.alerts)))
        if alerts:
            self.notes.append(
                f"torch has no deterministic implementation of {alerts} (run with "
                "use_deterministic_algorithms(True, warn_only=True)): the gradients are bounded "
                "by the spread of two control runs where they are not bit-identical; logits and "
                "loss must still be"
            )
        return seen


def _compare_runs(
    models: Models,
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
