"""What a test leaves behind in a rank that is kept for the next test, checked after each one.

Ranks live across tests, so state a test changes outlives it. Two kinds are handled here:

- **The default process group.** A test that destroys it (many training functions end with
  ``dist.destroy_process_group()``) or leaves it unusable would make the *next* test hang in
  its first collective. :func:`process_group_problem` says so right after the test that did it;
  the rank session reports that test and the controller replaces the ranks.
- **torch's global defaults** that silently change what later tests compute: the default dtype,
  the default device and grad mode. :class:`TorchDefaults` takes them before a test and restores
  them after, and the change is reported as a warning naming the test.

Everything else persists on purpose and is documented (README, "What persists between marked
tests"): imported modules, module globals, environment variables, files, the CUDA context,
torch's RNG (re-seeded before each test anyway), thread settings.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING, Any

from pytest_fp32keep.runner import protocol

if TYPE_CHECKING:
    import pytest


def process_group_problem() -> str | None:
    """Why the default process group cannot serve the next test, or ``None`` if it can."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = torch.distributed
    if not dist.is_available():
        return None
    if not dist.is_initialized():
        return (
            "the test destroyed the default process group (dist.destroy_process_group()); the "
            "next test would wait for ever in its first collective. The ranks are replaced. "
            "Leave the group to the plugin: it creates it once per rank and destroys it at the "
            "end, or call such code with a group of its own (dist.new_group)."
        )
    return None


@dataclasses.dataclass(frozen=True)
class TorchDefaults:
    """torch's process-wide defaults that a test may change and the next test would inherit."""

    dtype: Any
    device: Any
    grad_enabled: bool

    @classmethod
    def take(cls) -> TorchDefaults | None:
        """The current defaults, or ``None`` while torch is not imported."""
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        return cls(torch.get_default_dtype(), _default_device(torch), torch.is_grad_enabled())

    def restore(self) -> list[str]:
        """Put these defaults back; what had changed, one phrase each (empty: nothing)."""
        torch = sys.modules["torch"]
        changed: list[str] = []
        if torch.get_default_dtype() != self.dtype:
            changed.append(f"the default dtype to {torch.get_default_dtype()}")
            torch.set_default_dtype(self.dtype)
        device = _default_device(torch)
        if device != self.device:
            changed.append(f"the default device to {device}")
            # None is torch's own default (cpu, no device context installed): put that back
            # rather than a cpu context, which would sit in every later torch call.
            cpu = self.device == torch.device("cpu")
            torch.set_default_device(None if cpu else self.device)
        if torch.is_grad_enabled() != self.grad_enabled:
            changed.append(f"grad mode to {'enabled' if torch.is_grad_enabled() else 'disabled'}")
            torch.set_grad_enabled(self.grad_enabled)
        return changed


def restored_warning(item: pytest.Item, changed: list[str]) -> dict[str, Any]:
    """The warning (``protocol.rank_warning``) that ``item`` changed torch's defaults
    (:meth:`TorchDefaults.restore`'s phrases), placed where the test is defined."""
    path, line = item.reportinfo()[:2]
    return protocol.rank_warning(
        f"{item.nodeid} changed {', '.join(changed)} and did not restore it; the plugin "
        "restored it so that later tests in these ranks are not affected (restore it in the "
        "test, e.g. with a fixture, to silence this)",
        str(path),
        (line or 0) + 1,  # reportinfo's line counts from 0
    )


def _default_device(torch: Any) -> Any:
    get = getattr(torch, "get_default_device", None)  # torch >= 2.3
    return get() if get is not None else None
