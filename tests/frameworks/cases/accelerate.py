"""accelerate's FSDP2 path (``Accelerator.prepare`` -> ``fsdp2_prepare_model``, its loader) at the
pinned 1.15.0; fp32keep under accelerate's policy; and the one-line fix in accelerate's own
sharding on torch >= 2.15 (``keep_policy``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from examples.frameworks.accelerate_fsdp2 import (
    accelerate_load,
    accelerate_policy,
    accelerate_shard,
    accelerate_shard_keeping,
    checkpoint_cast,
    keeping_policy,
)
from pytest_fp32keep import ContractReport
from tests.frameworks.harness import (
    ADAPTERS,
    Cause,
    Run,
    Setup,
    Source,
    on_zoo,
    passes_everywhere,
)

_ADAPTER = f"{ADAPTERS}.accelerate_fsdp2"
_PLUGGED = (
    f"--master-dtype fp32 --cast {_ADAPTER}:checkpoint_cast --shard {_ADAPTER}:accelerate_shard "
    f"--load {_ADAPTER}:accelerate_load"
)
_UTILS = "accelerate/utils/fsdp_utils.py"
_UPCAST = Source(
    _UTILS,
    820,
    "param.data = param.data.to(torch.float32)",
    "every trainable parameter upcast to FP32, then all-gathered in the policy's `param_dtype`",
)
_POLICY = Source(
    "accelerate/utils/dataclasses.py",
    2137,
    'dtype_args = {"param_dtype": dtype, "reduce_dtype": dtype}',
    "one low-precision policy for every unit, the kept parameters' included",
)
_LOADER = Source(
    _UTILS,
    651,
    "full_tensor = torch.empty(sharded_param.size(), device=device_mesh.device_type, "
    "dtype=sharded_param.dtype)",
    "ranks other than 0 receive into the sharded parameter's dtype (FP32 after the upcast) "
    "what rank 0 sends in the checkpoint's",
)
_TIED = Source(
    _UTILS,
    874,
    "tail_modules = (final_norm, input_embed, output_embed)",
    "the tied embedding goes to the tail unit; T5's encoder and decoder `embed_tokens` share it "
    "from the root unit",
)
_DEVICE_MESH = Source(
    _UTILS,
    628,
    "device_mesh = sharded_param.device_mesh",
    "`.device_mesh` read from every state-dict entry, plain buffers included",
)

_ACCELERATE_ROWS = frozenset(
    {
        "materialized (kept)",
        "operators (kept)",
        "parity (kept)",
        "parity (not kept)",
        "parity (output)",
        "round trip (kept)",
        "round trip (not kept)",
    }
)
_EXPECTED = {
    # the loader corrupts what it loads (round trip); on T5 the model then fails in its forward
    # (crashed), on Ernie and GPT-OSS it computes NaN from the loaded weights (parity); on
    # DeepSeek-V3 the loader itself raises (crashed load)
    "t5": frozenset({"crashed (forward)", "round trip (kept)", "round trip (not kept)"}),
    "ernie4_5_moe": _ACCELERATE_ROWS,
    "deepseek_v3": frozenset({"crashed (load)"}),
    "gpt_oss": _ACCELERATE_ROWS,
}
_CAUSES = {
    "t5": Cause(
        "accelerate puts the tied `shared` embedding (with `lm_head`) in a tail unit, but T5's "
        "encoder and decoder `embed_tokens` tie the same parameter and stay in the root unit: "
        "torch refuses a parameter managed by two FSDP groups at the first forward (crashed "
        "forward); the loaded weights already differ before it (round trip, as for Ernie4.5-MoE)",
        (_TIED, _LOADER),
    ),
    "ernie4_5_moe": Cause(
        "every trainable parameter is upcast to FP32 and all-gathered in the policy's bf16, the "
        "kept router too (materialized, and its operators see the bf16 weight); the loader "
        "broadcasts rank 0's checkpoint dtype (bf16) into buffers the other ranks allocate in the "
        "model's FP32, a dtype mismatch gloo does not detect (round trip), and the model computes "
        "with what arrived: NaN outputs and gradients (parity)",
        (_UPCAST, _POLICY, _LOADER),
    ),
    "gpt_oss": Cause(
        "as for Ernie4.5-MoE, with the kept norms all-gathered in fp16",
        (_UPCAST, _POLICY, _LOADER),
    ),
    "deepseek_v3": Cause(
        "`fsdp2_load_full_state_dict` reads `.device_mesh` of every state-dict entry; the "
        "persistent router buffer `e_score_correction_bias` is a plain tensor, so the loader "
        "crashes (crashed load; the forward and backward that need the loaded weights are not run)",
        (_DEVICE_MESH,),
    ),
}


def _accelerate(policy: Callable[[torch.dtype], MixedPrecisionPolicy | None]) -> Run:
    def run(mesh: DeviceMesh, model: str, dtype: torch.dtype) -> ContractReport:
        return on_zoo(
            mesh,
            model,
            dtype,
            mp_policy=policy(dtype),
            cast=checkpoint_cast,
            shard=accelerate_shard,
            load=accelerate_load,
            master_dtype=torch.float32,  # accelerate upcasts every trainable parameter
        )

    return run


def _fp32keep_under_accelerates_policy(
    mesh: DeviceMesh, model: str, dtype: torch.dtype
) -> ContractReport:
    """fp32keep's cast, wrapping and loader with accelerate's out-of-the-box policy and its FP32
    master weights: the fix, adopted under accelerate's own settings."""
    return on_zoo(
        mesh, model, dtype, mp_policy=accelerate_policy(dtype), master_dtype=torch.float32
    )


