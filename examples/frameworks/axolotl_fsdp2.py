"""axolotl's FSDP2 path checked by the FP32-keep contract: copy this file (and
``accelerate_fsdp2.py``, whose accelerator it reuses) next to your tests.

axolotl trains through accelerate, with accelerate's ``fsdp2_prepare_model`` replaced by its own
(``axolotl.monkeypatch.accelerate.fsdp2``, installed by ``patch_accelerate_fsdp2``). What plugs
where (``assert_fp32_keep_contract(..., cast=, shard=, load=)``, no ``master_dtype``):

- ``cast=axolotl_cast``: the model as axolotl's ``ModelLoader`` hands it over for a full
  fine-tune under FSDP: ``from_pretrained(torch_dtype=dtype)``'s storage (kept tensors FP32),
  then the loader's own ``_configure_embedding_dtypes``, which under FSDP casts every module whose
  name holds ``norm`` (and the embeddings) to ``torch_dtype``, kept ones included. The loader
  runs on a bare ``ModelLoader`` that holds only the config and the model: building a whole one
  needs a tokenizer and a checkpoint on disk.
- ``shard=axolotl_shard``: axolotl's ``fsdp2_prepare_model`` (what ``Accelerator.prepare`` runs
  once axolotl has patched accelerate), with :func:`~examples.frameworks.accelerate_fsdp2.
  make_accelerator`'s accelerator. Unlike accelerate's, it does not upcast trainable parameters to
  FP32: a decoder layer with a kept FP32 tensor has two trainable dtypes, which FSDP2 refuses;
  its ``carve_trainable_dtype`` splits only PEFT adapter modules out of such a unit.
- ``load=axolotl_load``: axolotl's ``fsdp2_load_full_state_dict`` (rank 0 holds the dict).

:func:`axolotl_policy` is the policy axolotl shards with: accelerate's, from
``Accelerator(mixed_precision=...)`` (axolotl's ``bf16``/``fp16`` settings).

``fp32_norms: true`` in an axolotl config wraps every module whose *class name* ends in
``RMSNorm``/``LayerNorm`` in an FP32 unit (``shard_norms_fp32``), whatever the keep lists say;
:func:`axolotl_cast_fp32_norms` sets it, for the setup that shows it.

Python and dependencies: axolotl 0.21.0 declares ``Requires-Python >=3.12``; the modules this file
imports (``axolotl.monkeypatch.accelerate.fsdp2``, ``axolotl.loaders.model`` and what they import)
import and run on Python 3.11, so it is installed with ``pip install --no-deps
--ignore-requires-python axolotl==0.21.0``. ``--no-deps`` because it pins ``torch<2.15`` and
``transformers==5.20.1`` (the pins here are 2.15 and 5.24) and GPU-only packages (xformers,
flash-linear-attention, liger-kernel ...); those modules need ``addict``, ``bitsandbytes``,
``posthog``, ``fastcore`` and ``kernels`` besides (``ci/matrix.toml``'s ``[frameworks]
requirements``). axolotl's telemetry is opt-out: this module sets ``AXOLOTL_DO_NOT_TRACK=1``
before importing it.

Running it on CPU (gloo): axolotl's loader sends the state-dict entries that are not sharded
(plain buffers, e.g. DeepSeek-V3's router ``e_score_correction_bias``) to a hard-coded
``torch.device("cuda")``. Without CUDA, :func:`axolotl_load` runs it under :class:`CudaOnCpu`,
which turns that one device into the CPU and changes nothing else.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")  # before axolotl is imported

import torch
from axolotl.loaders.model import ModelLoader
from axolotl.monkeypatch.accelerate.fsdp2 import (
    fsdp2_load_full_state_dict,
    fsdp2_prepare_model,
)
from axolotl.utils.dict import DictDefault
from axolotl.utils.fp32_norms import tag_model_fp32_norms
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.overrides import TorchFunctionMode

from examples.frameworks.accelerate_fsdp2 import (
    accelerate_policy,
    make_accelerator,
)
from examples.frameworks.meshes import require_world_mesh
from fp32keep import KeepPlan, WrapSpec, keep_aware_cast


def axolotl_policy(dtype: torch.dtype) -> MixedPrecisionPolicy:
    """The policy axolotl shards with: accelerate's for ``mixed_precision`` ``dtype`` (param,
    reduce and output dtype all ``dtype``, inputs cast)."""
    return accelerate_policy(dtype)


def axolotl_config(dtype: torch.dtype, **options: Any) -> DictDefault:
    """An axolotl config for a full fine-tune under FSDP2 in ``dtype`` (``options`` added)."""
    return DictDefault(
        {
            "fsdp_version": 2,
            "fsdp_config": {"reshard_after_forward": True, "cpu_ram_efficient_loading": False},
            "torch_dtype": dtype,
            "bf16": dtype == torch.bfloat16,
            "fp16": dtype == torch.float16,
            **options,
        }
    )


def _axolotl_loader_dtypes(model: nn.Module, cfg: DictDefault) -> None:
    """axolotl's ``ModelLoader._configure_embedding_dtypes`` on ``model`` under ``cfg``."""
    loader = ModelLoader.__new__(ModelLoader)  # the method reads cfg, model and model_config
    loader.cfg = cfg
    loader.model = model
    loader.model_config = model.config
    loader._configure_embedding_dtypes()


