"""Record what dtypes a model really uses, per module and per forward call.

Three questions are easy to confuse when checking FP32-keep parameters under FSDP2, and
:class:`DtypeProbe` answers each one separately:

1. **Activation boundary** (:class:`BoundaryRecord`): the dtypes of the floating tensors a module's
   ``forward`` receives and the dtypes its caller receives back.
2. **Materialised parameters** (:class:`MaterializedParamRecord`): the dtype and shape of each of
   the module's own parameters as they are while ``forward`` runs, i.e. what FSDP2 all-gathered
   (``param_dtype``), not the sharded storage.
3. **Operators** (:class:`OpRecord`): the aten operators executed while the module is the
   innermost probed module on the stack, with the dtypes of their floating inputs and results.

and optionally a fourth, 4. **gradients** (:class:`GradRecord`): the dtype of the gradient autograd
computes for each materialised parameter.

They differ in practice, which is the point: an "Inkling-style" module that stores an FP32 weight,
receives a bf16 activation, upcasts it, computes in FP32 and casts back has a bf16 boundary, FP32
parameters and FP32 operators. Reading ``module.weight.dtype`` (observation 2) says nothing about
the activation boundary (1) or about the dtype an operator ran in (3); the first version of
verl PR 7165 went wrong exactly there: a weight-dtype hook, taken as evidence of the compute
dtype, could not see that ``param_dtype=torch.float32`` turned the unit's bf16 boundary FP32.

Where each observation is taken, and why
----------------------------------------
``torch.nn.Module.__call__`` runs, in order: global forward pre-hooks, the module's forward
pre-hooks, ``forward``, global forward hooks, the module's forward hooks. FSDP2 registers its
pre-forward hook (unshard + ``cast_forward_inputs``) with ``prepend=True`` and its post-forward
hook (reshard + ``output_dtype`` cast) with ``prepend=False``
(``torch/distributed/fsdp/_fully_shard/_fsdp_state.py``, ``FSDPState.init``).

* Inputs and materialised parameters are read in a forward pre-hook the probe registers without
  ``prepend``. FSDP2's prepended hook therefore runs first whether ``fully_shard`` was applied
  before or after the probe attached, so the probe sees the inputs after FSDP2's cast (what
  ``forward`` receives) and the parameters after the all-gather (unsharded, in ``param_dtype``).
  A non-FSDP pre-hook that rewrites inputs and is registered after the probe, without
  ``prepend``, runs after the probe and is not seen; attach the probe last in that case.
* Outputs are read in a forward hook (``always_call=True``) that the probe moves to the end of
  the module's forward hooks at every call, from its pre-hook (by removing and registering it
  again, with public API only). It runs after FSDP2's post-forward hook in both attach orders, so
  it sees the output after FSDP2's ``output_dtype`` cast, i.e. what the caller receives.
* Operators are recorded by a ``TorchDispatchMode`` entered when the outermost probed module is
  called and left when it returns. The module stack that attributes each operator is kept by the
  same hooks, plus a global forward pre-hook and a global forward hook (both always run before any
  module-level hook). This splits each call in two phases: ``"forward"`` (inside ``forward``
  proper) and ``"hooks"`` (inside the module's other forward pre/post-hooks, e.g. FSDP2's
  all-gather and its input and output casts). Operators of a child unit's FSDP2 hooks are thus
  attributed to that child's ``"hooks"`` phase rather than to the parent's forward.
* Autocast runs above Python dispatch, so the operators seen are those after autocast has
  rewritten them: under ``torch.autocast(dtype=torch.bfloat16)`` an ``nn.Linear`` with an FP32
  weight shows ``_to_copy`` operators and then an ``addmm``/``mm`` on bf16 tensors. That is the
  dtype the operator ran in, which is what observation 3 is for.
* Gradients (optional) come from ``Tensor.register_hook`` on each materialised parameter (for
  FSDP2 the unsharded parameter), i.e. the gradient dtype autograd computes before FSDP2 reduces
  it; ``.grad`` on the sharded parameter (``reduce_dtype``/storage dtype) is not this.

The probe never changes numerics: every hook returns ``None``, the dispatch mode only calls the
operator it intercepts, and nothing it does is visible to autograd.

Calls are counted per module from 0. Activation-checkpoint recomputation during backward is a
forward call too and gets the next index (non-reentrant checkpointing stops a recomputation
early by raising, which shows as ``completed=False``). A forward that raises is recorded with
``completed=False`` and no outputs.

Cost and limits: while attached, the probe's two global hooks put every module call in the
process on ``Module.__call__``'s hook path, and the dispatch mode makes every operator inside a
probed module pass through Python; fine for tests, not for benchmarks. Call stacks are kept per
thread. A module shared under two names is probed under its first name in ``named_modules()``.
Containers walked for tensors are mappings (including Hugging Face ``ModelOutput``), lists,
tuples, named tuples and dataclasses; other objects (e.g. a KV cache) are opaque. A deep copy of
a probed model carries inert copies of the hooks: the probe records only the modules it selected.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple, TypeAlias

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

__all__ = [
    "BoundaryDtypes",
    "BoundaryMismatch",
    "BoundaryRecord",
    "DtypeProbe",
    "GradRecord",
    "MaterializedParamRecord",
    "ModuleSelector",
    "OpDtypes",
    "OpRecord",
    "Phase",
    "TensorLeaf",
    "diff_boundaries",
    "dtype_name",
    "format_mismatches",
]

Phase: TypeAlias = Literal["forward", "hooks"]
"""``"forward"``: inside the module's ``forward``; ``"hooks"``: inside its other forward hooks."""

