"""A batch that fits a family's tiny model: causal LM, seq2seq, Q-Former vision-language,
audio, patch-grid vision-language and whole images (:mod:`.vision`), multi-codebook ids.

Which batch a model gets is read from its config (:func:`batch_kind`), not from a table:
``num_query_tokens`` with a ``vision_config`` is a Q-Former model (the zoo's Blip2 batch, whose
vision tower and Q-Former get gradients); ``is_encoder_decoder`` is seq2seq; anything else gets
text (``input_ids`` and ``labels``). Text ids avoid the special and placeholder ids that
:mod:`.shrink` moved to the ends of the vocabulary. Audio beyond Whisper-style mel clips
(time-major mels, speech encoders with a CTC head, text-to-speech latents) is :mod:`.audio`'s,
read from the model's forward and layers. A forward that takes a bundle of atoms
(``atom_inputs``: ESMFold2) gets a protein's tokens and atoms (:mod:`.structure`).

Floating inputs come the way a real caller gives them: the features a feature extractor or image
processor makes (``input_features``, ``pixel_values``) are in the model's dtype
(:func:`model_input_dtype`: its first floating parameter's, which is ``PreTrainedModel.dtype``),
as ``processor(...).to(model.device, dtype=model.dtype)`` does in Transformers' own examples
(``BatchFeature.to`` casts floating tensors only). Some models cast their features themselves
(Voxtral's and Blip2's towers); others (AudioFlamingo3's, GlmAsr's) feed them straight to a conv
and rely on the caller. The contract builds the batch from the reference, already cast to the
low-precision dtype, so FP32 features there would fail in every run, autocast or not, before
anything is compared. Token ids, masks and labels stay integer; the layout boxes of the text
batch stay FP32 (a real tokenizer gives integer boxes, which ``.to(dtype)`` leaves alone). The
curated zoo's own batches (:mod:`pytest_fp32keep.check.zoo.batches`) are unchanged: the
Q-Former kinds cast the zoo's batch here.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import nn

from pytest_fp32keep.check.families import audio, structure, vision
from pytest_fp32keep.check.families.readings import (
    embedding_count,
    forward_parameters,
    method_of,
    model_input_dtype,
    text_ids,
)
from pytest_fp32keep.check.zoo.batches import (
    BATCH_SIZE,
    SEQ_LEN,
    vision_language_batch,
)

BATCH_KINDS = ("text", "seq2seq", "qformer", "qformer-video", "audio", "vision-grid")
#: Frames of a clip for a Q-Former video model (InstructBlipVideo's code assumes 4).
_VIDEO_FRAMES = 4
#: Mel frames of a clip for an audio tower without ``max_source_positions``.
_AUDIO_FRAMES = 32
#: Frames of a clip of discrete mel-bin ids (Inkling's audio tower embeds one per frame).
_RAW_AUDIO_FRAMES = 4
#: The inputs a feature extractor or image processor makes: given in the model's dtype.
_FEATURE_INPUTS = frozenset({"input_features", "pixel_values"})


def batch_kind(config: Any) -> str:
    """Which of :data:`BATCH_KINDS` fits a model with ``config``."""
    if getattr(config, "num_query_tokens", None) and getattr(config, "vision_config", None):
        return "qformer-video" if hasattr(config, "video_token_index") else "qformer"
    if vision.is_patch_grid(config):
        return "vision-grid"
    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq"
    if getattr(config, "audio_config", None) and getattr(config, "audio_token_id", None):
        return "audio"
    return "text"


def _generator(seed: int | torch.Generator) -> torch.Generator:
    if isinstance(seed, torch.Generator):
        return seed
    return torch.Generator(device="cpu").manual_seed(int(seed))


def _features_in_model_dtype(model: nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
    dtype = model_input_dtype(model)
    return {
        key: value.to(dtype) if key in _FEATURE_INPUTS and value.is_floating_point() else value
        for key, value in batch.items()
    }


def family_batch(model: nn.Module, seed: int | torch.Generator) -> dict[str, Any]:
    """One forward's keyword arguments for ``model`` (a tiny family model), with ``labels``."""
    config: Any = getattr(model, "config", None)
    kind = batch_kind(config)
    if kind == "qformer":
        return _features_in_model_dtype(model, vision_language_batch(model, seed))
    if kind == "qformer-video":
        return _features_in_model_dtype(model, _video_batch(model, config, _generator(seed)))
    if kind == "audio" and audio.is_tokenized_audio(model):  # a waveform tokenizer (Apertus-1.5)
        return audio.tokenized_batch(model, _fp32_twin(model), config, _generator(seed))
    raw_audio = _raw_audio_input(model) if kind == "audio" else None
    if raw_audio is not None:
        return _raw_audio_batch(model, config, raw_audio, _generator(seed))
    if audio.is_latent_tts(model, config):  # text-to-speech on audio latents (PocketTTS)
        return audio.latent_batch(model, config, _generator(seed))
    if kind == "text" and audio.is_speech_encoder(model):  # mel frames in, no text (CTC)
        return audio.speech_batch(model, config, _generator(seed))
    if kind == "audio":
        return _audio_batch(model, config, _generator(seed))
    generator = _generator(seed)
    if structure.atom_inputs_class(model) is not None:  # a protein's tokens and atoms (ESMFold2)
        return structure.structure_batch(model, config, generator)
    if kind == "vision-grid":
        images, embeddings = vision.grid_images(model, config, generator)
        return vision.placeholder_batch(model, config, images, generator, embeddings)
    accepted = forward_parameters(model)
    # A whole-image tower without placeholder tokens (Udop's patches beside the text):
    # pixels too, so the tower runs and gets gradients.
    pixels = (
        vision.whole_pixels(model, config, generator)
        if "pixel_values" in accepted
        and vision.whole_image_size(config) is not None
        and vision.image_token(config) is None
        else None
    )
    if pixels is not None and "input_ids" not in accepted:
        return {"pixel_values": pixels}  # an image-only model (SLANeXt's table recogniser)
    input_ids = text_ids(generator)
    batch = {"input_ids": _with_audio_codes(config, input_ids, generator)}
    if pixels is not None:
        batch["pixel_values"] = pixels
    if "bbox" in accepted:  # layout models (Udop): one box per token, corners in [0, 1]
        corners = torch.rand((BATCH_SIZE, SEQ_LEN, 2, 2), generator=generator).sort(dim=2).values
        batch["bbox"] = corners.transpose(2, 3).reshape(BATCH_SIZE, SEQ_LEN, 4)
    if "labels" not in accepted:
        pass  # a base model: the contract's loss is the mean of its output
    elif type(model).__name__.endswith("ForTokenClassification"):
        classes = int(getattr(config, "num_labels", 2))
        batch["labels"] = torch.randint(0, classes, (BATCH_SIZE, SEQ_LEN), generator=generator)
    elif kind == "seq2seq" and _decoder_codebooks(config):
        batch.update(_code_stream_targets(config, generator))
    elif kind == "seq2seq":
        labels = text_ids(generator)
        start = int(getattr(config, "decoder_start_token_id", None) or 0)
        first = torch.full((BATCH_SIZE, 1), start, dtype=torch.long)
        batch["decoder_input_ids"] = torch.cat([first, labels[:, :-1]], dim=1)
        batch["labels"] = labels
    else:
        batch["labels"] = input_ids.clone()
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return {key: value.to(device) for key, value in batch.items()}


