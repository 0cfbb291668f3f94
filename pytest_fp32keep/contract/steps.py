"""The steps the contract runs: the implementation under test, and one forward and backward.

It owns the pluggable implementation (:class:`CastFn`, :class:`ShardFn`, :class:`LoadFn` and
their ``fp32keep`` defaults), the device helpers (the mesh's device, moving a batch, a DTensor's
local shard or full tensor), FSDP2 prefetching, the forward context (autocast or direct) and
:class:`Pass` (one model's forward and backward on one batch under a :class:`DtypeProbe`, as two
steps) and :func:`forward_backward` (both at once), which give the :class:`Run` the checks
compare.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import fp32keep
from fp32keep import KeepPlan, WrapSpec
from pytest_fp32keep.contract.determinism import cublas_alert, deterministic
from pytest_fp32keep.contract.probe import DtypeProbe

# --- the implementation under test -----------------------------------------------------------


class CastFn(Protocol):
    """Casts a model for low-precision training in place (the default: keep-aware)."""

    def __call__(self, model: nn.Module, dtype: torch.dtype, plan: KeepPlan) -> object: ...


class ShardFn(Protocol):
    """Shards a model with FSDP2 in place (the default: :func:`fp32keep.apply_fsdp2`).

    A function that also takes an ``observed`` keyword gets what the reference's forward used
    (a :class:`fp32keep.ParameterUse`, or ``None`` where nothing was observed): see
    :func:`accepts_observed`.
    """

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


def default_cast(model: nn.Module, dtype: torch.dtype, plan: KeepPlan) -> object:
    """``fp32keep``'s keep-aware cast."""
    return fp32keep.keep_aware_cast(model, dtype, plan=plan)


def master_cast(model: nn.Module, dtype: torch.dtype, plan: KeepPlan) -> object:
    """``fp32keep``'s cast for FP32 master weights: keep-aware, then every trainable parameter
    upcast to FP32 (:func:`fp32keep.upcast_to_fp32_master`); the policy's ``param_dtype`` casts
    for compute. The default under ``master_dtype=torch.float32``."""
    fp32keep.keep_aware_cast(model, dtype, plan=plan)
    return fp32keep.upcast_to_fp32_master(model)


def default_shard(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    plan: KeepPlan,
    wrap: WrapSpec | None,
    observed: fp32keep.ParameterUse | None = None,
) -> object:
    """``fp32keep``'s keep-aware FSDP2 wrapping, laid out from what the reference's forward used
    (``observed``) where that was observed."""
    return fp32keep.apply_fsdp2(
        model, mesh=mesh, mp_policy=mp_policy, plan=plan, wrap=wrap, observed=observed
    )


def accepts_observed(shard: Callable[..., object]) -> bool:
    """Whether ``shard`` names an ``observed`` parameter (``default_shard``, a
    ``functools.partial`` of :func:`fp32keep.apply_fsdp2`): the contract passes it the
    observation then, and leaves any other function's signature alone."""
    try:
        parameters = inspect.signature(shard).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False
    found = parameters.get("observed")
    return found is not None and found.kind in (found.KEYWORD_ONLY, found.POSITIONAL_OR_KEYWORD)


def default_load(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None) -> object:
    """``fp32keep``'s full-state-dict loader."""
    return fp32keep.load_full_state_dict(model, state_dict)


# --- devices and tensors -----------------------------------------------------------------------


def validate_mesh(mesh: object) -> DeviceMesh:
    """``mesh`` if FSDP2 can shard on it: a ``DeviceMesh`` of one dimension (FSDP) or two
    (HSDP: replicate x shard); else a ``TypeError`` or ``ValueError`` naming it and the fix.

    Refused here, before anything is built, because the control shards on the same mesh: a
    mesh FSDP2 cannot use is the caller's, never a ``crashed shard`` row blamed on the
    implementation."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"assert_fp32_keep_contract(mesh={mesh!r}): expected a torch DeviceMesh over the "
            "data-parallel ranks (the fsdp2_mesh fixture, or init_device_mesh(...))"
        )
    if mesh.ndim not in (1, 2):
        names = f" named {mesh.mesh_dim_names}" if mesh.mesh_dim_names else ""
        raise ValueError(
            f"assert_fp32_keep_contract(mesh=...): got a {mesh.ndim}-D mesh of shape "
            f"{tuple(mesh.shape)}{names}; FSDP2 shards on a 1-D mesh (FSDP) or a 2-D one (HSDP: "
            "replicate x shard): pass the data-parallel sub-mesh, e.g. mesh['dp_shard'] or "
            "mesh['dp_replicate', 'dp_shard']"
        )
    return mesh


def device_of(mesh: DeviceMesh) -> torch.device:
    """This rank's device in ``mesh``."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` (a tensor, or mappings, lists and tuples of them) moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, Mapping):
        return {key: to_device(item, device) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(item, device) for item in value)
    return value


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; any other tensor as is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered in full; any other tensor as is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


# --- running one model -------------------------------------------------------------------------


def set_prefetch(model: nn.Module, enabled: bool) -> None:
    """Turn on explicit forward and backward prefetching between the FSDP2 units of ``model``."""
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


def describe_context(autocast: bool, forward_prefetch: bool) -> str:
    """The run context as the report names it."""
    mode = "autocast" if autocast else "direct"
    return f"{mode}, forward prefetch {'on' if forward_prefetch else 'off'}"


