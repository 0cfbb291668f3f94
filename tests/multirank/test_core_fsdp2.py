"""The core library in every rank: wrapping, the seed reproducers, and loading.

Each test body runs in the plugin's torchrun ranks (``@pytest.mark.fsdp2``; gloo on CPU) with the
1-D mesh over all ranks.
"""

from __future__ import annotations

import copy
import functools
import re
from collections import OrderedDict
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

import fp32keep
from fp32keep import KeepLayoutError, StateDictError
from tests.core.toys import Stack, stack_class
from tests.error_bounds import LIBRARY_BOUND_S
from tests.multirank.refusals import refused_on_every_rank as shared_refused_on_every_rank
from tests.untouched import (
    assert_dict_unchanged,
    assert_same_parameters,
    assert_unchanged,
    dict_snapshot,
    fsdp_modules,
    snapshot,
)

pytestmark = pytest.mark.fsdp2  # every test runs in the ranks (2 by default)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
SEMANTICS = "5.10.4"  # toy declarations use 5.x glob entries; see tests/core/test_layout.py
BF16_POLICY = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)


def rank() -> int:
    return dist.get_rank()


def batch(vocab: int = 16) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 6), generator=torch.Generator().manual_seed(7))


def kept_stack(strict: list[str], dtype: torch.dtype = BF16) -> tuple[nn.Module, fp32keep.KeepPlan]:
    torch.manual_seed(0)
    model = stack_class(strict=strict)()
    plan = fp32keep.resolve_keep_plan(model, dtype, transformers_version=SEMANTICS)
    fp32keep.keep_aware_cast(model, dtype, plan=plan)
    return model, plan


def record_weight_dtypes(module: nn.Module) -> list[torch.dtype]:
    """Weight dtype at forward time, i.e. what FSDP2 all-gathered (its hook runs first)."""
    seen: list[torch.dtype] = []
    module.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    return seen


def record_input_dtypes(module: nn.Module) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    module.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    return seen


#: Every rank raises the same error within the library bound (tests/multirank/refusals.py).
refused_on_every_rank = functools.partial(shared_refused_on_every_rank, bound=LIBRARY_BOUND_S)


# --- the seed reproducers ------------------------------------------------------------------


def forced_fp32_norms() -> nn.Module:
    """accelerate's reproducer: a bf16 model whose norms were forced to FP32, nothing declared."""
    torch.manual_seed(0)
    model = Stack().to(BF16)
    for name, module in model.named_modules():
        if "norm" in name.lower():
            module.to(FP32)
    return model


def test_reproducer_mixed_dtype_unit_crashes_plain_fsdp2(mesh: DeviceMesh) -> None:
    model = forced_fp32_norms()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=BF16_POLICY)
    fully_shard(model, mesh=mesh, mp_policy=BF16_POLICY)
    with pytest.raises(AssertionError, match="FSDP expects uniform original parameter dtype"):
        model(batch())


def test_reproducer_mixed_dtype_unit_refused_then_trains_with_fp32_master(
    mesh: DeviceMesh,
) -> None:
    model = forced_fp32_norms()
    before = snapshot(model)
    with pytest.raises(KeepLayoutError, match="uniform original parameter dtype") as error:
        fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=BF16_POLICY)
    assert "layers.0.input_layernorm.weight" in error.value.fqns
    assert_unchanged(model, before)

    fp32keep.upcast_to_fp32_master(model)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=BF16_POLICY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        logits = model(batch())
        assert logits.dtype == BF16
        loss = logits.float().logsumexp(-1).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert torch.isfinite(loss)


def fp32_master_stack() -> nn.Module:
    """FP32 master weights, a bf16 policy, ``wo`` declared strict: the verl/accelerate setting."""
    torch.manual_seed(0)
    return stack_class(strict=["wo"])()


def test_reproducer_kept_module_all_gathered_in_bf16_by_plain_fsdp2(mesh: DeviceMesh) -> None:
    model = fp32_master_stack()
    seen = record_weight_dtypes(model.layers[0].wo)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=BF16_POLICY)
    fully_shard(model, mesh=mesh, mp_policy=BF16_POLICY)
    model(batch())
    assert model.layers[0].wo.weight.to_local().dtype == FP32  # storage is right...
    assert seen == [BF16]  # ...but the all-gather degraded it: the silent bug


