"""Transformers' own FSDP2 (``from_pretrained(..., distributed_config=...)``) at the pinned 5.24,
and fp32keep under the policy it shards with."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from examples.frameworks.transformers_fsdp2 import transformers_policy, transformers_shard
from pytest_fp32keep import ContractReport
from tests.frameworks.harness import ADAPTERS, Cause, Setup, Source, on_zoo, passes_everywhere

_ADAPTER = f"{ADAPTERS}.transformers_fsdp2"
_POLICY_OPTION = f"--policy {_ADAPTER}:transformers_policy"
_OWN_UNITS = Source(
    "transformers/distributed/mixin.py",
    293,
    'fsdp_plan = dict.fromkeys(fp32_modules, "free_full_weight") | fsdp_plan',
    "a unit per module that owns a kept tensor",
)
_POLICY = Source(
    "transformers/distributed/fsdp.py",
    77,
    'fsdp_policy_kwargs["mp_policy"] = MixedPrecisionPolicy(',
    "one policy, bf16 compute, for every unit, the kept ones included",
)


def _transformers(mesh: DeviceMesh, model: str, dtype: torch.dtype) -> ContractReport:
    return on_zoo(
        mesh,
        model,
        dtype,
        mp_policy=transformers_policy(),
        shard=transformers_shard,
        check_state_dict=False,  # no loader outside from_pretrained (transformers_fsdp2.py)
    )


def _fp32keep_under_transformers_policy(
    mesh: DeviceMesh, model: str, dtype: torch.dtype
) -> ContractReport:
    """fp32keep's cast, wrapping and loader with the policy ``distributed_config`` shards with
    (bf16 compute over the checkpoint's storage dtype, FP32 reduction)."""
    return on_zoo(mesh, model, dtype, mp_policy=transformers_policy())


SETUPS = (
    Setup(
        "transformers",
        "transformers",
        "`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2, "
        "fsdp_mixed_precision=True))`'s sharding and policy (bf16 compute, FP32 reduce)",
        _transformers,
        {
            "t5": frozenset(
                {
                    "boundary (kept)",
                    "materialized (kept)",
                    "operators (kept)",
                    "parity (kept)",
                    "parity (not kept)",
                    "parity (output)",
                }
            ),
            "ernie4_5_moe": frozenset(
                {
                    "boundary (kept)",
                    "materialized (kept)",
                    "operators (kept)",
                    "parity (kept)",
                    "parity (not kept)",
                }
            ),
            "deepseek_v3": frozenset({"materialized (kept)", "operators (kept)"}),
            "gpt_oss": frozenset({"crashed (forward)"}),
        },
        {
            "t5": Cause(
                "each kept `wo` gets its own unit, with the same bf16 policy as every other unit: "
                "all-gathered in bf16 and its input cast to bf16 (boundary); so `wo` computes in "
                "bf16, and the logits and gradients differ from a correct keep under the same "
                "bf16 compute, beyond the control's (parity)",
                (_OWN_UNITS, _POLICY),
            ),
            "ernie4_5_moe": Cause(
                "the router gets its own unit with the bf16 policy: all-gathered in bf16, its "
                "`moe_statics` input cast to bf16 (boundary); so the router's gradient is no "
                "longer bit-identical, as the control's is, and the routing it feeds moves other "
                "gradients past the control's (parity)",
                (_OWN_UNITS, _POLICY),
            ),
            "deepseek_v3": Cause(
                "the router weight gets its own unit with the bf16 policy: all-gathered in bf16 "
                "(materialized), so its matmul runs in bf16 (operators)",
                (_OWN_UNITS, _POLICY),
            ),
            "gpt_oss": Cause(
                "the kept final `norm` and the fp16 `lm_head` are bundled into one "
                "`keep_full_weight` unit (the norm-and-head pair), so FSDP2 refuses the unit's "
                "mixed dtypes at the first forward (uniform original parameter dtype)",
                (
                    Source(
                        "transformers/models/gpt_oss/modeling_gpt_oss.py",
                        569,
                        '_fsdp_plan = {"lm_head": "keep_full_weight"}',
                        "`lm_head` kept gathered, beside the kept final norm",
                    ),
                    Source(
                        "transformers/distributed/fsdp.py",
                        230,
                        "fully_shard(list(modules), mesh=fsdp_mesh, reshard_after_forward=False",
                        "the norm-and-head pair sharded as one unit, whatever their dtypes",
                    ),
                ),
            ),
        },
        f"--shard {_ADAPTER}:transformers_shard {_POLICY_OPTION} --load none",
    ),
    Setup(
        "fp32keep under transformers' policy",
        "pytest-fp32keep",
        "the contract's defaults with the policy `distributed_config` shards with (bf16 "
        "compute over the storage dtype, FP32 reduce): the fix passes under Transformers' "
        "own settings",
        _fp32keep_under_transformers_policy,
        passes_everywhere(),
        check_options=_POLICY_OPTION,
    ),
)
