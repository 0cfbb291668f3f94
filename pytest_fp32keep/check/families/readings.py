"""What every batch builder reads of a model: the dtype of its inputs, the arguments its forward
takes, a features method on it or its base model, how many embeddings such a method made, and
text ids. Shared by :mod:`.batches`, :mod:`.audio` and :mod:`.vision`."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from pytest_fp32keep.check.families.shrink import TEXT_HIGH, TEXT_LOW
from pytest_fp32keep.check.zoo.batches import BATCH_SIZE, SEQ_LEN


def model_input_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a real caller gives ``model``'s floating features in: ``model.dtype``, the
    dtype of its first floating parameter (FP32 for a model without one)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def forward_parameters(model: nn.Module) -> frozenset[str]:
    """The names ``model.forward`` accepts."""
    return frozenset(inspect.signature(model.forward).parameters)


def method_of(model: nn.Module, name: str) -> Any:
    """``model``'s method ``name``, or its base model's (``model.model``; 4.x put the features
    methods there), or ``None``."""
    return getattr(model, name, None) or getattr(getattr(model, "model", model), name, None)


def embedding_count(out: Any) -> int:
    """How many embeddings a features method made: its ``pooler_output``, else the tensor it
    returned or its first element; one tensor per image or clip are summed."""
    made = getattr(out, "pooler_output", None)
    if made is None:
        made = out if isinstance(out, torch.Tensor) else out[0]
    tensors = made if isinstance(made, list | tuple) else (made,)
    return sum(int(t.reshape(-1, t.shape[-1]).shape[0]) for t in tensors)


def text_ids(generator: torch.Generator) -> torch.Tensor:
    """A batch of text ids, clear of the special and placeholder ids :mod:`.shrink` moved to the
    ends of the vocabulary."""
    return torch.randint(TEXT_LOW, TEXT_HIGH, (BATCH_SIZE, SEQ_LEN), generator=generator)