Direction: TypeAlias = Literal["input", "output"]

ModuleSelector: TypeAlias = Callable[[str, nn.Module], bool] | Iterable[str] | str | None
"""Which modules to probe: ``None`` (all), a predicate ``(fqn, module) -> bool``, or FQNs."""

_SHORT_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "fp64",
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
}

# Deeply nested structures are walked no further than this (cycles are cut separately).
_MAX_DEPTH = 32


def dtype_name(dtype: torch.dtype | None, *, short: bool = False) -> str:
    """Name a dtype for tables (``short=True``: ``"bf16"``) or JSON (``"bfloat16"``)."""
    if dtype is None:
        return "-"
    if short and dtype in _SHORT_DTYPE_NAMES:
        return _SHORT_DTYPE_NAMES[dtype]
    return str(dtype).removeprefix("torch.")


def _display_fqn(fqn: str) -> str:
    return fqn if fqn else "(root)"


# --------------------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True)
class TensorLeaf:
    """One floating tensor found in a (nested) structure.

    Attributes:
        path: where it was found, e.g. ``args[0]``, ``kwargs['position_embeddings'][1]``,
            ``output['logits']``.
        dtype: its dtype.
        shape: its (global, for a DTensor) shape.
    """

    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form."""
        return {"path": self.path, "dtype": dtype_name(self.dtype), "shape": list(self.shape)}


def _leaves_text(leaves: Sequence[TensorLeaf]) -> str:
    return " ".join(f"{leaf.path}={dtype_name(leaf.dtype, short=True)}" for leaf in leaves) or "-"


@dataclasses.dataclass(frozen=True)
class BoundaryRecord:
    """Observation 1: the activation dtypes at a module's boundary, for one forward call.

    Attributes:
        fqn: the module's fully qualified name (``""`` for the root).
        call: 0-based index of this forward call of this module since the probe was created or
            last cleared.
        module_type: the module's class name.
        inputs: floating tensors among the positional (``args[i]``) and keyword (``kwargs['k']``)
            arguments ``forward`` received, after every forward pre-hook that runs before the
            probe's (FSDP2's ``cast_forward_inputs`` included).
        outputs: floating tensors the caller received back, after FSDP2's ``output_dtype`` cast.
        completed: ``False`` when the forward raised; ``outputs`` is then empty.
    """

    fqn: str
    call: int
    module_type: str
    inputs: tuple[TensorLeaf, ...]
    outputs: tuple[TensorLeaf, ...]
    completed: bool = True

    @property
    def input_dtypes(self) -> dict[str, torch.dtype]:
        """Input dtype per leaf path."""
        return {leaf.path: leaf.dtype for leaf in self.inputs}

    @property
    def output_dtypes(self) -> dict[str, torch.dtype]:
        """Output dtype per leaf path."""
        return {leaf.path: leaf.dtype for leaf in self.outputs}

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form."""
        return {
            "fqn": self.fqn,
            "call": self.call,
            "module_type": self.module_type,
            "inputs": [leaf.to_dict() for leaf in self.inputs],
            "outputs": [leaf.to_dict() for leaf in self.outputs],
            "completed": self.completed,
        }


