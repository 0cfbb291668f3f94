"""The source fallback is one syntax-tree rule: comments and strings never count (issue 35).

Without example inputs or an observation, :func:`fp32keep.apply_fsdp2` reads the model's source
(:mod:`fp32keep.uses.source`). The regex scan it replaced refused a valid model whose forward
carried a comment naming a weight (``# note: embed_positions.weight is initialised from a
sinusoid table``) with ``[read-not-called]``; the rule reads attribute chains of the syntax
tree only. Each test has its negative control: the same reader with a real read.
"""

from __future__ import annotations

import warnings
from typing import ClassVar

import pytest
import torch
from torch import nn

from fp32keep import KeepLayoutError, SourceFallbackWarning, keep_aware_cast, plan_layout
from fp32keep import resolve_keep_plan as resolve
from fp32keep.shard.apply import _warn_unseen
from fp32keep.uses.source import find_direct_read, unseen_uses
from tests.core.kept_toys import ReadStack
from tests.core.observed_toys import HelperStack
from tests.core.toys import Block
from tests.error_bounds import LIBRARY_BOUND_S, within

BF16 = torch.bfloat16
SEMANTICS = "5.10.4"  # 5.x glob entries, whatever the installed release


class CommentedEncoder(nn.Module):
    """Calls its kept, trainable ``embed_positions`` through a local name; a comment and a string
    name its weight. It also owns a bf16 ``scale``, so it could not hold a module it read."""

    def __init__(self, width: int = 8, positions: int = 6) -> None:
        super().__init__()
        self.embed_positions = nn.Embedding(positions, width)
        self.scale = nn.Parameter(torch.ones(width))
        self.layers = nn.ModuleList(Block(width) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # note: embed_positions.weight is initialised from a sinusoid table
        embed = self.embed_positions
        where = "self.embed_positions.weight"  # a string naming it: no read either
        ids = torch.arange(x.shape[1], device=x.device)
        x = (x.float() * self.scale.float() + embed(ids).float()).to(x.dtype)
        for layer in self.layers:
            x = layer(x)
        return x + 0 * len(where)


class ReadingEncoder(CommentedEncoder):
    """The negative control: the same encoder reading the weight instead of calling the module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = self.embed_positions.weight[: x.shape[1]]
        x = (x.float() * self.scale.float() + positions.float()).to(x.dtype)
        for layer in self.layers:
            x = layer(x)
        return x


class CommentedStack(nn.Module):
    _no_split_modules: ClassVar[list[str]] = ["Block"]
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["embed_positions"]
    encoder_class: ClassVar[type[nn.Module]] = CommentedEncoder

    def __init__(self, width: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.encoder = self.encoder_class(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)))  # type: ignore[no-any-return]


class ReadingStack(CommentedStack):
    encoder_class = ReadingEncoder


def cast(model: nn.Module) -> nn.Module:
    keep_aware_cast(model, BF16, plan=resolve(model, BF16, transformers_version=SEMANTICS))
    return model


def test_a_comment_or_a_string_naming_a_weight_is_no_read() -> None:
    model = cast(CommentedStack())
    assert find_direct_read(model, "encoder.embed_positions") is None
    layout = plan_layout(model, resolve(model, BF16, transformers_version=SEMANTICS))
    assert ("encoder.embed_positions",) in [unit.module_fqns for unit in layout.units]
    assert layout.owner["encoder.embed_positions.weight"] == "encoder.embed_positions"
    assert model(torch.arange(6).reshape(1, 6)).shape == (1, 6, 16)


def test_negative_control_the_same_encoder_reading_the_weight_is_refused() -> None:
    model = cast(ReadingStack())
    read = find_direct_read(model, "encoder.embed_positions")
    assert read is not None
    assert (read.reader, read.reader_fqn, read.expression) == (
        "ReadingEncoder",
        "encoder",
        "embed_positions.weight",
    )
    with pytest.raises(KeepLayoutError, match=r"read-not-called") as caught:
        plan_layout(model, resolve(model, BF16, transformers_version=SEMANTICS))
    assert "ReadingEncoder reads directly (embed_positions.weight) without calling it" in str(
        caught.value
    )


def warn(model: nn.Module) -> None:
    """apply_fsdp2's warning for ``model`` laid out from its source."""
    _warn_unseen(model, plan_layout(model, resolve(model, BF16, transformers_version=SEMANTICS)))


def test_the_fallback_warning_names_what_it_cannot_see_and_the_fix() -> None:
    model = cast(HelperStack())
    with within(LIBRARY_BOUND_S), pytest.warns(SourceFallbackWarning) as caught:
        warn(model)
    text = str(caught[0].message)
    assert "HelperStack.forward(): self.codec.get_encoded_length(...)" in text
    assert "HelperStack.forward(): self.codec.encode(...)" in text
    assert "no example_inputs=" in text and "Pass example_inputs=" in text
    # Negative control: a model whose source shows nothing the rule cannot judge warns nothing.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn(cast(ReadStack()))
        warn(cast(CommentedStack()))
    assert unseen_uses(cast(CommentedStack())) == []


def test_a_class_whose_methods_have_no_source_is_named() -> None:
    # Made by type(): its forward has no source for the rule to read.
    model = CommentedStack()
    made = type("MadeHead", (nn.Linear,), {"forward": lambda self, x: x @ self.weight.T})
    model.head = made(8, 16, bias=False)
    assert "MadeHead: no source to read" in unseen_uses(model)
    # Negative control: a class made with attributes only runs its bases' (readable) code.
    model.head = type("Renamed", (nn.Linear,), {"extra": 1})(8, 16, bias=False)
    assert unseen_uses(model) == []