def test_reproducer_kept_unit_with_callers_policy_all_gathers_bf16(mesh: DeviceMesh) -> None:
    # Transformers 5.24's own FSDP2 path: kept modules get units, but with the bf16 policy.
    model, _ = kept_stack(["wo"])
    seen = record_weight_dtypes(model.layers[0].wo)
    for layer in model.layers:
        fully_shard(layer.wo, mesh=mesh, mp_policy=BF16_POLICY)
        fully_shard(layer, mesh=mesh, mp_policy=BF16_POLICY)
    fully_shard(model, mesh=mesh, mp_policy=BF16_POLICY)
    model(batch())
    assert seen == [BF16]


def test_fp32_master_weights_keep_the_strict_list_under_a_bf16_policy(mesh: DeviceMesh) -> None:
    model = fp32_master_stack()
    seen = record_weight_dtypes(model.layers[0].wo)
    attn = record_weight_dtypes(model.layers[0].attn)
    # no plan given: resolved for the policy's param_dtype, since storage is FP32
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=BF16_POLICY)
    model(batch())
    assert seen == [FP32]
    assert attn == [BF16]  # tensors the plan does not keep get exactly plain FSDP2


def test_kept_module_all_gathered_in_fp32_by_apply_fsdp2(mesh: DeviceMesh) -> None:
    model, plan = kept_stack(["wo"])
    seen = record_weight_dtypes(model.layers[0].wo)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=BF16_POLICY, plan=plan)
    assert "layers.0.wo" in fsdp_modules(model)
    model(batch())
    assert model.layers[0].wo.weight.to_local().dtype == FP32
    assert seen == [FP32]


def test_kept_unit_keeps_the_activation_boundary(mesh: DeviceMesh) -> None:
    model, plan = kept_stack(["wo"])
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=BF16_POLICY, plan=plan)
    inputs = record_input_dtypes(model.layers[0].wo)
    model(batch())
    assert inputs == [FP32]  # the block casts to the weight dtype itself, as T5 does

    # A module that does not cast: its input must stay what the caller sends (bf16).
    model, plan = kept_stack(["mlp"])
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=BF16_POLICY, plan=plan)
    inputs = record_input_dtypes(model.layers[0].mlp)
    with torch.autocast("cpu", dtype=BF16):
        model(batch())
    assert inputs == [BF16]


def test_negative_control_fp32_param_dtype_changes_the_boundary(mesh: DeviceMesh) -> None:
    # The known wrong fix: a kept unit with param_dtype=torch.float32 casts its inputs to FP32.
    model, _ = kept_stack(["mlp"])
    for layer in model.layers:
        fully_shard(layer.mlp, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=FP32))
        fully_shard(layer, mesh=mesh, mp_policy=BF16_POLICY)
    fully_shard(model, mesh=mesh, mp_policy=BF16_POLICY)
    inputs = record_input_dtypes(model.layers[0].mlp)
    with torch.autocast("cpu", dtype=BF16):
        model(batch())
    assert inputs == [FP32]


def test_logits_loss_and_grads_match_unsharded_reference(mesh: DeviceMesh) -> None:
    model, plan = kept_stack(["wo", "norm"])
    reference = copy.deepcopy(model)
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, cast_forward_inputs=False)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=policy, plan=plan)
    ids = batch()
    for net in (model, reference):
        logits = net(ids)
        net.loss = logits.float().logsumexp(-1).mean()  # type: ignore[assignment]
        net.loss.backward()  # type: ignore[operator]
        net.logits = logits  # type: ignore[assignment]
    assert torch.equal(model.logits, reference.logits)  # type: ignore[arg-type]
    assert torch.equal(model.loss, reference.loss)  # type: ignore[arg-type]
    for (name, param), (_, ref_param) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert param.grad is not None and ref_param.grad is not None, name
        assert param.grad.dtype == ref_param.grad.dtype, name
        assert torch.equal(param.grad.full_tensor(), ref_param.grad), name


# --- apply_fsdp2 refusals --------------------------------------------------------------------


def root_owned_model() -> tuple[nn.Module, fp32keep.KeepPlan | None]:
    torch.manual_seed(0)
    model = stack_class(strict=["query_tokens"])()
    model.register_parameter("query_tokens", nn.Parameter(torch.randn(2, 8)))
    model.register_parameter("scale", nn.Parameter(torch.ones(8)))  # not kept: a mixed root
    plan = fp32keep.resolve_keep_plan(model, BF16, transformers_version=SEMANTICS)
    fp32keep.keep_aware_cast(model, BF16, plan=plan)
    return model, plan


