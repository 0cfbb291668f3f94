"""The FSDP2 internals the library calls, in one place: a unit's forward pre- and post-hook.

:mod:`fp32keep.shard.gathered` runs a unit's forward hooks around a method other than ``forward``
(all-gather before, reshard and the pre-backward hook after), as torch's own
``register_fsdp_forward_method`` does, but only for the outermost of nested calls. torch has no
public API for running those hooks, so this module reads FSDP2's private state, and nothing else
in the library does (``tests/test_architecture.py`` checks; the plugin's contract has its own
shim, ``pytest_fp32keep/contract/fsdp_state.py``, which the library may not import).

Every private name read here is in :data:`PRIVATE_READS`, and the torch releases the calls were
verified on in :data:`VERIFIED_TORCH`. When torch changes them, the call raises
:class:`FsdpHooksError` naming the attribute and the installed torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fp32keep.errors import Fp32KeepRuntimeError, hidden_in_tracebacks

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks

__all__ = [
    "PRIVATE_READS",
    "VERIFIED_TORCH",
    "FsdpHooksError",
    "unit_post_forward",
    "unit_pre_forward",
]

PRIVATE_READS: Mapping[str, str] = MappingProxyType(
    {
        "FSDPModule._get_fsdp_state": "the unit's FSDPState (what fully_shard registered)",
        "FSDPState._pre_forward": "the forward pre-hook: all-gather, post-backward hooks",
        "FSDPState._post_forward": "the forward post-hook: reshard, pre-backward hook",
    }
)
"""Each private name this module reads, and what for."""

VERIFIED_TORCH: Mapping[str, str] = MappingProxyType(
    {
        "2.9": "2.9.1+cu128 (PyPI's CUDA build, run on CPU): "
        "tests/multirank/test_observed_use_fsdp2.py passes (nested and pure gathered methods, "
        "gathers counted through this module); _pre_forward(module, args, kwargs) and "
        "_post_forward(module, input, output) are the hooks register_fsdp_forward_method calls",
        "2.13": "2.13.0+cpu: tests/multirank/test_observed_use_fsdp2.py (nested and pure "
        "gathered methods, gathers counted through this module)",
        "2.14": "2.14.1: register_fsdp_forward_method in torch/distributed/fsdp/_fully_shard/"
        "_fully_shard.py calls the same two hooks of the same state; 2.14.1+cu130 (PyPI's CUDA "
        "build, run on CPU): tests/multirank/test_observed_use_fsdp2.py passes",
        "2.15": "2.15.0+cu132 (PyPI's CUDA build, run on CPU): "
        "tests/multirank/test_observed_use_fsdp2.py passes (nested and pure gathered methods, "
        "gathers counted through this module); the hooks' signatures unchanged, "
        "register_fsdp_forward_method calls them the same way",
    }
)
"""The torch releases (``major.minor``) these calls were verified on, and how (the runs, with
their dates and counts: bench/RESULTS.md, "The FSDP2 shims on the PyTorch axis")."""


class FsdpHooksError(Fp32KeepRuntimeError):
    """FSDP2's private state no longer has the shape :mod:`fp32keep._torch.fsdp_hooks` calls."""


def _private(owner: object, name: str, what: str) -> Any:
    try:
        return getattr(owner, name)
    except AttributeError as error:
        raise FsdpHooksError(
            f"{what}.{name} is missing on torch {torch.__version__} (fp32keep verified "
            f"{', '.join(sorted(VERIFIED_TORCH))}): gathered methods cannot run the unit's "
            "forward hooks; please report it with your torch version"
        ) from error


def _state(module: FSDPModule) -> Any:
    return _private(module, "_get_fsdp_state", "FSDPModule")()


def unit_pre_forward(
    module: FSDPModule, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Run ``module``'s unit forward pre-hook (the all-gather); its possibly cast inputs."""
    hook = _private(_state(module), "_pre_forward", "FSDPState")
    result: tuple[tuple[Any, ...], dict[str, Any]] = hook(_as_module(module), args, kwargs)
    return result


def unit_post_forward(module: FSDPModule, args: tuple[Any, ...], output: Any) -> Any:
    """Run ``module``'s unit forward post-hook (reshard, pre-backward hook) on ``output``."""
    return _private(_state(module), "_post_forward", "FSDPState")(_as_module(module), args, output)


def _as_module(module: FSDPModule) -> nn.Module:
    assert isinstance(module, nn.Module)
    return module
