"""The precision contract, checked end to end on one model in every rank of a mesh.

:func:`assert_fp32_keep_contract` builds the model twice from the same weights: an FSDP2-sharded
copy made by the implementation under test (by default ``fp32keep``'s keep-aware cast, wrapping
and loader) and an unsharded reference cast the correct keep-aware way. It runs forward and
backward in both, in the same context, and checks every item of the contract in
``shared/docs/design.md``:

* ``stored``: every kept tensor's local shard (or buffer) is FP32; every other tensor is stored
  exactly as the reference stores it;
* ``materialized``: kept parameters are all-gathered in FP32; the others in what plain FSDP2
  gives them (the policy's ``param_dtype``);
* ``boundary``: the activation input/output dtypes of every kept module (and, when the policy does
  not cast forward inputs, of every module) equal the reference's;
* ``operators``: the operators run inside kept modules, with their dtypes, equal the reference's;
* ``parity``: logits and loss bit-identical; every gradient bit-identical, or — when plain FSDP2
  itself is not bit-identical on the same model (a control run measures it; T5's shared
  position bias makes autograd accumulate in another order) — no further from the reference
  than plain FSDP2 gets, or than two units of roundoff of the low-precision dtype, whichever is
  larger: both runs carry accumulation-order noise of that size, in different places;
* ``round trip``: loading a low-precision full state dict and gathering it back is exact, and the
  destination dtype wins for every alias.

The implementation under test is pluggable (``cast``, ``shard``, ``load``) so that a training
framework can check its own wrapping, and so that known-wrong implementations (the negative
controls) can prove the check fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import fp32keep
from fp32keep import KeepPlan
from fp32keep.layout import WrapSpec
from pytest_fp32keep.probe import DtypeProbe, diff_boundaries, dtype_name
from pytest_fp32keep.reference import build_unsharded_reference, seeded

CheckName = Literal["stored", "materialized", "boundary", "operators", "parity", "round trip"]
CHECKS: tuple[CheckName, ...] = (
    "stored",
    "materialized",
    "boundary",
    "operators",
    "parity",
    "round trip",
)


GRADIENT_NOISE_ULPS = 2
"""Accumulation-order noise allowed, in units of the low-precision dtype's roundoff (see parity)."""

CONTROL_ERROR_LIMIT = 0.05
"""The most plain FSDP2's *median* gradient may be off the unsharded model's (relative to each
gradient's scale) for its errors to serve as the noise bound. A few gradients far off are noise
(a key bias's gradient is zero in exact arithmetic, so all of it is roundoff); most of them far
off means plain FSDP2 itself is wrong on this torch and backend (torch 2.7 on gloo sums gradients
over the ranks instead of averaging them: every gradient 2x), and widening the bound to match
would let any bug of the same size pass."""


class CastFn(Protocol):
    """Casts a model for low-precision training in place (the default: keep-aware)."""

    def __call__(self, model: nn.Module, dtype: torch.dtype, plan: KeepPlan) -> object: ...


class ShardFn(Protocol):
    """Shards a model with FSDP2 in place (the default: :func:`fp32keep.apply_fsdp2`)."""

    def __call__(
        self,
        model: nn.Module,
        *,
        mesh: DeviceMesh,
        mp_policy: MixedPrecisionPolicy,
        plan: KeepPlan,
        wrap: WrapSpec | None,
    ) -> object: ...


class LoadFn(Protocol):
    """Loads a full state dict held by rank 0 into a sharded model."""

    def __call__(
        self, model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None
    ) -> object: ...


def _default_cast(model: nn.Module, dtype: torch.dtype, plan: KeepPlan) -> object:
    return fp32keep.keep_aware_cast(model, dtype, plan=plan)


def _default_shard(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    plan: KeepPlan,
    wrap: WrapSpec | None,
) -> object:
    return fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=mp_policy, plan=plan, wrap=wrap)


def _default_load(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None) -> object:
    return fp32keep.load_full_state_dict(model, state_dict)


