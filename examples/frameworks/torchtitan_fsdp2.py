"""torchtitan's FSDP2 for Hugging Face models (its Transformers modeling backend) checked by the
FP32-keep contract: copy this file next to your tests.

torchtitan 0.3.0 trains a Hugging Face decoder through ``HFTransformerModel``
(``torchtitan/experiments/transformers_modeling_backend/model.py``), which builds the model in
FP32 (master weights) and names its parts ``tok_embeddings``, ``layers``, ``norm`` and
``lm_head``. ``parallelize_hf_transformers`` then ends with ``apply_fsdp``: one unit for the
embedding (with the final norm and ``lm_head`` when the embedding is tied), one per block, one for
the final norm and ``lm_head``, then the root, every unit with the one
``MixedPrecisionPolicy(param_dtype=training.mixed_precision_param, reduce_dtype=
training.mixed_precision_reduce, cast_forward_inputs=False)``; last it calls
``disable_fsdp_gradient_division``: every unit sums the gradients over the ranks (divide factor
1.0) and the trainer divides by the global token count itself.

What plugs where (``assert_fp32_keep_contract(..., shard=, mp_policy=, master_dtype=,
gradient_divide_factor=)``):

- ``master_dtype=torch.float32``: torchtitan's FP32 master weights (the contract's cast then
  upcasts every parameter, as ``HFTransformerModel`` builds them).
- ``shard=torchtitan_shard``: torchtitan's own ``apply_fsdp`` on the zoo model, which is given
  the four names ``HFTransformerModel`` gives (:func:`titan_names`) for the call.
- ``mp_policy=torchtitan_policy(dtype)``: the policy ``apply_fsdp`` builds, with
  ``TrainingConfig``'s default ``mixed_precision_reduce`` (FP32) and ``param_dtype`` the model's
  dtype (``mixed_precision_param``: ``bfloat16`` by default, ``float16`` for fp16 models).
- ``gradient_divide_factor=TORCHTITAN_GRADIENT_DIVIDE_FACTOR`` (1.0, a sum): the scale
  ``disable_fsdp_gradient_division`` sets, declared so that gradients are judged at it.
- no ``load=``: torchtitan loads Hugging Face checkpoints through DCP and its state-dict adapter
  (``state_dict_adapter.py``) inside its checkpointer, not through a function that takes a state
  dict; the contract's default loader (fp32keep's) stands in, so the round trip judges that.

Not run here: what ``parallelize_hf_transformers`` does before ``apply_fsdp`` on a model it
built itself (untying a tied ``lm_head`` by cloning its weight, swapping Hugging Face MoE blocks
for torchtitan's own, converting every module to its ``Module`` protocol for ``spmd_types``).
Encoder-decoders (T5) are out of reach: ``HFTransformerModel`` only finds
``model.model.embed_tokens``, ``layers`` and ``norm`` of a decoder.

On CPU (gloo) one thing needs working around: FSDP2 applies a divide factor as NCCL's
``PREMUL_SUM`` reduction, which gloo does not have; there :func:`torchtitan_shard` also forces
sum reductions on every unit (``set_force_sum_reduction_for_comms``, which torchtitan itself calls
in ``enable_fsdp_symm_mem``): FSDP2 then sums and divides by the factor itself, the same values.

The fix on torch >= 2.15 is one line in ``apply_fsdp``: ``mp_policy = fp32keep.keep_policy(
MixedPrecisionPolicy(...), plan, model)`` (:func:`torchtitan_shard_keeping`; torchtitan's policy
already reduces in FP32 and does not cast forward inputs).

Installed with ``pip install --no-deps torchtitan==0.3.0``: it declares ``torchdata``,
``datasets``, ``wandb``, ``tensorboard`` and more for its trainer, none of which the modules
imported here import; they need ``tyro`` (``torchtitan.config``) and ``spmd_types==0.2.3``
(``torchtitan.distributed``), which ``ci/matrix.toml``'s ``requirements`` add.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torchtitan.experiments.transformers_modeling_backend.parallelize as titan_parallelize
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torchtitan.config import TORCH_DTYPE_MAP, TrainingConfig

from fp32keep import KeepPlan, WrapSpec, keep_policy

TORCHTITAN_GRADIENT_DIVIDE_FACTOR = 1.0
"""What ``disable_fsdp_gradient_division`` sets on every unit: the gradients are summed."""

TITAN_NAMES = {"tok_embeddings": "embed_tokens", "layers": "layers", "norm": "norm"}
"""``HFTransformerModel``'s name -> the attribute of the Hugging Face decoder (``model.model``)
it returns; ``lm_head`` is the Hugging Face model's own."""


