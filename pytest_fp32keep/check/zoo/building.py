"""Transformers configs and models from version-neutral arguments, offline, in FP32.

The one place that knows how config arguments differ between the supported versions.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from pytest_fp32keep.check.zoo.entry import transformers_version

#: Seed used by every builder, so the same entry always yields the same weights.
BUILD_SEED = 0


#: Config arguments whose name changed between supported versions:
#: ``(config class, zoo spelling) -> ((first version, spelling from that version on), ...)``.
#: Empty today: every argument the zoo passes is spelled the same from 4.56.0 to 5.24.0.
#: The zoo deliberately passes no rotary arguments (``rope_scaling`` in 4.x became
#: ``rope_parameters`` in 5.x) and relies on each class's default rotary setup instead.
_RENAMED_CONFIG_ARGS: Mapping[tuple[str, str], tuple[tuple[str, str], ...]] = MappingProxyType({})


def make_config(class_name: str, **kwargs: Any) -> Any:
    """Instantiate ``transformers.<class_name>`` from version-neutral keyword arguments.

    Arguments are renamed for the installed version per :data:`_RENAMED_CONFIG_ARGS`, then
    every scalar argument is checked to have reached the config: a config class that
    silently swallows an argument it no longer knows (and so builds a much larger model, or
    a different one) fails here, naming the argument and the version, instead of later.
    Attention is set to eager on the config and its sub-configs.
    """
    from packaging.version import Version

    transformers = importlib.import_module("transformers")
    installed = Version(transformers_version())
    spelled: dict[str, Any] = {}
    for key, value in kwargs.items():
        name = key
        for first, renamed in _RENAMED_CONFIG_ARGS.get((class_name, key), ()):
            if installed >= Version(first):
                name = renamed
        spelled[name] = value
    config = getattr(transformers, class_name)(**spelled)
    for key, value in spelled.items():
        if isinstance(value, dict):
            continue
        if getattr(config, key, _MISSING) != value:
            raise RuntimeError(
                f"{class_name}({key}={value!r}) did not take effect under transformers "
                f"{installed} (config has {getattr(config, key, '<nothing>')!r}); add the "
                "argument's new name to pytest_fp32keep.check.zoo.building._RENAMED_CONFIG_ARGS"
            )
    _set_eager_attention(config)
    return config


_MISSING = object()


def _set_eager_attention(config: Any) -> None:
    """Ask for the eager attention kernel on ``config`` and every nested sub-config.

    Eager attention is the same code path on every version and every CPU, so two runs
    of the same model give bit-identical results.
    """
    config._attn_implementation = "eager"
    for key in ("text_config", "vision_config", "qformer_config"):
        sub = getattr(config, key, None)
        if sub is not None:
            sub._attn_implementation = "eager"


def instantiate(class_name: str, config: Any) -> nn.Module:
    """Build ``transformers.<class_name>(config)`` in FP32 from :data:`BUILD_SEED`.

    The global RNG state is restored afterwards, so building a zoo model does not
    perturb the caller's random stream.
    """
    transformers = importlib.import_module("transformers")
    return build_seeded(getattr(transformers, class_name), config)


def build_seeded(cls: Any, config: Any) -> nn.Module:
    """``cls(config)`` in FP32 from :data:`BUILD_SEED`, the caller's RNG and default dtype kept."""
    previous_default = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(BUILD_SEED)
        torch.set_default_dtype(torch.float32)
        try:
            model: nn.Module = cls(config)
        finally:
            torch.set_default_dtype(previous_default)
    return model


def seed_query_tokens(model: nn.Module) -> None:
    """Seeded small values for a Q-Former model's root ``query_tokens``, in place (no-op for a
    model without them).

    Transformers initialises them to zeros, and InstructBlip's Q-Former (not kept)
    layer-normalises them in fp16, where its eps (1e-12) is 0: a zero row's variance is 0 and
    the unsharded fp16 model itself gets NaN gradients for ``query_tokens`` and that layernorm,
    leaving nothing to compare. Trained query tokens are never constant.
    """
    tokens = getattr(model, "query_tokens", None)
    if not isinstance(tokens, nn.Parameter):
        return
    generator = torch.Generator().manual_seed(BUILD_SEED)
    with torch.no_grad():
        tokens.copy_(0.02 * torch.randn(tokens.shape, generator=generator, dtype=tokens.dtype))
