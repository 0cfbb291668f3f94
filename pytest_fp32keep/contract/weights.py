"""The weights the round trip loads: not the ones built, so that the forward proves their use.

The model under test is built under the contract's seed; the checkpoint it loads holds other
values (:func:`loaded_weights`: the same factory under ``seed + 1``, and every floating
parameter that still came out equal, such as a norm initialised to ones, moved by
:func:`_shift`), cast to the low-precision dtype (:func:`low_precision`). The reference and the
control load the same checkpoint (:func:`loading`), so the forward, ``parity`` and ``stored``
rows hold only if the sharded model computes with what it loaded. A loader that leaves FSDP2
computing with the weights it was sharded with (one that ``setattr``-s new parameters after
FSDP2's lazy init, as Transformers' does) passes a gather-back check but not these rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from pytest_fp32keep.contract.reference import seeded

#: The loaded weights are built under the contract's seed plus this.
LOAD_SEED_OFFSET = 1


def _shift(param: torch.Tensor) -> None:
    # (|p| + 1) / 16 moves every value by at least 1/16 of its magnitude: far more than one
    # bf16 or fp16 rounding, so the cast checkpoint still differs from the built weights.
    param.add_(param.abs() + 1, alpha=1 / 16)


def loaded_weights(
    model_factory: Callable[[], nn.Module], built: nn.Module, seed: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """A full FP32 state dict for ``built`` whose floating parameters all differ from its own.

    ``built`` must not be cast yet (its values are the ones the factory made under ``seed``).
    Tied parameters are shifted once, so their aliases stay equal.
    """
    with seeded(seed + LOAD_SEED_OFFSET):
        other = model_factory().to(device)
    own = dict(built.named_parameters())
    with torch.no_grad():
        for name, param in other.named_parameters():  # each tied tensor once
            mine = own.get(name)
            if param.is_floating_point() and mine is not None and torch.equal(param, mine):
                _shift(param)
    return {name: t.detach().clone() for name, t in other.state_dict().items()}


def low_precision(
    weights: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """``weights`` as a low-precision checkpoint: every floating tensor in ``dtype`` (kept ones
    too: they must land in FP32 all the same)."""
    return {name: t.to(dtype) if t.is_floating_point() else t for name, t in weights.items()}


def loading(
    model_factory: Callable[[], nn.Module], checkpoint: Mapping[str, torch.Tensor]
) -> Callable[[], nn.Module]:
    """A factory that builds with ``model_factory`` and loads ``checkpoint`` (each tensor in its
    destination dtype, as ``load_state_dict`` copies): what the control must start from."""

    def build() -> nn.Module:
        model = model_factory()
        model.load_state_dict(dict(checkpoint))
        return model

    return build