@contextlib.contextmanager
def _context(autocast: bool, device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    if autocast:
        with torch.autocast(device.type, dtype=dtype):
            yield
    else:
        yield


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


def logits_and_loss(
    output: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output's logits (its ``logits``, else its first floating tensor) and the loss the
    backward starts from: ``loss_fn(output)``, else the output's ``loss``, else the mean square
    of the logits (a model without labels, or without a loss at all; the square, because the
    plain mean of a softmax output is a constant, whose gradient is zero)."""
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


@dataclasses.dataclass
class Run:
    """What one forward and backward produced, the dtypes it recorded, and the operators torch
    said it has no deterministic implementation of (:mod:`.determinism`)."""

    logits: torch.Tensor
    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    probe: DtypeProbe
    alerts: tuple[str, ...] = ()


class NonFiniteReference(ArithmeticError):
    """The unsharded reference itself computed a NaN or an infinity: nothing can be judged
    against it (the model overflows or divides by zero at this dtype, with these weights and
    this batch, before FSDP2 runs anything)."""


def non_finite(run: Run) -> str | None:
    """What of ``run`` holds a NaN or an infinity: the loss, the logits, then the gradients by
    name (the first, and how many more); ``None`` when every one is finite."""
    named = [("loss", run.loss), ("logits", run.logits)]
    grads = sorted(run.grads.items())
    named += [(f"grad {name}", grad) for name, grad in grads if grad is not None]
    bad = [
        (name, "NaN" if bool(torch.isnan(tensor).any()) else "inf")
        for name, tensor in named
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())
    ]
    if not bad:
        return None
    (name, what), more = bad[0], len(bad) - 1
    return f"{name} holds {what}" + (f" (and {more} more tensors)" if more else "")


def finite_reference(run: Run, dtype: torch.dtype) -> Run:
    """``run`` of the unsharded reference, or :class:`NonFiniteReference` naming what of it is
    not finite: a NaN reference would turn every parity row into a false failure of the model
    under test, so it is a crash of the reference and nothing is judged against it."""
    problem = non_finite(run)
    if problem is not None:
        raise NonFiniteReference(
            f"{problem} in {dtype} in the unsharded reference (cast keep-aware, no FSDP2): "
            "nothing can be judged against it; the model overflows or divides by zero at this "
            "dtype with these weights and this batch"
        )
    return run


class Pass:
    """One forward and backward of ``model`` on ``batch`` under a dtype probe, as two steps.

    The contract agrees across ranks between :meth:`forward` and :meth:`backward`, so that a
    crash in either is named as that step; :meth:`observe` runs an observed forward of its own
    first, for the reference. The probe stays attached from the start of the forward to the end
    of the backward (or to the crash that ends either). Both run with torch's deterministic
    algorithms on (:func:`~.determinism.deterministic`), the caller's setting restored after
    each.
    """

    def __init__(
        self,
        model: nn.Module,
        batch: Any,
        *,
        autocast: bool,
        device: torch.device,
        dtype: torch.dtype,
        loss_fn: Callable[[Any], torch.Tensor] | None,
    ) -> None:
        self.model, self.batch = model, batch
        self._autocast, self._device, self._dtype, self._loss_fn = autocast, device, dtype, loss_fn
        self.probe = DtypeProbe(model, record_grads=False)
        self._logits: torch.Tensor | None = None
        self._loss: torch.Tensor | None = None
        self._alerts: list[str] = []
        alert = cublas_alert(device)
        if alert is not None:
            self._alerts.append(alert)

    def observe(self) -> fp32keep.ParameterUse:
        """What a forward of the model (and its loss) uses, and where
        (:func:`fp32keep.observe_parameter_use`): a forward of its own, before :meth:`forward`,
        its output dropped and the random generators put back, so that the forward the checks
        compare runs as if it had not happened (autocast's weight cache, off while observing,
        changes how a weight used twice sums its gradient)."""
        python_state = random.getstate()
        cuda = [torch.cuda.current_device()] if self._device.type == "cuda" else []
        with (
            torch.random.fork_rng(devices=cuda),
            fp32keep.observe_parameter_use(self.model) as used,
            _context(self._autocast, self._device, self._dtype),
        ):
            logits_and_loss(_call(self.model, self.batch), self._loss_fn)
        random.setstate(python_state)
        return used

    def forward(self) -> None:
        """Run the forward and compute the loss (the probe attached)."""
        self.probe.attach()
        try:
            with (
                deterministic(self._alerts),
                _context(self._autocast, self._device, self._dtype),
            ):
                output = _call(self.model, self.batch)
                self._logits, self._loss = logits_and_loss(output, self._loss_fn)
        except BaseException:
            self.probe.detach()
            raise

    def backward(self) -> Run:
        """Run the backward from the loss; the probe is detached after it, crash or not."""
        if self._logits is None or self._loss is None:
            raise RuntimeError("Pass.backward() before a forward() that completed")
        try:
            # a frozen model (a reference or teacher model) has nothing to differentiate: its
            # run is forward only, every gradient None
            if self._loss.requires_grad:
                with deterministic(self._alerts):
                    self._loss.backward()  # type: ignore[no-untyped-call]
        finally:
            self.probe.detach()
        grads = {
            name: (None if param.grad is None else full(param.grad).detach())
            for name, param in self.model.named_parameters()
        }
        return Run(
            self._logits.detach(), self._loss.detach(), grads, self.probe, tuple(self._alerts)
        )


def forward_backward(
    model: nn.Module,
    batch: Any,
    *,
    autocast: bool,
    device: torch.device,
    dtype: torch.dtype,
    loss_fn: Callable[[Any], torch.Tensor] | None,
) -> Run:
    """Run ``model`` forward on ``batch`` and backward from its loss, under a dtype probe."""
    run = Pass(model, batch, autocast=autocast, device=device, dtype=dtype, loss_fn=loss_fn)
    run.forward()
    return run.backward()
