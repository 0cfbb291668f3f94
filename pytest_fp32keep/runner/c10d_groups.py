"""The process-group registry the runner reads, in one place: ``distributed_c10d``'s privates.

The Flight Recorder names the process group of a collective a rank is blocked in by the group's
name; :mod:`.waits` turns that into the group's ranks, which the controller needs to tell which
peers must join it. torch has no public way from a group's name to the group (``ProcessGroup``
knows its own name, nothing lists the groups), so this module reads the registry
``torch.distributed.distributed_c10d._world.pg_names`` (each group and its name). Under an
external launcher, :mod:`.spmd_watch` leaves a hung rank's stack in the store the default group
was made from, the one channel a thread can use while collectives hang, which only
``distributed_c10d._get_default_store`` hands out. Nothing else in the plugin reads them
(``tests/test_architecture.py`` checks).

The private names read here are in :data:`PRIVATE_READS`, and the torch releases the reads were
verified on in :data:`VERIFIED_TORCH`. When torch changes them, :func:`group_names` and
:func:`default_store` raise :class:`ProcessGroupRegistryError` naming the attribute and the
installed torch.

torch is imported only when the registry is read: the controller imports :mod:`.waits` too.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

__all__ = [
    "PRIVATE_READS",
    "VERIFIED_TORCH",
    "ProcessGroupRegistryError",
    "default_store",
    "group_names",
]

PRIVATE_READS: tuple[str, ...] = (
    "torch.distributed.distributed_c10d._world",  # the process-group registry of this process
    "_World.pg_names",  # every process group and its name
    "torch.distributed.distributed_c10d._get_default_store",  # the default group's store
)
"""Every private name this module reads."""

VERIFIED_TORCH: Mapping[str, str] = MappingProxyType(
    {
        "2.9": "2.9.1: its distributed_c10d.py defines _world (a _World with pg_names) and "
        "_get_default_store; tests/test_torch_shims.py, tests/multirank/test_waits.py, "
        "tests/plugin/test_spmd.py (the default store) (2.9.1+cu128, on CPU)",
        "2.13": "2.13.0+cpu: tests/test_torch_shims.py, tests/multirank/test_waits.py, "
        "tests/plugin/test_spmd.py (the default store)",
        "2.14": "2.14.1+cu130 (run on CPU): tests/test_torch_shims.py, "
        "tests/multirank/test_waits.py",
        "2.15": "2.15.0+cu132: tests/test_torch_shims.py, tests/multirank/test_waits.py; these "
        "reads, before they moved here, passed the torch-newest nox session (docs/matrix.json: "
        "tests/multirank/test_waits.py finds a pending collective's group ranks through the "
        "registry) and tests/plugin in its venv (bench/RESULTS.md: test_spmd.py's hang watch "
        "uses the default store)",
    }
)
"""The torch releases (``major.minor``) these reads were verified on, and how."""


class ProcessGroupRegistryError(RuntimeError):
    """torch's process-group registry no longer has the shape :mod:`.c10d_groups` reads."""


def _changed(attribute: str, needed_for: str) -> ProcessGroupRegistryError:
    import torch

    return ProcessGroupRegistryError(
        f"torch {torch.__version__}: torch.distributed.distributed_c10d.{attribute} is missing or "
        f"changed (pytest_fp32keep verified torch {', '.join(VERIFIED_TORCH)}): {needed_for}; "
        "update pytest_fp32keep/runner/c10d_groups.py for this release"
    )


def group_names() -> Mapping[Any, str]:
    """Every process group this process knows, with its name (the default group included)."""
    from torch.distributed import distributed_c10d

    world = getattr(distributed_c10d, "_world", None)
    names = getattr(world, "pg_names", None)
    if not isinstance(names, Mapping):
        missing = "_world" if world is None else "_world.pg_names"
        raise _changed(missing, "a collective's process group is not known by its ranks")
    return names


def default_store() -> Any:
    """The store the default process group was made from (``init_process_group`` first)."""
    from torch.distributed import distributed_c10d

    get_store = getattr(distributed_c10d, "_get_default_store", None)
    if get_store is None:
        raise _changed("_get_default_store", "a hung rank cannot leave its stack for rank 0")
    return get_store()