@dataclasses.dataclass(frozen=True)
class Finding:
    """One contract item observed for one tensor or module.

    Attributes:
        check: which contract item.
        subject: the tensor FQN, module FQN (with call and leaf), or output name.
        expected: what the contract requires.
        observed: what happened.
        ok: whether they agree.
    """

    check: CheckName
    subject: str
    expected: str
    observed: str
    ok: bool

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class KeptTensor:
    """What the contract saw for one kept tensor."""

    fqn: str
    entry: str
    list_kind: str
    stored: str
    materialized: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ContractReport:
    """Everything :func:`assert_fp32_keep_contract` checked, passed or not.

    Attributes:
        model_name: the model's class name.
        dtype: the low-precision dtype.
        context: ``"autocast"`` or ``"direct"``, with forward prefetch on or off.
        kept: one row per kept tensor name.
        findings: every observation, passing ones included.
        notes: context a reader needs (e.g. the control run's gradient error).
    """

    model_name: str
    dtype: torch.dtype
    context: str
    kept: tuple[KeptTensor, ...]
    findings: tuple[Finding, ...]
    notes: tuple[str, ...] = ()

    @property
    def failures(self) -> tuple[Finding, ...]:
        """The findings that break the contract."""
        return tuple(f for f in self.findings if not f.ok)

    @property
    def ok(self) -> bool:
        """True when every finding passed."""
        return not self.failures

    def status(self) -> dict[CheckName, bool]:
        """Per contract item: passed (True) or not."""
        return {check: all(f.ok for f in self.findings if f.check == check) for check in CHECKS}

    def table(self, *, failures_only: bool = False) -> str:
        """A readable text table of the findings."""
        rows = [f for f in self.findings if not (failures_only and f.ok)]
        header = ("check", "subject", "expected", "observed", "")
        cells = [header] + [
            (f.check, f.subject, f.expected, f.observed, "ok" if f.ok else "FAIL") for f in rows
        ]
        widths = [min(max(len(row[i]) for row in cells), 70) for i in range(len(header))]
        lines = [
            "  ".join(cell[:70].ljust(width) for cell, width in zip(row, widths, strict=True))
            for row in cells
        ]
        return "\n".join(lines)

    def summary(self) -> str:
        """One line per contract item, then the kept tensors."""
        lines = [
            f"FP32-keep contract for {self.model_name} at {dtype_name(self.dtype)} ({self.context})"
        ]
        for check, passed in self.status().items():
            count = sum(1 for f in self.findings if f.check == check)
            lines.append(f"  {check:<12} {'pass' if passed else 'FAIL'} ({count} observations)")
        for row in self.kept:
            lines.append(
                f"  kept {row.fqn} [{row.list_kind} {row.entry!r}] stored {row.stored}, "
                f"all-gathered {row.materialized}"
            )
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form."""
        return {
            "model": self.model_name,
            "dtype": dtype_name(self.dtype),
            "context": self.context,
            "ok": self.ok,
            "status": self.status(),
            "kept": [row.to_dict() for row in self.kept],
            "findings": [f.to_dict() for f in self.findings],
            "notes": list(self.notes),
        }

    def to_json(self) -> str:
        """The report as JSON."""
        return json.dumps(self.to_dict(), indent=2)


class ContractViolation(AssertionError):
    """The FP32-keep contract does not hold; ``report`` holds every finding."""

    def __init__(self, report: ContractReport) -> None:
        self.report = report
        failed = sorted({f.check for f in report.failures}, key=CHECKS.index)
        super().__init__(
            f"FP32-keep contract broken for {report.model_name} at {dtype_name(report.dtype)} "
            f"({report.context}): {', '.join(failed)}\n" + report.table(failures_only=True)
        )


# --- running the two models ----------------------------------------------------------------


def _device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, Mapping):
        return {key: _to_device(item, device) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(item, device) for item in value)
    return value


def _call(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, tuple):
        return model(*batch)
    return model(batch)


def _first_floating(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    if isinstance(value, Mapping):
        items: Iterable[Any] = value.values()
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        return None
    for item in items:
        found = _first_floating(item)
        if found is not None:
            return found
    return None


def _logits_and_loss(
    output: Any, loss_fn: Callable[[Any], torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor):
        logits = _first_floating(output)
    if logits is None:
        raise TypeError("the model returned no floating tensor; pass loss_fn=")
    if loss_fn is not None:
        return logits, loss_fn(output)
    loss: object = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return logits, loss
    return logits, logits.float().square().mean()


def _set_prefetch(model: nn.Module, enabled: bool) -> None:
    # Explicit prefetching: each unit all-gathers the next one during its forward (and the
    # previous one during backward), in module order, which is forward order for these models.
    units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    if not enabled:
        return
    for index, unit in enumerate(units):
        if index + 1 < len(units):
            unit.set_modules_to_forward_prefetch([units[index + 1]])
        if index > 0:
            unit.set_modules_to_backward_prefetch([units[index - 1]])


@contextlib.contextmanager
def _context(autocast: bool, device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    if autocast:
        with torch.autocast(device.type, dtype=dtype):
            yield
    else:
        yield


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _describe_context(autocast: bool, forward_prefetch: bool) -> str:
    mode = "autocast" if autocast else "direct"
    return f"{mode}, forward prefetch {'on' if forward_prefetch else 'off'}"


def _relative_error(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest gradient difference relative to the gradient's own scale.

    Scale-relative rather than per-element or per-ulp: near-zero elements would inflate a
    per-element ratio, and counting ulps would punish an FP32 gradient (kept) against a bf16 one
    (the control) for its finer grid.
    """
    if observed.shape != expected.shape:
        return float("inf")
    if not expected.numel():
        return 0.0
    scale = float(expected.double().abs().max())
    diff = float((observed.double() - expected.double()).abs().max())
    return diff / scale if scale else diff


