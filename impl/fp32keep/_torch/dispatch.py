"""The dispatch and autograd internals the library reads, in one place.

:mod:`fp32keep.uses.observe` sees every operator that takes a parameter through a
``TorchDispatchMode``, whose only home is the private ``torch.utils._python_dispatch``, and
leaves out the operators autograd's engine runs in backward, which only
``torch._C._current_graph_task_id`` tells (``-1`` outside a backward graph task on this thread).
:mod:`fp32keep.load.loader` tells whether ``init_buffers`` wrote into a tensor by its version
counter (``Tensor._version``: autograd bumps it at every in-place write). torch has no public
API for these, so this module reads them, and nothing else in the library does
(``tests/test_architecture.py`` checks; the plugin's probe has its own shim,
``pytest_fp32keep/contract/torch_dispatch.py``, since it may not import this one).

Every private name read here is in :data:`PRIVATE_READS`, and the torch releases the reads were
verified on in :data:`VERIFIED_TORCH`. When torch moves one, using it raises
:class:`TorchDispatchError` naming the name and the installed torch (the dispatch mode already
when :mod:`fp32keep.uses.observe` is imported: its recorder subclasses it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch

from fp32keep.errors import Fp32KeepRuntimeError, hidden_in_tracebacks

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks

__all__ = [
    "PRIVATE_READS",
    "VERIFIED_TORCH",
    "TorchDispatchError",
    "TorchDispatchMode",
    "backward_running",
    "version_counter",
]

PRIVATE_READS: Mapping[str, str] = MappingProxyType(
    {
        "torch.utils._python_dispatch.TorchDispatchMode": "sees every operator a forward runs",
        "torch._C._current_graph_task_id": "whether autograd's backward runs on this thread",
        "Tensor._version": "the version counter autograd bumps at every in-place write",
    }
)
"""Each private name this module reads, and what for."""

VERIFIED_TORCH: Mapping[str, str] = MappingProxyType(
    {
        "2.9": "2.9.1: TorchDispatchMode in its torch/utils/_python_dispatch.py, "
        "_current_graph_task_id in torch/_C/__init__.pyi; these reads (Tensor._version "
        "included): tests/test_torch_shims.py, tests/core/test_observed_use.py, "
        "tests/multirank/test_observed_use_fsdp2.py, test_load_meta_fsdp2.py (2.9.1+cu128, on CPU)",
        "2.13": "2.13.0+cpu: tests/test_torch_shims.py, tests/core/test_observed_use.py, "
        "tests/multirank/test_observed_use_fsdp2.py, test_load_meta_fsdp2.py",
        "2.14": "2.14.1+cu130 (run on CPU): tests/test_torch_shims.py, "
        "tests/core/test_observed_use.py, tests/multirank/test_observed_use_fsdp2.py, "
        "test_load_meta_fsdp2.py",
        "2.15": "2.15.0+cu132: tests/test_torch_shims.py, the 2.14 files; these reads, before "
        "they moved here, passed the torch-newest nox session (docs/matrix.json)",
    }
)
"""The torch releases (``major.minor``) these reads were verified on, and how."""


class TorchDispatchError(Fp32KeepRuntimeError):
    """torch no longer has a dispatch or autograd internal :mod:`fp32keep._torch.dispatch`
    reads."""


def _moved(name: str) -> TorchDispatchError:
    return TorchDispatchError(
        f"{name} is missing on torch {torch.__version__} (fp32keep verified torch "
        f"{', '.join(VERIFIED_TORCH)}): fp32keep.observe_parameter_use and load_state_dict need "
        "it; please report it with your torch version"
    )


try:
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # pragma: no cover - torch moved it; the message says which torch
    raise _moved("torch.utils._python_dispatch.TorchDispatchMode") from None


def backward_running() -> Callable[[], bool]:
    """A function telling whether autograd's engine runs a backward graph task on the calling
    thread (its operators run with no model code on the stack). Raises here, not at each call,
    when torch lacks the internal."""
    graph_task = getattr(torch._C, "_current_graph_task_id", None)
    if graph_task is None:
        raise _moved("torch._C._current_graph_task_id")
    return lambda: bool(graph_task() != -1)


def version_counter(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter: it changes with every in-place write into the tensor."""
    try:
        version: int = tensor._version
    except AttributeError:
        raise _moved("Tensor._version") from None
    return version
