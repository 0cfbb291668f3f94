"""Real families whose kept modules are reached without a plain call: what their forward is
observed to use is exactly what their 2-rank contract needs (issue 22).

For each family the facts are written down from its modeling source, not taken from the code
under test: Voxtral's encoder adds ``embed_positions.weight`` and never calls the module;
Apertus 1.5 runs its audio tokenizer through ``self.audio_tokenizer.encode(...)`` (its vision
tokenizer has no forward of its own: its children are the units, and ``encode`` calls each);
Kyutai's speech-to-text forward never runs its codec (``generate`` does); Bailing-Hybrid 5.25
hands its kept ``conv1d`` to ``causal_conv1d_forward``. Each test checks that
the observation of the family's own batch says that and nothing more, that the contract, laid
out from it, passes, and (the negative control) that the same observation without the
family's fact makes the sharded forward fail. Families only one Transformers line has skip with the
reason there; Voxtral is the default tier's one family, the others are ``slow``.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

import fp32keep
from pytest_fp32keep import assert_fp32_keep_contract
from pytest_fp32keep.check.families import entries
from pytest_fp32keep.check.families.batches import family_batch

pytestmark = pytest.mark.fsdp2

BF16 = torch.bfloat16
POLICY = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)


def requires(family: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        importlib.util.find_spec(f"transformers.models.{family}") is None,
        reason=f"this Transformers release has no {family} family",
    )


def build(family: str) -> nn.Module:
    return entries.build_family_model(family)


def batch(model: nn.Module) -> dict[str, Any]:
    return family_batch(model, 0)  # type: ignore[no-any-return]


def observed_layout(family: str) -> tuple[nn.Module, fp32keep.ParameterUse, fp32keep.Layout]:
    """The family cast for bf16, its forward on its own batch observed, and the layout from it."""
    model = build(family)
    plan = fp32keep.resolve_keep_plan(model, BF16)
    fp32keep.keep_aware_cast(model, BF16, plan=plan)
    inputs = batch(model)  # the builder runs parts of a copy of the model: not observed
    with fp32keep.observe_parameter_use(model) as use, torch.autocast("cpu", dtype=BF16):
        model(**inputs)
    return model, use, fp32keep.plan_layout(model, plan, observed=use)


def without(use: fp32keep.ParameterUse, model: nn.Module, prefix: str) -> fp32keep.ParameterUse:
    """``use`` with every use of the parameters under ``prefix`` forgotten."""
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    stacks = {name: use.stacks(name) for name in use.used if not name.startswith(prefix)}
    return fp32keep.ParameterUse(use.model_name, {n[0]: n for n in aliases.values()}, stacks)


def contract(family: str, mesh: DeviceMesh) -> object:
    return assert_fp32_keep_contract(
        functools.partial(build, family), batch, mesh=mesh, dtype=BF16, autocast=True
    )


def assert_forgetting_crashes(family: str, mesh: DeviceMesh, prefix: str) -> None:
    """Sharded from its observation minus every use of what ``prefix`` owns, the family's
    forward meets a sharded parameter FSDP2 never gathered."""
    model, use, _ = observed_layout(family)
    inputs = batch(model)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=POLICY, observed=without(use, model, prefix))
    with (
        pytest.raises(Exception, match=r"mixed torch\.Tensor and DTensor"),
        torch.autocast("cpu", dtype=BF16),
    ):
        model(**inputs)


@requires("voxtral")
def test_voxtral_observed_read_is_what_its_contract_needs(mesh: DeviceMesh) -> None:
    model, use, layout = observed_layout("voxtral")
    # Where the encoder sits differs by release (4.56: ``audio_tower``; 5.x: ``model.audio_tower``).
    tower = next(name for name, m in model.named_modules() if type(m).__name__ == "VoxtralEncoder")
    read = use.direct_read(model, f"{tower}.embed_positions")
    assert read is not None
    assert (read.reader, read.reader_fqn, read.expression, read.evidence) == (
        "VoxtralEncoder",
        tower,
        "embed_positions.weight",
        "observed in VoxtralEncoder.forward",
    )
    assert layout.replicated == (f"{tower}.embed_positions.weight",)
    assert layout.forward_methods == {}
    assert contract("voxtral", mesh).ok  # type: ignore[attr-defined]
    # Negative control: forgetting the read makes embed_positions a unit never all-gathered.
    assert_forgetting_crashes("voxtral", mesh, f"{tower}.embed_positions.")


@pytest.mark.slow
@requires("apertus1p5")
def test_apertus_observed_encode_is_what_its_contract_needs(mesh: DeviceMesh) -> None:
    *_, layout = observed_layout("apertus1p5")
    assert layout.forward_methods == {"model.audio_tokenizer": ("encode",)}
    assert layout.replicated == ()
    assert contract("apertus1p5", mesh).ok  # type: ignore[attr-defined]
    # Negative control: without its uses, encode is not gathered and meets sharded weights.
    assert_forgetting_crashes("apertus1p5", mesh, "model.audio_tokenizer.")


@pytest.mark.slow
@requires("kyutai_speech_to_text")
def test_kyutai_codec_is_not_gathered_around_its_pure_helper(mesh: DeviceMesh) -> None:
    model, use, layout = observed_layout("kyutai_speech_to_text")
    assert not any(name.startswith("codec_model.") for name in use.used)  # generate's, not ours
    assert layout.forward_methods == {} and layout.replicated == ()
    assert contract("kyutai_speech_to_text", mesh).ok  # type: ignore[attr-defined]
    # Without inputs, the source fallback reads forward (and what it calls): generate's
    # `self.codec_model.encode(...)` is no part of it, so nothing is gathered and nothing warned
    # about (the regex scan it replaced made encode a collective on this path only).
    sharded = build("kyutai_speech_to_text")
    fp32keep.keep_aware_cast(sharded, BF16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fp32keep.SourceFallbackWarning)
        fp32keep.apply_fsdp2(sharded, mesh=mesh, mp_policy=POLICY)
    assert "encode" not in vars(sharded.codec_model)
    assert "get_encoded_length" not in vars(sharded.codec_model)
    if dist.get_rank() == 0:  # a gathered helper would wait here for rank 1 forever
        length = sharded.codec_model.get_encoded_length(torch.tensor(4800))
        assert int(length) == int(model.codec_model.get_encoded_length(torch.tensor(4800)))


@requires("voxtral")
def test_voxtral_example_inputs_lay_out_the_read_and_run(mesh: DeviceMesh) -> None:
    # apply_fsdp2 observes the forward itself on the family's own batch.
    model = build("voxtral")
    fp32keep.keep_aware_cast(model, BF16)
    inputs = batch(model)
    with torch.autocast("cpu", dtype=BF16):
        fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=POLICY, example_inputs=inputs)
    layout = fp32keep.sharded_layout(model)
    assert layout is not None and len(layout.replicated) == 1
    assert layout.replicated[0].endswith("audio_tower.embed_positions.weight")
    with torch.autocast("cpu", dtype=BF16):
        loss = model(**inputs).loss
    loss.backward()
    assert torch.isfinite(loss)


def _hands_conv1d_off() -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version("5.25")


def _installed() -> str:
    import transformers

    return str(transformers.__version__)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("transformers.models.bailing_hybrid") is None
    or not _hands_conv1d_off(),
    reason=f"transformers {_installed()} (installed): Bailing-Hybrid hands conv1d to "
    "causal_conv1d_forward from 5.25 on",
)
def test_bailing_hybrid_hand_off_runs_from_example_inputs(mesh: DeviceMesh) -> None:
    model = build("bailing_hybrid")
    fp32keep.keep_aware_cast(model, BF16)
    inputs = batch(model)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=POLICY, example_inputs=inputs)
    layout = fp32keep.sharded_layout(model)
    assert layout is not None
    assert layout.owner["model.layers.0.self_attn.conv1d.weight"] == "model.layers.0.self_attn"
    with torch.autocast("cpu", dtype=BF16):
        model(**inputs)
    # Negative control: from the source the conv is its own unit, never gathered; warned.
    fallback = build("bailing_hybrid")
    fp32keep.keep_aware_cast(fallback, BF16)
    with pytest.warns(fp32keep.SourceFallbackWarning, match=r"self\.conv1d handed to a function"):
        fp32keep.apply_fsdp2(fallback, mesh=mesh, mp_policy=POLICY)
    with (
        pytest.raises(Exception, match=r"mixed torch\.Tensor and DTensor"),
        torch.autocast("cpu", dtype=BF16),
    ):
        fallback(**inputs)
