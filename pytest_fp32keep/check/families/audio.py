"""Audio inputs that fit a family's tiny model when the Whisper-style mel batch does not.

:mod:`.batches` gives an audio-placeholder model (an ``audio_config`` and an ``audio_token_id``)
one mel clip per sample, channel-first ``(batch, mel bins, frames)`` as Whisper's feature
extractor makes it. Three other shapes are read from the model here, not from a table:

* **Time-major mel features** ``(batch, frames, mel bins)`` (Nemotron-3.5-Transcribe's
  spectrogram): :func:`mel_layouts` offers the channel-first clip, then its transpose; the
  batch keeps the first one the model's own audio-features method accepts.
* **A speech encoder with its own head** (``...ForCTC``: Granite-Speech-5), whose ``forward``
  takes ``input_features`` and no text: :func:`speech_batch`. The width of a frame is what the
  model's first input layer reads (:func:`feature_layout`): a ``Linear``'s ``in_features`` on
  the last axis (Granite's stacked, delta-expanded mel frames: ``4 x num_mel_bins``), a
  ``Conv1d``'s ``in_channels`` on axis 1. CTC labels are text ids, shorter than the encoder's
  output, none of them the blank (``pad_token_id``).
* **Continuous audio latents** of a text-to-speech model (PocketTTS, Gradium-Phonon-TTS):
  ``audio_latents`` ``(batch, frames, latent_dim)`` after an ``audio_bos_token_id`` position,
  one ``audio_latent_token_id`` position per frame (:func:`latent_batch`), and a voice prompt of
  ``audio_prompt_latents`` at ``audio_prompt_token_id`` positions, so the prompt's projection
  gets a gradient too. No ``labels``: their training loss (5.24's ``loss_lsd``) draws its flow
  noise and times from the global RNG (``torch.randn_like``) at every call, so two runs of one
  model differ and the contract's bit parity would judge the draw, not FSDP2 (measured: the
  known-correct control itself 7% off the unsharded model). The contract's loss is then the
  mean of the end-of-speech logits: the backbone and its kept buffers are checked, the flow
  head (and its kept ``freqs``) only where they are stored and round-tripped.

* **A waveform for a discrete audio tokenizer** (Apertus-1.5's WavTokenizer), whose
  ``get_audio_features(input_values, padding_mask)`` turns samples into codes of the shared
  vocabulary: :func:`tokenized_batch` gives two tokens' worth of samples (``hop_length`` each)
  and, where ``get_image_features(pixel_values, image_sizes)`` tokenizes images too, one image
  of one code (``spatial_scale_factor`` pixels a side). The placeholders are as many as the
  model's own methods make embeddings, counted on an FP32 copy (:mod:`.batches`). Codes are
  discrete: the tokenizers run (and are all-gathered) but get no gradient; the embeddings do.

Floating inputs are in the model's dtype, as :mod:`.batches` explains (``processor(...)``
``.to(dtype=model.dtype)``; latents come from an audio tokenizer in that dtype).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from pytest_fp32keep.check.families.readings import (
    embedding_count,
    forward_parameters,
    method_of,
    model_input_dtype,
    text_ids,
)
from pytest_fp32keep.check.families.shrink import TEXT_HIGH, TEXT_LOW
from pytest_fp32keep.check.zoo.batches import BATCH_SIZE

#: Frames of a clip for a speech encoder (:func:`speech_batch`).
SPEECH_FRAMES = 32
#: Labels of a CTC clip: fewer than the encoder's output frames (subsampling halves them).
_CTC_LABELS = 4
#: Latent frames of a text-to-speech target, and of its voice prompt.
_LATENT_FRAMES, _PROMPT_FRAMES = 4, 2
#: The config fields a latent text-to-speech batch needs (:func:`is_latent_tts`).
_LATENT_TOKENS = ("audio_bos_token_id", "audio_latent_token_id")


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def mel_layouts(features: torch.Tensor) -> Iterator[torch.Tensor]:
    """``features`` (channel-first: ``(batch, mel bins, frames)``), then time-major."""
    yield features
    yield features.transpose(1, 2).contiguous()


def is_speech_encoder(model: nn.Module) -> bool:
    """Whether ``model`` takes mel features and no text (a CTC or frame-classification head)."""
    accepted = forward_parameters(model)
    return "input_features" in accepted and "input_ids" not in accepted


def feature_layout(model: nn.Module) -> tuple[int, bool]:
    """``(width, time_major)`` of one frame: what the model's first input layer reads.

    Raises:
        ValueError: ``model`` has no ``Linear`` or ``Conv1d`` to read the width from.
    """
    for module in model.modules():
        if isinstance(module, nn.Linear):
            return module.in_features, True
        if isinstance(module, nn.Conv1d):
            return module.in_channels, False
    raise ValueError(f"{type(model).__name__}: no Linear or Conv1d layer to read a frame's width")


def speech_batch(model: nn.Module, config: Any, generator: torch.Generator) -> dict[str, Any]:
    """One clip of :data:`SPEECH_FRAMES` frames per sample (:func:`feature_layout`), its mask,
    and CTC labels when the forward takes labels."""
    width, time_major = feature_layout(model)
    shape = (BATCH_SIZE, SPEECH_FRAMES, width) if time_major else (BATCH_SIZE, width, SPEECH_FRAMES)
    features = torch.randn(shape, generator=generator).to(model_input_dtype(model))
    batch: dict[str, Any] = {"input_features": features}
    accepted = forward_parameters(model)
    if "attention_mask" in accepted:  # the CTC loss reads the encoder's lengths from it
        batch["attention_mask"] = torch.ones((BATCH_SIZE, SPEECH_FRAMES), dtype=torch.long)
    if "labels" in accepted:
        # Text ids lie above the text specials, so none is the blank (pad_token_id, 0).
        batch["labels"] = torch.randint(
            TEXT_LOW, TEXT_HIGH, (BATCH_SIZE, _CTC_LABELS), generator=generator
        )
    return batch


def is_latent_tts(model: nn.Module, config: Any) -> bool:
    """Whether ``model`` takes continuous audio latents (:func:`latent_batch`)."""
    return (
        _int(getattr(config, "latent_dim", None))
        and all(_int(getattr(config, key, None)) for key in _LATENT_TOKENS)
        and "audio_latents" in forward_parameters(model)
    )


def latent_batch(model: nn.Module, config: Any, generator: torch.Generator) -> dict[str, Any]:
    """A voice prompt, text, the audio BOS and one position per target latent frame.

    Row layout: :data:`_PROMPT_FRAMES` ``audio_prompt_token_id`` positions (when the config and
    the forward have a prompt), the text, ``audio_bos_token_id``, then :data:`_LATENT_FRAMES`
    ``audio_latent_token_id`` positions, filled by ``audio_latents`` (no ``labels``: see the
    module docstring).
    """
    dtype, latent = model_input_dtype(model), int(config.latent_dim)

    def ids(token: str, count: int) -> torch.Tensor:
        return torch.full((BATCH_SIZE, count), int(getattr(config, token)), dtype=torch.long)

    text = text_ids(generator)
    rows = [text, ids("audio_bos_token_id", 1), ids("audio_latent_token_id", _LATENT_FRAMES)]
    batch: dict[str, Any] = {}
    prompt_token = getattr(config, "audio_prompt_token_id", None)
    if _int(prompt_token) and "audio_prompt_latents" in forward_parameters(model):
        rows.insert(0, ids("audio_prompt_token_id", _PROMPT_FRAMES))
        prompt = torch.randn((BATCH_SIZE, _PROMPT_FRAMES, latent), generator=generator)
        batch["audio_prompt_latents"] = prompt.to(dtype)
    batch["input_ids"] = torch.cat(rows, dim=1)
    latents = torch.randn((BATCH_SIZE, _LATENT_FRAMES, latent), generator=generator)
    batch["audio_latents"] = latents.to(dtype)
    return batch


def _method_parameters(model: nn.Module, name: str) -> tuple[str, ...]:
    method = method_of(model, name)
    return tuple(inspect.signature(method).parameters) if method is not None else ()


def is_tokenized_audio(model: nn.Module) -> bool:
    """Whether the model's audio method tokenizes a waveform (``input_values, padding_mask``)."""
    return _method_parameters(model, "get_audio_features")[:2] == ("input_values", "padding_mask")