def torchtitan_policy(dtype: torch.dtype) -> MixedPrecisionPolicy:
    """The policy ``apply_fsdp`` builds for compute in ``dtype`` with ``TrainingConfig``'s
    default ``mixed_precision_reduce``."""
    reduce_dtype = TORCH_DTYPE_MAP[TrainingConfig().mixed_precision_reduce]
    return MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
    )


@contextlib.contextmanager
def titan_names(model: nn.Module) -> Iterator[None]:
    """``model`` answering to ``HFTransformerModel``'s names for the duration.

    Set in the instance's ``__dict__``, not registered as submodules, so that neither
    ``named_parameters`` nor the state dict sees them twice.
    """
    decoder = getattr(model, "model", None)
    lacking = [hf for hf in TITAN_NAMES.values() if not hasattr(decoder, hf)]
    if lacking or not hasattr(model, "lm_head"):
        raise ValueError(
            f"torchtitan's Transformers backend trains decoders: {type(model).__name__} has no "
            f"model.{', model.'.join(lacking) or 'lm_head'} (HFTransformerModel reads "
            "model.model.embed_tokens, layers and norm, and model.lm_head)"
        )
    for titan, hf in TITAN_NAMES.items():
        object.__setattr__(model, titan, getattr(decoder, hf))
    try:
        yield
    finally:
        for titan in TITAN_NAMES:
            model.__dict__.pop(titan, None)


def apply_fsdp_as_torchtitan(
    model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy
) -> None:
    """torchtitan's ``apply_fsdp`` as ``parallelize_hf_transformers`` calls it on one data
    parallel axis, after checking that ``mp_policy`` is one it can build; nothing for gloo."""
    if mp_policy != torchtitan_policy(mp_policy.param_dtype or torch.float32):
        raise ValueError(
            f"torchtitan builds MixedPrecisionPolicy(param_dtype=..., reduce_dtype=float32, "
            f"cast_forward_inputs=False) and nothing else; got {mp_policy}"
        )
    with titan_names(model):
        titan_parallelize.apply_fsdp(
            model,
            mesh,
            param_dtype=mp_policy.param_dtype,
            reduce_dtype=mp_policy.reduce_dtype,
            pp_enabled=False,
        )


def _apply_fsdp(model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy) -> None:
    """:func:`apply_fsdp_as_torchtitan`, with sum reductions forced on gloo (docstring)."""
    apply_fsdp_as_torchtitan(model, mesh, mp_policy)
    if dist.get_backend(mesh.get_group()) == "gloo":  # gloo has no PREMUL_SUM
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


def torchtitan_shard(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    plan: KeepPlan,
    wrap: WrapSpec | None,
) -> None:
    """The contract's ``shard``: torchtitan's ``apply_fsdp``, in place (``plan`` and ``wrap``
    ignored: torchtitan reads no keep list; that is what the contract judges)."""
    _apply_fsdp(model, mesh, mp_policy)


@contextlib.contextmanager
def _policy_built_as(build: Callable[..., Any]) -> Iterator[None]:
    """``apply_fsdp`` building its policy with ``build`` instead of ``MixedPrecisionPolicy``."""
    titan_parallelize.MixedPrecisionPolicy = build  # type: ignore[misc]
    try:
        yield
    finally:
        titan_parallelize.MixedPrecisionPolicy = MixedPrecisionPolicy  # type: ignore[misc]


def torchtitan_shard_keeping(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    plan: KeepPlan,
    wrap: WrapSpec | None,
) -> None:
    """:func:`torchtitan_shard` with the one-line fix in ``apply_fsdp``: the policy it builds
    wrapped by ``fp32keep.keep_policy``, so every unit all-gathers the plan's parameters in FP32
    (torch >= 2.15, FP32 master weights)."""

    def keeping(**fields: Any) -> MixedPrecisionPolicy:
        return keep_policy(MixedPrecisionPolicy(**fields), plan, model)

    with _policy_built_as(keeping):
        _apply_fsdp(model, mesh, mp_policy)
