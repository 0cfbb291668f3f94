"""The dispatch internal the contract reads, in one place: torch's ``TorchDispatchMode``.

The probe (:mod:`.probe.recorder`) records every operator a probed module runs through a
``TorchDispatchMode``, whose only home is the private ``torch.utils._python_dispatch``. This
module imports it, and nothing else in the plugin does (``tests/test_architecture.py`` checks;
the library reads the same class through its own shim, ``fp32keep._torch.dispatch``, which the
plugin may not import: it is not among ``fp32keep``'s exports).

The private name read here is in :data:`PRIVATE_READS`, and the torch releases it was verified on
in :data:`VERIFIED_TORCH`. When torch moves it, importing the probe raises
:class:`TorchDispatchError` naming it and the installed torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

__all__ = ["PRIVATE_READS", "VERIFIED_TORCH", "TorchDispatchError", "TorchDispatchMode"]

PRIVATE_READS: tuple[str, ...] = ("torch.utils._python_dispatch.TorchDispatchMode",)
"""Every private name this module reads, as its full dotted path."""

VERIFIED_TORCH: Mapping[str, str] = MappingProxyType(
    {
        "2.9": "2.9.1: TorchDispatchMode in its torch/utils/_python_dispatch.py; "
        "tests/test_torch_shims.py, tests/probe (2.9.1+cu128, on CPU)",
        "2.13": "2.13.0+cpu: tests/test_torch_shims.py, tests/probe",
        "2.14": "2.14.1+cu130 (run on CPU): tests/test_torch_shims.py",
        "2.15": "2.15.0+cu132: tests/test_torch_shims.py; the probe, before its import moved "
        "here, passed the torch-newest nox session (docs/matrix.json)",
    }
)
"""The torch releases (``major.minor``) the read was verified on, and how."""


class TorchDispatchError(RuntimeError):
    """torch no longer has the dispatch internal :mod:`.torch_dispatch` reads."""


try:
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # pragma: no cover - torch moved it; the message says which torch
    raise TorchDispatchError(
        f"torch {torch.__version__} has no torch.utils._python_dispatch.TorchDispatchMode "
        f"(pytest_fp32keep verified torch {', '.join(VERIFIED_TORCH)}): the DtypeProbe records "
        "operators through it. Use a verified torch, or update "
        "pytest_fp32keep/contract/torch_dispatch.py for this release"
    ) from None
