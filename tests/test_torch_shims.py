"""The shims over torch's privates (``tests/test_architecture.py``'s ``TORCH_PRIVATE_SHIMS``), on
the installed torch: every read each one lists exists, the installed release is one it was
verified on, each accessor agrees with torch's public view, and a missing read is an error that
names it and the torch. Runs under every torch of the nox axis, so a release that moves a read
fails here, naming it.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from packaging.version import Version
from torch import nn
from torch.distributed import distributed_c10d

from fp32keep._torch import dispatch as dispatch_shim
from fp32keep._torch import modules as modules_shim
from pytest_fp32keep.contract import torch_dispatch as contract_dispatch
from pytest_fp32keep.runner import c10d_groups, c10d_recorder

SHIMS: dict[str, ModuleType] = {
    "fp32keep._torch.modules": modules_shim,
    "fp32keep._torch.dispatch": dispatch_shim,
    "pytest_fp32keep.contract.torch_dispatch": contract_dispatch,
    "pytest_fp32keep.runner.c10d_recorder": c10d_recorder,
    "pytest_fp32keep.runner.c10d_groups": c10d_groups,
}


def _resolve(read: str) -> Any:
    """What ``read`` names on the installed torch: ``Class.attribute`` off an instance, or a
    dotted path from ``torch``. Raises ``AttributeError`` / ``ImportError`` where it is not."""
    owners = {"Module": nn.Module(), "Tensor": torch.zeros(1), "_World": distributed_c10d._world}
    head, _, rest = read.partition(".")
    if head in owners:
        return getattr(owners[head], rest)
    parts = read.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise ImportError(read)


def _reads(shim: ModuleType) -> list[str]:
    required = [read for read in shim.PRIVATE_READS if read not in c10d_recorder.NCCL_ONLY]
    if dist.is_nccl_available():  # NCCL's dump exists only in a torch built with NCCL
        required += [read for read in shim.PRIVATE_READS if read in c10d_recorder.NCCL_ONLY]
    return required


@pytest.mark.parametrize("name", sorted(SHIMS))
def test_every_read_the_shim_lists_exists_on_the_installed_torch(name: str) -> None:
    shim = SHIMS[name]
    assert shim.PRIVATE_READS, name
    missing = []
    for read in _reads(shim):
        try:
            _resolve(read)
        except (AttributeError, ImportError) as error:
            missing.append(f"{read} ({error})")
    assert missing == [], f"torch {torch.__version__} lacks what {name} reads: {missing}"


@pytest.mark.parametrize("name", sorted(SHIMS))
def test_the_installed_torch_is_one_the_shim_was_verified_on(name: str) -> None:
    """A new torch fails here, naming itself, until its reads are checked and recorded."""
    release = Version(torch.__version__)
    installed = f"{release.major}.{release.minor}"
    verified = SHIMS[name].VERIFIED_TORCH
    assert installed in verified, f"torch {torch.__version__}: {name} verified on {list(verified)}"


def test_the_resolver_refuses_a_read_torch_lacks() -> None:
    """Negative control: a renamed read is reported missing, not resolved to something else."""
    for read in ("Module._parameterz", "Tensor._versions", "torch._C._dump_nothing_json"):
        with pytest.raises((AttributeError, ImportError)):
            _resolve(read)
    assert _resolve("torch.utils._python_dispatch.TorchDispatchMode").__name__ == (
        "TorchDispatchMode"
    )


def test_the_module_accessors_agree_with_torch_s_public_view() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    model[1].register_buffer("scratch", torch.zeros(1), persistent=False)
    model[0].register_parameter("unused", None)
    for module in model.modules():
        params = {k: v for k, v in modules_shim.own_parameters(module).items() if v is not None}
        assert params == dict(module.named_parameters(recurse=False))
        buffers = {k: v for k, v in modules_shim.own_buffers(module).items() if v is not None}
        assert buffers == dict(module.named_buffers(recurse=False))
        assert dict(modules_shim.own_children(module)) == dict(module.named_children())
    assert "unused" in modules_shim.own_parameters(model[0])  # the None slot the view skips
    state = set(model[1].state_dict())
    assert modules_shim.non_persistent_buffers(model[1]) == {"scratch"}
    assert "scratch" not in state and "running_mean" in state


def test_the_module_writers_change_the_module() -> None:
    model = nn.Sequential(nn.BatchNorm1d(2))
    running_mean = model[0].running_mean
    assert isinstance(running_mean, torch.Tensor)
    halved = running_mean.to(torch.float16)
    modules_shim.rebind_buffer(model[0], "running_mean", halved)
    assert model[0].running_mean is halved
    modules_shim.apply_to_tensors(model, lambda tensor: tensor.to(torch.float64))
    assert {t.dtype for t in model.state_dict().values() if t.is_floating_point()} == {
        torch.float64
    }
    assert modules_shim.call_impl_code().co_name == "_call_impl"


def test_a_missing_module_internal_names_itself_and_the_torch() -> None:
    class Hollow(nn.Module):
        """A module whose registry torch renamed."""

    hollow = Hollow()
    del hollow._buffers
    with pytest.raises(modules_shim.TorchModulesError) as raised:
        modules_shim.own_buffers(hollow)
    assert "nn.Module._buffers is missing" in str(raised.value)
    assert f"torch {torch.__version__}" in str(raised.value)


def test_backward_running_tells_autograd_s_backward_from_forward() -> None:
    running = dispatch_shim.backward_running()
    seen: list[bool] = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        seen.append(running())
        return grad

    weight = torch.ones(2, requires_grad=True)
    weight.register_hook(hook)  # type: ignore[no-untyped-call]
    (weight * 2).sum().backward()  # type: ignore[no-untyped-call]
    assert seen == [True]
    assert running() is False


def test_the_version_counter_moves_with_an_in_place_write() -> None:
    tensor = torch.zeros(2)
    before = dispatch_shim.version_counter(tensor)
    tensor.add_(1)
    assert dispatch_shim.version_counter(tensor) > before
    assert dispatch_shim.version_counter(tensor.clone()) == 0


def test_a_missing_autograd_internal_names_itself_and_the_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    with pytest.raises(dispatch_shim.TorchDispatchError) as raised:
        dispatch_shim.backward_running()
    assert "torch._C._current_graph_task_id is missing" in str(raised.value)
    assert f"torch {torch.__version__}" in str(raised.value)


def test_the_dispatch_shims_hand_out_torch_s_dispatch_mode() -> None:
    expected = _resolve("torch.utils._python_dispatch.TorchDispatchMode")
    assert dispatch_shim.TorchDispatchMode is expected
    assert contract_dispatch.TorchDispatchMode is expected


def test_a_missing_flight_recorder_names_itself_and_the_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dumps = c10d_recorder.recorder_dumps()
    assert dumps and dumps[0] is _resolve("torch._C._distributed_c10d._dump_fr_trace_json")
    monkeypatch.delattr(torch._C._distributed_c10d, "_dump_fr_trace_json")
    with pytest.raises(c10d_recorder.FlightRecorderError) as raised:
        c10d_recorder.recorder_dumps()
    assert "torch._C._distributed_c10d._dump_fr_trace_json" in str(raised.value)
    assert f"torch {torch.__version__}" in str(raised.value)


def test_a_missing_process_group_registry_names_itself_and_the_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert c10d_groups.group_names() is distributed_c10d._world.pg_names
    monkeypatch.delattr(distributed_c10d, "_world")
    with pytest.raises(c10d_groups.ProcessGroupRegistryError) as raised:
        c10d_groups.group_names()
    assert "distributed_c10d._world is missing" in str(raised.value)
    monkeypatch.delattr(distributed_c10d, "_get_default_store")
    with pytest.raises(c10d_groups.ProcessGroupRegistryError, match="_get_default_store"):
        c10d_groups.default_store()
    assert f"torch {torch.__version__}" in str(raised.value)
