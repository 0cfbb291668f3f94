"""Kept units in the ranks: the kept-unit policy, owners with children, nested units, direct reads.

Each test body runs in the plugin's torchrun ranks (``@pytest.mark.fsdp2``; gloo on CPU, 2 ranks by
default). Every check has its negative control: the known-wrong layout or policy, sharded by hand
with ``fully_shard``, fails the same check.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import fp32keep
from fp32keep import KeepLayoutError
from fp32keep.shard.apply import kept_unit_policy
from pytest_fp32keep import assert_fp32_keep_contract
from tests.core.kept_toys import (
    ConvReadStack,
    EncodeStack,
    ReadStack,
    RouterStack,
    SinkStack,
    TowerStack,
)
from tests.error_bounds import LIBRARY_BOUND_S
from tests.multirank.refusals import refused_on_every_rank as shared_refused_on_every_rank
from tests.untouched import assert_unchanged, snapshot

pytestmark = pytest.mark.fsdp2

BF16, FP32 = torch.bfloat16, torch.float32
SEMANTICS = "5.10.4"
#: accelerate's shape: everything low precision, outputs cast too.
ACCELERATE_POLICY = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16, output_dtype=BF16)
EXACT_POLICY = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32, cast_forward_inputs=False)

refused_on_every_rank = functools.partial(shared_refused_on_every_rank, bound=LIBRARY_BOUND_S)


def batch() -> torch.Tensor:
    return torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(7))


def cast(model: nn.Module) -> tuple[nn.Module, fp32keep.KeepPlan]:
    plan = fp32keep.resolve_keep_plan(model, BF16, transformers_version=SEMANTICS)
    fp32keep.keep_aware_cast(model, BF16, plan=plan)
    return model, plan


def built(cls: type[nn.Module]) -> tuple[nn.Module, nn.Module, fp32keep.KeepPlan]:
    """A keep-aware cast model, its unsharded reference, and the plan."""
    torch.manual_seed(0)
    model, plan = cast(cls())
    return model, copy.deepcopy(model), plan


def step(model: nn.Module) -> torch.Tensor:
    logits = model(batch())
    logits.float().logsumexp(-1).mean().backward()
    return logits


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad
            out[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return out


def assert_same_grads(model: nn.Module, reference: nn.Module) -> None:
    """Every gradient of the sharded ``model`` bit-identical to the unsharded ``reference``'s."""
    got, want = grads(model), grads(reference)
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def shard_attention_owners_with_the_callers_policy(model: nn.Module, mesh: DeviceMesh) -> None:
    """The units fp32keep gives a stack whose attentions own kept tensors beside their
    projections (projections first, then each attention as an owner), every one with the
    caller's policy instead of the kept-unit policy: the known-wrong layout of the negative
    controls."""
    for layer in model.layers:
        fully_shard(layer.self_attn.q_proj, mesh=mesh, mp_policy=EXACT_POLICY)
        fully_shard(layer.self_attn.o_proj, mesh=mesh, mp_policy=EXACT_POLICY)
        fully_shard(layer.self_attn, mesh=mesh, mp_policy=EXACT_POLICY)
        fully_shard(layer, mesh=mesh, mp_policy=EXACT_POLICY)
    fully_shard(model, mesh=mesh, mp_policy=EXACT_POLICY)


def output_dtypes(module: nn.Module) -> list[torch.dtype]:
    seen: list[torch.dtype] = []
    module.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    return seen


# --- the kept-unit policy -------------------------------------------------------------------


def test_kept_units_drop_output_dtype_and_low_reduce_dtype(mesh: DeviceMesh) -> None:
    model, reference, plan = built(RouterStack)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=ACCELERATE_POLICY, plan=plan)
    # registered after sharding, so they run after FSDP2's output cast: what the block receives
    sharded_out = output_dtypes(model.layers[0].gate)
    reference_out = output_dtypes(reference.layers[0].gate)
    assert torch.equal(step(model), step(reference))
    assert sharded_out == reference_out == [FP32]  # the router's FP32 boundary survives
    got, want = grads(model), grads(reference)
    assert set(got) == set(want)
    for name in want:  # kept grads reduce-scattered in FP32: the average of equal grads is exact
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


