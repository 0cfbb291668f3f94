"""How many CUDA devices the ranks would see, asked without touching CUDA in this process.

Why not ``torch.cuda.device_count()`` here: the pytest process must not import torch for
projects without marked tests, and must never initialise CUDA (a CUDA context in the parent
holds device memory and breaks fork-based tools). So the count is answered in two steps:

1. For free: if ``CUDA_VISIBLE_DEVICES`` hides every device, or the installed torch is a
   CPU-only build (its ``torch/version.py`` says ``cuda = None`` and ``hip = None``, read as
   text, no import), the answer is 0. This is the CI case and costs a file read.
2. Otherwise one short-lived subprocess runs ``torch.cuda.device_count()`` with
   ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (NVML, no CUDA context), which honours
   ``CUDA_VISIBLE_DEVICES`` exactly as the ranks will. It runs at most once per session and
   only when a marked test needs ``auto`` or ``nccl`` resolved.

``nvidia-smi`` was not chosen: it ignores ``CUDA_VISIBLE_DEVICES`` and says nothing about
whether the installed torch can use the devices.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Final

#: Bound on the probe subprocess (an ``import torch`` takes a few seconds on a slow box).
PROBE_TIMEOUT_S: Final = 120.0

_PROBE = (
    "import os; os.environ['PYTORCH_NVML_BASED_CUDA_CHECK'] = '1'; import torch; "
    "print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
)


def _hidden_by_environment() -> bool:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible is not None and visible.strip() in ("", "-1", "NoDevFiles")


def _torch_is_cpu_only_build() -> bool:
    """Read ``torch/version.py`` as text: ``cuda`` and ``hip`` are both ``None`` there."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return True  # no torch at all: nothing could use a GPU
    version_file = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        text = version_file.read_text(encoding="utf-8")
    except OSError:
        return False  # cannot tell: let the probe answer
    accelerators = re.findall(r"^(cuda|hip)\s*(?::[^=\n]*)?=\s*(.+)$", text, flags=re.M)
    return bool(accelerators) and all(value.strip() == "None" for _, value in accelerators)


def count_cuda_devices() -> int:
    """The number of CUDA devices torch would see in a rank; 0 when unsure or on error."""
    if _hidden_by_environment() or _torch_is_cpu_only_build():
        return 0
    try:
        completed = subprocess.run(
            [sys.executable, "-c", _PROBE],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    lines = completed.stdout.strip().splitlines()
    try:
        return max(0, int(lines[-1])) if completed.returncode == 0 and lines else 0
    except ValueError:
        return 0


def nccl_shortfall(nproc: int, devices: int) -> str:
    """Why a test that needs ``nproc`` ranks on nccl is skipped with ``devices`` GPUs visible,
    and what to do: run on gloo, or, where some GPUs are visible, with fewer ranks (never "at
    most 0 ranks": a test cannot run in none)."""
    fewer = (
        f", or ask for at most {devices} rank{'s' if devices != 1 else ''}"
        if devices > 0
        else f", or run on a machine with {nproc} GPUs"
    )
    return (
        f"fsdp2: backend nccl needs {nproc} CUDA devices (one per rank), {devices} visible "
        f"here; run with --fsdp-backend=gloo (or auto){fewer}"
    )
