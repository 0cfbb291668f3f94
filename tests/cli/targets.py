"""Factories for ``fp32keep check`` tests, importable as ``tests.cli.targets:NAME``."""

from __future__ import annotations

import os
import sys
import time
import warnings

import torch
from torch import nn

from tests.core.toys import stack_class


def kept_stack() -> nn.Module:
    """A toy decoder that keeps ``wo`` strictly: the contract holds."""
    return stack_class(strict=["wo"])()


def regular_stack() -> nn.Module:
    """A toy decoder declaring ``wo`` in the regular list: kept under fp16, and (Transformers'
    dtype gate, every release but 5.0.0) nothing kept under bf16."""
    return stack_class(regular=["wo"])()


def root_owned() -> nn.Module:
    """A toy whose kept parameter belongs to the root, beside one that is not kept: FSDP2
    cannot keep it (one unit would hold both)."""
    model = stack_class(strict=["query_tokens"])()
    model.register_parameter("query_tokens", nn.Parameter(torch.randn(2, 8)))
    model.register_parameter("scale", nn.Parameter(torch.ones(8)))
    return model


def toy_batch(model: nn.Module) -> torch.Tensor:
    """Token ids for the toy decoder."""
    return torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(0))


def raises() -> nn.Module:
    """A factory that fails."""
    raise RuntimeError("no weights here")


def not_a_module() -> object:
    """A factory that returns the wrong thing."""
    return {"weights": 1}


NOT_CALLABLE = 3


def slow_in_ranks() -> nn.Module:
    """Builds at once in the command (validation), but sleeps for minutes inside the ranks."""
    if "RANK" in os.environ:  # set by torchrun for every rank
        time.sleep(300)
    return kept_stack()


#: What :func:`noisy_stack` writes to stderr in the ranks: no filter of ``fp32keep check`` knows it.
NOISY_LINE = "noisy_stack: a line on the ranks' stderr that fp32keep check must not swallow"
#: The warning :func:`noisy_stack` raises in the ranks: not torch's, so it is printed as usual.
NOISY_WARNING = "noisy_stack: a warning of the user's own"


def noisy_stack() -> nn.Module:
    """:func:`kept_stack`, writing a line to stderr and warning, inside the ranks only."""
    if "RANK" in os.environ:
        print(NOISY_LINE, file=sys.stderr, flush=True)
        warnings.warn(NOISY_WARNING, UserWarning, stacklevel=1)
    return kept_stack()