def mixed_unit_model() -> tuple[nn.Module, fp32keep.KeepPlan | None]:
    # Rwkv's shape: the attention module owns time_decay and also low-precision weights.
    torch.manual_seed(0)
    model = stack_class(strict=["time_decay"])()
    for layer in model.layers:
        layer.attn.register_parameter("time_decay", nn.Parameter(torch.randn(8)))
    plan = fp32keep.resolve_keep_plan(model, BF16, transformers_version=SEMANTICS)
    fp32keep.keep_aware_cast(model, BF16, plan=plan)
    return model, plan


def tied_across_units_model() -> tuple[nn.Module, fp32keep.KeepPlan | None]:
    torch.manual_seed(0)
    model = Stack().to(BF16)
    # An alias on the root: no fully_shard call can group the root with a block's module.
    model.register_parameter("tied", model.layers[0].attn.weight)
    return model, None


def degraded_model() -> tuple[nn.Module, fp32keep.KeepPlan | None]:
    torch.manual_seed(0)
    model = stack_class(strict=["wo"])()
    plan = fp32keep.resolve_keep_plan(model, BF16, transformers_version=SEMANTICS)
    model.to(BF16)  # a blanket cast instead of keep_aware_cast
    return model, plan


def mixed_dtype_unit_model() -> tuple[nn.Module, fp32keep.KeepPlan | None]:
    return forced_fp32_norms(), None


@pytest.mark.parametrize(
    ("reason", "build", "fqn", "remedy"),
    [
        pytest.param(
            "root-owned",
            root_owned_model,
            "query_tokens",
            "move it into a submodule",
            id="root-owned",
        ),
        pytest.param(
            "mixed-unit",
            mixed_unit_model,
            "layers.1.attn.time_decay",
            "declare the whole module kept",
            id="mixed-unit",
        ),
        pytest.param(
            "tied-across-units",
            tied_across_units_model,
            "tied",
            "Wrap a common ancestor",
            id="tied-across-units",
        ),
        pytest.param(
            "degraded",
            degraded_model,
            "layers.0.wo.weight",
            "fp32keep.keep_aware_cast",
            id="degraded",
        ),
        pytest.param(
            "mixed-dtype-unit",
            mixed_dtype_unit_model,
            "layers.0.input_layernorm.weight",
            "upcast_to_fp32_master",
            id="mixed-dtype-unit",
        ),
    ],
)
def test_layout_refusal_leaves_every_rank_untouched(
    mesh: DeviceMesh,
    reason: str,
    build: Callable[[], tuple[nn.Module, fp32keep.KeepPlan | None]],
    fqn: str,
    remedy: str,
) -> None:
    model, plan = build()
    before = snapshot(model)
    error = refused_on_every_rank(
        lambda: fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=BF16_POLICY, plan=plan),
        KeepLayoutError,
        "nothing was sharded",
    )
    assert {problem.reason for problem in error.problems} == {reason}
    assert fqn in error.fqns
    assert f"{fqn}" in str(error) and f"[{reason}]" in str(error) and remedy in str(error)
    assert_unchanged(model, before)


def test_frozen_kept_parameter_in_a_mixed_module_is_replicated_fp32(mesh: DeviceMesh) -> None:
    torch.manual_seed(0)
    model = stack_class(strict=["expert_bias"])()
    for layer in model.layers:
        layer.attn.register_parameter(
            "expert_bias", nn.Parameter(torch.randn(8), requires_grad=False)
        )
    plan = fp32keep.resolve_keep_plan(model, BF16, transformers_version=SEMANTICS)
    fp32keep.keep_aware_cast(model, BF16, plan=plan)
    source = {k: v.clone() for k, v in model.state_dict().items()}
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=BF16_POLICY, plan=plan)
    bias = model.layers[0].attn.expert_bias
    assert not isinstance(bias, torch.distributed.tensor.DTensor)  # whole on every rank
    assert bias.dtype == FP32
    model(batch()).float().sum().backward()
    assert model.layers[0].attn.weight.grad is not None
    fp32keep.load_full_state_dict(model, source if rank() == 0 else None)
    assert_loaded(model, source)