def tokenized_batch(
    model: nn.Module, twin: nn.Module, config: Any, generator: torch.Generator
) -> dict[str, Any]:
    """A waveform (and an image, where the model tokenizes images), their placeholders, text.

    ``twin`` is ``model`` in FP32 (or ``model`` itself), on which the placeholders are counted.
    """
    dtype = model_input_dtype(model)
    samples = 2 * int(config.audio_config.hop_length)
    batch: dict[str, Any] = {
        "input_values": torch.randn((BATCH_SIZE, samples), generator=generator),
        "padding_mask": torch.ones((BATCH_SIZE, samples), dtype=torch.long),
    }
    counts: dict[str, int] = {}
    with torch.no_grad():
        get_audio = method_of(twin, "get_audio_features")
        counts["audio_token_id"] = embedding_count(
            get_audio(batch["input_values"], batch["padding_mask"])
        )
    vision = getattr(config, "vision_config", None)
    side = getattr(vision, "spatial_scale_factor", None)
    if (
        _method_parameters(model, "get_image_features")[:2] == ("pixel_values", "image_sizes")
        and isinstance(side, int)
        and _int(getattr(config, "image_token_id", None))
    ):
        channels = int(getattr(vision, "in_channels", 3))
        batch["pixel_values"] = torch.randn((BATCH_SIZE, channels, side, side), generator=generator)
        batch["image_sizes"] = torch.tensor([[side, side]] * BATCH_SIZE)
        with torch.no_grad():
            get_image = method_of(twin, "get_image_features")
            counts["image_token_id"] = embedding_count(
                get_image(batch["pixel_values"], batch["image_sizes"])
            )
    placeholders = torch.cat(
        [
            torch.full((BATCH_SIZE, count // BATCH_SIZE), int(getattr(config, token)))
            for token, count in counts.items()
        ],
        dim=1,
    )
    text = text_ids(generator)
    batch["input_ids"] = torch.cat([placeholders, text], dim=1)
    batch["labels"] = torch.cat([torch.full_like(placeholders, -100), text], dim=1)
    for key in ("input_values", "pixel_values"):  # what a processor gives, in the model's dtype
        if key in batch:
            batch[key] = batch[key].to(dtype)
    return batch