@dataclasses.dataclass
class _Run:
    logits: torch.Tensor
    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    probe: DtypeProbe


def _forward_backward(
    model: nn.Module,
    batch: Any,
    *,
    autocast: bool,
    device: torch.device,
    dtype: torch.dtype,
    loss_fn: Callable[[Any], torch.Tensor] | None,
) -> _Run:
    probe = DtypeProbe(model, record_grads=False)
    with probe:
        with _context(autocast, device, dtype):
            output = _call(model, batch)
            logits, loss = _logits_and_loss(output, loss_fn)
        loss.backward()  # type: ignore[no-untyped-call]
    grads = {
        name: (None if param.grad is None else _full(param.grad).detach())
        for name, param in model.named_parameters()
    }
    return _Run(logits.detach(), loss.detach(), grads, probe)


# --- the contract items --------------------------------------------------------------------


def _stored(model: nn.Module, reference: nn.Module, plan: KeepPlan) -> list[Finding]:
    findings: list[Finding] = []
    expected: dict[str, torch.Tensor] = dict(reference.named_parameters(remove_duplicate=False))
    expected.update(reference.named_buffers(remove_duplicate=False))
    observed: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    observed.update(model.named_buffers(remove_duplicate=False))
    for name, tensor in observed.items():
        if not tensor.is_floating_point():
            continue
        want = torch.float32 if name in plan else expected[name].dtype
        got = _local(tensor).dtype
        if name in plan or got != want:
            findings.append(Finding("stored", name, dtype_name(want), dtype_name(got), got == want))
    return findings


def _materialized(
    probe: DtypeProbe, model: nn.Module, plan: KeepPlan, policy: MixedPrecisionPolicy
) -> tuple[list[Finding], dict[str, str]]:
    findings: list[Finding] = []
    seen: dict[str, str] = {}
    storage = {name: _local(p).dtype for name, p in model.named_parameters(remove_duplicate=False)}
    for record in probe.param_records:
        name = f"{record.fqn}.{record.name}" if record.fqn else record.name
        if name not in storage or not record.dtype.is_floating_point:
            continue
        if name in plan:
            want = torch.float32
        elif policy.param_dtype is not None:
            want = policy.param_dtype  # exactly what plain FSDP2 gives the rest
        else:
            want = storage[name]
        seen.setdefault(name, dtype_name(record.dtype))
        if name in plan or record.dtype != want:
            findings.append(
                Finding(
                    "materialized",
                    f"{name} (call {record.call})",
                    dtype_name(want),
                    dtype_name(record.dtype) + (" (still sharded)" if record.sharded else ""),
                    record.dtype == want and not record.sharded,
                )
            )
    return findings, seen


