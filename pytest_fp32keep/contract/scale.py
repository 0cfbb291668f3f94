"""The gradient scale a framework declares: FSDP2's mean over the ranks, or its own divide factor.

FSDP2 divides each reduced gradient by the data-parallel world size (a mean) unless a unit is
given another factor (``FSDPModule.set_gradient_divide_factor``): torchtitan's
``disable_fsdp_gradient_division`` sets ``1.0`` on every unit, a plain sum, and divides by the
token count itself. That is a choice of the framework's loss scaling, not a keep defect, so the
caller declares it (``gradient_divide_factor``) and the contract honours it in both places the
gradients are judged from:

* **the reference** (:func:`gradient_scale`): every rank runs the same batch, so each rank's
  gradient is the reference's ``g`` and the reduction sums ``world_size`` copies of it; the
  expected gradient is ``g * world_size / factor`` (FSDP2's default mean is ``g`` itself);
* **the control** (:func:`set_divide_factor`): its units get the same factor, so where the
  control is not bit-identical to the reference it carries the factor's rounding too.

Nothing is read from the implementation's units: an implementation that sums without the
declaration, or divides although the caller declared a sum, fails ``parity`` on its gradients.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

__all__ = ["gradient_scale", "set_divide_factor", "validate_gradient_divide_factor"]


def validate_gradient_divide_factor(factor: object) -> float | None:
    """``factor`` as a float when it is ``None`` or a positive finite number (not a bool); else a
    ``ValueError`` naming it and saying what to pass."""
    if factor is None:
        return None
    if (
        isinstance(factor, (int, float))
        and not isinstance(factor, bool)
        and math.isfinite(factor)
        and factor > 0
    ):
        return float(factor)
    raise ValueError(
        f"assert_fp32_keep_contract(gradient_divide_factor={factor!r}): expected None (FSDP2's "
        "default: the mean over the data-parallel ranks) or a positive finite number the "
        "implementation's units divide the summed gradient by (their "
        "set_gradient_divide_factor; torchtitan's disable_fsdp_gradient_division: 1.0, a sum)"
    )


def gradient_scale(mesh: DeviceMesh, factor: float | None) -> float:
    """What the reference's gradient is multiplied by to be the one FSDP2 leaves under
    ``factor``: ``world_size / factor`` (each rank contributes the same gradient), or 1 for
    FSDP2's default mean. ``world_size`` counts every rank of the mesh: HSDP's replicas too,
    as FSDP2's own default divides by both."""
    if factor is None:
        return 1.0
    return mesh.size() / factor


def set_divide_factor(units: Iterable[nn.Module], mesh: DeviceMesh, factor: float | None) -> None:
    """Give every FSDP2 unit in ``units`` the divide ``factor`` (nothing for ``None``).

    With an FP32 or bf16 reduce dtype FSDP2 applies a factor other than the world size as
    NCCL's ``PREMUL_SUM``, which gloo does not have; on gloo the units therefore also force sum
    reductions (``set_force_sum_reduction_for_comms``: FSDP2 then divides after the sum).
    A torch without that method keeps ``PREMUL_SUM``, and on gloo the control's backward raises:
    a failing ``parity`` control row naming gloo's error, never a pass.
    """
    if factor is None:
        return
    force_sum = _backend(mesh) == "gloo"
    for unit in units:
        if not isinstance(unit, FSDPModule):
            continue
        unit.set_gradient_divide_factor(factor)
        if force_sum and hasattr(unit, "set_force_sum_reduction_for_comms"):
            unit.set_force_sum_reduction_for_comms(True)


def _backend(mesh: DeviceMesh) -> str:
    """The backend of ``mesh``'s (innermost) process group: the one FSDP2 reduce-scatters on."""
    return str(dist.get_backend(mesh.get_group(mesh.ndim - 1)))
