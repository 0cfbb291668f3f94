"""trl's FSDP2 path for reference and teacher models, checked by the FP32-keep contract: copy this
file (and ``accelerate_fsdp2.py``, whose accelerator it reuses) next to your tests.

trl trains its policy through accelerate, but shards the models it only runs forward (DPO's and
GRPO's reference model, the SDFT/SDPO teacher) itself, with ``trl.models.utils.prepare_fsdp``:
one ``fully_shard`` of the whole model with the accelerate plugin's policy, then ``eval()``.
Those models are built by ``create_model_from_path(..., dtype=<the policy model's dtype>)``:
``from_pretrained``'s storage, kept modules FP32, the rest low precision; no FP32 master upcast
(that is ``Accelerator.prepare``'s, which these models skip). What plugs where
(``assert_fp32_keep_contract(..., cast=, shard=, check_state_dict=False)``):

- ``cast=reference_cast``: the model as ``create_model_from_path`` hands it over
  (``from_pretrained``'s storage). DPO's and GRPO's reference model keeps ``requires_grad``
  (trl runs it under ``torch.no_grad()``).
- ``cast=teacher_cast``: the teacher of ``SDFTTrainer``/``SDPOTrainer``, the same storage,
  frozen by trl before ``prepare_fsdp`` (``requires_grad_(False)``, ``eval()``: :func:`freeze`),
  in the cast as trl does it. The contract's reference follows what the implementation's
  ``cast`` and ``shard`` freeze, so it judges the teacher forward only, and its report says
  what was not judged.
- ``shard=trl_shard``: ``prepare_fsdp(model, accelerator)`` with an accelerator configured for FSDP2
  (:func:`examples.frameworks.accelerate_fsdp2.make_accelerator`, which also says what running
  accelerate on CPU needs).
- No ``load``: trl loads these models with ``from_pretrained`` before sharding them and has no
  loader of its own for a sharded model, so the contract runs with ``check_state_dict=False``.

:func:`trl_policy` is the policy ``prepare_fsdp`` passes to ``fully_shard`` out of the box:
accelerate's (``Accelerator(mixed_precision=...)``: param, reduce and output dtype all low
precision, forward inputs cast).

Installed with its declared dependencies (``pip install trl==1.16.0``: accelerate, datasets,
pandas, pyarrow ... all run on CPU and on Python 3.11).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from trl.models.utils import prepare_fsdp

from examples.frameworks.accelerate_fsdp2 import (
    accelerate_policy,
    make_accelerator,
)
from examples.frameworks.meshes import require_world_mesh
from fp32keep import KeepPlan, WrapSpec, keep_aware_cast


def trl_policy(dtype: torch.dtype) -> MixedPrecisionPolicy:
    """The policy ``prepare_fsdp`` shards with under ``Accelerator(mixed_precision=...)``:
    accelerate's plugin policy (param, reduce and output dtype all ``dtype``, inputs cast)."""
    return accelerate_policy(dtype)


def reference_cast(model: nn.Module, dtype: torch.dtype, plan: KeepPlan) -> None:
    """The contract's ``cast``: the reference model as ``create_model_from_path(...,
    dtype=dtype)`` hands it over (kept tensors FP32, the rest ``dtype``), still trainable."""
    keep_aware_cast(model, dtype, plan=plan)


def teacher_cast(model: nn.Module, dtype: torch.dtype, plan: KeepPlan) -> None:
    """The contract's ``cast`` for the SDFT/SDPO teacher: frozen as trl freezes it
    (:func:`freeze`), stored as ``create_model_from_path(..., dtype=dtype)`` hands it over."""
    keep_aware_cast(freeze(model), dtype, plan=plan)


def freeze(model: nn.Module) -> nn.Module:
    """The teacher as SDFT/SDPO freeze it before ``prepare_fsdp``: no parameter requires a
    gradient, eval mode; returns ``model``."""
    model.requires_grad_(False)
    return model.eval()


def trl_shard(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    plan: KeepPlan,
    wrap: WrapSpec | None,
) -> None:
    """The contract's ``shard``: trl's ``prepare_fsdp``, in place, with an accelerator whose FSDP2
    plugin carries ``mp_policy``. ``plan`` and ``wrap`` are ignored: trl shards the whole model
    as one unit; that is what the contract judges. The mesh must span every rank
    (:func:`~examples.frameworks.meshes.require_world_mesh`).
    """
    require_world_mesh(mesh, "trl_shard")
    prepared = prepare_fsdp(model, make_accelerator(mp_policy))
    if prepared is not model:  # prepare_fsdp shards in place and returns the model
        raise RuntimeError("prepare_fsdp returned a new module; the contract shards in place")
