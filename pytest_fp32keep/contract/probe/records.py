"""The probe's record types and the dtype/module naming helpers they share.

Each observation :class:`~pytest_fp32keep.contract.probe.DtypeProbe` makes is one frozen record
here (:class:`BoundaryRecord`, :class:`MaterializedParamRecord`, :class:`OpRecord`,
:class:`GradRecord`, each made of :class:`TensorLeaf` values), plus the small tuples its queries
return (:class:`BoundaryDtypes`, :class:`OpDtypes`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple, TypeAlias

import torch

Phase: TypeAlias = Literal["forward", "hooks"]
"""``"forward"``: inside the module's ``forward``; ``"hooks"``: inside its other forward hooks."""

Direction: TypeAlias = Literal["input", "output"]

_SHORT_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "fp64",
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
}


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
