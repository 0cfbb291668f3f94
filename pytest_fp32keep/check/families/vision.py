"""Image inputs that fit a family's tiny vision tower, so the tower runs and gets gradients.

Two layouts, read from the config, not from a table:

* **Patch grids** (Qwen2-VL style: Glm4vMoe, Ernie4_5_VLMoe): the vision config has a
  ``spatial_merge_size``; ``pixel_values`` are already cut into patches, one row per patch of
  ``in_channels x temporal_patch_size x patch_size^2`` values, and ``image_grid_thw`` says how
  the rows tile each image. Each image here is one frame of ``2 merge x 2 merge`` patches.
  Or (Inkling2) one row per merged token, a block of pixels, the grid counted in tokens: the
  model's own ``get_image_features`` says which (:func:`grid_images`).
* **Whole images** (``(batch, channels, size, size)``): a model whose ``forward`` takes
  ``pixel_values`` and whose config (or vision config) has an ``image_size`` (Udop's patch
  embedding, SLANeXt's SAM-style encoder).

Where the model has an image placeholder token, the text gets as many placeholders as the
model's own ``get_image_features`` makes embeddings of those pixels (the count depends on the
tower's merger), the same way :mod:`.batches` counts audio embeddings; labels ignore them.
Pixels are in the model's dtype, as an image processor's output ``.to(dtype=model.dtype)`` is.
"""

from __future__ import annotations

import inspect
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
from pytest_fp32keep.check.zoo.batches import BATCH_SIZE

#: Keys of an image placeholder token id, in the order they are looked for.
_IMAGE_TOKEN_KEYS = ("image_token_id", "image_token_index")
#: Per-token modality types a processor returns beside ``input_ids``.
_TOKEN_TYPE_KEYS = ("mm_token_type_ids", "moe_mm_token_type_ids")


def image_token(config: Any) -> int | None:
    """The config's image placeholder id, or ``None`` (a model that takes no image tokens)."""
    for key in _IMAGE_TOKEN_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def is_patch_grid(config: Any) -> bool:
    """Whether the model takes Qwen2-VL-style patch rows with an ``image_grid_thw``."""
    vision = getattr(config, "vision_config", None)
    return (
        vision is not None
        and isinstance(getattr(vision, "spatial_merge_size", None), int)
        and isinstance(getattr(vision, "patch_size", None), int)
        and image_token(config) is not None
    )


def whole_image_size(config: Any) -> int | None:
    """The side of a whole image for the model, from its config or vision config."""
    for source in (getattr(config, "vision_config", None), config):
        size = getattr(source, "image_size", None)
        if isinstance(size, int) and not isinstance(size, bool):
            return size
    return None


def _channels(vision: Any) -> int:
    channels: Any = getattr(vision, "in_channels", None) or getattr(vision, "num_channels", 3)
    return int(channels)


def grid_pixels(
    model: nn.Module, config: Any, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """One image per sample as patch rows, and its ``image_grid_thw``."""
    vision = config.vision_config
    merge = int(vision.spatial_merge_size)
    patch = int(vision.patch_size)
    temporal = int(getattr(vision, "temporal_patch_size", None) or 1)
    side = 2 * merge  # patches per side: a whole number of merged tokens
    rows = BATCH_SIZE * side * side
    width = _channels(vision) * temporal * patch * patch
    pixels = torch.randn((rows, width), generator=generator).to(model_input_dtype(model))
    grid = torch.tensor([[1, side, side]] * BATCH_SIZE, dtype=torch.long)
    return {"pixel_values": pixels, "image_grid_thw": grid}


def token_pixels(
    model: nn.Module, config: Any, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """One image per sample as rows of merged tokens, and its ``image_grid_thw`` in tokens.

    The other patch-grid layout (Inkling2's tower): each row is one language-model image
    token, a ``(patch x merge, patch x merge, channels)`` block of pixels, and the grid counts
    tokens, not patches. Each image here is one frame of ``2 x 2`` tokens.
    """
    vision = config.vision_config
    merge = int(vision.spatial_merge_size)
    patch = int(vision.patch_size)
    side = 2  # tokens per side
    block = (patch * merge, patch * merge, _channels(vision))
    pixels = torch.randn((BATCH_SIZE * side * side, *block), generator=generator)
    grid = torch.tensor([[1, side, side]] * BATCH_SIZE, dtype=torch.long)
    return {"pixel_values": pixels.to(model_input_dtype(model)), "image_grid_thw": grid}


#: The patch-grid layouts, in the order they are tried (:func:`grid_images`).
GRID_LAYOUTS = (grid_pixels, token_pixels)


def grid_images(
    model: nn.Module, config: Any, generator: torch.Generator
) -> tuple[dict[str, torch.Tensor], int]:
    """Patch-grid images in the first of :data:`GRID_LAYOUTS` that the model's own
    ``get_image_features`` takes, and how many embeddings it makes of them.

    Both layouts share the config fields (``spatial_merge_size``, ``patch_size``) and the
    ``image_grid_thw`` argument; only the tower's code says which one it reshapes its pixels
    as, so the tower is asked. When no layout runs, the first layout's error is raised (the
    common layout's failure is the informative one).
    """
    first_error: Exception | None = None
    for layout in GRID_LAYOUTS:
        images = layout(model, config, generator)
        try:
            return images, image_embeddings(model, images)
        except Exception as error:  # this layout does not fit the tower: try the next one
            first_error = first_error or error
    assert first_error is not None
    raise first_error


def whole_pixels(model: nn.Module, config: Any, generator: torch.Generator) -> torch.Tensor:
    """``(batch, channels, size, size)`` pixels in the model's dtype."""
    size = whole_image_size(config)
    assert size is not None  # callers check whole_image_size first
    vision = getattr(config, "vision_config", None) or config
    shape = (BATCH_SIZE, _channels(vision), size, size)
    return torch.randn(shape, generator=generator).to(model_input_dtype(model))


def image_embeddings(model: nn.Module, images: dict[str, torch.Tensor]) -> int:
    """How many placeholder embeddings the model's own ``get_image_features`` makes of
    ``images``."""
    get = method_of(model, "get_image_features")
    accepted = frozenset(inspect.signature(get).parameters)
    arguments = {key: value for key, value in images.items() if key in accepted}
    with torch.no_grad():
        out = get(**arguments)
    return embedding_count(out)


def placeholder_batch(
    model: nn.Module,
    config: Any,
    images: dict[str, torch.Tensor],
    generator: torch.Generator,
    embeddings: int | None = None,
) -> dict[str, torch.Tensor]:
    """``images`` with text that starts with one placeholder per image embedding
    (``embeddings`` of them in all, counted by the model when not given)."""
    token = image_token(config)
    assert token is not None  # callers check is_patch_grid / image_token first
    if embeddings is None:
        embeddings = image_embeddings(model, images)
    per_sample = embeddings // BATCH_SIZE
    placeholders = torch.full((BATCH_SIZE, per_sample), token, dtype=torch.long)
    text = text_ids(generator)
    batch = dict(images)
    batch["input_ids"] = torch.cat([placeholders, text], dim=1)
    batch["labels"] = torch.cat([torch.full_like(placeholders, -100), text], dim=1)
    accepted = forward_parameters(model)
    # The token types a processor returns beside the ids (text 0, image 1): M-RoPE needs them
    # once pixels come (Glm4vMoe raises without them); Ernie4_5_VLMoe routes its experts by them.
    types = (batch["input_ids"] == token).to(torch.int32)
    for key in _TOKEN_TYPE_KEYS:
        if key in accepted:
            batch[key] = types
    return batch
