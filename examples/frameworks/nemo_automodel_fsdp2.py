"""nemo-automodel's FSDP2 path for Hugging Face models checked by the FP32-keep contract: copy
this file next to your tests.

``NeMoAutoModelForCausalLM.from_pretrained(..., torch_dtype=...)`` with an ``FSDP2Config``
(nemo-automodel 0.7.0) loads the Hugging Face model, then shards it with
``parallelize_model(model, mesh_context)``: the default ``ModelParallelizer._apply`` wraps each
layer of every ``ModuleList`` (``apply_fsdp2_sharding_recursively``), then the root, all with the
one ``FSDP2Config.mp_policy``; it reads neither keep list. Checkpoints are then loaded by
``_load_full_state_dict_into_model``, every rank holding the whole state dict.

What plugs where (``assert_fp32_keep_contract(..., shard=, load=, mp_policy=, master_dtype=)``):

- ``cast``: the contract's default. With ``torch_dtype`` a low-precision dtype, Transformers leaves
  the kept tensors FP32 and the rest in that dtype (``fp32keep.keep_aware_cast`` follows its
  rules); with ``torch_dtype=torch.float32`` (nemo-automodel's recommended FP32 master weights,
  ``master_dtype=torch.float32`` in the contract) every parameter is FP32.
- ``cast=nemo_checkpoint_cast`` (optional): the same load of a checkpoint that stores every
  tensor in ``torch_dtype`` (as many published bf16 checkpoints do), after which
  ``from_pretrained`` runs nemo-automodel's ``_restore_loaded_model_dtype``: it casts each tensor
  to the wider of its checkpoint dtype and the requested one, the kept ones included.
- ``shard=nemo_shard``: a ``MeshContext`` built by nemo-automodel's own ``MeshContext.build``
  (a ``dp_shard`` axis over every rank) and ``parallelize_model``, the function
  ``from_pretrained`` runs.
- ``mp_policy=nemo_policy(dtype)``: ``FSDP2Config``'s default policy (bf16 compute, FP32 reduce,
  outputs and inputs left as they come), with ``param_dtype`` set to fp16 for fp16 models.
- ``load=nemo_load`` with ``load_on_every_rank=True``: ``_load_full_state_dict_into_model``.

The fix on torch >= 2.15 is one line: ``FSDP2Config(mp_policy=fp32keep.keep_policy(policy, plan,
model))`` under FP32 master weights (:func:`nemo_shard_keeping`). The default policy already
reduces in FP32 and does not cast forward inputs, as ``keep_policy`` needs.

On CPU (gloo) nothing needs working around: nemo-automodel builds its mesh on the CPU when the
default process group is not NCCL. One thing does on torch 2.15, which nemo-automodel 0.7.0
accepts (``torch>=2.8.0``): ``ModelParallelizer._apply`` first installs a process-wide guard
around FSDP2's private ``FSDPParam.to_accumulated_grad_if_needed``
(``fsdp_patches.patch_fsdp_accumulated_grad_guard``), a method torch 2.15 no longer has, so
``parallelize_model`` raises ``AttributeError`` before it shards anything
(:func:`nemo_shard_as_installed` shows it). The guard only turns an ``AttributeError`` of that
missing method into a no-op, so :func:`nemo_shard` skips installing it where the method is
absent (:func:`_guard_skipped_where_torch_lacks_its_target`) and shards exactly as
``parallelize_model`` otherwise does. Where torch has the method the guard is installed, process
wide, and stays installed in the contract's ranks, as in a nemo-automodel run.

Installed with ``pip install --no-deps nemo-automodel==0.7.0``: it pins ``transformers==5.18.0``
and declares GPU or data-pipeline packages (``torchao``, ``torchdata``, ``tiktoken`` ...) that the
modules imported here never import; torch and Transformers are the ones the contract runs with.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping

import nemo_automodel.components.distributed.parallelizer as nemo_parallelizer
import torch
from nemo_automodel._transformers.model_init import _restore_loaded_model_dtype
from nemo_automodel.components.checkpoint.checkpointing import _load_full_state_dict_into_model
from nemo_automodel.components.distributed.config import FSDP2Config
from nemo_automodel.components.distributed.fsdp_patches import patch_fsdp_accumulated_grad_guard
from nemo_automodel.components.distributed.mesh import MeshContext, ParallelismSizes
from nemo_automodel.components.distributed.model_parallelizer import parallelize_model
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from examples.frameworks.meshes import require_world_mesh
from fp32keep import KeepPlan, WrapSpec, keep_aware_cast, keep_policy


def nemo_policy(dtype: torch.dtype) -> MixedPrecisionPolicy:
    """The policy nemo-automodel shards with for compute in ``dtype``: ``FSDP2Config``'s default
    (``reduce_dtype`` FP32, ``output_dtype`` None, no input cast) with ``param_dtype`` ``dtype``.

    For bf16 that is the default exactly; for fp16 it is the default with the one field a user
    overrides in the YAML (``mp_policy: {param_dtype: float16, ...}``, the pattern
    ``FSDP2Config``'s docstring gives), so that compute runs in the dtype the model is kept for.
    """
    policy = FSDP2Config().to_dict()["mp_policy"]
    assert isinstance(policy, MixedPrecisionPolicy)
    return dataclasses.replace(policy, param_dtype=dtype)


_MESHES: dict[int, DeviceMesh] = {}
"""nemo-automodel's device mesh per world size: built once, as a training run does (each build
creates process groups, which the contract's long-lived ranks would otherwise accumulate)."""


def mesh_context(mp_policy: MixedPrecisionPolicy) -> MeshContext:
    """A nemo-automodel ``MeshContext`` for plain FSDP2 over every rank with ``mp_policy``."""
    config = FSDP2Config(mp_policy=mp_policy)
    world = torch.distributed.get_world_size()
    if world not in _MESHES:
        built = MeshContext.build(config, ParallelismSizes(dp_size=world), world_size=world)
        assert built.device_mesh is not None
        _MESHES[world] = built.device_mesh
    return MeshContext.from_meshes(_MESHES[world], strategy_config=config)


def _guard_installs() -> bool:
    """Whether nemo-automodel's accumulated-gradient guard installs on the installed torch: it
    wraps ``FSDPParam.to_accumulated_grad_if_needed`` and raises ``AttributeError`` where torch
    has no such method (2.15). Installing it is idempotent and what ``parallelize_model`` does
    first anyway."""
    try:
        patch_fsdp_accumulated_grad_guard()
    except AttributeError:
        return False
    return True


@contextlib.contextmanager
def _guard_skipped_where_torch_lacks_its_target() -> Iterator[None]:
    """``parallelize_model`` without its accumulated-gradient guard where the guard cannot be
    installed (torch 2.15): there nemo-automodel 0.7.0 would raise instead of sharding."""
    if _guard_installs():
        yield
        return
    install = nemo_parallelizer._patch_fsdp_accumulated_grad_guard
    nemo_parallelizer._patch_fsdp_accumulated_grad_guard = lambda: None
    try:
        yield
    finally:
        nemo_parallelizer._patch_fsdp_accumulated_grad_guard = install


def nemo_shard_as_installed(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    plan: KeepPlan,
    wrap: WrapSpec | None,
) -> None:
    """The contract's ``shard``: nemo-automodel's ``parallelize_model`` as installed, in place
    (on torch 2.15 it raises before sharding; :func:`nemo_shard` gets past that)."""
    require_world_mesh(
        mesh, "nemo_shard", "nemo-automodel shards on its own dp_shard axis over every rank"
    )
    sharded = parallelize_model(model, mesh_context(mp_policy))
    if sharded is not model:
        raise RuntimeError("parallelize_model returned a new module; the contract shards in place")


def nemo_shard(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    plan: KeepPlan,
    wrap: WrapSpec | None,
) -> None:
    """The contract's ``shard``: nemo-automodel's ``parallelize_model``, in place.

    ``plan`` and ``wrap`` are ignored: nemo-automodel reads no keep list and wraps every layer of
    each ``ModuleList`` itself; that is what the contract judges. Its mesh spans every rank, as
    the contract's ``mesh`` must. On torch 2.15 its accumulated-gradient guard is skipped (the
    module docstring says why); nothing else differs from :func:`nemo_shard_as_installed`.
    """
    with _guard_skipped_where_torch_lacks_its_target():
        nemo_shard_as_installed(model, mesh=mesh, mp_policy=mp_policy, plan=plan, wrap=wrap)


def nemo_shard_keeping(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    plan: KeepPlan,
    wrap: WrapSpec | None,
) -> None:
    """:func:`nemo_shard` with the one-line fix: ``FSDP2Config.mp_policy`` wrapped by
    ``fp32keep.keep_policy``, so every unit nemo-automodel builds all-gathers the plan's
    parameters in FP32 (torch >= 2.15; FP32 master weights, ``torch_dtype=torch.float32``)."""
    nemo_shard(
        model, mesh=mesh, mp_policy=keep_policy(mp_policy, plan, model), plan=plan, wrap=wrap
    )


def nemo_load(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None) -> None:
    """The contract's ``load`` (with ``load_on_every_rank=True``): nemo-automodel's
    ``_load_full_state_dict_into_model``, each rank slicing its shard from the whole dict."""
    if state_dict is None:
        raise ValueError(
            "nemo_load needs the whole state dict on every rank: pass load_on_every_rank=True"
        )
    _load_full_state_dict_into_model([model], dict(state_dict))


def nemo_checkpoint_cast(model: nn.Module, dtype: torch.dtype, plan: KeepPlan) -> None:
    """The contract's ``cast``: ``from_pretrained(torch_dtype=dtype)`` of a checkpoint that
    stores every floating tensor in ``dtype``.

    Transformers' load leaves the kept tensors FP32 (``fp32keep.keep_aware_cast`` follows its
    rules); ``from_pretrained`` then calls nemo-automodel's own ``_restore_loaded_model_dtype``
    with the checkpoint's dtypes (handed over as ``load_kwargs["state_dict"]``, from which it reads
    them; meta tensors, as only the dtypes are read).
    """
    keep_aware_cast(model, dtype, plan=plan)
    checkpoint = {
        name: torch.empty_like(
            tensor, device="meta", dtype=dtype if tensor.is_floating_point() else tensor.dtype
        )
        for name, tensor in model.state_dict().items()
    }
    config = getattr(model, "config", None)
    _restore_loaded_model_dtype(
        model, None, config, None, {"state_dict": checkpoint}, requested_dtype=dtype
    )
