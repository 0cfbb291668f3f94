"""Tiny models for the two layouts FSDP2 can represent once laid out right (issue 23).

Defined in a file, as the layout reads their source.

* :class:`QueryStack`: Blip2's shape. The root owns a kept ``query_tokens`` directly, next to a
  fully kept ``qformer``, a vision stand-in, a projection and a language model whose input
  embedding the root calls itself (``self.get_input_embeddings()(ids)``), tied to the language
  model's ``lm_head`` (OPT's default): the root becomes an FP32 kept unit, its children and the
  embedding get units of their own, and the tied embedding and head form one unit.
* :class:`MixedRootStack`: the same, but the root also owns a ``scale`` that is not kept: a mixed
  root, refused.
* :class:`ReadingRootStack`: the root reads its ``head``'s weight without calling it: the head
  cannot be a unit of its own, so the root cannot be an FP32 unit; refused.
* :class:`TiedKeptStack`: a kept embedding tied to a kept head, in different kept units (hy_v4
  with ``tie_word_embeddings=True``): one kept unit holding both modules.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from tests.core.kept_toys import Tower
from tests.core.toys import Block, RMSNorm


def tie(head: nn.Module, embedding: nn.Module) -> None:
    """Tie ``head.weight`` to ``embedding.weight`` outside the classes' source, as Transformers'
    ``tie_weights`` does (the layout reads ``NAME.weight`` in a class's source as a read)."""
    head.weight = embedding.weight


class TinyLM(nn.Module):
    """A decoder LM fed ``inputs_embeds``, its ``lm_head`` tied to its ``embed_tokens``."""

    def __init__(self, width: int = 8, vocab: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.lm_head = nn.Linear(width, vocab, bias=False)
        tie(self.lm_head, self.embed_tokens)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)  # type: ignore[no-any-return]


class QueryStack(nn.Module):
    """Blip2's root: kept ``query_tokens`` read by the root, a kept Q-Former, the rest not kept."""

    _no_split_modules: ClassVar[list[str]] = ["Block", "TowerLayer"]
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["query_tokens", "qformer"]

    def __init__(self, width: int = 8, vocab: int = 16, queries: int = 2) -> None:
        super().__init__()
        self.vision = nn.Linear(width, width)
        self.query_tokens = nn.Parameter(0.5 * torch.randn(1, queries, width))
        self.qformer = Tower(width)
        self.projection = nn.Linear(width, width)
        self.language_model = TinyLM(width, vocab)

    def get_input_embeddings(self) -> nn.Module:
        return self.language_model.get_input_embeddings()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        embeds = self.get_input_embeddings()(ids)
        image = self.vision(embeds[:, :1])  # stands for the vision tower's pooled output
        queries = self.query_tokens.expand(ids.shape[0], -1, -1)
        # The Q-Former computes in FP32 from the FP32 query tokens, as Blip2's does.
        queries = self.qformer(queries + image.to(queries.dtype))
        prefix = self.projection(queries.to(embeds.dtype))
        logits = self.language_model(torch.cat([prefix, embeds], dim=1))
        return logits[:, prefix.shape[1] :]


class MixedRootStack(QueryStack):
    """Also owns ``scale``, not kept: FSDP2 cannot split the root's own parameters."""

    def __init__(self, width: int = 8, vocab: int = 16, queries: int = 2) -> None:
        super().__init__(width, vocab, queries)
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.scale.mean()


class ReadingRootStack(nn.Module):
    """Owns a kept ``query_tokens`` and reads ``head.weight`` itself, never calling ``head``."""

    _no_split_modules: ClassVar[list[str]] = ["Block"]
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["query_tokens"]

    def __init__(self, width: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.query_tokens = nn.Parameter(torch.randn(1, 1, width))
        self.block = Block(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover - refused
        x = self.block(self.embed(ids) + self.query_tokens.to(torch.bfloat16))
        return nn.functional.linear(x, self.head.weight)


class TiedKeptStack(nn.Module):
    """A kept embedding and a head tied to it, so kept too; the blocks and the final norm in
    between are not kept (hy_v4's tied word embeddings: its strict ``["lm_head"]`` keeps the
    embedding through the tie). The declaration names ``embed`` alone: the tied head's weight
    is the embedding's, so no parameter is named under ``head``, and Transformers 4.x refuses
    an entry that is no segment of a parameter name."""

    _no_split_modules: ClassVar[list[str]] = ["Block"]
    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["embed"]

    def __init__(self, width: int = 8, vocab: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        tie(self.head, self.embed)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids).to(self.layers[0].attn.weight.dtype)  # FP32 rows into the stream
        for layer in self.layers:
            x = layer(x)
        h = self.norm(x)
        return self.head(h.to(self.head.weight.dtype))  # FP32 logits from the kept head
