"""Factories whose model differs between ranks, importable as ``tests.cli.rank_targets:NAME``.

For the merge of every rank's verdict in ``fp32keep check`` (``tests/cli/test_rank_verdicts.py``).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from tests.cli.targets import kept_stack


def differs_on_rank_1() -> nn.Module:
    """:func:`~tests.cli.targets.kept_stack` with a persistent buffer that forward never reads,
    built with other values on rank 1 (``RANK=1``, set by torchrun): a buffer filled from a
    per-rank source.

    Every rank shards the same shapes and runs the same collectives; forward, gradients and
    every dtype agree. Only the full-state-dict round trip sees it: the loader sends rank 0's
    checkpoint, and rank 1 compares what it gathers back with its own, which holds other
    values. So the contract passes on rank 0 and fails ``round trip`` on rank 1 alone.
    """
    model = kept_stack()
    fill = 2.0 if os.environ.get("RANK") == "1" else 1.0
    model.register_buffer("table", torch.full((4,), fill))
    return model