def test_negative_control_callers_policy_minus_param_dtype(mesh: DeviceMesh) -> None:
    # The old kept-unit policy, replace(mp_policy, param_dtype=None), kept output/reduce dtypes.
    model, reference, _ = built(RouterStack)
    wrong = dataclasses.replace(ACCELERATE_POLICY, param_dtype=None)
    for layer in model.layers:
        fully_shard(layer.gate, mesh=mesh, mp_policy=wrong)
        fully_shard(layer, mesh=mesh, mp_policy=ACCELERATE_POLICY)
    fully_shard(model, mesh=mesh, mp_policy=ACCELERATE_POLICY)
    sharded_out = output_dtypes(model.layers[0].gate)
    step(model), step(reference)
    assert sharded_out == [BF16]
    got, want = grads(model), grads(reference)
    assert not torch.equal(got["layers.0.gate.weight"], want["layers.0.gate.weight"])


# --- owners with children, nested units, direct reads --------------------------------------


@pytest.mark.parametrize(
    ("cls", "kept_module", "kept_param"),
    [
        pytest.param(SinkStack, "layers.0.self_attn", "sinks", id="owner-with-children"),
        pytest.param(TowerStack, "tower.layers.0.dense", "weight", id="nested"),
    ],
)
def test_kept_layout_matches_the_unsharded_model(
    mesh: DeviceMesh, cls: type[nn.Module], kept_module: str, kept_param: str
) -> None:
    model, reference, plan = built(cls)
    seen: list[torch.dtype] = []
    module = model.get_submodule(kept_module)
    module.register_forward_pre_hook(lambda m, a: seen.append(getattr(m, kept_param).dtype))
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=EXACT_POLICY, plan=plan)
    assert isinstance(getattr(module, kept_param), DTensor)  # sharded, not replicated
    assert torch.equal(step(model), step(reference))
    assert seen == [FP32]
    assert_same_grads(model, reference)


def test_negative_control_owner_sharded_with_the_callers_policy(mesh: DeviceMesh) -> None:
    model, _, _ = built(SinkStack)
    seen: list[torch.dtype] = []
    model.layers[0].self_attn.register_forward_pre_hook(lambda m, a: seen.append(m.sinks.dtype))
    shard_attention_owners_with_the_callers_policy(model, mesh)
    step(model)
    assert seen == [BF16]  # the same units with the caller's policy gather the sinks in bf16


def test_frozen_module_read_without_a_call_is_replicated_and_runs(mesh: DeviceMesh) -> None:
    model, reference, plan = built(ReadStack)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=EXACT_POLICY, plan=plan)
    positions = model.encoder.embed_positions.weight
    assert not isinstance(positions, DTensor) and positions.dtype == FP32
    assert torch.equal(step(model), step(reference))


def test_negative_control_module_read_without_a_call_as_its_own_unit(mesh: DeviceMesh) -> None:
    # What the layout did before: the kept module became a unit FSDP2 never all-gathers.
    model, _, _ = built(ReadStack)
    kept = kept_unit_policy(EXACT_POLICY)
    fully_shard(model.encoder.embed_positions, mesh=mesh, mp_policy=kept)
    for layer in model.encoder.layers:
        fully_shard(layer, mesh=mesh, mp_policy=EXACT_POLICY)
    fully_shard(model, mesh=mesh, mp_policy=EXACT_POLICY)
    with pytest.raises(Exception, match=r"mixed torch\.Tensor and DTensor"):
        step(model)


def test_trainable_module_read_without_a_call_goes_with_its_reader(mesh: DeviceMesh) -> None:
    # Bailing-Hybrid's conv1d: its reader's unit all-gathers conv.weight in FP32, sharded at rest.
    model, reference, plan = built(ConvReadStack)
    attention = model.layers[0].self_attn
    seen: list[tuple[bool, torch.dtype]] = []
    attention.register_forward_pre_hook(
        lambda m, a: seen.append((isinstance(m.conv.weight, DTensor), m.conv.weight.dtype))
    )
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=EXACT_POLICY, plan=plan)
    assert isinstance(attention.conv.weight, DTensor)  # sharded, not replicated
    assert torch.equal(step(model), step(reference))
    assert seen == [(False, FP32)]
    assert_same_grads(model, reference)


