"""The ``nn.Module`` internals the library reads, in one place.

A module's own registries (``_parameters``, ``_buffers``, ``_modules``) hold what
``named_parameters`` and friends skip or cannot say: a slot registered as ``None``, an entry read
without running ``__getattr__`` (whatever a class overrides it with), the dict a buffer is rebound
in so that every tied alias sees the one new tensor. ``_non_persistent_buffers_set`` is the only
record of which buffers a state dict leaves out; ``_apply`` is the one pass over a module tree's
tensors that ``FSDPModule`` overrides (it re-pads each sharded parameter), which ``to_empty``
runs too; ``_call_impl`` is the body of ``nn.Module.__call__``, where FSDP2's forward hooks run,
whose frame :mod:`fp32keep.uses.observe` recognises on the stack. torch has no public API for any of
them, so this module reads them, and nothing else in the library does
(``tests/test_architecture.py`` checks; the plugin does not read them at all).

Every private name read here is in :data:`PRIVATE_READS`, and the torch releases the reads were
verified on in :data:`VERIFIED_TORCH`. When torch renames one, the read raises
:class:`TorchModulesError` naming the attribute and the installed torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Set
from types import CodeType, MappingProxyType
from typing import Any

import torch
from torch import nn

from fp32keep.errors import Fp32KeepRuntimeError, hidden_in_tracebacks

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks

__all__ = [
    "PRIVATE_READS",
    "VERIFIED_TORCH",
    "TorchModulesError",
    "apply_to_tensors",
    "call_impl_code",
    "non_persistent_buffers",
    "own_buffers",
    "own_children",
    "own_parameters",
    "rebind_buffer",
]

PRIVATE_READS: Mapping[str, str] = MappingProxyType(
    {
        "Module._parameters": "a module's own parameters by attribute, None slots included",
        "Module._buffers": "a module's own buffers by attribute; the cast rebinds one there",
        "Module._modules": "a module's registered children, read without running __getattr__",
        "Module._non_persistent_buffers_set": "the buffers a state dict leaves out",
        "Module._apply": "the pass over every tensor that FSDPModule overrides (meta loads)",
        "Module._call_impl": "the body of nn.Module.__call__, where FSDP2's forward hooks run",
    }
)
"""Each private name this module reads, as ``Class.attribute``, and what for."""

VERIFIED_TORCH: Mapping[str, str] = MappingProxyType(
    {
        "2.9": "2.9.1: each name in its torch/nn/modules/module.py; tests/test_torch_shims.py, "
        "tests/core/test_observed_use.py, the meta loads of tests/multirank (2.9.1+cu128, on CPU)",
        "2.13": "2.13.0+cpu: tests/test_torch_shims.py, tests/core (the cast, the plan's tensor "
        "slots, the source reader, observe), the meta loads of tests/multirank",
        "2.14": "2.14.1+cu130 (run on CPU): tests/test_torch_shims.py, "
        "tests/core/test_observed_use.py, test_cast.py, tests/multirank/test_load_meta_fsdp2.py",
        "2.15": "2.15.0+cu132: tests/test_torch_shims.py, the 2.14 files; these reads, before "
        "they moved here, passed the torch-newest nox session (docs/matrix.json)",
    }
)
"""The torch releases (``major.minor``) these reads were verified on, and how."""


class TorchModulesError(Fp32KeepRuntimeError):
    """``nn.Module`` no longer has an internal :mod:`fp32keep._torch.modules` reads."""


def _read(owner: object, name: str) -> Any:
    try:
        return getattr(owner, name)
    except AttributeError as error:
        raise TorchModulesError(
            f"nn.Module.{name} is missing on torch {torch.__version__} (fp32keep read it on "
            f"torch {', '.join(VERIFIED_TORCH)}); please report it with your torch version"
        ) from error


def own_parameters(module: nn.Module) -> Mapping[str, nn.Parameter | None]:
    """``module``'s own parameters by attribute, a slot registered as ``None`` included."""
    found: Mapping[str, nn.Parameter | None] = _read(module, "_parameters")
    return found


def own_buffers(module: nn.Module) -> Mapping[str, torch.Tensor | None]:
    """``module``'s own buffers by attribute, a slot registered as ``None`` included."""
    found: Mapping[str, torch.Tensor | None] = _read(module, "_buffers")
    return found


def own_children(module: nn.Module) -> Mapping[str, nn.Module | None]:
    """``module``'s registered children by attribute (no ``__getattr__`` runs)."""
    found: Mapping[str, nn.Module | None] = _read(module, "_modules")
    return found


def non_persistent_buffers(module: nn.Module) -> Set[str]:
    """The attributes of ``module``'s own buffers that its state dict leaves out."""
    found: Set[str] = _read(module, "_non_persistent_buffers_set")
    return found


def rebind_buffer(module: nn.Module, attribute: str, tensor: torch.Tensor) -> None:
    """Make ``tensor`` ``module``'s registered buffer ``attribute``, as its registry holds it
    (no registration hook runs: the buffer is the same buffer, in another dtype)."""
    _read(module, "_buffers")[attribute] = tensor


def apply_to_tensors(module: nn.Module, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``module._apply(function)``: every parameter and buffer of the tree replaced by what
    ``function`` makes of it, through ``FSDPModule``'s override where the module has one."""
    _read(module, "_apply")(function)


def call_impl_code() -> CodeType:
    """The code object of ``nn.Module.__call__``'s body (``Module._call_impl``)."""
    code: CodeType = _read(nn.Module, "_call_impl").__code__
    return code