def _accelerate_keeping(mesh: DeviceMesh, model: str, dtype: torch.dtype) -> ContractReport:
    """accelerate's own sharding with the one-line ``keep_policy`` fix; fp32keep's loader,
    because accelerate's loader has a defect of its own that no policy fixes."""
    return on_zoo(
        mesh,
        model,
        dtype,
        mp_policy=keeping_policy(dtype),
        cast=checkpoint_cast,
        shard=accelerate_shard_keeping,
        master_dtype=torch.float32,
    )


SETUPS = (
    Setup(
        "accelerate",
        "accelerate",
        "`Accelerator(mixed_precision=...)` and its policy (param, reduce and output dtype all "
        "low precision; inputs cast), FP32 master weights, its own loader",
        _accelerate(accelerate_policy),
        _EXPECTED,
        _CAUSES,
        f"{_PLUGGED} --policy {_ADAPTER}:accelerate_policy",
    ),
    Setup(
        "accelerate, contract policy",
        "accelerate",
        "the same with the contract's default policy passed as `mixed_precision_policy` (reduce "
        "in FP32, `cast_forward_inputs=False`)",
        _accelerate(lambda dtype: None),
        _EXPECTED,
        _CAUSES,
        _PLUGGED,
    ),
    Setup(
        "fp32keep under accelerate's policy",
        "pytest-fp32keep",
        "the contract's defaults with accelerate's out-of-the-box policy (param, reduce and "
        "output dtype all low precision; inputs cast) over FP32 master weights: the fix passes "
        "under accelerate's own settings",
        _fp32keep_under_accelerates_policy,
        passes_everywhere(),
        check_options=f"--master-dtype fp32 --policy {_ADAPTER}:accelerate_policy",
    ),
    Setup(
        "accelerate + keep_policy (torch >= 2.15)",
        "accelerate",
        "accelerate's own sharding with one line changed: `mixed_precision_policy="
        "fp32keep.keep_policy(policy, plan, model)`, the policy reducing in FP32 without casting "
        "forward inputs (`keeping_policy`); fp32keep's loader (accelerate's has its own defect)",
        _accelerate_keeping,
        {**passes_everywhere(), "t5": frozenset({"crashed (forward)"})},
        {
            "t5": Cause(
                "the policy keeps every kept tensor, but accelerate's units still split T5's "
                "tied embedding: the tail unit takes `shared` (with `lm_head`) while the encoder "
                "and decoder `embed_tokens` reach the same parameter from the root unit, which "
                "torch refuses at the first forward: a defect of accelerate's unit layout that no "
                "policy fixes",
                (_TIED,),
            )
        },
        check_options=(
            f"--master-dtype fp32 --cast {_ADAPTER}:checkpoint_cast "
            f"--shard {_ADAPTER}:accelerate_shard_keeping --policy {_ADAPTER}:keeping_policy"
        ),
    ),
)
