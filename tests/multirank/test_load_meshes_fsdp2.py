"""Loading into FSDP2 models over the meshes real trainers use, on 4 ranks (one session).

HSDP (a 2 x 2 replicate x shard mesh), FSDP on the ``dp`` sub-mesh of a 2 x 2 DP x TP world, and
``Shard(1)`` placements from a ``shard_placement_fn``: every tensor must come back bit-equal to
the source dict's in the keep plan's dtype, on every rank, after
:func:`fp32keep.load_full_state_dict` from global rank 0. Which bytes land where is checked two
ways: the gathered full state dict against the source, and every rank's local shard against the
block its own mesh coordinate names (so a loader that sends one replica group's shard to the
other, or ignores the sub-mesh coordinate, fails here; the negative controls prove the checks
catch exactly that).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Shard

import fp32keep
from tests.core.toys import stack_class
from tests.error_bounds import LIBRARY_BOUND_S
from tests.multirank.refusals import refused_on_every_rank as shared_refused_on_every_rank
from tests.untouched import assert_dict_unchanged, dict_snapshot

pytestmark = pytest.mark.fsdp2(nproc=4)  # every test here shares one 4-rank session

BF16, FP32 = torch.bfloat16, torch.float32
BF16_POLICY = MixedPrecisionPolicy(param_dtype=BF16)

#: Every rank raises the same error within the library bound (tests/multirank/refusals.py).
refused_on_every_rank = functools.partial(shared_refused_on_every_rank, bound=LIBRARY_BOUND_S)


def device_type() -> str:
    """The ranks' device type: CUDA under NCCL (ci/gpu-check with 4 GPUs), else the CPU."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def hsdp_mesh() -> DeviceMesh:
    return init_device_mesh(device_type(), (2, 2), mesh_dim_names=("replicate", "shard"))


def dp_sub_mesh() -> DeviceMesh:
    """The 1-D ``dp`` mesh of a 2 x 2 DP x TP world: ranks {0, 2} and {1, 3}."""
    return init_device_mesh(device_type(), (2, 2), mesh_dim_names=("dp", "tp"))["dp"]


def kept_model(width: int = 8) -> tuple[nn.Module, fp32keep.KeepPlan]:
    """The toy decoder in bf16 with ``wo`` and the norms kept FP32 (a mixed-dtype plan)."""
    torch.manual_seed(0)
    model = stack_class(strict=["wo", "norm"])(width=width)
    plan = fp32keep.resolve_keep_plan(model, BF16)
    fp32keep.keep_aware_cast(model, BF16, plan=plan)
    return model, plan


def source_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A full FP32 checkpoint with other values than the model's (every rank builds it alike)."""
    generator = torch.Generator().manual_seed(7)
    return {
        name: torch.randn(value.shape, generator=generator, dtype=FP32)
        for name, value in model.state_dict().items()
    }


def expected_block(full: torch.Tensor, value: DTensor) -> torch.Tensor:
    """The block of ``full`` that this rank's coordinate in ``value``'s mesh names."""
    mesh, coordinate = value.device_mesh, value.device_mesh.get_coordinate()
    assert coordinate is not None
    piece = full
    for mesh_dim, placement in enumerate(value.placements):
        if isinstance(placement, Shard):
            chunks = list(piece.chunk(mesh.size(mesh_dim), dim=placement.dim))
            index = coordinate[mesh_dim]
            piece = chunks[index] if index < len(chunks) else piece.narrow(placement.dim, 0, 0)
    return piece


def assert_loaded_exactly(
    model: nn.Module, source: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype]
) -> None:
    """Every local shard is its block of the source in the planned dtype, bit for bit, and the
    gathered full state dict equals the source (a collective: call it on every rank)."""
    full = fp32keep.gather_full_state_dict(model)  # first: every rank takes part, pass or fail
    for name, value in model.state_dict().items():
        want = source[name].to(dtypes[name])
        assert value.dtype == dtypes[name], (name, value.dtype)
        if isinstance(value, DTensor):
            local, block = value.to_local().cpu(), expected_block(want, value)
            assert torch.equal(local, block), f"rank {dist.get_rank()}: {name} is not its block"
    for name, value in full.items():
        want = source[name].to(dtypes[name])
        assert value.dtype == want.dtype and torch.equal(value, want), name


def planned_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    return {name: value.dtype for name, value in model.state_dict().items()}


def load_from_rank0(model: nn.Module, source: dict[str, torch.Tensor], **options: object) -> None:
    fp32keep.load_full_state_dict(model, source if dist.get_rank() == 0 else None, **options)  # type: ignore[arg-type]


# bucket sizes: the default (direct scatters for big blocks, one bucket), and tiny buckets with
# no direct scatter (every tensor through many buckets; a bucket smaller than one tensor)
OPTIONS = {
    "default": {"direct_bytes": 64},
    "buckets": {"bucket_bytes": 96, "direct_bytes": 1 << 40},
}