def _kept_modules(model: nn.Module, plan: KeepPlan) -> list[str]:
    """Modules whose own floating parameters or buffers are all kept, and their descendants."""
    kept: list[str] = []
    for fqn, module in model.named_modules():
        own = [
            f"{fqn}.{name}" if fqn else name
            for name, tensor in [
                *module.named_parameters(recurse=False),
                *module.named_buffers(recurse=False),
            ]
            if tensor.is_floating_point()
        ]
        inside = any(fqn.startswith(k + ".") for k in kept if k)
        if inside or (own and all(name in plan for name in own)):
            kept.append(fqn)
    return kept


def _boundary(
    reference: DtypeProbe, observed: DtypeProbe, modules: list[str] | None
) -> list[Finding]:
    findings = [
        Finding(
            "boundary",
            f"{m.fqn or '<root>'} call {m.call} {m.direction} {m.path}",
            dtype_name(m.expected) if m.expected is not None else "absent",
            dtype_name(m.observed) if m.observed is not None else "absent",
            False,
        )
        for m in diff_boundaries(reference, observed, modules=modules)
    ]
    compared = modules if modules is not None else list(reference.modules)
    for fqn in compared:
        if not findings and reference.calls(fqn):
            inputs = reference.boundary_dtypes(fqn).inputs
            shown = ", ".join(f"{p}={dtype_name(d)}" for p, d in inputs.items()) or "-"
            findings.append(Finding("boundary", fqn or "<root>", shown, shown, True))
    return findings


def _operators(reference: DtypeProbe, observed: DtypeProbe, modules: list[str]) -> list[Finding]:
    findings: list[Finding] = []
    for fqn in modules:
        for call in range(min(reference.calls(fqn), observed.calls(fqn))):
            want = reference.op_dtypes(fqn, call)
            got = observed.op_dtypes(fqn, call)
            text_want = "; ".join(
                f"{o.op}->{','.join(dtype_name(d) for d in o.outputs)}" for o in want
            )
            text_got = "; ".join(
                f"{o.op}->{','.join(dtype_name(d) for d in o.outputs)}" for o in got
            )
            findings.append(
                Finding(
                    "operators",
                    f"{fqn} call {call}",
                    text_want or "-",
                    text_got or "-",
                    want == got,
                )
            )
    return findings


def _parity(observed: _Run, reference: _Run) -> tuple[list[Finding], list[str]]:
    findings = [
        Finding(
            "parity",
            "logits",
            f"{dtype_name(reference.logits.dtype)} bit-identical",
            "bit-identical"
            if torch.equal(observed.logits, reference.logits)
            else f"max |diff| {_max_diff(observed.logits, reference.logits):.3g}",
            torch.equal(observed.logits, reference.logits),
        ),
        Finding(
            "parity",
            "loss",
            f"{reference.loss.item():.6g}",
            f"{observed.loss.item():.6g}",
            torch.equal(observed.loss, reference.loss),
        ),
    ]
    off: list[str] = []
    for name, want in reference.grads.items():
        got = observed.grads.get(name)
        if want is None or got is None:
            if (want is None) != (got is None):
                findings.append(
                    Finding(
                        "parity", f"grad {name}", str(want is not None), str(got is not None), False
                    )
                )
            continue
        if got.dtype != want.dtype:
            findings.append(
                Finding(
                    "parity", f"grad {name}", dtype_name(want.dtype), dtype_name(got.dtype), False
                )
            )
        elif not torch.equal(got, want):
            off.append(name)
    return findings, off


