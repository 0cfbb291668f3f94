"""The adapters' CPU workarounds change the device a framework hard-codes, and nothing else.

verl's and axolotl's FSDP utilities name CUDA where they place tensors (verl through
``get_device_id()``, axolotl with a literal ``torch.device("cuda")``); on a CPU-only machine the
adapters hand them the CPU (examples/frameworks/verl_fsdp2.py, axolotl_fsdp2.py). The framework
cases exercise both on every load; these pin down what each does and leaves alone.
"""

from __future__ import annotations

import pytest
import torch
import verl.utils.fsdp_utils as verl_fsdp_utils

from examples.frameworks import verl_fsdp2
from examples.frameworks.axolotl_fsdp2 import CudaOnCpu

pytestmark = pytest.mark.slow  # imports the pinned frameworks (conftest.py)


def test_cuda_on_cpu_places_what_names_cuda_on_the_cpu() -> None:
    with CudaOnCpu():
        made = torch.empty(2, device="cuda")
        moved = torch.ones(2).to(torch.device("cuda"))
        like = torch.empty_like(torch.ones(2, device="meta"), device=torch.device("cuda"))
    assert (made.device.type, moved.device.type, like.device.type) == ("cpu", "cpu", "cpu")


def test_cuda_on_cpu_leaves_other_devices_and_values_alone() -> None:
    """The negative control: a device other than CUDA, and the values, pass through as given."""
    with CudaOnCpu():
        meta = torch.empty(2, device="meta")
        same = torch.arange(3.0).to(torch.float16)
    assert meta.device.type == "meta"
    assert same.dtype == torch.float16 and same.tolist() == [0.0, 1.0, 2.0]


def test_verl_device_is_the_cpu_only_without_cuda_and_is_restored() -> None:
    original = verl_fsdp_utils.get_device_id
    with verl_fsdp2._device_for_verl():
        inside = verl_fsdp_utils.get_device_id()
    assert verl_fsdp_utils.get_device_id is original
    if torch.cuda.is_available():
        assert inside == torch.cuda.current_device()
    else:
        assert inside == "cpu"