def axolotl_cast(model: nn.Module, dtype: torch.dtype, plan: KeepPlan) -> None:
    """The contract's ``cast``: ``from_pretrained(torch_dtype=dtype)``'s storage, then axolotl's
    loader's dtype pass for a full fine-tune under FSDP2."""
    keep_aware_cast(model, dtype, plan=plan)
    cfg = axolotl_config(dtype, model_config_type=model.config.model_type)
    _axolotl_loader_dtypes(model, cfg)


def axolotl_cast_fp32_norms(model: nn.Module, dtype: torch.dtype, plan: KeepPlan) -> None:
    """:func:`axolotl_cast` with ``fp32_norms: true``: the loader leaves every module whose class
    name ends in ``RMSNorm``/``LayerNorm`` in FP32, and the model carries the patterns to
    ``fsdp2_prepare_model``, which gives each such module an FP32 unit."""
    keep_aware_cast(model, dtype, plan=plan)
    cfg = axolotl_config(dtype, model_config_type=model.config.model_type, fp32_norms=True)
    _axolotl_loader_dtypes(model, cfg)
    tag_model_fp32_norms(model, cfg)


_ACCELERATORS: dict[int, Any] = {}
"""The accelerator that sharded each model (by ``id``), for :func:`axolotl_load`."""


def axolotl_shard(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    plan: KeepPlan,
    wrap: WrapSpec | None,
) -> None:
    """The contract's ``shard``: axolotl's ``fsdp2_prepare_model``, in place. ``plan`` and
    ``wrap`` are ignored: axolotl knows no keep list and wraps ``_no_split_modules`` itself."""
    require_world_mesh(mesh, "axolotl_shard")
    accelerator = make_accelerator(mp_policy)
    if fsdp2_prepare_model(accelerator, model) is not model:
        raise RuntimeError(
            "fsdp2_prepare_model returned a new module; the contract shards in place"
        )
    _ACCELERATORS[id(model)] = accelerator


class CudaOnCpu(TorchFunctionMode):
    """Inside it, a torch call given the device ``cuda`` gets the CPU instead (a CPU-only
    machine running code that hard-codes ``torch.device("cuda")``)."""

    @staticmethod
    def _cpu(value: Any) -> Any:
        is_cuda = isinstance(value, torch.device | str) and torch.device(value).type == "cuda"
        return torch.device("cpu") if is_cuda else value

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        args = tuple(self._cpu(a) if isinstance(a, torch.device) else a for a in args)
        kwargs = {k: self._cpu(v) if k == "device" else v for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


def axolotl_load(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None) -> None:
    """The contract's ``load``: axolotl's ``fsdp2_load_full_state_dict`` (rank 0 holds it)."""
    accelerator = _ACCELERATORS.get(id(model))
    if accelerator is None:
        raise ValueError("axolotl_load needs a model sharded by axolotl_shard")
    full = dict(state_dict or {})
    if torch.cuda.is_available():
        fsdp2_load_full_state_dict(accelerator, model, full)
        return
    with CudaOnCpu():
        fsdp2_load_full_state_dict(accelerator, model, full)