def _control_error(
    model_factory: Callable[[], nn.Module],
    batch: Any,
    *,
    mesh: DeviceMesh,
    dtype: torch.dtype,
    policy: MixedPrecisionPolicy,
    wrap: WrapSpec | None,
    autocast: bool,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    seed: int,
) -> list[float]:
    """How far each gradient of plain FSDP2 (nothing kept, same policy) lands from its own
    unsharded reference, relative to the gradient's scale."""
    device = _device(mesh)
    with seeded(seed):
        model = model_factory().to(device=device, dtype=dtype)
    reference = build_unsharded_reference(model)
    # With nothing kept, apply_fsdp2 is plain FSDP2 over the same units.
    nothing_kept = fp32keep.resolve_keep_plan(model, torch.float32)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=policy, plan=nothing_kept, wrap=wrap)
    observed = _forward_backward(
        model, batch, autocast=autocast, device=device, dtype=dtype, loss_fn=loss_fn
    )
    expected = _forward_backward(
        reference, batch, autocast=autocast, device=device, dtype=dtype, loss_fn=loss_fn
    )
    errors: list[float] = []
    for name, want in expected.grads.items():
        got = observed.grads.get(name)
        if want is not None and got is not None:
            errors.append(_relative_error(got, want))
    return errors


def gradient_bound(
    control: Sequence[float] | str, dtype: torch.dtype
) -> tuple[float, list[Finding], list[str]]:
    """How far keep-aware gradients may be from the unsharded model's, given the control.

    ``control`` is how far each gradient of plain FSDP2 with nothing kept lands from its own
    unsharded reference (relative), or why it could not run. Plain FSDP2 bit-identical: any
    difference is ours (bound 0). Off by noise: both runs carry accumulation-order noise, bounded
    by the larger of plain FSDP2's worst gradient and ``GRADIENT_NOISE_ULPS`` roundoffs of
    ``dtype``. A control that failed, or whose median gradient is off by more than
    :data:`CONTROL_ERROR_LIMIT`, is itself a finding (the installed torch's FSDP2 does not
    reproduce the model on this backend), and the bound stays at the roundoff one.

    Returns:
        the bound, findings about the control, notes for the report.
    """
    roundoff = GRADIENT_NOISE_ULPS * torch.finfo(dtype).eps
    if isinstance(control, str):
        observed = control
    else:
        worst, typical = max(control, default=0.0), statistics.median(control or [0.0])
        if typical <= CONTROL_ERROR_LIMIT:
            bound = max(worst, roundoff) if worst else 0.0
            note = f"plain FSDP2 with nothing kept: at most {worst:.3g} (median {typical:.3g})"
            return bound, [], [note + " from its reference"]
        observed = f"median {typical:.3g} relative over {len(control)} gradients"
    finding = Finding(
        "parity",
        "plain FSDP2 control (nothing kept)",
        f"median <= {CONTROL_ERROR_LIMIT:g} relative to the unsharded model",
        observed,
        False,
    )
    note = (
        "plain FSDP2 with nothing kept does not reproduce the unsharded model here "
        f"({observed}): the installed torch's FSDP2 is wrong for this model or backend (torch "
        "2.7 on gloo, for one, sums gradients over the ranks instead of averaging them), so "
        f"gradient parity is judged against roundoff alone ({roundoff:.3g})."
    )
    return roundoff, [finding], [note]


