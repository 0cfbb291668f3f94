"""torchtitan's FSDP2 for Hugging Face decoders (its Transformers modeling backend's
``apply_fsdp``) at the pinned 0.3.0, FP32 master weights, gradients summed over the ranks
(``disable_fsdp_gradient_division``, declared to the contract); fp32keep under torchtitan's
policy; and the one-line fix in ``apply_fsdp`` on torch >= 2.15 (``keep_policy``).

T5 is left out of both torchtitan setups: the backend's ``HFTransformerModel`` only trains
decoders (it reads ``model.model.embed_tokens``, ``layers`` and ``norm``; T5 has an encoder and a
decoder and neither), so an encoder-decoder cannot be given to it at all. fp32keep under
torchtitan's policy runs on every model, T5 included.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from examples.frameworks.torchtitan_fsdp2 import (
    TORCHTITAN_GRADIENT_DIVIDE_FACTOR,
    torchtitan_policy,
    torchtitan_shard,
    torchtitan_shard_keeping,
)
from pytest_fp32keep import ContractReport
from pytest_fp32keep.contract.steps import ShardFn
from tests.frameworks.harness import (
    ADAPTERS,
    Cause,
    Run,
    Setup,
    Source,
    on_zoo,
    passes_everywhere,
)

DECODERS = ("ernie4_5_moe", "deepseek_v3", "gpt_oss")
"""The zoo models torchtitan's Transformers backend can train (module docstring: not T5)."""

_ADAPTER = f"{ADAPTERS}.torchtitan_fsdp2"
_POLICY_OPTION = f"--policy {_ADAPTER}:torchtitan_policy"
_SCALE_OPTION = f"--gradient-divide-factor {TORCHTITAN_GRADIENT_DIVIDE_FACTOR:g}"
_PARALLELIZE = "torchtitan/experiments/transformers_modeling_backend/parallelize.py"
_ONE_POLICY = Source(
    _PARALLELIZE,
    269,
    'fsdp_config: dict[str, Any] = {"mesh": dp_mesh, "mp_policy": mp_policy}',
    "one policy, `param_dtype` the training dtype, for every unit",
)
_BLOCK_UNIT = Source(
    _PARALLELIZE,
    361,
    "transformer_block,",
    "each block one unit, its kept parameters with the rest",
)

_CAUSES = {
    "ernie4_5_moe": Cause(
        "the kept router's FP32 master weight is all-gathered in the policy's bf16 with the rest "
        "of its block (materialized), and the router upcasts what arrives (operators), so its "
        "gradient is no longer bit-identical, as a correct keep's is (parity)",
        (_BLOCK_UNIT, _ONE_POLICY),
    ),
    "deepseek_v3": Cause(
        "the kept router weight's FP32 master is all-gathered in the policy's bf16 with the rest "
        "of its block (materialized), and the router upcasts what arrives (operators)",
        (_BLOCK_UNIT, _ONE_POLICY),
    ),
    "gpt_oss": Cause(
        "the kept norms' FP32 masters are all-gathered in the policy's fp16 with the rest of "
        "their block (materialized), so the norms multiply by an fp16 weight (operators)",
        (_BLOCK_UNIT, _ONE_POLICY),
    ),
}


def _torchtitan(shard: ShardFn) -> Run:
    def run(mesh: DeviceMesh, model: str, dtype: torch.dtype) -> ContractReport:
        return on_zoo(
            mesh,
            model,
            dtype,
            mp_policy=torchtitan_policy(dtype),
            shard=shard,
            master_dtype=torch.float32,  # HFTransformerModel builds the model in FP32
            gradient_divide_factor=TORCHTITAN_GRADIENT_DIVIDE_FACTOR,
        )

    return run


def _fp32keep_under_torchtitans_policy(
    mesh: DeviceMesh, model: str, dtype: torch.dtype
) -> ContractReport:
    """fp32keep's cast, wrapping and loader with torchtitan's policy over FP32 master weights."""
    return on_zoo(
        mesh, model, dtype, mp_policy=torchtitan_policy(dtype), master_dtype=torch.float32
    )


SETUPS = (
    Setup(
        "torchtitan",
        "torchtitan",
        "the Transformers backend's `apply_fsdp`: FP32 master weights, one policy (compute in "
        "the training dtype, FP32 reduce, no input cast) for every unit, gradients summed "
        "(`disable_fsdp_gradient_division`, declared); fp32keep's loader (torchtitan loads "
        "through DCP)",
        _torchtitan(torchtitan_shard),
        {
            "ernie4_5_moe": frozenset({"materialized (kept)", "operators (kept)", "parity (kept)"}),
            "deepseek_v3": frozenset({"materialized (kept)", "operators (kept)"}),
            "gpt_oss": frozenset({"materialized (kept)", "operators (kept)"}),
        },
        _CAUSES,
        f"--master-dtype fp32 --shard {_ADAPTER}:torchtitan_shard {_POLICY_OPTION} {_SCALE_OPTION}",
    ),
    Setup(
        "fp32keep under torchtitan's policy",
        "pytest-fp32keep",
        "the contract's defaults with torchtitan's policy (compute in the model's dtype, FP32 "
        "reduce, no input cast) over FP32 master weights: the fix passes under torchtitan's own "
        "settings",
        _fp32keep_under_torchtitans_policy,
        passes_everywhere(),
        check_options=f"--master-dtype fp32 {_POLICY_OPTION}",
    ),
    Setup(
        "torchtitan + keep_policy (torch >= 2.15)",
        "torchtitan",
        "torchtitan's own `apply_fsdp` with one line changed: `mp_policy = "
        "fp32keep.keep_policy(MixedPrecisionPolicy(...), plan, model)`; gradients summed, "
        "declared",
        _torchtitan(torchtitan_shard_keeping),
        {model: frozenset() for model in DECODERS},
        check_options=(
            f"--master-dtype fp32 --shard {_ADAPTER}:torchtitan_shard_keeping {_POLICY_OPTION} "
            f"{_SCALE_OPTION}"
        ),
    ),
)
