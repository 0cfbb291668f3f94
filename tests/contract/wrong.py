"""Known-wrong implementations shared by several contract tests (the negative controls).

Each is a ``shard=`` function for ``assert_fp32_keep_contract``: fp32keep's own layout and
policies, then one precision loss that only ``parity`` can see.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from fp32keep import KeepPlan, WrapSpec, apply_fsdp2

SCALE = 1 + 2**-10
"""How much too large each kept gradient is made: far below one bf16 rounding (``2**-8``)."""


def scaled_kept_gradients(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    plan: KeepPlan,
    wrap: WrapSpec | None,
) -> None:
    """fp32keep's wrapping, then every kept parameter's gradient scaled by ``SCALE``."""
    apply_fsdp2(model, mesh=mesh, mp_policy=mp_policy, plan=plan, wrap=wrap)
    hooked: set[int] = set()

    def scale(module: nn.Module, args: Any) -> None:
        # After FSDP2's own pre-forward (registered first, prepended): the module's parameters
        # are the unsharded leaves whose .grad FSDP2 reduce-scatters after backward.
        for name, param in module.named_parameters(recurse=False):
            if param.requires_grad and id(param) not in hooked and _owner(module, name) in plan:
                hooked.add(id(param))
                param.register_hook(lambda grad: grad * SCALE)

    names = {id(m): fqn for fqn, m in model.named_modules()}

    def _owner(module: nn.Module, name: str) -> str:
        fqn = names[id(module)]
        return f"{fqn}.{name}" if fqn else name

    for module in model.modules():
        module.register_forward_pre_hook(scale)
