"""The library's one entry to FSDP2's private state (``fp32keep._torch.fsdp_hooks``): verified on
the installed torch, and a clear error where torch changed the shape it calls."""

from __future__ import annotations

import pytest
import torch
from packaging.version import Version

from fp32keep._torch import fsdp_hooks


def test_the_installed_torch_is_one_the_hooks_were_verified_on() -> None:
    """Runs under every torch of the nox axis: a new torch fails here, naming itself, until its
    reads are checked and recorded in ``VERIFIED_TORCH``."""
    release = Version(torch.__version__)
    installed = f"{release.major}.{release.minor}"
    assert installed in fsdp_hooks.VERIFIED_TORCH, (
        f"torch {torch.__version__}: fp32keep._torch.fsdp_hooks was verified on "
        f"{sorted(fsdp_hooks.VERIFIED_TORCH)} only"
    )
    for name in fsdp_hooks.PRIVATE_READS:
        _owner, attribute = name.split(".")
        assert attribute.startswith("_"), name


def test_a_changed_shape_names_the_attribute_and_the_torch() -> None:
    class NotAnFsdpState:
        """What an FSDPModule would hand back if torch renamed its hooks."""

    class Unit(torch.nn.Module):
        def _get_fsdp_state(self) -> NotAnFsdpState:
            return NotAnFsdpState()

    with pytest.raises(fsdp_hooks.FsdpHooksError) as raised:
        fsdp_hooks.unit_pre_forward(Unit(), (), {})  # type: ignore[arg-type]
    message = str(raised.value)
    assert "FSDPState._pre_forward is missing" in message
    assert f"torch {torch.__version__}" in message
    with pytest.raises(fsdp_hooks.FsdpHooksError, match=r"FSDPModule\._get_fsdp_state"):
        fsdp_hooks.unit_post_forward(torch.nn.Linear(1, 1), (), None)  # type: ignore[arg-type]