def test_negative_control_reader_sharded_with_the_callers_policy(mesh: DeviceMesh) -> None:
    # The same units, the reader's with the caller's policy: conv.weight gathered in bf16.
    model, _, _ = built(ConvReadStack)
    seen: list[torch.dtype] = []
    model.layers[0].self_attn.register_forward_pre_hook(
        lambda m, a: seen.append(m.conv.weight.dtype)
    )
    shard_attention_owners_with_the_callers_policy(model, mesh)
    step(model)
    assert seen == [BF16]


def test_trainable_module_read_without_a_call_is_refused_on_every_rank(mesh: DeviceMesh) -> None:
    # A reader that also owns a parameter not kept cannot hold it: refused, nothing sharded.
    model, _, plan = built(ReadStack)
    model.encoder.embed_positions.requires_grad_(True)
    model.encoder.register_parameter("scale", nn.Parameter(torch.ones(8, dtype=BF16)))
    before = snapshot(model)
    error = refused_on_every_rank(
        lambda: fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=EXACT_POLICY, plan=plan),
        KeepLayoutError,
        "nothing was sharded",
    )
    assert [(p.fqn, p.reason) for p in error.problems] == [
        ("encoder.embed_positions.weight", "read-not-called")
    ]
    assert_unchanged(model, before)


# --- real families (tiny configs, no downloads) ---------------------------------------------