@dataclasses.dataclass(frozen=True)
class MaterializedParamRecord:
    """Observation 2: one of a module's own parameters as it is while ``forward`` runs.

    Attributes:
        fqn: the owning module's fully qualified name.
        call: the forward call index (see :class:`BoundaryRecord`).
        name: the parameter's attribute name on the module (``recurse=False``).
        dtype: the dtype ``forward`` sees: for FSDP2 the all-gathered (``param_dtype``) dtype.
        shape: the shape ``forward`` sees: for FSDP2 the unsharded shape.
        sharded: ``True`` if the parameter was still a ``DTensor`` at forward time, i.e. nothing
            unsharded it (it is then the sharded storage, not a materialised parameter).
    """

    fqn: str
    call: int
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    sharded: bool = False

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form."""
        return {
            "fqn": self.fqn,
            "call": self.call,
            "name": self.name,
            "dtype": dtype_name(self.dtype),
            "shape": list(self.shape),
            "sharded": self.sharded,
        }


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """Observation 3: one aten operator executed while a module was the innermost probed one.

    Attributes:
        fqn: the module the operator is attributed to.
        call: that module's forward call index.
        seq: the order in which the probe saw the operator (across all modules).
        op: the operator overload, e.g. ``"aten.mm.default"``, as it ran after autocast; any
            namespace (``fsdp.*``, ``c10d.*`` in FSDP2's hooks) except ``profiler`` markers.
        phase: ``"forward"`` inside ``forward``, ``"hooks"`` inside the module's other forward
            hooks (e.g. FSDP2's unshard and its input/output casts).
        inputs: floating tensors among the operator's arguments.
        outputs: floating tensors among its results.
    """

    fqn: str
    call: int
    seq: int
    op: str
    phase: Phase
    inputs: tuple[TensorLeaf, ...]
    outputs: tuple[TensorLeaf, ...]

    @property
    def input_dtypes(self) -> tuple[torch.dtype, ...]:
        """The floating input dtypes, in argument order."""
        return tuple(leaf.dtype for leaf in self.inputs)

    @property
    def output_dtypes(self) -> tuple[torch.dtype, ...]:
        """The floating result dtypes, in result order."""
        return tuple(leaf.dtype for leaf in self.outputs)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form."""
        return {
            "fqn": self.fqn,
            "call": self.call,
            "seq": self.seq,
            "op": self.op,
            "phase": self.phase,
            "inputs": [leaf.to_dict() for leaf in self.inputs],
            "outputs": [leaf.to_dict() for leaf in self.outputs],
        }


@dataclasses.dataclass(frozen=True)
class GradRecord:
    """Observation 4 (optional): the gradient autograd computed for a materialised parameter.

    Attributes:
        fqn: the owning module's fully qualified name.
        name: the parameter's attribute name on the module.
        seq: the order in which the probe saw the gradient.
        dtype: the gradient's dtype (for FSDP2: w.r.t. the unsharded parameter, before the
            reduce-scatter).
        shape: the gradient's shape.
    """

    fqn: str
    name: str
    seq: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form."""
        return {
            "fqn": self.fqn,
            "name": self.name,
            "seq": self.seq,
            "dtype": dtype_name(self.dtype),
            "shape": list(self.shape),
        }


class BoundaryDtypes(NamedTuple):
    """The boundary dtypes of one forward call: input and output dtype per leaf path."""

    inputs: dict[str, torch.dtype]
    outputs: dict[str, torch.dtype]


class OpDtypes(NamedTuple):
    """An operator with its floating input and result dtypes."""

    op: str
    inputs: tuple[torch.dtype, ...]
    outputs: tuple[torch.dtype, ...]


@dataclasses.dataclass(frozen=True)
class BoundaryMismatch:
    """A boundary dtype that differs between a reference and an observed run.

    Attributes:
        fqn: the module.
        call: the forward call index.
        direction: ``"input"`` or ``"output"``.
        path: the leaf path (see :class:`TensorLeaf`).
        expected: the reference's dtype, ``None`` if the reference had no such leaf.
        observed: the observed dtype, ``None`` if the observed run had no such leaf.
    """

    fqn: str
    call: int
    direction: Direction
    path: str
    expected: torch.dtype | None
    observed: torch.dtype | None

    def __str__(self) -> str:
        return (
            f"{_display_fqn(self.fqn)} call {self.call} {self.direction} {self.path}: "
            f"expected {dtype_name(self.expected)}, observed {dtype_name(self.observed)}"
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form (a missing dtype is ``None``)."""
        return {
            "fqn": self.fqn,
            "call": self.call,
            "direction": self.direction,
            "path": self.path,
            "expected": None if self.expected is None else dtype_name(self.expected),
            "observed": None if self.observed is None else dtype_name(self.observed),
        }


# --------------------------------------------------------------------------- walking


def _is_dtensor(tensor: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    # Imported here: torch.distributed.tensor is a heavy import a plain run does not need.
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _floating_leaves(obj: Any, path: str) -> list[TensorLeaf]:
    """Every floating tensor in ``obj`` with its path; only metadata is read, no tensor op."""
    found: list[TensorLeaf] = []
    on_path: set[int] = set()

    def walk(value: Any, where: str, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            # dtype.is_floating_point is metadata; Tensor.is_floating_point() could dispatch.
            if value.dtype.is_floating_point:
                found.append(TensorLeaf(where, value.dtype, tuple(value.shape)))
            return
        if depth >= _MAX_DEPTH or id(value) in on_path:
            return
        if isinstance(value, Mapping):
            children: Iterable[tuple[str, Any]] = (
                (f"{where}[{key!r}]", item) for key, item in value.items()
            )
        elif isinstance(value, tuple) and hasattr(value, "_fields"):
            children = ((f"{where}.{name}", getattr(value, name)) for name in value._fields)
        elif isinstance(value, (list, tuple)):
            children = ((f"{where}[{index}]", item) for index, item in enumerate(value))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            children = (
                (f"{where}.{field.name}", getattr(value, field.name, None))
                for field in dataclasses.fields(value)
            )
        else:
            return
        on_path.add(id(value))
        for child_path, child in children:
            walk(child, child_path, depth + 1)
        on_path.discard(id(value))

    walk(obj, path, 0)
    return found


def _call_leaves(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[TensorLeaf, ...]:
    leaves = _floating_leaves(tuple(args), "args")
    leaves += _floating_leaves(dict(kwargs), "kwargs")
    return tuple(leaves)


# --------------------------------------------------------------------------- op recording


class _Frame:
    """One active probed module call on a thread's stack."""

    __slots__ = ("call", "fqn", "inputs", "module", "phase")

    def __init__(self, module: nn.Module, fqn: str, call: int) -> None:
        self.module = module
        self.fqn = fqn
        self.call = call
        # "hooks" until the probe's pre-hook runs: FSDP2's prepended pre-hook runs in between.
        self.phase: Phase = "hooks"
        self.inputs: tuple[TensorLeaf, ...] = ()


# torch's TorchDispatchMode is untyped; the ignores below are about its signatures only.
class _OpRecorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """One dispatch mode per thread, shared by every probe that has a module call active.

    Sharing it (entered when the first probe becomes active on a thread, left when the last one
    becomes idle) keeps the mode stack strictly LIFO even when two probes watch the same module
    and their hooks interleave.
    """

    # Higher-order operators (e.g. flex attention) pass through as one recorded operator
    # instead of raising NotImplementedError under the mode.
    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.active: list[DtypeProbe] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        # The mode is popped while this runs, so the call below is exactly the operator
        # autograd and autocast asked for; recording reads metadata only.
        result = func(*args, **kwargs)
        for probe in tuple(self.active):
            probe._record_op(func, args, kwargs, result)
        return result


_thread_state = threading.local()


def _recorder() -> _OpRecorder:
    recorder: _OpRecorder | None = getattr(_thread_state, "recorder", None)
    if recorder is None:
        recorder = _OpRecorder()
        _thread_state.recorder = recorder
    return recorder


def _activate(probe: DtypeProbe) -> None:
    recorder = _recorder()
    if probe in recorder.active:
        return
    recorder.active.append(probe)
    if len(recorder.active) == 1:
        recorder.__enter__()  # type: ignore[no-untyped-call]


def _deactivate(probe: DtypeProbe) -> None:
    recorder = _recorder()
    if probe not in recorder.active:
        return
    recorder.active.remove(probe)
    if not recorder.active:
        recorder.__exit__(None, None, None)  # type: ignore[no-untyped-call]


# --------------------------------------------------------------------------- the probe


def _select_modules(model: nn.Module, modules: ModuleSelector) -> dict[nn.Module, str]:
    named = dict(model.named_modules())
    if modules is None:
        chosen = named
    elif callable(modules):
        predicate = modules
        chosen = {fqn: module for fqn, module in named.items() if predicate(fqn, module)}
    else:
        wanted = [modules] if isinstance(modules, str) else list(modules)
        unknown = [fqn for fqn in wanted if fqn not in named]
        if unknown:
            known = ", ".join(repr(fqn) for fqn in list(named)[:8])
            raise ValueError(
                f"DtypeProbe: {type(model).__name__} has no module named {unknown}; "
                f"names are FQNs from model.named_modules(), e.g. {known}"
            )
        chosen = {fqn: module for fqn, module in named.items() if fqn in wanted}
    if not chosen:
        raise ValueError(f"DtypeProbe: the module selector {modules!r} selects no module")
    return {module: fqn for fqn, module in chosen.items()}


class DtypeProbe:
    """Record boundary, materialised-parameter, operator and gradient dtypes of a model.

    Attach it to a plain ``nn.Module`` or a Hugging Face model, before or after
    ``fully_shard``, run forward (and backward), then read the records::

        with DtypeProbe(model, modules=["layers.0.mlp"]) as probe:
            loss = model(batch).sum()
            loss.backward()
        probe.boundary_dtypes("layers.0.mlp").inputs   # {"args[0]": torch.bfloat16}
        probe.materialized_dtypes("layers.0.mlp")      # {"weight": torch.float32, ...}
        probe.op_dtypes("layers.0.mlp")                # [OpDtypes("aten.mm.default", ...)]
        print(probe.summary())

    The module docstring explains where each observation is taken and why they must not be
    conflated. Records survive :meth:`detach`; :meth:`clear` drops them.

    Args:
        model: the model to observe.
        modules: which modules to probe: ``None`` for every module (the root is ``""``), a
            predicate ``(fqn, module) -> bool``, or an iterable of FQNs (a single string is one
            FQN). An unknown FQN or an empty selection raises ``ValueError``.
        record_ops: record operators (observation 3) through a ``TorchDispatchMode``.
        record_grads: record gradient dtypes (observation 4) through tensor hooks.
    """

    def __init__(
        self,
        model: nn.Module,
        modules: ModuleSelector = None,
        *,
        record_ops: bool = True,
        record_grads: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"DtypeProbe needs an nn.Module, got {type(model).__name__}")
        self._model_type = type(model).__name__
        self._fqn_of = _select_modules(model, modules)
        self._position = {fqn: index for index, fqn in enumerate(self._fqn_of.values())}
        self._record_ops = record_ops
        self._record_grads = record_grads
        self._pre_handles: dict[nn.Module, RemovableHandle] = {}
        self._post_handles: dict[nn.Module, RemovableHandle] = {}
        self._global_handles: list[RemovableHandle] = []
        self._grad_hooks: dict[tuple[str, str], tuple[weakref.ref[torch.Tensor], RemovableHandle]]
        self._grad_hooks = {}
        self._local = threading.local()
        self._lock = threading.Lock()
        self._attached = False
        self.clear()

    # ---- lifecycle

    def attach(self) -> DtypeProbe:
        """Register the hooks; returns ``self``. Attaching twice raises ``RuntimeError``."""
        if self._attached:
            raise RuntimeError("DtypeProbe is already attached")
        for module in self._fqn_of:
            self._pre_handles[module] = module.register_forward_pre_hook(
                self._on_pre_forward, with_kwargs=True
            )
            self._post_handles[module] = module.register_forward_hook(
                self._on_post_forward, always_call=True
            )
        self._global_handles = [
            nn.modules.module.register_module_forward_pre_hook(self._on_global_pre_forward),
            nn.modules.module.register_module_forward_hook(
                self._on_global_post_forward, always_call=True
            ),
        ]
        self._attached = True
        return self

    def detach(self) -> None:
        """Remove every hook the probe registered; the records stay. Idempotent."""
        handles = [
            *self._pre_handles.values(),
            *self._post_handles.values(),
            *self._global_handles,
            *(handle for _, handle in self._grad_hooks.values()),
        ]
        for handle in handles:
            handle.remove()
        self._pre_handles.clear()
        self._post_handles.clear()
        self._global_handles.clear()
        self._grad_hooks.clear()
        # A forward interrupted by a BaseException (Ctrl-C) skips the always-call hooks; do not
        # leave this thread's dispatch mode entered on its behalf.
        self._stack().clear()
        _deactivate(self)
        self._attached = False

    @property
    def attached(self) -> bool:
        """Whether the hooks are registered."""
        return self._attached

    def __enter__(self) -> DtypeProbe:
        return self.attach()

    def __exit__(self, *exc_info: object) -> None:
        self.detach()

    def __deepcopy__(self, memo: dict[int, Any]) -> DtypeProbe:
        # ``copy.deepcopy(model)`` copies the model's hook dicts, and with them the bound methods
        # of this probe. Sharing the probe makes those copied hooks inert (they ignore modules
        # the probe did not select) instead of feeding a silent copy of the probe.
        return self

    def clear(self) -> None:
        """Drop every record and restart call indices at 0."""
        self._boundaries: list[BoundaryRecord] = []
        self._params: list[MaterializedParamRecord] = []
        self._ops: list[OpRecord] = []
        self._grads: list[GradRecord] = []
        self._calls: Counter[str] = Counter()
        self._seq = 0

    # ---- hooks (each returns None: the probe never changes what the model computes)

    def _stack(self) -> list[_Frame]:
        stack: list[_Frame] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = []
            self._local.stack = stack
        return stack

    def _next_seq(self) -> int:
        with self._lock:
            self._seq += 1
            return self._seq - 1

    def _on_global_pre_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        fqn = self._fqn_of.get(module)
        if fqn is None:
            return
        with self._lock:
            call = self._calls[fqn]
            self._calls[fqn] += 1
        stack = self._stack()
        stack.append(_Frame(module, fqn, call))
        if self._record_ops:
            _activate(self)  # idempotent: only the outermost probed call enters the mode

    def _frame_of(self, module: nn.Module) -> _Frame | None:
        for frame in reversed(self._stack()):
            if frame.module is module:
                return frame
        return None

    def _on_pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        frame = self._frame_of(module)
        if frame is None:
            return
        frame.inputs = _call_leaves(args, kwargs)
        frame.phase = "forward"
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            self._params.append(
                MaterializedParamRecord(
                    fqn=frame.fqn,
                    call=frame.call,
                    name=name,
                    dtype=param.dtype,
                    shape=tuple(param.shape),
                    sharded=_is_dtensor(param),
                )
            )
            if self._record_grads and param.requires_grad:
                self._watch_grad(frame.fqn, name, param)
        # Move the output hook behind any forward hook registered since the last call (FSDP2's
        # post-forward hook when fully_shard ran after attach), so outputs are read after
        # FSDP2's output_dtype cast. Hooks for this call are collected only after forward.
        post = self._post_handles.get(module)
        if post is not None:
            post.remove()
            self._post_handles[module] = module.register_forward_hook(
                self._on_post_forward, always_call=True
            )

    def _on_global_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        frame = self._frame_of(module)
        if frame is not None:
            frame.phase = "hooks"

    def _on_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        stack = self._stack()
        frame = self._frame_of(module)
        if frame is None:
            return
        # Called from torch's exception path (always_call) when forward raised.
        raised = output is None and sys.exc_info()[1] is not None
        self._boundaries.append(
            BoundaryRecord(
                fqn=frame.fqn,
                call=frame.call,
                module_type=type(module).__name__,
                inputs=frame.inputs,
                outputs=() if raised else tuple(_floating_leaves(output, "output")),
                completed=not raised,
            )
        )
        # Frames above this one belong to calls that never reached their post-hook.
        del stack[stack.index(frame) :]
        if not stack:
            _deactivate(self)

    def _record_op(self, func: Any, args: Any, kwargs: Any, result: Any) -> None:
        stack = self._stack()
        # record_function markers (FSDP2 wraps its casts in them) carry no tensor data.
        if not stack or getattr(func, "namespace", None) == "profiler":
            return
        frame = stack[-1]
        self._ops.append(
            OpRecord(
                fqn=frame.fqn,
                call=frame.call,
                seq=self._next_seq(),
                op=str(func),
                phase=frame.phase,
                inputs=_call_leaves(args, kwargs),
                outputs=tuple(_floating_leaves(result, "result")),
            )
        )

    def _watch_grad(self, fqn: str, name: str, param: torch.Tensor) -> None:
        # One hook per parameter object: FSDP2 reuses its unsharded parameter across calls, and
        # a leaf's hook fires once per backward however many calls used it.
        watched = self._grad_hooks.get((fqn, name))
        if watched is not None:
            ref, handle = watched
            if ref() is param:
                return
            handle.remove()

        def on_grad(grad: torch.Tensor) -> None:
            self._grads.append(
                GradRecord(fqn, name, self._next_seq(), grad.dtype, tuple(grad.shape))
            )

        self._grad_hooks[(fqn, name)] = (weakref.ref(param), param.register_hook(on_grad))  # type: ignore[no-untyped-call]

    # ---- raw records

    @property
    def modules(self) -> tuple[str, ...]:
        """The probed FQNs, in ``named_modules()`` order."""
        return tuple(self._fqn_of.values())

    @property
    def boundary_records(self) -> tuple[BoundaryRecord, ...]:
        """Observation 1, in the order calls returned."""
        return tuple(self._boundaries)

    @property
    def param_records(self) -> tuple[MaterializedParamRecord, ...]:
        """Observation 2, in the order calls started."""
        return tuple(self._params)

    @property
    def op_records(self) -> tuple[OpRecord, ...]:
        """Observation 3, in execution order."""
        return tuple(self._ops)

    @property
    def grad_records(self) -> tuple[GradRecord, ...]:
        """Observation 4, in the order autograd produced the gradients."""
        return tuple(self._grads)

    def calls(self, fqn: str) -> int:
        """How many forward calls of ``fqn`` were seen."""
        self._check_fqn(fqn)
        return self._calls[fqn]

    # ---- per-module queries

    def _check_fqn(self, fqn: str) -> None:
        if fqn not in self._position:
            raise KeyError(f"DtypeProbe does not probe module {fqn!r}; it probes {self.modules}")

    def _resolve_call(self, fqn: str, call: int) -> int:
        self._check_fqn(fqn)
        count = self._calls[fqn]
        resolved = call + count if call < 0 else call
        if not 0 <= resolved < count:
            raise IndexError(
                f"module {_display_fqn(fqn)} has {count} recorded forward call(s); "
                f"call {call} does not exist"
            )
        return resolved

    def boundary(self, fqn: str, call: int = -1) -> BoundaryRecord:
        """The :class:`BoundaryRecord` of one call (``call=-1``: the latest, as in a list)."""
        resolved = self._resolve_call(fqn, call)
        for record in self._boundaries:
            if record.fqn == fqn and record.call == resolved:
                return record
        raise LookupError(f"call {resolved} of {_display_fqn(fqn)} has not returned yet")

    def boundary_dtypes(self, fqn: str, call: int = -1) -> BoundaryDtypes:
        """Observation 1 for one call: input and output dtype per leaf path."""
        record = self.boundary(fqn, call)
        return BoundaryDtypes(record.input_dtypes, record.output_dtypes)

    def materialized_dtypes(self, fqn: str, call: int = -1) -> dict[str, torch.dtype]:
        """Observation 2 for one call: the dtype of each own parameter as ``forward`` saw it."""
        resolved = self._resolve_call(fqn, call)
        return {r.name: r.dtype for r in self._params if r.fqn == fqn and r.call == resolved}

    def op_records_of(
        self, fqn: str, call: int = -1, *, phase: Phase | None = "forward"
    ) -> list[OpRecord]:
        """Observation 3 for one call, in execution order; ``phase=None`` gives both phases."""
        resolved = self._resolve_call(fqn, call)
        return [
            r
            for r in self._ops
            if r.fqn == fqn and r.call == resolved and (phase is None or r.phase == phase)
        ]

    def op_dtypes(
        self, fqn: str, call: int = -1, *, phase: Phase | None = "forward"
    ) -> list[OpDtypes]:
        """Observation 3 for one call as ``(op, input dtypes, output dtypes)`` tuples.

        By default only the ``"forward"`` phase: what the module's own code ran, not FSDP2's
        unshard and casts around it (``phase="hooks"``).
        """
        return [
            OpDtypes(r.op, r.input_dtypes, r.output_dtypes)
            for r in self.op_records_of(fqn, call, phase=phase)
        ]

    def grad_dtypes(self, fqn: str) -> dict[str, torch.dtype]:
        """Observation 4: the latest gradient dtype seen per own parameter of ``fqn``."""
        self._check_fqn(fqn)
        return {r.name: r.dtype for r in self._grads if r.fqn == fqn}

    # ---- reports

    def to_dict(self) -> dict[str, Any]:
        """Every record in a JSON-able form (``json.dumps`` works on it)."""
        return {
            "model_type": self._model_type,
            "modules": list(self.modules),
            "calls": {fqn: self._calls[fqn] for fqn in self.modules},
            "boundary": [r.to_dict() for r in self._boundaries],
            "materialized_params": [r.to_dict() for r in self._params],
            "ops": [r.to_dict() for r in self._ops],
            "grads": [r.to_dict() for r in self._grads],
        }

    def summary(self, *, only_called: bool = True) -> str:
        """One row per module call with all observations side by side, clearly separated.

        Columns: boundary inputs, boundary outputs, materialised parameters, and the forward
        operators grouped as ``op->result dtypes xcount``.
        """
        rows: list[list[str]] = []
        boundaries = sorted(self._boundaries, key=lambda r: (self._order(r.fqn), r.call))
        for record in boundaries:
            params = " ".join(
                f"{p.name}={dtype_name(p.dtype, short=True)}"
                for p in self._params
                if p.fqn == record.fqn and p.call == record.call
            )
            ops: Counter[str] = Counter()
            for op in self._ops:
                if op.fqn == record.fqn and op.call == record.call and op.phase == "forward":
                    name = op.op.removeprefix("aten.").removesuffix(".default")
                    dtypes = ",".join(dtype_name(d, short=True) for d in op.output_dtypes)
                    ops[f"{name}->{dtypes or '-'}"] += 1
            rows.append(
                [
                    _display_fqn(record.fqn),
                    str(record.call),
                    _leaves_text(record.inputs),
                    _leaves_text(record.outputs) if record.completed else "(raised)",
                    params or "-",
                    " ".join(f"{k}x{n}" for k, n in ops.items()) or "-",
                ]
            )
        if not only_called:
            called = {r.fqn for r in self._boundaries}
            rows += [
                [_display_fqn(f), "-", "-", "-", "-", "-"] for f in self.modules if f not in called
            ]
        headers = ["module", "call", "inputs", "outputs", "materialized params", "forward ops"]
        return _format_table(headers, rows)

    def as_table(self, kind: Literal["boundary", "params", "ops", "grads"] = "boundary") -> str:
        """A detailed text table of one observation, one row per leaf/parameter/operator."""
        rows: list[list[str]]
        if kind == "boundary":
            headers = ["module", "call", "direction", "path", "dtype", "shape"]
            rows = []
            for b in self._boundaries:
                for direction, leaves in (("input", b.inputs), ("output", b.outputs)):
                    rows += [
                        [
                            _display_fqn(b.fqn),
                            str(b.call),
                            direction,
                            leaf.path,
                            dtype_name(leaf.dtype),
                            str(list(leaf.shape)),
                        ]
                        for leaf in leaves
                    ]
        elif kind == "params":
            headers = ["module", "call", "parameter", "dtype", "shape", "sharded"]
            rows = [
                [
                    _display_fqn(p.fqn),
                    str(p.call),
                    p.name,
                    dtype_name(p.dtype),
                    str(list(p.shape)),
                    str(p.sharded),
                ]
                for p in self._params
            ]
        elif kind == "ops":
            headers = ["seq", "module", "call", "phase", "op", "inputs", "outputs"]
            rows = [
                [
                    str(o.seq),
                    _display_fqn(o.fqn),
                    str(o.call),
                    o.phase,
                    o.op,
                    _leaves_text(o.inputs),
                    _leaves_text(o.outputs),
                ]
                for o in self._ops
            ]
        elif kind == "grads":
            headers = ["seq", "module", "parameter", "dtype", "shape"]
            rows = [
                [str(g.seq), _display_fqn(g.fqn), g.name, dtype_name(g.dtype), str(list(g.shape))]
                for g in self._grads
            ]
        else:
            raise ValueError(f"kind must be boundary, params, ops or grads, not {kind!r}")
        return _format_table(headers, rows)

    def _order(self, fqn: str) -> int:
        return self._position[fqn]

    def __repr__(self) -> str:
        state = "attached" if self._attached else "detached"
        return (
            f"<DtypeProbe {self._model_type} {state}: {len(self._fqn_of)} module(s), "
            f"{len(self._boundaries)} call(s), {len(self._ops)} op(s)>"
        )


# --------------------------------------------------------------------------- comparison


def _boundaries_of(source: DtypeProbe | Iterable[BoundaryRecord]) -> list[BoundaryRecord]:
    if isinstance(source, DtypeProbe):
        return list(source.boundary_records)
    return list(source)


def diff_boundaries(
    reference: DtypeProbe | Iterable[BoundaryRecord],
    observed: DtypeProbe | Iterable[BoundaryRecord],
    *,
    modules: Iterable[str] | None = None,
) -> list[BoundaryMismatch]:
    """Compare the activation boundaries of two runs, e.g. unsharded reference vs FSDP2.

    Both runs must make the same forward calls in the same context (autocast or direct); FQNs
    are compared as they are (``fully_shard`` does not rename modules).

    Args:
        reference: the expected run (a probe or its boundary records).
        observed: the run under test.
        modules: FQNs to compare. By default every module both probes select (given records,
            every module either recorded), so a module probed on one side only is not a
            mismatch, but a probed module called fewer times on one side is.

    Returns:
        One :class:`BoundaryMismatch` per (module, call, direction, leaf path) whose dtype
        differs or that exists on one side only, in the reference's module order (given a
        probe) and call order; empty when the two runs agree.
    """
    expected_records = _boundaries_of(reference)
    observed_records = _boundaries_of(observed)
    if modules is not None:
        wanted = set([modules] if isinstance(modules, str) else modules)
    elif isinstance(reference, DtypeProbe) and isinstance(observed, DtypeProbe):
        wanted = set(reference.modules) & set(observed.modules)
    else:
        wanted = {r.fqn for r in expected_records} | {r.fqn for r in observed_records}

    def index(records: list[BoundaryRecord]) -> dict[tuple[str, int], BoundaryRecord]:
        return {(r.fqn, r.call): r for r in records if r.fqn in wanted}

    expected_by_call = index(expected_records)
    observed_by_call = index(observed_records)
    keys = list(expected_by_call) + [k for k in observed_by_call if k not in expected_by_call]
    if isinstance(reference, DtypeProbe):
        # Records are kept in return order (children first); report in module order instead.
        order = {fqn: position for position, fqn in enumerate(reference.modules)}
        keys.sort(key=lambda key: (order.get(key[0], len(order)), key[1]))
    mismatches: list[BoundaryMismatch] = []
    for fqn, call in keys:
        want = expected_by_call.get((fqn, call))
        got = observed_by_call.get((fqn, call))
        for direction in ("input", "output"):
            want_dtypes = _direction_dtypes(want, direction)
            got_dtypes = _direction_dtypes(got, direction)
            paths = list(want_dtypes) + [p for p in got_dtypes if p not in want_dtypes]
            for path in paths:
                if want_dtypes.get(path) != got_dtypes.get(path):
                    mismatches.append(
                        BoundaryMismatch(
                            fqn, call, direction, path, want_dtypes.get(path), got_dtypes.get(path)
                        )
                    )
    return mismatches


def _direction_dtypes(
    record: BoundaryRecord | None, direction: Direction
) -> dict[str, torch.dtype]:
    if record is None:
        return {}
    return record.input_dtypes if direction == "input" else record.output_dtypes


def format_mismatches(mismatches: Sequence[BoundaryMismatch]) -> str:
    """A readable table of :func:`diff_boundaries` results (``"no mismatches"`` if empty)."""
    if not mismatches:
        return "no mismatches"
    rows = [
        [
            _display_fqn(m.fqn),
            str(m.call),
            m.direction,
            m.path,
            dtype_name(m.expected),
            dtype_name(m.observed),
        ]
        for m in mismatches
    ]
    return _format_table(["module", "call", "direction", "path", "expected", "observed"], rows)


def _format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(cell.ljust(w) for cell, w in zip(cells, widths, strict=True)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])