def test_apply_twice_is_refused(mesh: DeviceMesh) -> None:
    model, plan = kept_stack(["wo"])
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=BF16_POLICY, plan=plan)
    units = fsdp_modules(model)
    before = snapshot(model)
    error = refused_on_every_rank(
        lambda: fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=BF16_POLICY, plan=plan),
        ValueError,
        r"already sharded: \['<root>', 'layers\.0', .*Call apply_fsdp2 once, on an unsharded model",
    )
    assert type(error) is fp32keep.Fp32KeepValueError  # a bad call, not a KeepLayoutError
    assert fsdp_modules(model) == units  # not sharded a second time
    assert_same_parameters(model, before)


def test_apply_without_a_mesh_is_refused() -> None:
    model, plan = kept_stack(["wo"])
    before = snapshot(model)
    refused_on_every_rank(
        lambda: fp32keep.apply_fsdp2(model, mesh=None, mp_policy=BF16_POLICY, plan=plan),  # type: ignore[arg-type]
        TypeError,
        r"mesh must be a torch\.distributed\.device_mesh\.DeviceMesh, got None",
    )
    assert_unchanged(model, before)


def test_apply_with_a_mesh_fsdp2_cannot_shard_over_is_refused(mesh: DeviceMesh) -> None:
    # "Wrong size" for apply_fsdp2 is a mesh FSDP2 cannot use: neither 1-D (FSDP) nor 2-D
    # (HSDP). A smaller 1-D or a 2-D mesh is valid here (composition with TP or PP), and the
    # loader serves both (next test).
    world = dist.get_world_size()
    cube = init_device_mesh(mesh.device_type, (world, 1, 1))
    model, plan = kept_stack(["wo"])
    before = snapshot(model)
    error = refused_on_every_rank(
        lambda: fp32keep.apply_fsdp2(model, mesh=cube, mp_policy=BF16_POLICY, plan=plan),
        ValueError,
        r"needs a 1-D mesh \(FSDP\) or a 2-D one .* pass the data-parallel sub-mesh",
    )
    assert f"3-D mesh of shape ({world}, 1, 1)" in str(error), error
    assert_unchanged(model, before)


def other_mesh(mesh: DeviceMesh, kind: str) -> DeviceMesh:
    """A mesh that is not the plain 1-D one over every rank (issue 12: both load exactly)."""
    world = dist.get_world_size()
    if kind == "sub-mesh":  # a 1-D mesh of one rank: each rank holds a whole copy
        return init_device_mesh(mesh.device_type, (world, 1), mesh_dim_names=("dp", "alone"))[
            "alone"
        ]
    return init_device_mesh(mesh.device_type, (1, world), mesh_dim_names=("replicate", "shard"))


@pytest.mark.parametrize("kind", ["sub-mesh", "hsdp"])
def test_load_into_a_model_sharded_over_a_sub_mesh_or_hsdp(mesh: DeviceMesh, kind: str) -> None:
    # More meshes (2 x 2 HSDP, the dp sub-mesh of a DP x TP world, Shard(1)) on 4 ranks:
    # tests/multirank/test_load_meshes_fsdp2.py
    model, plan = kept_stack(["wo"])
    fp32keep.apply_fsdp2(model, mesh=other_mesh(mesh, kind), mp_policy=BF16_POLICY, plan=plan)
    source = fresh_full_state()
    held = dict_snapshot(source)
    fp32keep.load_full_state_dict(model, source if rank() == 0 else None)
    assert_loaded(model, source)
    assert_dict_unchanged(source, held)


