"""verl's FSDP2 path (its FSDP engine with ``strategy="fsdp2"``: ``module.to(model_dtype)``,
``apply_fsdp2``, ``fsdp2_load_full_state_dict``) at the pinned 0.9.1; fp32keep under verl's
policy; and the one-line fix in verl's own sharding on torch >= 2.15 (``keep_policy``)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from examples.frameworks.verl_fsdp2 import (
    keeping_policy,
    verl_cast,
    verl_load,
    verl_policy,
    verl_shard,
    verl_shard_keeping,
)
from pytest_fp32keep import ContractReport
from tests.frameworks.harness import ADAPTERS, Cause, Setup, Source, on_zoo, passes_everywhere

_ADAPTER = f"{ADAPTERS}.verl_fsdp2"
_ENGINE = "verl/workers/engine/fsdp/transformer_impl.py"
_UPCAST = Source(
    _ENGINE,
    333,
    "module.to(torch_dtype)",
    "every tensor cast to the engine's `model_dtype` (`fp32` for training): FP32 master "
    "weights, and every buffer FP32 too",
)
_POLICY = Source(
    _ENGINE,
    456,
    "param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=True",
    "one policy, low-precision `param_dtype`, for every unit",
)
_UNITS = Source(
    "verl/utils/fsdp_utils.py",
    595,
    "fully_shard(module, **fsdp_kwargs)",
    "every decoder layer sharded with that policy, the kept tensors inside it included",
)
_CAUSES = {
    "t5": Cause(
        "verl upcasts everything to FP32 and shards each `T5Block` with one fp16 policy: the "
        "kept `wo` is all-gathered in fp16 (materialized), so T5 no longer casts `wo`'s input "
        "to the weight's FP32 (boundary), and `wo`'s operators get fp16 tensors where the "
        "reference's get FP32 ones (operators)",
        (_UPCAST, _POLICY, _UNITS),
    ),
    "ernie4_5_moe": Cause(
        "the kept router (strict list) is all-gathered in bf16 with the rest of its decoder "
        "layer (materialized); it upcasts the rounded weight itself (operators), so its "
        "gradient is off (parity, kept)",
        (_UPCAST, _POLICY, _UNITS),
    ),
    "deepseek_v3": Cause(
        "the kept router weight is all-gathered in bf16 with the rest of its decoder layer "
        "(materialized) and upcast from it (operators); on the zoo model logits and gradients "
        "still equal the reference's",
        (_UPCAST, _POLICY, _UNITS),
    ),
    "gpt_oss": Cause(
        "every kept norm is all-gathered in fp16 with the rest of its decoder layer "
        "(materialized) and multiplies in fp16 (operators)",
        (_UPCAST, _POLICY, _UNITS),
    ),
}
_EXPECTED = {
    "t5": frozenset({"boundary (kept)", "materialized (kept)", "operators (kept)"}),
    "ernie4_5_moe": frozenset({"materialized (kept)", "operators (kept)", "parity (kept)"}),
    "deepseek_v3": frozenset({"materialized (kept)", "operators (kept)"}),
    "gpt_oss": frozenset({"materialized (kept)", "operators (kept)"}),
}
"""The buffers `module.to(torch.float32)` upcasts (the rotary `inv_freq`) are FP32 storage the
contract accepts under FP32 master weights (its reference follows them), so no row here comes
from them: each is the kept tensors' all-gather in the one low-precision policy."""


def _verl(mesh: DeviceMesh, model: str, dtype: torch.dtype) -> ContractReport:
    return on_zoo(
        mesh,
        model,
        dtype,
        mp_policy=verl_policy(dtype),
        cast=verl_cast,
        shard=verl_shard,
        load=verl_load,
        master_dtype=torch.float32,  # verl trains FP32 weights under a low-precision param_dtype
    )


def _fp32keep_under_verls_policy(
    mesh: DeviceMesh, model: str, dtype: torch.dtype
) -> ContractReport:
    """fp32keep's cast, wrapping and loader with verl's policy over FP32 master weights."""
    return on_zoo(mesh, model, dtype, mp_policy=verl_policy(dtype), master_dtype=torch.float32)


def _verl_keeping(mesh: DeviceMesh, model: str, dtype: torch.dtype) -> ContractReport:
    """verl's own cast, sharding and loader with the one-line ``keep_policy`` fix."""
    return on_zoo(
        mesh,
        model,
        dtype,
        mp_policy=keeping_policy(dtype),
        cast=verl_cast,
        shard=verl_shard_keeping,
        load=verl_load,
        master_dtype=torch.float32,
    )


SETUPS = (
    Setup(
        "verl",
        "verl",
        "verl's FSDP engine with `strategy=fsdp2`: the model cast to `model_dtype` (FP32), "
        "`apply_fsdp2` with its policy (param low precision, reduce FP32, inputs cast), its "
        "loader `fsdp2_load_full_state_dict`",
        _verl,
        _EXPECTED,
        _CAUSES,
        f"--master-dtype fp32 --cast {_ADAPTER}:verl_cast --shard {_ADAPTER}:verl_shard "
        f"--load {_ADAPTER}:verl_load --policy {_ADAPTER}:verl_policy",
    ),
    Setup(
        "fp32keep under verl's policy",
        "pytest-fp32keep",
        "the contract's defaults with verl's policy (param low precision, reduce FP32, inputs "
        "cast) over FP32 master weights: the fix passes under verl's own settings",
        _fp32keep_under_verls_policy,
        passes_everywhere(),
        check_options=f"--master-dtype fp32 --policy {_ADAPTER}:verl_policy",
    ),
    Setup(
        "verl + keep_policy (torch >= 2.15)",
        "verl",
        "verl's own cast (`module.to(torch.float32)`), `apply_fsdp2` and loader with one line "
        "changed: `mp_policy=fp32keep.keep_policy(mp_policy, plan, module)`, inputs not cast "
        "(`keeping_policy`)",
        _verl_keeping,
        passes_everywhere(),
        check_options=(
            f"--master-dtype fp32 --cast {_ADAPTER}:verl_cast "
            f"--shard {_ADAPTER}:verl_shard_keeping "
            f"--load {_ADAPTER}:verl_load --policy {_ADAPTER}:keeping_policy"
        ),
    ),
)
