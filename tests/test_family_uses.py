"""The real families the source scan needed a case for, under one answer type (issue 35).

Voxtral's encoder reads ``embed_positions.weight``; Apertus 1.5 runs its audio tokenizer
through ``self.audio_tokenizer.encode(...)``; Kyutai's speech-to-text forward never runs its
codec (``generate`` does); Bailing-Hybrid 5.25 hands its kept ``conv1d`` to
``causal_conv1d_forward`` (earlier releases read ``self.conv1d.weight``); MusicGen composes a
T5 text encoder (kept ``wo``) with an audio decoder. Each family is built from its tiny config
(:mod:`pytest_fp32keep.check.families`), and the facts are written from its modeling source,
not taken from the code under test. For each: what one observed forward on the family's own
batch lays out (what ``apply_fsdp2(example_inputs=...)`` uses), what the source fallback lays
out and warns about, and a negative control. Families only some Transformers releases have
skip, naming the installed release; tests/multirank/test_observed_families_fsdp2.py shards them.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from torch import nn

import fp32keep
from fp32keep.uses.source import find_direct_read, unseen_uses
from pytest_fp32keep.check.families import entries
from pytest_fp32keep.check.families.batches import family_batch
from pytest_fp32keep.check.families.discovery import FamilyError

BF16 = torch.bfloat16


def _installed() -> str:
    import transformers

    return str(transformers.__version__)


def requires(family: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        importlib.util.find_spec(f"transformers.models.{family}") is None,
        reason=f"transformers {_installed()} (installed) has no {family} family",
    )


def built(
    family: str, dtype: torch.dtype = BF16
) -> tuple[nn.Module, fp32keep.KeepPlan, dict[str, Any]]:
    """The family's tiny model cast for ``dtype``, its plan, and its own batch; skipped, naming
    the installed Transformers, where that release's family keeps nothing (MusicGen on 4.56,
    whose config does not hold a T5 encoder that keeps ``wo``)."""
    try:
        model = entries.build_family_model(family)
    except FamilyError as error:
        if "keeps a tensor" not in str(error):
            raise
        pytest.skip(f"transformers {_installed()}: {error}")
    plan = fp32keep.resolve_keep_plan(model, dtype)
    fp32keep.keep_aware_cast(model, dtype, plan=plan)
    return model, plan, family_batch(model, 0)


def observed(model: nn.Module, batch: dict[str, Any]) -> fp32keep.ParameterUse:
    """One forward on ``batch``, observed, as apply_fsdp2(example_inputs=batch) runs it."""
    dtype = next(p.dtype for p in model.parameters() if p.dtype != torch.float32)
    with (
        fp32keep.observe_parameter_use(model) as use,
        torch.no_grad(),
        torch.autocast("cpu", dtype=dtype),
    ):
        model(**batch)
    return use


def without(use: fp32keep.ParameterUse, model: nn.Module, prefix: str) -> fp32keep.ParameterUse:
    """``use`` with every use of the parameters under ``prefix`` forgotten."""
    aliases: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    stacks = {name: use.stacks(name) for name in use.used if not name.startswith(prefix)}
    return fp32keep.ParameterUse(use.model_name, {n[0]: n for n in aliases.values()}, stacks)


def facts(layout: fp32keep.Layout) -> tuple[Any, ...]:
    return [u.module_fqns for u in layout.units], layout.replicated, dict(layout.forward_methods)


def unit_modules(layout: fp32keep.Layout) -> set[str]:
    return {fqn for unit in layout.units for fqn in unit.module_fqns}


@requires("voxtral")
def test_voxtral_read_is_observed_and_read_from_the_source_alike() -> None:
    model, plan, batch = built("voxtral")
    tower = next(n for n, m in model.named_modules() if type(m).__name__ == "VoxtralEncoder")
    use = observed(model, batch)
    layout = fp32keep.plan_layout(model, plan, observed=use)
    assert layout.replicated == (f"{tower}.embed_positions.weight",)
    source = fp32keep.plan_layout(model, plan)
    assert facts(source) == facts(layout)
    read = find_direct_read(model, f"{tower}.embed_positions")
    assert read is not None and (read.reader, read.expression) == (
        "VoxtralEncoder",
        "embed_positions.weight",
    )
    assert unseen_uses(model, unit_modules(source)) == []  # nothing to warn about
    # Negative control: the observation without the read makes embed_positions a unit.
    forgot = fp32keep.plan_layout(model, plan, observed=without(use, model, f"{tower}.embed_"))
    assert (f"{tower}.embed_positions",) in [u.module_fqns for u in forgot.units]


@pytest.mark.slow
@requires("apertus1p5")
def test_apertus_encode_is_observed_and_named_by_the_source_fallback() -> None:
    model, plan, batch = built("apertus1p5")
    layout = fp32keep.plan_layout(model, plan, observed=observed(model, batch))
    assert layout.forward_methods == {"model.audio_tokenizer": ("encode",)}
    source = fp32keep.plan_layout(model, plan)
    assert source.forward_methods == {}  # the fallback gathers no method...
    unseen = unseen_uses(model, unit_modules(source))
    assert any("audio_tokenizer.encode(...), a method other than forward" in u for u in unseen)


@requires("kyutai_speech_to_text")
def test_kyutai_codec_is_neither_gathered_nor_warned_about() -> None:
    model, plan, batch = built("kyutai_speech_to_text")
    use = observed(model, batch)
    assert not any(name.startswith("codec_model.") for name in use.used)  # generate's, not ours
    layout = fp32keep.plan_layout(model, plan, observed=use)
    source = fp32keep.plan_layout(model, plan)
    assert facts(source) == facts(layout)
    assert layout.forward_methods == {} and layout.replicated == ()
    # The rule reads the forward only: generate's `self.codec_model.encode(...)` is not in it,
    # so nothing is named for the units; inside the codec's own forward it does see Mimi's
    # quantizer methods (the negative control: the rule does name such calls).
    assert unseen_uses(model, unit_modules(source)) == []
    every = unseen_uses(model)
    assert any("self.quantizer.encode(...), a method other than forward" in u for u in every)


def _hands_conv1d_off() -> bool:
    """From 5.25 on, Bailing-Hybrid hands ``conv1d`` to ``causal_conv1d_forward``."""
    from packaging.version import Version

    return Version(_installed()) >= Version("5.25")


CONV = "model.layers.0.self_attn.conv1d"


@requires("bailing_hybrid")
def test_bailing_hybrid_conv1d_goes_with_its_reader_when_observed() -> None:
    model, plan, batch = built("bailing_hybrid")
    layout = fp32keep.plan_layout(model, plan, observed=observed(model, batch))
    assert layout.owner[f"{CONV}.weight"] == "model.layers.0.self_attn"
    if not _hands_conv1d_off():  # before 5.25 the attention spells `self.conv1d.weight`
        assert find_direct_read(model, CONV) is not None
        assert facts(fp32keep.plan_layout(model, plan)) == facts(layout)


@pytest.mark.skipif(
    importlib.util.find_spec("transformers.models.bailing_hybrid") is None
    or not _hands_conv1d_off(),
    reason=f"transformers {_installed()} (installed): Bailing-Hybrid hands conv1d to "
    "causal_conv1d_forward from 5.25 on",
)
def test_bailing_hybrid_hand_off_is_named_by_the_source_fallback() -> None:
    model, plan, _ = built("bailing_hybrid")
    # Negative control of the observed layout above: the fallback cannot follow the hand-off,
    # so conv1d is its own unit (what fails sharded), and the warning names it.
    source = fp32keep.plan_layout(model, plan)
    assert find_direct_read(model, CONV) is None
    assert source.owner[f"{CONV}.weight"] == CONV
    unseen = unseen_uses(model, unit_modules(source))
    assert any("self.conv1d handed to a function" in line for line in unseen), unseen


@requires("musicgen")
def test_musicgen_lays_out_the_same_from_its_batch_and_from_its_source() -> None:
    model, plan, batch = built("musicgen", torch.float16)  # T5 keeps `wo` under fp16 only
    use = observed(model, batch)
    layout = fp32keep.plan_layout(model, plan, observed=use)
    source = fp32keep.plan_layout(model, plan)
    assert facts(source) == facts(layout)
    assert layout.forward_methods == {} and layout.replicated == ()
    wo = sorted(n for n in plan.param_names if n.startswith("text_encoder.") and ".wo." in n)
    assert wo and all(n in use.used for n in wo)  # the T5 encoder's kept wo ran
    assert unseen_uses(model, unit_modules(source)) == []
    # Negative control: what MusicGen's generate calls (`self.audio_encoder.decode(...)`,
    # `self.decoder.build_delay_pattern_mask(...)`) is no part of the rule: not in a forward.
    assert not any("audio_encoder.decode" in line for line in unseen_uses(model))