def _decoder_codebooks(config: Any) -> int | None:
    """How many parallel code streams a seq2seq model's decoder predicts (MusicGen's decoder
    over its codec's codebooks), or ``None`` for a text decoder."""
    codebooks = getattr(getattr(config, "decoder", None), "num_codebooks", None)
    return codebooks if isinstance(codebooks, int) and codebooks > 0 else None


def _code_stream_targets(config: Any, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Labels ``(batch, seq, codebooks)`` of audio codes and the decoder's inputs, one row per
    codebook of each example (``(batch * codebooks, seq)``), as MusicGen's forward takes them:
    the text ids go to its text encoder."""
    codebooks = int(_decoder_codebooks(config) or 1)
    vocab = int(config.decoder.vocab_size)
    labels = torch.randint(0, vocab, (BATCH_SIZE, SEQ_LEN, codebooks), generator=generator)
    inputs = labels.permute(0, 2, 1).reshape(BATCH_SIZE * codebooks, SEQ_LEN)
    return {"decoder_input_ids": inputs, "labels": labels}


def _with_audio_codes(config: Any, text: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``text`` with one audio code per codebook beside each token, for a model that embeds
    ``(batch, seq, 1 + num_codebooks)`` ids and sums them (KyutaiSpeechToText: its codec runs
    in ``generate`` only, so the training forward takes the codes); else ``text`` itself."""
    codebooks = getattr(config, "num_codebooks", None)
    vocab = getattr(config, "codebook_vocab_size", None)
    if not (isinstance(codebooks, int) and isinstance(vocab, int)):
        return text
    codes = torch.randint(0, vocab - 1, (*text.shape, codebooks), generator=generator)
    return torch.cat([text[..., None], codes], dim=-1)


def _audio_batch(model: nn.Module, config: Any, generator: torch.Generator) -> dict[str, Any]:
    """One mel clip per sample, and as many audio placeholders as the tower makes embeddings.

    How many embeddings a clip becomes depends on the tower and its projector (frames merged
    by 2, by 4, ...): the count is read from one run of the model's own ``get_audio_features``
    instead of being re-derived here. The text follows the placeholders; labels ignore them.
    """
    audio = config.audio_config
    positions = getattr(audio, "max_source_positions", None)
    frames = 2 * int(positions) if positions else _AUDIO_FRAMES
    mels = int(getattr(audio, "num_mel_bins", 16))
    features = torch.randn((BATCH_SIZE, mels, frames), generator=generator)
    features = features.to(model_input_dtype(model))  # before the model's own features method
    batch: dict[str, Any] = {"input_features": features}
    accepted = forward_parameters(model)
    if "input_features_mask" in accepted:
        batch["input_features_mask"] = torch.ones((BATCH_SIZE, frames), dtype=torch.long)
    per_sample = _count_in_a_layout(model, batch) // BATCH_SIZE
    token = int(config.audio_token_id)
    placeholders = torch.full((BATCH_SIZE, per_sample), token, dtype=torch.long)
    text = text_ids(generator)
    batch["input_ids"] = torch.cat([placeholders, text], dim=1)
    batch["labels"] = torch.cat([torch.full_like(placeholders, -100), text], dim=1)
    return batch


def _count_in_a_layout(model: nn.Module, batch: dict[str, Any]) -> int:
    """:func:`_audio_embeddings` of ``batch``, its features in the first layout of
    :func:`.audio.mel_layouts` that the model's own audio method accepts (``batch`` is changed
    to that layout); the first layout's error when none is."""
    twin, first_error = _fp32_twin(model), None
    for features in audio.mel_layouts(batch["input_features"]):
        trial = {**batch, "input_features": features}
        try:
            count = _audio_embeddings(twin, _fp32_features(trial))
        except (RuntimeError, ValueError) as error:  # a shape the tower refuses
            first_error = first_error or error
            continue
        batch["input_features"] = features
        return count
    assert first_error is not None
    raise first_error


def _fp32_twin(model: nn.Module) -> nn.Module:
    """``model`` itself when it is FP32, else an FP32 copy of it, to count embeddings on.

    The count is a shape, the same in every dtype; counting on the cast model would make the
    batch depend on whether the model's low-precision forward runs on this device at all
    (AudioFlamingo3's tower adds its FP32-kept ``embed_positions`` without casting back, and
    torch's CPU ``layer_norm`` refuses the FP32 activations with its bf16 weights). Whether the
    cast model runs is the unsharded reference's step to show, not the batch's.
    """
    if model_input_dtype(model) == torch.float32:
        return model
    return copy.deepcopy(model).float()


def _fp32_features(batch: dict[str, Any]) -> dict[str, Any]:
    return {
        key: value.float() if key in _FEATURE_INPUTS and value.is_floating_point() else value
        for key, value in batch.items()
    }


def _audio_embeddings(model: nn.Module, batch: dict[str, Any]) -> int:
    """How many placeholder embeddings the model's own audio-features method makes of ``batch``'s
    clips."""
    # 4.x's Voxtral names it get_audio_embeds.
    get: Any = getattr(model, "get_audio_features", None) or model.get_audio_embeds
    accepted = frozenset(inspect.signature(get).parameters)
    if "input_ids" in accepted:
        # MusicFlamingo places its time embeddings by the placeholders, so it cannot count
        # them first: its tower's own output lengths (after conv and pooling) say how many.
        return _tower_lengths(model, batch)
    arguments = {
        key: value for key, value in batch.items() if key in accepted or "args" in accepted
    }
    if "input_features_mask" not in accepted and "kwargs" not in accepted:
        arguments.pop("input_features_mask", None)
    with torch.no_grad():
        out = get(**arguments)
    return embedding_count(out)


def _tower_lengths(model: nn.Module, batch: dict[str, Any]) -> int:
    """The audio tower's output frames for ``batch``'s clips, by its
    ``_get_feat_extract_output_lengths`` (the last length, when it gives several)."""
    base: Any = getattr(model, "model", model)
    tower: Any = getattr(model, "audio_tower", None) or base.audio_tower
    frames = batch["input_features"].shape[-1]
    mask = batch.get("input_features_mask")
    lengths = torch.full((BATCH_SIZE,), frames) if mask is None else mask.sum(-1)
    out = tower._get_feat_extract_output_lengths(lengths.to(torch.long))
    return int((out[-1] if isinstance(out, tuple) else out).sum())


#: The first argument of an audio-features method that takes no mel features, and what it is:
#: MuseSpark's waveform, Inkling's discretised mel bins.
_RAW_AUDIO_INPUTS = ("input_values", "audio_input_ids")


def _raw_audio_input(model: nn.Module) -> str | None:
    """Which of :data:`_RAW_AUDIO_INPUTS` the model's audio method takes first, if any."""
    get = method_of(model, "get_audio_features")
    if get is None:
        return None
    first = next(iter(inspect.signature(get).parameters), None)
    return first if first in _RAW_AUDIO_INPUTS else None


def _raw_audio(model: nn.Module, config: Any, name: str, generator: torch.Generator) -> Any:
    """A clip per sample for a tower that takes ``name`` (one of :data:`_RAW_AUDIO_INPUTS`)."""
    audio = config.audio_config
    if name == "input_values":
        # two embeddings' worth of samples: the tower refuses a length that is not whole ones
        samples = 2 * int(audio.samples_per_token)
        wave = torch.randn((BATCH_SIZE, samples), generator=generator)
        return wave.to(model_input_dtype(model))
    # one mel bin id per frame and mel channel, each below the per-channel vocabulary
    shape = (BATCH_SIZE, _RAW_AUDIO_FRAMES, int(audio.num_codebooks))
    return torch.randint(0, int(audio.codebook_size), shape, generator=generator)


def _raw_audio_batch(
    model: nn.Module, config: Any, name: str, generator: torch.Generator
) -> dict[str, Any]:
    """Raw audio (:func:`_raw_audio`), as many placeholders as the model's own
    ``get_audio_features`` makes embeddings of it, then text; labels ignore the placeholders."""
    clip = _raw_audio(model, config, name, generator)
    with torch.no_grad():
        out = method_of(model, "get_audio_features")(clip)
    per_sample = embedding_count(out) // BATCH_SIZE
    placeholders = torch.full((BATCH_SIZE, per_sample), int(config.audio_token_id))
    text = text_ids(generator)
    return {
        name: clip,
        "input_ids": torch.cat([placeholders, text], dim=1),
        "labels": torch.cat([torch.full_like(placeholders, -100), text], dim=1),
    }


def _video_batch(model: nn.Module, config: Any, generator: torch.Generator) -> dict[str, Any]:
    """Clips of :data:`_VIDEO_FRAMES` frames, one Q-Former query block per frame in the text."""
    vision = config.vision_config
    size, channels = int(vision.image_size), int(getattr(vision, "num_channels", 3))
    pixels = torch.randn((BATCH_SIZE, _VIDEO_FRAMES, channels, size, size), generator=generator)
    count = int(config.num_query_tokens) * _VIDEO_FRAMES
    video = torch.full((BATCH_SIZE, count), int(config.video_token_index), dtype=torch.long)
    text = text_ids(generator)
    batch: dict[str, Any] = {"pixel_values": pixels, "input_ids": torch.cat([video, text], dim=1)}
    if getattr(config, "use_decoder_only_language_model", True):
        batch["labels"] = torch.cat([torch.full_like(video, -100), text], dim=1)
    else:
        batch["labels"] = text_ids(generator)
    if getattr(config, "qformer_config", None) is not None:
        batch["qformer_input_ids"] = text_ids(generator)
        batch["qformer_attention_mask"] = torch.ones_like(batch["qformer_input_ids"])
    return batch
