"""verl's FSDP2 path checked by the FP32-keep contract: copy this file next to your tests.

verl's FSDP engine (``verl/workers/engine/fsdp/transformer_impl.py``, ``strategy="fsdp2"``)
builds a training model in three steps, each plugged in here
(``assert_fp32_keep_contract(..., cast=, shard=, load=, master_dtype=torch.float32)``):

- ``cast=verl_cast``: ``_build_module`` loads the model with ``torch_dtype`` =
  ``FSDPEngineConfig.model_dtype`` (``"fp32"`` for training) and then runs
  ``module.to(torch_dtype)``: every tensor FP32, the kept ones too (FP32 master weights).
- ``shard=verl_shard``: ``_build_fsdp_module`` calls verl's ``apply_fsdp2(module, fsdp_kwargs,
  engine_config)``: one ``fully_shard`` per ``_no_split_modules`` layer (and per untied
  embedding / ``lm_head``), then the root, all with the one policy :func:`verl_policy`.
- ``load=verl_load``: verl's ``fsdp2_load_full_state_dict`` (rank 0 broadcasts the checkpoint
  with ``set_model_state_dict``, then every buffer).

The policy is built inline in ``_build_fsdp_module`` (``MixedPrecisionPolicy(param_dtype=
param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=True)``, param ``bf16`` and reduce
``fp32`` unless ``engine_config.mixed_precision`` says otherwise); :func:`verl_policy` is that
line with ``param_dtype`` the contract's ``dtype`` (verl's ``mixed_precision.param_dtype``).

The fix on torch >= 2.15 is one line in ``_build_fsdp_module``: ``mp_policy=fp32keep.keep_policy(
mp_policy, plan, module)`` with ``cast_forward_inputs=False`` (:func:`keeping_policy`; verl
already reduces in FP32 and keeps FP32 masters); :func:`verl_shard_keeping` is
:func:`verl_shard` with that line.

Installed with ``pip install --no-deps verl==0.9.1``: verl declares ``transformers<5.11`` (the
pinned 5.24 is newer), ``ray[default]``, ``wandb``, ``vllm``/``sglang`` extras and more; the
modules imported here need only ``ray`` (``verl/__init__`` imports ``verl.protocol``),
``tensordict``, ``omegaconf`` and ``codetiming`` (``verl.workers.config``) and ``peft``
(``ci/matrix.toml``'s ``[frameworks] requirements``).

Running it on CPU (gloo): verl's device layer (``verl.plugin.platform``) knows CUDA, NPU and ROCm
only and falls back to CUDA, so ``get_device_id()`` calls ``torch.cuda.current_device()``, which
``fsdp2_load_full_state_dict`` reads as the device to move the model to. Without CUDA,
:func:`verl_load` hands that function ``"cpu"`` as its device (the one name it reads), and changes
nothing else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
import verl.utils.fsdp_utils as verl_fsdp_utils
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from verl.utils.fsdp_utils import apply_fsdp2, fsdp2_load_full_state_dict
from verl.utils.torch_dtypes import PrecisionType
from verl.workers.config.engine import FSDPEngineConfig

from fp32keep import KeepPlan, WrapSpec, keep_policy


def engine_config() -> FSDPEngineConfig:
    """verl's FSDP engine config as a user selects FSDP2 (``strategy="fsdp2"``), the rest default
    (``model_dtype="fp32"``, ``reshard_after_forward=True``, no wrap-policy override)."""
    return FSDPEngineConfig(strategy="fsdp2")


def verl_policy(dtype: torch.dtype) -> MixedPrecisionPolicy:
    """The policy verl's ``_build_fsdp_module`` shards with: ``param_dtype`` ``dtype``, gradients
    reduced in verl's default ``reduce_dtype`` (``"fp32"``), forward inputs cast."""
    return MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=PrecisionType.to_dtype("fp32"), cast_forward_inputs=True
    )


def keeping_policy(dtype: torch.dtype) -> MixedPrecisionPolicy:
    """verl's policy as the keep needs it: the same ``param_dtype`` and FP32 reduction, but forward
    inputs left as they come (a kept module's FP32 output must reach the next unit in FP32)."""
    return MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )


def verl_cast(model: nn.Module, dtype: torch.dtype, plan: KeepPlan) -> None:
    """The contract's ``cast``: verl's ``module.to(torch_dtype)`` after loading, ``torch_dtype``
    read from the engine config (FP32 for training): every tensor FP32, whatever ``dtype``."""
    model.to(PrecisionType.to_dtype(engine_config().model_dtype))


def verl_shard(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    plan: KeepPlan,
    wrap: WrapSpec | None,
) -> None:
    """The contract's ``shard``: verl's ``apply_fsdp2`` with the ``fsdp_kwargs`` that
    ``_build_fsdp_module`` passes it (no CPU offload). ``plan`` and ``wrap`` are ignored: verl
    knows no keep list and picks its own units; that is what the contract judges."""
    config = engine_config()
    fsdp_kwargs = {
        "mesh": mesh,
        "mp_policy": mp_policy,
        "offload_policy": None,
        "reshard_after_forward": config.reshard_after_forward,
    }
    apply_fsdp2(model, fsdp_kwargs, config)


def verl_shard_keeping(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    plan: KeepPlan,
    wrap: WrapSpec | None,
) -> None:
    """:func:`verl_shard` with the one-line fix: the policy wrapped by ``fp32keep.keep_policy``,
    so every unit verl builds all-gathers the plan's parameters in FP32 (torch >= 2.15)."""
    verl_shard(
        model, mesh=mesh, mp_policy=keep_policy(mp_policy, plan, model), plan=plan, wrap=wrap
    )


@contextlib.contextmanager
def _device_for_verl() -> Iterator[None]:
    """Without CUDA, the device verl's FSDP utilities read (``get_device_id``) is ``"cpu"``."""
    if torch.cuda.is_available():
        yield
        return
    original = verl_fsdp_utils.get_device_id
    verl_fsdp_utils.get_device_id = lambda: "cpu"  # type: ignore[assignment]
    try:
        yield
    finally:
        verl_fsdp_utils.get_device_id = original


def verl_load(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None) -> None:
    """The contract's ``load``: verl's ``fsdp2_load_full_state_dict`` (rank 0 holds the dict,
    the other ranks pass an empty one: verl broadcasts from rank 0)."""
    with _device_for_verl():
        fsdp2_load_full_state_dict(model, dict(state_dict or {}))
