"""Tensor naming and classification shared by the plan, the cast, the wrapper and the loader,
and the checks of the arguments they share (a model, a dtype)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from fp32keep._torch.modules import non_persistent_buffers, own_buffers, own_parameters
from fp32keep.errors import Fp32KeepTypeError, Fp32KeepValueError, hidden_in_tracebacks
from fp32keep.reprs import clipped_repr

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks

# Packed low-bit floats hold quantized weights: casting them would destroy the values, and
# Transformers leaves float8_e4m3fn alone when it casts a checkpoint. They are never kept or cast.
_PACKED_FLOAT_DTYPES = frozenset(
    getattr(torch, name)
    for name in (
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    )
    if hasattr(torch, name)
)


def is_castable_float(dtype: torch.dtype) -> bool:
    """True for the floating dtypes a precision cast may change (fp16, bf16, fp32, fp64)."""
    return dtype.is_floating_point and dtype not in _PACKED_FLOAT_DTYPES


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as every message spells it: as torch prints it (``torch.bfloat16``), the spelling
    users paste into code and that tools written for other FP32-keep paths (verl's) match."""
    return str(dtype)


def check_float_dtype(dtype: object, *, what: str) -> torch.dtype:
    """Return ``dtype`` if it is a castable floating torch dtype, else raise a clear error."""
    if not isinstance(dtype, torch.dtype):
        raise Fp32KeepTypeError(
            f"{what} must be a torch.dtype such as torch.bfloat16, got {dtype!r}"
        )
    if not is_castable_float(dtype):
        raise Fp32KeepValueError(
            f"{what} must be a floating dtype (torch.float16, torch.bfloat16 or torch.float32), "
            f"got {dtype_name(dtype)}"
        )
    return dtype


def module_problem(model: object, *, where: str, parameter: str = "model") -> str | None:
    """Why ``model`` cannot be the ``nn.Module`` argument ``parameter`` of ``where``, or None.

    Checked first at every public entry point, so that ``None`` or a checkpoint path gets this
    sentence instead of what the first use of it raises (``vars() argument must have __dict__
    attribute``, ``'NoneType' object has no attribute 'parameters'``).
    """
    if isinstance(model, nn.Module):
        return None
    hint = (
        " (a checkpoint path? build the model first, e.g. "
        "AutoModelForCausalLM.from_pretrained(path))"
        if isinstance(model, str | bytes) or hasattr(model, "__fspath__")
        else ""
    )
    return (
        f"{where}: {parameter} must be a torch.nn.Module, got {clipped_repr(model, 80)} of type "
        f"{type(model).__name__}{hint}; pass the model itself"
    )


def check_module(model: object, *, where: str, parameter: str = "model") -> nn.Module:
    """Return ``model`` if it is an ``nn.Module``, else raise :class:`Fp32KeepTypeError`
    (:func:`module_problem`)."""
    problem = module_problem(model, where=where, parameter=parameter)
    if problem is not None:
        raise Fp32KeepTypeError(problem)
    assert isinstance(model, nn.Module)
    return model


@dataclass(frozen=True)
class TensorSlot:
    """One registered parameter or buffer, under every name it is reachable by.

    Attributes:
        names: every fully qualified name of the tensor (tied aliases), in module order.
        tensor: the tensor itself.
        is_param: parameter (True) or buffer (False).
        persistent: for buffers, whether any alias is saved in the state dict.
    """

    names: tuple[str, ...]
    tensor: torch.Tensor
    is_param: bool
    persistent: bool = True

    @property
    def name(self) -> str:
        """The first name, the one ``named_parameters()`` reports."""
        return self.names[0]


def _split(fqn: str) -> tuple[str, str]:
    owner, _, leaf = fqn.rpartition(".")
    return owner, leaf


def tensor_slots(model: nn.Module) -> list[TensorSlot]:
    """Every parameter and buffer of ``model``, tied aliases grouped into one slot."""
    names: dict[int, list[str]] = defaultdict(list)
    tensors: dict[int, torch.Tensor] = {}
    kinds: dict[int, bool] = {}
    persistent: dict[int, bool] = defaultdict(bool)
    modules = dict(model.named_modules(remove_duplicate=False))
    for fqn, param in model.named_parameters(remove_duplicate=False):
        names[id(param)].append(fqn)
        tensors[id(param)] = param
        kinds[id(param)] = True
    for fqn, buffer in model.named_buffers(remove_duplicate=False):
        names[id(buffer)].append(fqn)
        tensors[id(buffer)] = buffer
        kinds[id(buffer)] = False
        owner, leaf = _split(fqn)
        if leaf not in non_persistent_buffers(modules[owner]):
            persistent[id(buffer)] = True
    return [
        TensorSlot(tuple(names[key]), tensors[key], kinds[key], kinds[key] or persistent[key])
        for key in names
    ]


def iter_owned(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, torch.Tensor, bool]]:
    """Yield ``(module_fqn, module, attribute, tensor, is_param)`` for every alias."""
    for module_fqn, module in model.named_modules(remove_duplicate=False):
        for attribute, param in own_parameters(module).items():
            if param is not None:
                yield module_fqn, module, attribute, param, True
        for attribute, buffer in own_buffers(module).items():
            if buffer is not None:
                yield module_fqn, module, attribute, buffer, False


def join(prefix: str, name: str) -> str:
    """Join a module FQN and a child name the way ``named_modules`` does."""
    return f"{prefix}.{name}" if prefix else name
