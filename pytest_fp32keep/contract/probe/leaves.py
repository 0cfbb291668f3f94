"""Finding the floating tensors in a module's or an operator's arguments and results.

Only metadata is read (dtype, shape, type), never a tensor operation, so walking is safe from
inside the probe's hooks and its dispatch mode. See the package docstring for which containers
are walked.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from pytest_fp32keep.contract.probe.records import TensorLeaf

# Deeply nested structures are walked no further than this (cycles are cut separately).
_MAX_DEPTH = 32


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
