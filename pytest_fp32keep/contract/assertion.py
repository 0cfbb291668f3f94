"""The precision contract, checked end to end on one model in every rank of a mesh.

:func:`assert_fp32_keep_contract` builds the model twice: an FSDP2-sharded copy made by the
implementation under test (by default ``fp32keep``'s keep-aware cast, wrapping and loader) and an
unsharded reference cast the correct keep-aware way. With the round trip on, the sharded copy
loads, before its first forward, a checkpoint of weights it was not built with
(:mod:`.weights`), and the reference holds the same ones, so the forward proves the model
computes with what it loaded. It runs forward and backward in both, in the same context, and
checks every item of the contract in ``docs/contract.md``:

* ``stored``: every kept tensor's local shard (or buffer) is FP32; every other tensor is stored
  exactly as the reference stores it, or, under ``master_dtype=torch.float32`` (FP32 master
  weights, :mod:`.master`), every trainable parameter in FP32 (buffers and frozen parameters
  in ``dtype`` or FP32: the reference follows the implementation, :mod:`.follow`);
* ``materialized``: kept parameters are all-gathered in FP32; the others in what plain FSDP2
  gives them (the policy's ``param_dtype``);
* ``boundary``: the activation input/output dtypes of every kept module (and, when the policy does
  not cast forward inputs, of every module) equal the reference's;
* ``operators``: the operators run inside kept modules, with their dtypes, equal the reference's;
* ``parity``: logits and loss bit-identical (the reference running the caller's policy as a correct
  implementation applies it: :mod:`.policy`); every gradient bit-identical, or — where a control
  with the implementation's own units (kept parameters in units of their own), at the same world
  size, sharded with the correct policy (:mod:`.control`) is not bit-identical for that parameter
  either (averaging over 3 ranks rounds; T5's shared position bias makes autograd accumulate in
  another order) — no further from the reference than the control is, plus, where a run is not
  known to be deterministic (:mod:`.determinism`), the spread of two control runs
  (``docs/contract.md`` gives the argument);
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

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from fp32keep import WrapSpec
from pytest_fp32keep.contract.kept import (
    check_kept_count,
    kept_rows,
    nothing_kept_note,
    validate_expect_kept,
)
from pytest_fp32keep.contract.master import validate_master_dtype
from pytest_fp32keep.contract.own_warnings import own_sharding_warnings
from pytest_fp32keep.contract.report import ContractReport, ContractViolation, Finding
from pytest_fp32keep.contract.scale import validate_gradient_divide_factor
from pytest_fp32keep.contract.sequence import Setup, Steps, build_models
from pytest_fp32keep.contract.steps import (
    CastFn,
    LoadFn,
    ShardFn,
    default_cast,
    default_load,
    default_shard,
    describe_context,
    device_of,
    master_cast,
    validate_mesh,
)
from pytest_fp32keep.contract.verdicts import STEPS, Agreement, plan_account, plan_problem


@own_sharding_warnings  # torch's view-tensor warning about the units it shards: not an error
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
    load_on_every_rank: bool = False,
    expect_kept: int | None = None,
    gradient_divide_factor: float | None = None,
) -> ContractReport:
    """Check the FP32-keep contract for one model; call it in every rank of ``mesh``.

    Args:
        model_factory: builds the model (FP32, unsharded) from scratch; called under ``seed``.
        batch_factory: builds one batch from the unsharded reference, already cast keep-aware
            (kept tensors FP32, the others in ``dtype``, whatever ``master_dtype``), e.g. reading
            its config or its dtype: a mapping of keyword arguments, a tuple of
            positional arguments, or one tensor. Every rank must build the same batch: the
            ranks compare a hash of each entry's shape, dtype and bytes before anything runs.
        mesh: the data-parallel mesh: 1-D (FSDP; the ``fsdp2_mesh`` fixture, or one the
            framework builds, e.g. ``init_device_mesh("cpu", (world,),
            mesh_dim_names=("dp_shard",))`` or the sub-mesh ``mesh["dp_shard"]`` of its
            ``("dp_replicate", "dp_shard")`` mesh) or 2-D (HSDP: replicate x shard). The
            implementation and the control both shard on it; every rank of it runs the call.
        dtype: the low-precision dtype: the compute dtype, and the storage dtype of the tensors
            that are not kept (unless ``master_dtype`` says otherwise).
        autocast: run forward under ``torch.autocast(dtype=dtype)`` (else directly).
        forward_prefetch: let each FSDP2 unit prefetch the next one (and the previous in
            backward).
        mp_policy: the policy to shard with; default
            ``MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32,
            cast_forward_inputs=False)``. Any policy is judged as a correct implementation
            applies it: the reference computes the parameters it does not keep in its
            ``param_dtype`` (bf16 compute over fp16 storage, say) and casts inputs and outputs
            as it does at each of the implementation's units, but never at a unit of kept
            parameters (:mod:`~pytest_fp32keep.contract.policy`): a policy's cast at a kept
            module's boundary is a ``boundary`` row.
        wrap: standard wrap targets (default: ``_no_split_modules``).
        loss_fn: loss from the model output; default: ``output.loss`` if present, else the mean
            square of the logits (first floating output).
        check_state_dict: also check the full-state-dict round trip: before the first forward,
            ``load`` gets (on rank 0, ``None`` elsewhere, unless ``load_on_every_rank``) a fresh
            copy of a low-precision checkpoint of other weights (the factory under ``seed + 1``,
            every parameter that came out equal shifted), which it may rewrite: it is never read
            back. The reference and the control hold the same weights, so the forward, ``parity``
            and ``stored`` rows hold only if the model computes with what it loaded. ``False``:
            nothing is loaded and both compute with the weights built under ``seed``.
        seed: seed for building the model.
        cast, shard, load: the implementation under test; default: ``fp32keep``'s (under
            ``master_dtype=torch.float32`` the default cast is keep-aware followed by
            ``fp32keep.upcast_to_fp32_master``).
        master_dtype: the storage convention judged: ``None`` (parameters the plan does not
            keep stored in ``dtype``) or ``torch.float32`` (FP32 master weights: every
            trainable parameter stored in FP32, the policy's ``param_dtype`` casts for compute;
            gradients are expected in FP32; buffers and frozen parameters the plan does not
            keep in ``dtype`` or FP32, as the implementation stores them). Kept tensors are
            judged the same way under both.
        measure_spread: run the parity control, twice, whatever the gradients, and report how
            far its two runs differ (``docs/contract.md``, "Determinism"); a diagnostic (CI's
            GPU check), never needed for a verdict: the control runs twice by itself wherever
            the runs are not known to be deterministic.
        load_on_every_rank: hand ``load`` the checkpoint on every rank, for loaders that read
            the whole dict on each rank (nemo-automodel's); default: rank 0 only.
        expect_kept: fail (a ``kept count`` row) when fewer than this many tensor names are
            kept in FP32; a report that keeps nothing always says why in a note (:mod:`.kept`).
        gradient_divide_factor: the gradient scale the implementation's units apply:
            ``None``, FSDP2's default (the mean over the mesh's ranks); a positive number,
            what they divide the summed gradient by (``FSDPModule.set_gradient_divide_factor``;
            torchtitan's ``disable_fsdp_gradient_division`` sets 1.0, a sum). The expected
            gradients are the reference's times ``world_size / gradient_divide_factor`` and the
            control's units get the same factor (:mod:`.scale`).

    The reference follows which parameters train as ``cast`` and ``shard`` leave them
    (:mod:`~pytest_fp32keep.contract.follow`). A model with no parameter that requires a
    gradient (a frozen reference or teacher model) is judged forward only: no backward runs,
    and the report's notes say that gradients were not judged.

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
        TypeError: ``load_on_every_rank`` is not a bool, or ``mesh`` not a ``DeviceMesh``.
        ValueError: ``master_dtype`` is neither ``None`` nor ``torch.float32``,
            ``expect_kept`` neither ``None`` nor a whole number, ``gradient_divide_factor``
            neither ``None`` nor a positive finite number, or ``mesh`` has neither one nor two
            dimensions (raised before anything is built); or the ranks built different batches
            ("rank 1 built a different batch: input_ids differ; ... seed your batch_factory")
            or keep plans, raised on every rank before the model under test is cast.
    """
    master_dtype = validate_master_dtype(master_dtype)
    expect_kept = validate_expect_kept(expect_kept)
    gradient_divide_factor = validate_gradient_divide_factor(gradient_divide_factor)
    if not isinstance(load_on_every_rank, bool):
        raise TypeError(
            f"assert_fp32_keep_contract(load_on_every_rank={load_on_every_rank!r}): pass True "
            "(the loader reads the checkpoint on every rank) or False (rank 0 holds it)"
        )
    mesh = validate_mesh(mesh)
    if cast is default_cast and master_dtype is not None:
        cast = master_cast
    policy = mp_policy or MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    setup = Setup(
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
        load_on_every_rank,
        gradient_divide_factor,
    )
    planned = [step for step in STEPS if step != "load" or check_state_dict]
    agreement = Agreement(mesh, planned)
    device = device_of(mesh)
    models, plans = agreement.step(
        "build",
        lambda: build_models(
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
        steps = Steps(setup, agreement, models)
        steps.make_batch(batch_factory)
        steps.observe_reference()
        steps.prepare()
        steps.run_reference()
        steps.run_model()
        seen = steps.compare()
        findings = steps.findings + check_kept_count(models.plan, expect_kept)
        notes = steps.notes + list(filter(None, [nothing_kept_note(models.plan)]))
    findings += agreement.findings()
    notes += agreement.notes()
    name = getattr(model_factory, "__name__", type(model_factory).__name__)
    report = ContractReport(
        model_name=type(models.reference).__name__ if models is not None else name,
        dtype=dtype,
        context=describe_context(autocast, forward_prefetch),
        kept=kept_rows(models.plan, findings, seen) if models is not None else (),
        findings=tuple(findings),
        notes=tuple(notes),
    )
    if not report.ok:
        raise ContractViolation(report) from agreement.error
    return report