@pytest.mark.parametrize(
    ("field", "bad", "expected", "match"),
    [
        pytest.param(
            "param_dtype",
            torch.int32,
            ValueError,
            r"mp_policy\.param_dtype must be a floating dtype \(torch\.float16.*got torch\.int32",
            id="param_dtype-int32",
        ),
        pytest.param(
            "param_dtype",
            "bf17",
            TypeError,
            r"mp_policy\.param_dtype must be a torch\.dtype such as torch\.bfloat16, got 'bf17'",
            id="param_dtype-bf17",
        ),
        pytest.param(
            "reduce_dtype",
            torch.int32,
            ValueError,
            r"mp_policy\.reduce_dtype must be a floating dtype",
            id="reduce_dtype-int32",
        ),
        pytest.param(
            "reduce_dtype",
            "bf17",
            TypeError,
            r"mp_policy\.reduce_dtype must be a torch\.dtype",
            id="reduce_dtype-bf17",
        ),
        pytest.param(
            "output_dtype",
            torch.int32,
            ValueError,
            r"mp_policy\.output_dtype must be a floating dtype",
            id="output_dtype-int32",
        ),
        pytest.param(
            "output_dtype",
            "bf17",
            TypeError,
            r"mp_policy\.output_dtype must be a torch\.dtype",
            id="output_dtype-bf17",
        ),
    ],
)
def test_bad_policy_dtype_is_refused(
    mesh: DeviceMesh, field: str, bad: object, expected: type[Exception], match: str
) -> None:
    model, plan = kept_stack(["wo"])
    before = snapshot(model)
    policy = MixedPrecisionPolicy(**{field: bad})  # type: ignore[arg-type]
    refused_on_every_rank(
        lambda: fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=policy, plan=plan),
        expected,
        match,
    )
    assert_unchanged(model, before)


def test_grouped_kept_units_keep_the_contract(mesh: DeviceMesh) -> None:
    model, plan = kept_stack(["norm"])
    seen = record_weight_dtypes(model.layers[0].post_attention_layernorm)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=BF16_POLICY, plan=plan, group_kept=True)
    model(batch()).float().sum().backward()
    assert seen == [FP32]


# --- load_full_state_dict ---------------------------------------------------------------------


def fresh_full_state() -> OrderedDict[str, torch.Tensor]:
    torch.manual_seed(123)
    return stack_class(strict=["wo"])().state_dict()


def sharded_kept_stack(mesh: DeviceMesh, **apply: object) -> nn.Module:
    model, plan = kept_stack(["wo"])
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=BF16_POLICY, plan=plan, **apply)  # type: ignore[arg-type]
    return model


def expected_after_load(
    model: nn.Module, source: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    dtypes = {name: t.dtype for name, t in model.state_dict().items()}
    return {name: source[name].to(dtypes[name]) for name in dtypes}


def assert_loaded(model: nn.Module, source: dict[str, torch.Tensor]) -> None:
    full = fp32keep.gather_full_state_dict(model)
    expected = expected_after_load(model, source)
    assert full.keys() == expected.keys()
    for name, value in expected.items():
        assert full[name].dtype == value.dtype, name
        assert torch.equal(full[name], value), name


def test_load_destination_dtype_wins_and_caller_dict_untouched(mesh: DeviceMesh) -> None:
    model = sharded_kept_stack(mesh)
    source = fresh_full_state()
    # a bf16 checkpoint: kept tensors arrive bf16 and must land FP32 (upcast values)
    checkpoint = OrderedDict((k, v.to(BF16)) for k, v in source.items())
    checkpoint._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    identity = {k: id(v) for k, v in checkpoint.items()}
    result = fp32keep.load_full_state_dict(model, checkpoint if rank() == 0 else None)
    assert result == fp32keep.LoadResult()
    assert model.layers[0].wo.weight.to_local().dtype == FP32
    assert_loaded(model, dict(checkpoint))
    # the caller's mapping: same keys, same tensor objects, same dtypes, metadata intact
    assert {k: id(v) for k, v in checkpoint.items()} == identity
    assert {v.dtype for v in checkpoint.values()} == {BF16}
    assert checkpoint._metadata == {"": {"version": 1}}  # type: ignore[attr-defined]


def test_load_ties_survive_and_one_alias_suffices(mesh: DeviceMesh) -> None:
    torch.manual_seed(0)
    model = stack_class(strict=["wo"])()
    model.head.weight = model.embed.weight
    plan = fp32keep.resolve_keep_plan(model, BF16, transformers_version=SEMANTICS)
    fp32keep.keep_aware_cast(model, BF16, plan=plan)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=BF16_POLICY, plan=plan)
    source = fresh_full_state()
    deduplicated = {k: v for k, v in source.items() if k != "head.weight"}  # as safetensors saves
    fp32keep.load_full_state_dict(model, deduplicated if rank() == 0 else None)
    assert model.head.weight is model.embed.weight
    full = fp32keep.gather_full_state_dict(model)
    assert torch.equal(full["head.weight"], source["embed.weight"].to(BF16))


