"""Rank-side script for ``test_probe_fsdp.py``: real FSDP2 on gloo, observed by ``DtypeProbe``.

Run as ``python -m torch.distributed.run --standalone --nproc-per-node=2 fsdp_probe_worker.py OUT``.
Every rank writes ``OUT/rank<r>.json`` with, per scenario and per attach order, the probe's
``to_dict()`` and its boundary diff against an unsharded reference run in the same context.
The assertions live in the test, so a failure there shows the observed dtypes.

The model has an "Inkling-style" module (``Inkling``: records its input dtype, computes in FP32,
casts back), the module a Hugging Face FP32-keep declaration would name. Scenarios:

- ``bf16_child``: the Inkling unit with the caller's ``param_dtype=bf16`` policy (what
  Transformers 5.24 does): its weight is all-gathered in bf16.
- ``keep_none``: the Inkling unit with ``param_dtype=None`` over FP32 storage (the contract):
  weight all-gathered in FP32, activation boundary unchanged (bf16, as the root cast it).
- ``keep_fp32``: the Inkling unit with ``param_dtype=torch.float32`` (the known-wrong fix):
  FSDP2 casts the unit's input to FP32, so the boundary turns FP32.
- ``output_cast``: the Inkling unit with ``output_dtype=torch.float32``: its forward returns bf16
  but its caller receives FP32, which the probe must report in both attach orders.

This file is replaced by the plugin's ``fsdp2`` marker once it lands.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from pytest_fp32keep.contract.probe import DtypeProbe, diff_boundaries
from pytest_fp32keep.contract.reference import build_unsharded_reference

DIM = 8
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)


class Inkling(nn.Module):
    """Stores an FP32-keep weight, computes in FP32 (autocast off) and returns its input's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, DIM) / DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        with torch.autocast("cpu", enabled=False):
            y = F.linear(x.to(torch.float32), self.weight.to(torch.float32))
        return y.to(input_dtype)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.conv = Inkling()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.proj(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.block = Block()
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def build() -> Net:
    torch.manual_seed(0)
    return Net()


# Child (Inkling unit) policy per scenario; the root always uses BF16.
CHILD_POLICIES: dict[str, MixedPrecisionPolicy] = {
    "bf16_child": BF16,
    "keep_none": dataclasses.replace(BF16, param_dtype=None),
    "keep_fp32": dataclasses.replace(BF16, param_dtype=torch.float32),
    "output_cast": dataclasses.replace(BF16, output_dtype=torch.float32),
}


def shard(model: Net, child_policy: MixedPrecisionPolicy) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.block.conv, mesh=mesh, mp_policy=child_policy)
    fully_shard(model, mesh=mesh, mp_policy=BF16)


def reference_model() -> Net:
    """The unsharded model FSDP2 with ``keep_none`` should be transparent to.

    Keep-aware cast by hand (the Inkling weight stays FP32, the rest goes to bf16): this script
    tests the probe, not ``fp32keep``.
    """
    model = build()
    model.to(torch.bfloat16)
    model.block.conv.to(torch.float32)
    return model


def run(model: nn.Module, x: torch.Tensor, autocast: bool = True) -> torch.Tensor:
    # Engine-style context (verl's FSDPEngine): without it the known-wrong fix does not even
    # run, since the FP32 output of the Inkling unit reaches a bf16 Linear.
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    out.float().sum().backward()
    return out.detach()


def probed_run(
    model: Net, attach_first: bool, child_policy: MixedPrecisionPolicy, autocast: bool = True
) -> DtypeProbe:
    """Shard ``model``, attaching the probe before or after ``fully_shard``, then run it."""
    x = batch()
    if attach_first:
        probe = DtypeProbe(model).attach()
        shard(model, child_policy)
    else:
        shard(model, child_policy)
        probe = DtypeProbe(model).attach()
    try:
        run(model, x, autocast)
    finally:
        probe.detach()
    return probe


def batch() -> torch.Tensor:
    # The same batch on every rank keeps the comparison simple; FP32 so the root's
    # cast_forward_inputs is what makes the activations bf16.
    generator = torch.Generator().manual_seed(1)
    return torch.randn(4, DIM, generator=generator)


def local_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    grads: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        grad: Any = param.grad
        if grad is not None:
            grads[name] = grad.to_local() if hasattr(grad, "to_local") else grad
    return grads


def numerics_unchanged() -> dict[str, bool]:
    """Sharded logits and local gradient shards with and without a probe, bit for bit."""
    plain = build()
    shard(plain, CHILD_POLICIES["keep_none"])
    plain_out = run(plain, batch())
    probed = build()
    with DtypeProbe(probed):
        shard(probed, CHILD_POLICIES["keep_none"])
        probed_out = run(probed, batch())
    plain_grads, probed_grads = local_grads(plain), local_grads(probed)
    return {
        "logits": torch.equal(plain_out, probed_out),
        "grads": plain_grads.keys() == probed_grads.keys()
        and all(torch.equal(plain_grads[k], probed_grads[k]) for k in plain_grads),
    }


def reference_checks() -> dict[str, Any]:
    """``build_unsharded_reference`` against a real FSDP2 model."""
    model = build()
    reference = build_unsharded_reference(model)
    shard(model, CHILD_POLICIES["keep_none"])
    matches = all(
        torch.equal(param.full_tensor(), dict(reference.named_parameters())[name])
        for name, param in model.named_parameters()
    )
    try:
        build_unsharded_reference(model)
    except ValueError as error:
        refused = str(error)
    else:
        refused = ""
    return {"reference_matches_full_shards": matches, "reference_of_sharded_error": refused}


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict[str, Any] = {"world_size": dist.get_world_size()}
    reference = reference_model()
    with DtypeProbe(reference) as reference_probe:
        run(reference, batch().to(torch.bfloat16))
    results["reference"] = reference_probe.to_dict()
    # The contract holds outside autocast too (the known-wrong fix would not even run there).
    direct_reference = reference_model()
    with DtypeProbe(direct_reference) as direct_probe:
        run(direct_reference, batch().to(torch.bfloat16), autocast=False)
    direct = probed_run(build(), False, CHILD_POLICIES["keep_none"], autocast=False)
    results["keep_none_direct"] = {
        "probe": direct.to_dict(),
        "summary": direct.summary(),
        "diff_vs_reference": [m.to_dict() for m in diff_boundaries(direct_probe, direct)],
    }
    for name, child_policy in CHILD_POLICIES.items():
        results[name] = {}
        for order, attach_first in (("attach_before_shard", True), ("attach_after_shard", False)):
            probe = probed_run(build(), attach_first, child_policy)
            results[name][order] = {
                "probe": probe.to_dict(),
                "summary": probe.summary(),
                "diff_vs_reference": [m.to_dict() for m in diff_boundaries(reference_probe, probe)],
            }
    results["numerics_unchanged"] = numerics_unchanged()
    results.update(reference_checks())
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(Path(sys.argv[1]))