def _round_trip(
    model: nn.Module, pristine: Mapping[str, torch.Tensor], dtype: torch.dtype, load: LoadFn
) -> list[Finding]:
    # A low-precision checkpoint: kept tensors arrive in `dtype` and must land in FP32.
    checkpoint = {name: t.to(dtype) if t.is_floating_point() else t for name, t in pristine.items()}
    destination = {name: _local(t).dtype for name, t in model.state_dict().items()}
    load(model, checkpoint if dist.get_rank() == 0 else None)
    gathered = fp32keep.gather_full_state_dict(model)
    findings: list[Finding] = []
    for name, want_dtype in destination.items():
        got = gathered.get(name)
        if got is None:
            findings.append(Finding("round trip", name, dtype_name(want_dtype), "missing", False))
            continue
        expected = checkpoint[name].to(want_dtype)
        exact = got.dtype == want_dtype and torch.equal(got.cpu(), expected.cpu())
        observed = dtype_name(got.dtype) + (
            "" if exact or got.dtype != want_dtype else " (values differ)"
        )
        findings.append(Finding("round trip", name, dtype_name(want_dtype), observed, exact))
    return findings


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
    cast: CastFn = _default_cast,
    shard: ShardFn = _default_shard,
    load: LoadFn = _default_load,
) -> ContractReport:
    """Check the FP32-keep contract for one model; call it in every rank of ``mesh``.

    Args:
        model_factory: builds the model (FP32, unsharded) from scratch; called under ``seed``.
        batch_factory: builds one batch from the (unsharded, FP32) model, e.g. reading its
            config: a mapping of keyword arguments, a tuple of positional arguments, or one
            tensor. Every rank must build the same batch.
        mesh: the 1-D data-parallel mesh (the ``fsdp2_mesh`` fixture).
        dtype: the low-precision dtype: storage dtype of the tensors that are not kept.
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
        cast, shard, load: the implementation under test; default: ``fp32keep``'s.

    Returns:
        The :class:`ContractReport` (every finding, passing ones included).

    Raises:
        ContractViolation: an ``AssertionError`` whose message is a table of what broke, for
            which tensor, expected against observed.
    """
    device = _device(mesh)
    policy = mp_policy or MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    with seeded(seed):
        model = model_factory().to(device)
    pristine = {name: t.detach().clone() for name, t in model.state_dict().items()}
    plan = fp32keep.resolve_keep_plan(model, dtype)
    reference = build_unsharded_reference(model)
    fp32keep.keep_aware_cast(reference, dtype, plan=plan)  # the oracle is always cast correctly
    cast(model, dtype, plan)
    shard(model, mesh=mesh, mp_policy=policy, plan=plan, wrap=wrap)
    _set_prefetch(model, forward_prefetch)

    batch = _to_device(batch_factory(reference), device)
    findings = _stored(model, reference, plan)
    observed = _forward_backward(
        model, batch, autocast=autocast, device=device, dtype=dtype, loss_fn=loss_fn
    )
    expected = _forward_backward(
        reference, batch, autocast=autocast, device=device, dtype=dtype, loss_fn=loss_fn
    )

    materialized, seen = _materialized(observed.probe, model, plan, policy)
    findings += materialized
    kept_modules = _kept_modules(reference, plan)
    findings += _boundary(
        expected.probe, observed.probe, None if not policy.cast_forward_inputs else kept_modules
    )
    findings += _operators(expected.probe, observed.probe, kept_modules)
    parity, off = _parity(observed, expected)
    findings += parity
    notes: list[str] = []
    if off:
        keep_error = max(_relative_error(observed.grads[n], expected.grads[n]) for n in off)  # type: ignore[arg-type]
        control: list[float] | str
        try:
            control = _control_error(
                model_factory,
                batch,
                mesh=mesh,
                dtype=dtype,
                policy=policy,
                wrap=wrap,
                autocast=autocast,
                loss_fn=loss_fn,
                seed=seed,
            )
        except Exception as exc:  # a diagnostic: its failure is reported, not raised
            control = f"{type(exc).__name__}: {exc}"
        bound, control_findings, control_notes = gradient_bound(control, dtype)
        findings += control_findings
        notes += control_notes
        notes.append(
            f"{len(off)} gradient(s) not bit-identical: at most {keep_error:.3g} (relative to the "
            f"gradient's scale) from the reference; bound {bound:.3g}"
        )
        for name in off:
            error = _relative_error(observed.grads[name], expected.grads[name])  # type: ignore[arg-type]
            findings.append(
                Finding(
                    "parity",
                    f"grad {name}",
                    f"<= {bound:.3g} relative",
                    f"{error:.3g} relative",
                    error <= bound,
                )
            )
    else:
        findings.append(Finding("parity", "every gradient", "bit-identical", "bit-identical", True))
    if check_state_dict:
        findings += _round_trip(model, pristine, dtype, load)

    kept_rows = tuple(
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
    report = ContractReport(
        model_name=type(reference).__name__,
        dtype=dtype,
        context=_describe_context(autocast, forward_prefetch),
        kept=kept_rows,
        findings=tuple(findings),
        notes=tuple(notes),
    )
    if not report.ok:
        raise ContractViolation(report)
    return report