def test_load_small_buckets_is_exact(mesh: DeviceMesh) -> None:
    model = sharded_kept_stack(mesh)
    source = fresh_full_state()
    fp32keep.load_full_state_dict(model, source if rank() == 0 else None, bucket_bytes=40)
    assert_loaded(model, source)


@pytest.mark.parametrize("checkpoint_dtype", [FP32, BF16], ids=["fp32", "bf16"])
def test_load_direct_scatter_and_buckets_mixed_are_exact(
    mesh: DeviceMesh, checkpoint_dtype: torch.dtype
) -> None:
    # vocab 15 splits unevenly over 2 ranks (embed, head go through buckets); every other tensor
    # splits evenly and, with direct_bytes=0, is scattered straight into its local shard.
    torch.manual_seed(0)
    model = stack_class(strict=["wo"])(vocab=15)
    plan = fp32keep.resolve_keep_plan(model, BF16, transformers_version=SEMANTICS)
    fp32keep.keep_aware_cast(model, BF16, plan=plan)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=BF16_POLICY, plan=plan)
    torch.manual_seed(5)
    source = {
        k: v.to(checkpoint_dtype)
        for k, v in stack_class(strict=["wo"])(vocab=15).state_dict().items()
    }
    fp32keep.load_full_state_dict(
        model, source if rank() == 0 else None, direct_bytes=0, bucket_bytes=64
    )
    assert_loaded(model, source)
    assert model.layers[0].wo.weight.to_local().dtype == FP32


def test_load_from_rank_1(mesh: DeviceMesh) -> None:
    model = sharded_kept_stack(mesh)
    source = fresh_full_state()
    fp32keep.load_full_state_dict(model, source if rank() == 1 else None, src_rank=1)
    assert_loaded(model, source)


def test_load_into_meta_model(mesh: DeviceMesh) -> None:
    with torch.device("meta"):
        model = stack_class(strict=["wo"])()
    plan = fp32keep.resolve_keep_plan(model, BF16, transformers_version=SEMANTICS)
    fp32keep.keep_aware_cast(model, BF16, plan=plan)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=BF16_POLICY, plan=plan)
    source = fresh_full_state()
    fp32keep.load_full_state_dict(model, source if rank() == 0 else None)
    assert not any(p.is_meta for p in model.parameters())
    assert_loaded(model, source)
    model(batch()).float().sum().backward()


