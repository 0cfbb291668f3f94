"""The unsharded reference model that bit-exact FSDP2 comparisons are made against.

A contract check compares a sharded model with an unsharded one that starts from exactly the same
weights, cast the same keep-aware way, and runs in the same context.
:func:`build_unsharded_reference` makes that model; the plugin's ``unsharded_reference`` fixture
(:mod:`pytest_fp32keep.fixtures`) delegates to it, and ``assert_fp32_keep_contract`` uses it.

Two ways in, because a sharded model cannot be un-sharded faithfully:

* **a module**, before it is sharded: the reference is a deep copy, independent of the original
  (``fully_shard`` changes the original in place, the copy stays a plain module);
* **a zero-argument factory**: the reference is built under a fixed seed, so calling the factory
  again under the same seed (:func:`seeded`) gives the sharded model the same starting weights,
  bit for bit, without keeping a second copy alive before sharding.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import random
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeAlias

import torch
from torch import nn

__all__ = ["ModelFactory", "build_unsharded_reference", "seeded"]

ModelFactory: TypeAlias = Callable[[], nn.Module]
"""A zero-argument callable that builds a fresh model (on any device, in any dtype)."""


class _KeepAwareCast(Protocol):
    def __call__(self, model: nn.Module, dtype: torch.dtype) -> nn.Module: ...


class _MasterUpcast(Protocol):
    def __call__(self, model: nn.Module) -> nn.Module: ...


def _library(name: str) -> Any:
    # Imported lazily: fp32keep pulls in transformers, which the plugin must not import until a
    # marked test runs; and the plugin depends on the library, never the reverse.
    fp32keep = importlib.import_module("fp32keep")
    found = getattr(fp32keep, name, None)
    if found is None:
        raise ImportError(
            f"build_unsharded_reference needs fp32keep.{name}, which this installation of "
            "fp32keep does not provide"
        )
    return found


def _keep_aware_cast() -> _KeepAwareCast:
    cast: _KeepAwareCast = _library("keep_aware_cast")
    return cast


def _master_upcast() -> _MasterUpcast:
    upcast: _MasterUpcast = _library("upcast_to_fp32_master")
    return upcast


def _check_master_dtype(dtype: torch.dtype | None, master_dtype: object) -> None:
    if master_dtype is None:
        return
    if master_dtype is not torch.float32:
        raise ValueError(
            f"build_unsharded_reference(master_dtype={master_dtype!r}): unsupported master "
            "dtype; pass None (parameters stored in `dtype`) or torch.float32 (FP32 master "
            "weights)"
        )
    if dtype is None:
        raise ValueError(
            "build_unsharded_reference(master_dtype=torch.float32) needs the low-precision "
            "dtype too (dtype=torch.bfloat16, say): the master weights are what a keep-aware "
            "cast to it, upcast back to FP32, stores"
        )


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch (CPU and every CUDA device) and ``random`` with ``seed`` inside the block.

    The caller's CPU and ``random`` generator states are restored on exit, so building a model
    here does not shift the randomness of the code around it. Build the sharded model's
    starting weights with the same seed to match :func:`build_unsharded_reference`::

        reference = build_unsharded_reference(factory, torch.bfloat16, seed=0)
        with seeded(0):
            model = factory()
        fp32keep.keep_aware_cast(model, torch.bfloat16)

    CUDA generator states are restored only when CUDA is already initialised (saving them
    would otherwise initialise it); ``torch.manual_seed`` still seeds them.
    """
    python_state = random.getstate()
    cuda_ready = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    cuda_devices = list(range(torch.cuda.device_count())) if cuda_ready else []
    with torch.random.fork_rng(devices=cuda_devices):
        random.seed(seed)
        torch.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(python_state)


def _fsdp_modules(model: nn.Module) -> list[str]:
    if not torch.distributed.is_available():
        return []
    from torch.distributed.fsdp import FSDPModule

    return [
        fqn or "(root)" for fqn, module in model.named_modules() if isinstance(module, FSDPModule)
    ]


def _check_unsharded(model: nn.Module, origin: str) -> None:
    sharded = _fsdp_modules(model)
    if sharded:
        shown = ", ".join(sharded[:5]) + (" …" if len(sharded) > 5 else "")
        raise ValueError(
            f"{origin} is already sharded by FSDP2 (fully_shard applied to: {shown}); an unsharded "
            "reference cannot be rebuilt from it. Build the reference before apply_fsdp2/"
            "fully_shard, or pass a zero-argument model factory instead of the model."
        )


def build_unsharded_reference(
    model_or_factory: nn.Module | ModelFactory,
    dtype: torch.dtype | None = None,
    *,
    device: torch.device | str | None = None,
    seed: int = 0,
    master_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Build the unsharded model a sharded run is compared against, bit for bit.

    Args:
        model_or_factory: a model that is not sharded yet (it is deep-copied; the copy shares
            nothing with it, tied parameters stay tied within the copy), or a zero-argument
            factory (called once under ``seed``; see :func:`seeded`).
        dtype: if given, cast the reference keep-aware with ``fp32keep.keep_aware_cast``: the
            tensors the model's FP32-keep plan names stay FP32, every other floating tensor
            becomes ``dtype``, exactly as the sharded model is cast before ``apply_fsdp2``. If
            ``None``, the reference keeps the dtypes it was built or copied with.
        device: if given, move the reference there (dtypes unchanged).
        seed: the seed for a factory; ignored for a module.
        master_dtype: ``torch.float32``: after the keep-aware cast, every trainable parameter
            is upcast to FP32 (``fp32keep.upcast_to_fp32_master``): the reference then stores
            what a correct FP32-master-weight run stores before sharding (compare state dicts
            and storage dtypes with it). Its forward computes in FP32; to compare a forward
            under a policy whose ``param_dtype`` casts for compute, use ``master_dtype=None``
            (the compute copy, bit-identical to what FSDP2 all-gathers).

    Returns:
        An ``nn.Module`` that no FSDP2 hook touches, in the same train/eval mode as built.

    Raises:
        ValueError: the module, or what the factory built, is already sharded by FSDP2; or
            ``master_dtype`` is neither ``None`` nor ``torch.float32``, or is given without
            ``dtype`` (checked before anything is built or copied).
        TypeError: the argument is neither a module nor a callable, or the factory did not
            return a module.
        ImportError: ``dtype`` is given and ``fp32keep.keep_aware_cast`` is unavailable.
    """
    _check_master_dtype(dtype, master_dtype)
    if isinstance(model_or_factory, nn.Module):
        _check_unsharded(model_or_factory, f"the model {type(model_or_factory).__name__}")
        reference = copy.deepcopy(model_or_factory)
    elif callable(model_or_factory):
        with seeded(seed):
            built = model_or_factory()
        if not isinstance(built, nn.Module):
            raise TypeError(
                f"the model factory {model_or_factory!r} returned {type(built).__name__}, "
                "not an nn.Module"
            )
        _check_unsharded(built, f"the model built by {model_or_factory!r}")
        reference = built
    else:
        raise TypeError(
            "build_unsharded_reference needs an nn.Module or a zero-argument factory, got "
            f"{type(model_or_factory).__name__}"
        )
    if dtype is not None:
        reference = _keep_aware_cast()(reference, dtype)
    if master_dtype is not None:
        reference = _master_upcast()(reference)
    if device is not None:
        reference = reference.to(device)
    return reference
