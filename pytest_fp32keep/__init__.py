"""pytest plugin that proves a model keeps FP32 where it says so under FSDP2.

The names below are imported lazily: pytest imports this package for the ``pytest11`` entry
point, and a project with no marked test must not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytest_fp32keep.contract import (
        ContractReport,
        ContractViolation,
        assert_fp32_keep_contract,
    )
    from pytest_fp32keep.contract.probe import DtypeProbe
    from pytest_fp32keep.contract.reference import build_unsharded_reference

_LAZY = {
    "assert_fp32_keep_contract": "pytest_fp32keep.contract",
    "ContractReport": "pytest_fp32keep.contract",
    "ContractViolation": "pytest_fp32keep.contract",
    "DtypeProbe": "pytest_fp32keep.contract.probe",
    "build_unsharded_reference": "pytest_fp32keep.contract.reference",
}

__all__ = [
    "ContractReport",
    "ContractViolation",
    "DtypeProbe",
    "assert_fp32_keep_contract",
    "build_unsharded_reference",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pytest_fp32keep' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
