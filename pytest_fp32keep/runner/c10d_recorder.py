"""The Flight Recorder dumps the runner reads, in one place: torch's c10d private bindings.

:mod:`.waits` tells a rank blocked in a collective from one running its own code partly by
torch's Flight Recorder: its JSON dumps list every process group's last enqueued and completed
collective, and each recorded collective with its ``retired`` flag. torch has no public API for
them (``torch.distributed.flight_recorder`` reads dump files, it does not take one), so this
module reads the bindings in ``torch._C._distributed_c10d``, and nothing else in the plugin does
(``tests/test_architecture.py`` checks).

The private names read here are in :data:`PRIVATE_READS` (NCCL's dump exists only in a torch
built with NCCL), and the torch releases the reads were verified on in :data:`VERIFIED_TORCH`.
Where the generic dump is missing, :func:`recorder_dumps` raises :class:`FlightRecorderError`
naming it and the installed torch; :mod:`.waits` then judges the rank by its CPU time, as with
the recorder switched off, and the shim's test on the PyTorch axis names what torch changed.

torch is imported only when a dump is asked for: the controller imports :mod:`.waits` too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Final

__all__ = [
    "NCCL_ONLY",
    "PRIVATE_READS",
    "VERIFIED_TORCH",
    "FlightRecorderError",
    "recorder_dumps",
]

PRIVATE_READS: Mapping[str, str] = MappingProxyType(
    {
        "torch._C._distributed_c10d._dump_fr_trace_json": "the generic recorder (gloo, CPU): "
        "(includeCollectives, onlyActive) -> JSON",
        "torch._C._distributed_c10d._dump_nccl_trace_json": "NCCL's recorder, same arguments",
    }
)
"""Each private name this module reads, and what for."""

#: The reads only a torch built with NCCL has.
NCCL_ONLY: Final = frozenset({"torch._C._distributed_c10d._dump_nccl_trace_json"})

VERIFIED_TORCH: Mapping[str, str] = MappingProxyType(
    {
        "2.9": "2.9.1: _dump_fr_trace_json bound in its libtorch_python.so; "
        "tests/test_torch_shims.py, tests/multirank/test_waits.py (2.9.1+cu128, on CPU)",
        "2.13": "2.13.0+cpu: tests/test_torch_shims.py, tests/multirank/test_waits.py",
        "2.14": "2.14.1+cu130 (run on CPU): tests/test_torch_shims.py (NCCL's dump included), "
        "tests/multirank/test_waits.py",
        "2.15": "2.15.0+cu132: tests/test_torch_shims.py (NCCL's dump included), "
        "tests/multirank/test_waits.py; these reads, before they moved here, passed the "
        "torch-newest nox session (docs/matrix.json), tests/multirank/test_waits.py among it",
    }
)
"""The torch releases (``major.minor``) these reads were verified on, and how."""


class FlightRecorderError(RuntimeError):
    """torch no longer has the Flight Recorder dump :mod:`.c10d_recorder` reads."""


def recorder_dumps() -> list[Callable[..., Any]]:
    """The Flight Recorder's JSON dumps this torch has: the generic one first, NCCL's where
    torch was built with NCCL. Each takes ``(include_collectives, only_active)``."""
    import torch

    c10d = torch._C._distributed_c10d
    dumps: list[Callable[..., Any]] = []
    for read in PRIVATE_READS:
        dump = getattr(c10d, read.rpartition(".")[2], None)
        if dump is not None:
            dumps.append(dump)
        elif read not in NCCL_ONLY:
            raise FlightRecorderError(
                f"torch {torch.__version__} has no {read} (pytest_fp32keep verified torch "
                f"{', '.join(VERIFIED_TORCH)}): a rank blocked in a collective is told from one "
                "running its own code by CPU time alone; update "
                "pytest_fp32keep/runner/c10d_recorder.py for this release"
            )
    return dumps
