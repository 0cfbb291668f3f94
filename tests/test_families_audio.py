"""Audio and speech families (:mod:`pytest_fp32keep.check.families.audio`) and the table's
``not runnable`` cells.

Each test builds one tiny family of the installed Transformers (skipped, with the reason, where
that version has no such family) and has its negative control: the batch the family got before
(the Whisper-style channel-first clip, the text batch, the training labels) fails the way the
family table recorded, or the known-wrong classification is shown to be refused.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pytest_fp32keep.check import families
from pytest_fp32keep.check.families import audio, entries, table
from pytest_fp32keep.check.families.batches import family_batch


def _family(name: str) -> Any:
    try:  # imports that family's modeling code only, not every family's
        families.check_family_names([name])
    except families.FamilyError:
        pytest.skip(f"transformers has no {name} family whose model keeps a tensor")
    return entries.build_family_model(name)


def _case(failures: list[tuple[str, str]]) -> dict[str, Any]:
    return {
        "target": "family/x",
        "dtype": "bf16",
        "context": "autocast",
        "outcome": "fail",
        "failures": [
            {"check": check, "subject": subject, "observed": "RuntimeError: mixed dtype (CPU)"}
            for check, subject in failures
        ],
    }


def test_a_crash_of_the_unsharded_reference_alone_is_not_runnable() -> None:
    """The unsharded reference crashing is no FSDP2 result: ``not runnable`` with the error.
    Negative controls: a crash of the batch (our code) or of the sharded forward, or any other
    failure beside the reference's crash, stays ``FAIL``."""
    cell = table.case_cell(_case([("crashed", "reference")]))
    assert cell == "not runnable (unsharded reference: RuntimeError: mixed dtype (CPU))"
    assert table.kind(cell) == "not runnable"
    for failures in (
        [("crashed", "batch")],
        [("crashed", "forward")],
        [("crashed", "reference"), ("stored", "model.norm.weight")],
    ):
        assert table.kind(table.case_cell(_case(failures))) == "FAIL", failures


def test_audioflamingo3_batch_builds_and_its_cast_reference_cannot_run_on_cpu() -> None:
    """AudioFlamingo3 (5.10): its tower adds the FP32-kept ``embed_positions`` without casting
    back, so the bf16 LayerNorm after it gets FP32 activations, which torch's CPU kernel refuses
    (``from_pretrained(dtype=torch.bfloat16)`` keeps the same tensor: the plan oracle). The
    batch is counted on an FP32 copy and builds; the cast model's forward raises, the
    reference's step to show. Negative control: counting on the cast model itself (the old
    batch) crashed in the batch, which the table could not tell from our own bug."""
    from fp32keep import keep_aware_cast
    from pytest_fp32keep.check.families import batches

    model = _family("audioflamingo3")
    keep_aware_cast(model, torch.bfloat16)
    batch = family_batch(model, 0)
    assert batch["input_features"].dtype == torch.bfloat16
    assert model.model.audio_tower.embed_positions.weight.dtype == torch.float32
    with pytest.raises(RuntimeError, match=r"mixed dtype \(CPU\)"):
        model(**batch)
    with pytest.raises(RuntimeError, match=r"mixed dtype \(CPU\)"):
        batches._audio_embeddings(model, batch)  # the old count, on the cast model


def test_time_major_mel_features_fit_a_tower_that_reads_them() -> None:
    """Nemotron-3.5-Transcribe (5.24) reads ``(batch, frames, mel bins)``: the batch keeps the
    layout its own ``get_audio_features`` accepts, and the whole model runs. Negative control:
    the channel-first clip (the old batch) fails there, as the family table recorded."""
    model = _family("nemotron3_5_transcribe")
    batch = family_batch(model, 0)
    frames = batch["input_features_mask"].shape[1]
    assert batch["input_features"].shape[1] == frames  # time-major
    model(**batch)[0].float().mean().backward()
    channel_first = batch["input_features"].transpose(1, 2)
    with pytest.raises(RuntimeError, match="must match the size"):
        model.get_audio_features(channel_first, batch["input_features_mask"])


def test_speech_encoder_gets_frames_of_its_input_width_and_ctc_labels() -> None:
    """Granite-Speech-5's CTC model (5.24) takes stacked, delta-expanded mel frames
    (``4 x num_mel_bins`` wide, read from its input layer) and CTC labels; every parameter
    gets a gradient. Negative controls: the text batch (the old one) and frames of
    ``num_mel_bins`` (unstacked) do not run."""
    model = _family("granite_speech5")
    batch = family_batch(model, 0)
    mels = model.config.encoder_config.num_mel_bins
    assert batch["input_features"].shape[-1] == 4 * mels == audio.feature_layout(model)[0]
    model(**batch).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    with pytest.raises(TypeError, match="input_features"):
        model(input_ids=batch["labels"], labels=batch["labels"])
    with pytest.raises(RuntimeError):
        model(**{**batch, "input_features": batch["input_features"][..., :mels]})


def test_tts_latents_give_a_deterministic_forward_and_labels_do_not() -> None:
    """PocketTTS (5.24): voice-prompt and audio latents at their token positions run the
    backbone deterministically (the contract compares runs bit for bit); every backbone
    parameter gets a gradient. Negative control: with training ``labels``, two forwards of the
    same model give different losses (the flow loss draws its noise from the global RNG)."""
    model = _family("pocket_tts")
    batch = family_batch(model, 0)
    assert "labels" not in batch and batch["audio_latents"].shape[-1] == model.config.latent_dim
    first, second = (model(**batch).logits for _ in range(2))
    assert torch.equal(first, second)
    first.float().mean().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if n.startswith("model."))
    with torch.no_grad():
        targets = batch["audio_latents"]
        trained = {k: v for k, v in batch.items() if k != "audio_latents"}
        losses = [model(**trained, labels=targets).loss for _ in range(2)]
    assert not torch.equal(*losses)


def test_codebooks_and_code_ranges_shrink_into_the_vocabulary(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Apertus-1.5 (5.24): 16-entry codebooks and its code-range offsets (an override) fit the
    tiny vocabulary, and a waveform and an image run through both kept tokenizers. Negative
    control: without the override its validator refuses the offsets (the old row)."""
    model = _family("apertus1p5")
    config = model.config
    assert config.vision_config.codebook_size == config.audio_config.codebook_size == 16
    assert config.audio_token_offset + 16 <= config.text_config.vocab_size
    batch = family_batch(model, 0)
    assert {"input_values", "padding_mask", "pixel_values", "image_sizes"} <= set(batch)
    model(**batch).loss.backward()
    monkeypatch.setattr(entries, "OVERRIDES", {})
    with pytest.raises(Exception, match="token range"):
        entries.build_family_model("apertus1p5")