def test_load_with_cpu_offload(mesh: DeviceMesh) -> None:
    model = sharded_kept_stack(mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    source = fresh_full_state()
    fp32keep.load_full_state_dict(model, source if rank() == 0 else None, cpu_offload=True)
    assert all(p.to_local().device.type == "cpu" for p in model.parameters())
    assert_loaded(model, source)
    model(batch()).float().sum().backward()


def _every_rank_raises(
    mesh: DeviceMesh, mutate: Callable[[dict[str, object]], None], match: str
) -> StateDictError:
    model = sharded_kept_stack(mesh)
    before = fp32keep.gather_full_state_dict(model)
    source: dict[str, object] = dict(fresh_full_state())
    mutate(source)
    held = dict_snapshot(source)
    error = refused_on_every_rank(  # the same error on every rank
        lambda: fp32keep.load_full_state_dict(model, source if rank() == 0 else None),
        StateDictError,
        match,
    )
    assert "does not fit the model; nothing was loaded" in str(error)
    assert_dict_unchanged(source, held)
    after = fp32keep.gather_full_state_dict(model)
    assert all(torch.equal(after[k], before[k]) for k in before)  # nothing loaded
    return error


def test_load_missing_key(mesh: DeviceMesh) -> None:
    error = _every_rank_raises(mesh, lambda sd: sd.pop("layers.1.wo.weight"), "missing keys")
    assert error.missing == ("layers.1.wo.weight",)
    assert "'layers.1.wo.weight'" in str(error) and "Pass strict=False" in str(error)


def test_load_unexpected_key(mesh: DeviceMesh) -> None:
    error = _every_rank_raises(
        mesh, lambda sd: sd.__setitem__("layers.9.wo.weight", torch.zeros(2)), "unexpected keys"
    )
    assert error.unexpected == ("layers.9.wo.weight",)
    assert "'layers.9.wo.weight'" in str(error) and "Pass strict=False" in str(error)


def test_load_shape_mismatch(mesh: DeviceMesh) -> None:
    error = _every_rank_raises(
        mesh,
        lambda sd: sd.__setitem__("layers.0.wo.weight", torch.zeros(3, 8)),
        r"has shape \(3, 8\)",
    )
    assert error.mismatched[0][0] == "layers.0.wo.weight"


def test_load_non_tensor_meta_and_integer_entries(mesh: DeviceMesh) -> None:
    def mutate(sd: dict[str, object]) -> None:
        sd["layers.0.wo.weight"] = [[0.0] * 8] * 8
        sd["layers.0.attn.weight"] = torch.empty(8, 8, device="meta")
        sd["layers.0.attn.bias"] = torch.zeros(8, dtype=torch.int64)

    error = _every_rank_raises(mesh, mutate, "cannot be loaded")
    reasons = dict(error.mismatched)
    assert "not a tensor" in reasons["layers.0.wo.weight"]
    assert "meta device" in reasons["layers.0.attn.weight"]
    assert "integer" in reasons["layers.0.attn.bias"]


def test_load_non_strict_reports_and_loads_the_rest(mesh: DeviceMesh) -> None:
    model = sharded_kept_stack(mesh)
    source = fresh_full_state()
    partial = {k: v for k, v in source.items() if k != "norm.weight"}
    partial["extra"] = torch.zeros(1)
    result = fp32keep.load_full_state_dict(model, partial if rank() == 0 else None, strict=False)
    assert result.missing_keys == ("norm.weight",)
    assert result.unexpected_keys == ("extra",)
    full = fp32keep.gather_full_state_dict(model)
    assert torch.equal(full["layers.1.wo.weight"], source["layers.1.wo.weight"])


def test_load_dict_on_wrong_or_no_rank(mesh: DeviceMesh) -> None:
    model = sharded_kept_stack(mesh)
    before = snapshot(model)
    source = fresh_full_state()
    held = dict_snapshot(source)
    remedy = r"it must be held by src_rank=0 alone \(pass None on every other rank\)"
    everyone = re.escape(f"ranks {list(range(dist.get_world_size()))}")
    for given, where in ((source, everyone), (None, "no rank")):
        refused_on_every_rank(
            lambda given=given: fp32keep.load_full_state_dict(model, given),  # type: ignore[misc]
            ValueError,
            rf"held by {where}; {remedy} \[raised on rank \d\]",
            same_message=False,  # each rank names itself
        )
    refused_on_every_rank(
        lambda: fp32keep.load_full_state_dict(model, source if rank() == 1 else None),
        ValueError,
        rf"held by ranks \[1\]; {remedy}",
        same_message=False,
    )
    assert_same_parameters(model, before)
    assert_dict_unchanged(source, held)


def test_load_before_apply_is_refused() -> None:
    model, _ = kept_stack(["wo"])
    before = snapshot(model)
    source = fresh_full_state()
    held = dict_snapshot(source)
    refused_on_every_rank(
        lambda: fp32keep.load_full_state_dict(model, source if rank() == 0 else None),
        ValueError,
        r"KeptStack is not sharded: call fp32keep\.apply_fsdp2\(model, \.\.\.\) before "
        r"load_full_state_dict \(for an unsharded model use model\.load_state_dict\)",
    )
    assert_unchanged(model, before)
    assert_dict_unchanged(source, held)


# --- a real Transformers model ----------------------------------------------------------------


def test_t5_fp16_keeps_wo_through_wrap_and_load(mesh: DeviceMesh) -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
    )
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config)
    source = {k: v.clone() for k, v in model.state_dict().items()}
    plan = fp32keep.resolve_keep_plan(model, FP16)
    assert len(plan.param_names) == 4  # one `wo` per block, regular list under fp16
    fp32keep.keep_aware_cast(model, FP16, plan=plan)
    wo = model.encoder.block[0].layer[1].DenseReluDense.wo
    seen = record_weight_dtypes(wo)
    policy = MixedPrecisionPolicy(param_dtype=FP16, reduce_dtype=FP32)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=policy, plan=plan)
    fp32keep.load_full_state_dict(model, source if rank() == 0 else None)
    assert_loaded(model, source)
    ids = batch(64)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert seen == [FP32]
    assert torch.isfinite(out.loss)
    assert isinstance(model, FSDPModule)
    assert isinstance(wo, FSDPModule)
