"""One batch that fits each kind of zoo model: causal LM, seq2seq, vision-language."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: Batch geometry shared by every entry.
BATCH_SIZE = 2
SEQ_LEN = 8


def _generator(seed: int | torch.Generator) -> torch.Generator:
    """A CPU generator: ``seed`` itself if it already is one, else a fresh seeded one."""
    if isinstance(seed, torch.Generator):
        return seed
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int(seed))
    return generator


def _hf(model: nn.Module) -> Any:
    """``model`` seen as the untyped Transformers model it is (for ``.config``)."""
    return model


def _device_of(model: nn.Module) -> torch.device:
    """Where the model's first parameter lives (CPU for a parameterless module)."""
    for param in model.parameters():
        return param.device
    return torch.device("cpu")


def _tokens(
    generator: torch.Generator, vocab_size: int, low: int = 2, length: int = SEQ_LEN
) -> torch.Tensor:
    """Random token ids in ``[low, vocab_size)`` of shape ``(BATCH_SIZE, length)``."""
    return torch.randint(low, vocab_size, (BATCH_SIZE, length), generator=generator)


def _to_device(batch: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    device = _device_of(model)
    return {key: value.to(device) for key, value in batch.items()}


def causal_lm_batch(model: nn.Module, seed: int | torch.Generator) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``labels`` (the same ids: the model shifts them) for a causal LM."""
    generator = _generator(seed)
    vocab_size = int(_hf(model).config.vocab_size)
    input_ids = _tokens(generator, vocab_size)
    return _to_device({"input_ids": input_ids, "labels": input_ids.clone()}, model)


def seq2seq_batch(model: nn.Module, seed: int | torch.Generator) -> dict[str, torch.Tensor]:
    """Encoder ``input_ids``, ``decoder_input_ids`` and ``labels`` for T5."""
    generator = _generator(seed)
    config = _hf(model).config
    vocab_size = int(config.vocab_size)
    input_ids = _tokens(generator, vocab_size)
    labels = _tokens(generator, vocab_size)
    start = torch.full((BATCH_SIZE, 1), int(config.decoder_start_token_id), dtype=torch.long)
    decoder_input_ids = torch.cat([start, labels[:, :-1]], dim=1)
    return _to_device(
        {"input_ids": input_ids, "decoder_input_ids": decoder_input_ids, "labels": labels},
        model,
    )


def _pixel_values(generator: torch.Generator, vision_config: Any) -> torch.Tensor:
    size = int(vision_config.image_size)
    channels = int(getattr(vision_config, "num_channels", 3))
    return torch.randn((BATCH_SIZE, channels, size, size), generator=generator)


def vision_language_batch(model: nn.Module, seed: int | torch.Generator) -> dict[str, torch.Tensor]:
    """``pixel_values``, text with the image placeholder tokens, and ``labels``.

    The text starts with ``num_query_tokens`` image tokens, which the model replaces by
    the Q-Former outputs (4.56+ placeholder layout). InstructBlip also gets the
    instruction for its Q-Former (``qformer_input_ids``). With an encoder-decoder
    language model (T5) the labels go to the decoder; with a decoder-only one they cover
    the whole input, placeholders set to the ignore index -100.
    """
    generator = _generator(seed)
    config = _hf(model).config
    text_vocab = int(config.text_config.vocab_size)
    image_token = int(config.image_token_index)
    num_query = int(config.num_query_tokens)
    pixel_values = _pixel_values(generator, config.vision_config)
    text = _tokens(generator, image_token, low=2)  # ids below the image token
    image_tokens = torch.full((BATCH_SIZE, num_query), image_token, dtype=torch.long)
    input_ids = torch.cat([image_tokens, text], dim=1)
    batch = {"pixel_values": pixel_values, "input_ids": input_ids}
    if getattr(config, "use_decoder_only_language_model", True):
        # Full-length labels, placeholders ignored: with shorter labels 5.24's Blip2 slices
        # the logits to a non-contiguous view that its loss function cannot ``.view``.
        batch["labels"] = torch.cat([torch.full_like(image_tokens, -100), text], dim=1)
    else:
        batch["labels"] = _tokens(generator, text_vocab)
    if hasattr(config, "qformer_config") and "InstructBlip" in type(model).__name__:
        batch["qformer_input_ids"] = _tokens(generator, int(config.qformer_config.vocab_size))
        batch["qformer_attention_mask"] = torch.ones_like(batch["qformer_input_ids"])
    return _to_device(batch, model)