@pytest.mark.parametrize("how", list(OPTIONS))
@pytest.mark.parametrize("where", ["hsdp", "sub-mesh"])
def test_apply_fsdp2_then_load_is_exact(where: str, how: str) -> None:
    model, plan = kept_model(width=16)
    mesh = hsdp_mesh() if where == "hsdp" else dp_sub_mesh()
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=BF16_POLICY, plan=plan)
    dtypes = planned_dtypes(model)
    assert dtypes["layers.0.wo.weight"] == FP32 and dtypes["layers.0.attn.weight"] == BF16
    source = source_dict(model)
    held = dict_snapshot(source)
    load_from_rank0(model, source, **OPTIONS[how])
    assert_loaded_exactly(model, source, dtypes)
    assert_dict_unchanged(source, held)


def shard_dim1(param: nn.Parameter) -> Shard | None:
    """MoE-style: 2-D weights on Shard(1) (columns split evenly over 4 ranks), else Shard(0)."""
    return Shard(1) if param.ndim == 2 and param.shape[1] % 4 == 0 else None


@pytest.mark.parametrize("where", ["fsdp", "hsdp"])
def test_shard_placement_fn_on_dim_1_loads_exactly(where: str) -> None:
    model, _ = kept_model(width=16)
    mesh = hsdp_mesh() if where == "hsdp" else init_device_mesh(device_type(), (4,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, shard_placement_fn=shard_dim1)
    fully_shard(model, mesh=mesh, shard_placement_fn=shard_dim1)
    placements = {
        n: p.placements[-1] for n, p in model.named_parameters() if isinstance(p, DTensor)
    }
    assert placements["layers.0.attn.weight"] == Shard(1)
    assert placements["layers.0.attn.bias"] == Shard(0)
    dtypes = planned_dtypes(model)
    source = source_dict(model)
    load_from_rank0(model, source, direct_bytes=64)
    assert_loaded_exactly(model, source, dtypes)


def test_contract_holds_on_a_2x2_hsdp_mesh() -> None:
    from pytest_fp32keep import assert_fp32_keep_contract

    factory = stack_class(strict=["wo", "norm"])

    def batch(model: nn.Module) -> torch.Tensor:
        return torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(3))

    report = assert_fp32_keep_contract(factory, batch, mesh=hsdp_mesh(), dtype=BF16)
    assert report.ok and all(report.status().values())
    assert {row.stored for row in report.kept} == {"float32"}


def test_tensor_parallel_placements_are_refused_on_every_rank() -> None:
    model, plan = kept_model()
    fp32keep.apply_fsdp2(
        model, mesh=init_device_mesh(device_type(), (4,)), mp_policy=BF16_POLICY, plan=plan
    )
    tp = init_device_mesh(device_type(), (4,))
    partial = DTensor.from_local(
        torch.zeros(8, device=device_type()), tp, [Partial()], run_check=False
    )
    model.norm.register_parameter("tp_scale", nn.Parameter(partial, requires_grad=False))
    source = source_dict(model)
    held = dict_snapshot(source)
    error = refused_on_every_rank(
        lambda: load_from_rank0(model, source),
        fp32keep.Fp32KeepNotImplementedError,
        r"norm\.tp_scale is sharded as \(Partial\(sum\),\) over a mesh of shape \(4,\)",
    )
    assert "set_model_state_dict" in str(error)
    assert isinstance(error, NotImplementedError)  # what it was before the common base
    assert_dict_unchanged(source, held)


# --- negative controls: the exactness check catches the wrong bytes in the wrong place ---------


def test_negative_control_the_check_catches_a_misplaced_shard() -> None:
    model, plan = kept_model(width=16)
    fp32keep.apply_fsdp2(model, mesh=hsdp_mesh(), mp_policy=BF16_POLICY, plan=plan)
    dtypes = planned_dtypes(model)
    source = source_dict(model)
    load_from_rank0(model, source, direct_bytes=64)
    assert_loaded_exactly(model, source, dtypes)  # the right load passes
    # Known wrong: rank 3 holds the other rows of one weight's block (what a loader that ignored
    # a mesh coordinate would leave). Rank 3's own block check and the gather of its replica
    # group (ranks 2 and 3; HSDP gathers over the shard dim) must fail; ranks 0 and 1 gather
    # only from each other and pass, which is why the local check exists.
    weight = model.layers[0].attn.weight
    assert isinstance(weight, DTensor)
    if dist.get_rank() == 3:
        with torch.no_grad():
            local = weight.to_local()
            wrong = expected_block(source["layers.0.attn.weight"].to(BF16), weight).flip(0)
            local.copy_(wrong)
    if dist.get_rank() in (2, 3):
        with pytest.raises(AssertionError, match=r"layers\.0\.attn\.weight"):
            assert_loaded_exactly(model, source, dtypes)
    else:
        assert_loaded_exactly(model, source, dtypes)