class AudioTowerOnly(nn.Module):
    """Runs Voxtral's audio tower only; a plain wrapper, so the plan comes from ``voxtral``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.voxtral = model

    @property
    def tower(self) -> nn.Module:
        """The audio tower: under ``model`` since Transformers 5, on the model itself in 4.x."""
        inner = getattr(self.voxtral, "model", None)
        tower = getattr(inner, "audio_tower", None) or self.voxtral.audio_tower
        assert isinstance(tower, nn.Module)
        return tower

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.tower(features).last_hidden_state  # type: ignore[no-any-return]


def voxtral() -> tuple[nn.Module, nn.Module, fp32keep.KeepPlan]:
    from transformers import VoxtralConfig, VoxtralForConditionalGeneration

    torch.manual_seed(0)
    text = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1}
    text |= {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8}
    audio = {"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2}
    audio |= {"num_attention_heads": 2, "num_mel_bins": 8, "max_source_positions": 8}
    config = VoxtralConfig(text_config=text, audio_config=audio, audio_token_id=5)
    model = AudioTowerOnly(VoxtralForConditionalGeneration(config))
    plan = fp32keep.resolve_keep_plan(model, BF16)  # the installed release's own rules
    fp32keep.keep_aware_cast(model, BF16, plan=plan)
    return model, copy.deepcopy(model), plan


def features() -> torch.Tensor:
    return torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(3)).to(BF16)


def test_voxtral_frozen_positions_read_without_a_call_are_replicated(mesh: DeviceMesh) -> None:
    model, reference, plan = voxtral()
    tower_name = next(name for name, module in model.named_modules() if module is model.tower)
    assert plan.declared_by == ("voxtral",)
    assert plan.param_names == {f"{tower_name}.embed_positions.weight"}
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=EXACT_POLICY, plan=plan)
    positions = model.tower.embed_positions.weight
    assert not isinstance(positions, DTensor) and positions.dtype == FP32
    assert torch.equal(model(features()), reference(features()))


def test_negative_control_voxtral_positions_as_their_own_unit_crash(mesh: DeviceMesh) -> None:
    model, _, _ = voxtral()
    tower = model.tower
    fully_shard(tower.embed_positions, mesh=mesh, mp_policy=kept_unit_policy(EXACT_POLICY))
    for layer in tower.layers:
        fully_shard(layer, mesh=mesh, mp_policy=EXACT_POLICY)
    fully_shard(model, mesh=mesh, mp_policy=EXACT_POLICY)
    with pytest.raises(Exception, match=r"mixed torch\.Tensor and DTensor"):
        model(features())


requires_privacy_filter = pytest.mark.skipif(
    importlib.util.find_spec("transformers.models.openai_privacy_filter") is None,
    reason="this Transformers release has no OpenAI privacy filter (it came in the 5.x line)",
)
"""The privacy filter is the real owner-with-children family; older releases lack it."""


def privacy_filter() -> nn.Module:
    """OpenAI privacy filter, strict ``["sinks"]``: attention owns the sinks and Linear children."""
    from transformers import OpenAIPrivacyFilterConfig, OpenAIPrivacyFilterForTokenClassification

    torch.manual_seed(0)
    config = OpenAIPrivacyFilterConfig(
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=64,
        hidden_size=16,
        intermediate_size=16,
        head_dim=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=4,
        pad_token_id=0,
        eos_token_id=0,
    )
    return OpenAIPrivacyFilterForTokenClassification(config)


def tokens_and_labels(model: nn.Module, seed: int | torch.Generator) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed) if isinstance(seed, int) else seed
    labels = int(model.config.num_labels)  # type: ignore[union-attr]
    return {
        "input_ids": torch.randint(1, 64, (2, 6), generator=generator),
        "labels": torch.randint(0, labels, (2, 6), generator=generator),
    }


@requires_privacy_filter
@pytest.mark.parametrize("group_kept", [False, "model"], ids=["per-module", "model-wide"])
def test_openai_privacy_filter_keeps_the_whole_contract(
    mesh: DeviceMesh, group_kept: bool | str
) -> None:
    report = assert_fp32_keep_contract(
        privacy_filter,
        lambda model: tokens_and_labels(model, 0),
        mesh=mesh,
        dtype=BF16,
        autocast=True,
        shard=functools.partial(fp32keep.apply_fsdp2, group_kept=group_kept),
    )
    assert report.ok


@requires_privacy_filter
def test_openai_privacy_filter_sinks_are_an_owner_unit(mesh: DeviceMesh) -> None:
    model, plan = cast(privacy_filter())
    reference = copy.deepcopy(model)
    attention = model.model.layers[0].self_attn
    seen: list[torch.dtype] = []
    attention.register_forward_pre_hook(lambda m, a: seen.append(m.sinks.dtype))
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=EXACT_POLICY, plan=plan)
    assert isinstance(attention.sinks, DTensor)
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(7))
    logits, expected = model(input_ids=ids).logits, reference(input_ids=ids).logits
    assert seen == [FP32]
    assert torch.equal(logits, expected)
    logits.float().logsumexp(-1).mean().backward()
    expected.float().logsumexp(-1).mean().backward()
    got = attention.sinks.grad
    assert got is not None and isinstance(got, DTensor)
    assert torch.equal(got.full_tensor(), reference.model.layers[0].self_attn.sinks.grad)


def test_kept_unit_called_through_a_method_is_gathered_around_it(mesh: DeviceMesh) -> None:
    # Apertus 1.5's tokenizers: the parent calls `tokenizer.encode(...)`, never the module.
    # Only a run shows that encode runs the tokenizer's parameters: apply_fsdp2 observes one
    # forward on the example inputs (from the source alone it gathers no method and warns).
    model, reference, plan = built(EncodeStack)
    fp32keep.apply_fsdp2(
        model, mesh=mesh, mp_policy=EXACT_POLICY, plan=plan, example_inputs=(batch(),)
    )
    assert "encode" in vars(model.tokenizer)
    assert isinstance(model.tokenizer.scale, DTensor)  # sharded at rest
    assert torch.equal(step(model), step(reference))
    assert_same_grads(model, reference)


def test_negative_control_kept_unit_called_through_a_method_left_unhooked(
    mesh: DeviceMesh,
) -> None:
    # The same units without `register_fsdp_forward_method`: `encode` meets the sharded weights.
    model, _, _ = built(EncodeStack)
    fully_shard(model.tokenizer, mesh=mesh, mp_policy=kept_unit_policy(EXACT_POLICY))
    fully_shard(model.block, mesh=mesh, mp_policy=EXACT_POLICY)
    fully_shard(model, mesh=mesh, mp_policy=EXACT_POLICY)
    with pytest.raises(Exception, match=r"mixed torch\.Tensor and DTensor"):
        step(model)
