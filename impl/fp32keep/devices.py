"""The device collectives run on: where the wrapper and the loader put the tensors they own."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fp32keep.errors import hidden_in_tracebacks

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks


def collective_device(mesh: DeviceMesh | None = None) -> torch.device:
    """The device ``mesh``'s collectives run on; without a mesh, the default process group's.

    A mesh names its device type (``init_device_mesh("cuda", ...)``); the default process group
    runs on CUDA under NCCL and on the CPU otherwise (gloo). An accelerator is this process's
    current one (``torch.cuda.current_device()``: torchrun's ``LOCAL_RANK`` after
    ``set_device``), the device FSDP2 itself moves sharded parameters to.
    """
    if mesh is not None:
        device_type = mesh.device_type
    else:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())
