"""PROTOTYPE of a proposed option for ``impl/fp32keep/wrap.py`` and ``layout.py`` (not the
library; delete when the option lands): one model-wide kept unit, not resharded after forward.

Measured by ``python bench/bench_step.py --prototype`` as the arm ``(d) proposed``.

``group_kept=True`` gives every block one kept unit, resharded after forward like the block
itself: per step and block that is one extra all-gather in forward, one more in backward and one
extra reduce-scatter, plus FSDP2's per-unit hooks and copies. Kept modules are norms and routers:
a few vectors and ``num_experts x hidden`` matrices per block, tiny next to the block. So the
proposal shards every kept module of the model as a single unit (``fully_shard`` on the list)
with ``reshard_after_forward=False``: its parameters are all-gathered once, at the first kept
module's forward, stay unsharded until the step's backward has produced all their gradients,
and are reduce-scattered once. Per step that is one all-gather and one reduce-scatter for all
kept parameters together, whatever the depth of the model.

Cost: every rank holds the kept parameters unsharded (FP32) from the first forward to the end of
backward. For Qwen3-235B-A22B (94 layers, 128 experts, hidden 4096) that is two norms of 4096 and
a 128 x 4096 router per layer: about 0.2 GB; for dense models only the norms (a few MB). Worth a
flag (for example ``group_kept="model"``) rather than a silent default.

The layout is validated by the library's own :func:`fp32keep.plan_layout` (``group_kept=False``
gives the list of kept modules; every refusal still happens before anything is sharded), then
sharded children first, as ``apply_fsdp2`` does.
"""

from __future__ import annotations

import dataclasses

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fp32keep


def apply_fsdp2_model_wide_kept(
    model: nn.Module, *, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy, plan: fp32keep.KeepPlan
) -> nn.Module:
    """Shard like :func:`fp32keep.apply_fsdp2`, but all kept modules form one unit that is not
    resharded after forward (the kept policy is the caller's minus ``param_dtype``, as there)."""
    layout = fp32keep.plan_layout(model, plan, group_kept=False)
    modules = dict(model.named_modules(remove_duplicate=False))
    kept = [
        modules[fqn] for unit in layout.units if unit.kind == "kept" for fqn in unit.module_fqns
    ]
    if kept:
        kept_policy = dataclasses.replace(mp_policy, param_dtype=None)
        fully_shard(
            kept if len(kept) > 1 else kept[0],
            mesh=mesh,
            mp_policy=kept_policy,
            reshard_after_forward=False,
        )
    # The remaining units in the library's order: deepest first, the root last.
    for unit in layout.units:
        if unit.kind != "kept":
            fully_shard(modules[unit.module_fqns[0]], mesh=mesh, mp_policy=mp_policy)
    return model
