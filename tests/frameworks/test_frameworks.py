"""accelerate's and Transformers' own FSDP2 paths under the contract, on zoo models, in 2 ranks.

Each case asserts exactly the set of failing rows observed (``observe.rows_of``), so a fix or a
new regression in either framework changes the set and fails here; ``nox -s frameworks`` then
renders the recorded sets into ``docs/frameworks.md``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from examples.frameworks.accelerate_fsdp2 import (
    accelerate_load,
    accelerate_policy,
    accelerate_shard,
    checkpoint_cast,
)
from examples.frameworks.transformers_fsdp2 import transformers_policy, transformers_shard
from pytest_fp32keep import ContractReport, assert_fp32_keep_contract
from pytest_fp32keep.check.zoo import ZOO
from tests.frameworks.observe import observe, record

pytestmark = pytest.mark.slow  # breadth at pinned versions (conftest.py)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MODELS = {"t5": "fp16", "ernie4_5_moe": "bf16", "deepseek_v3": "bf16", "gpt_oss": "fp16"}
"""Zoo model -> the dtype it keeps something under (regular lists: fp16 only); T5 ties three
embeddings, Ernie4.5-MoE keeps its router (strict list) and ties two, DeepSeek-V3 keeps a router
weight and a router buffer, GptOss keeps every norm (regular list)."""


@dataclasses.dataclass(frozen=True)
class Setup:
    """One framework configured one way."""

    name: str
    dist: str  # the distribution whose version the table shows
    description: str
    run: Callable[[DeviceMesh, str, torch.dtype], ContractReport]


def _on_zoo(mesh: DeviceMesh, model: str, dtype: torch.dtype, **plugged: Any) -> ContractReport:
    """The contract on zoo ``model`` at ``dtype``, forward under autocast, with ``plugged``
    (``cast=``, ``shard=``, ``load=``, ``mp_policy=`` ...) in place of its defaults."""
    entry = ZOO[model]
    return assert_fp32_keep_contract(
        entry.build,
        functools.partial(entry.make_batch, seed=0),
        mesh=mesh,
        dtype=dtype,
        autocast=True,
        **plugged,
    )


def _accelerate(
    policy: Callable[[torch.dtype], MixedPrecisionPolicy | None],
) -> Callable[[DeviceMesh, str, torch.dtype], ContractReport]:
    def run(mesh: DeviceMesh, model: str, dtype: torch.dtype) -> ContractReport:
        return _on_zoo(
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
    return _on_zoo(
        mesh, model, dtype, mp_policy=accelerate_policy(dtype), master_dtype=torch.float32
    )


def _fp32keep_under_transformers_policy(
    mesh: DeviceMesh, model: str, dtype: torch.dtype
) -> ContractReport:
    """fp32keep's cast, wrapping and loader with the policy ``distributed_config`` shards with
    (bf16 compute over the checkpoint's storage dtype, FP32 reduction)."""
    return _on_zoo(mesh, model, dtype, mp_policy=transformers_policy())


def _transformers(mesh: DeviceMesh, model: str, dtype: torch.dtype) -> ContractReport:
    return _on_zoo(
        mesh,
        model,
        dtype,
        mp_policy=transformers_policy(),
        shard=transformers_shard,
        check_state_dict=False,  # no loader outside from_pretrained (transformers_fsdp2.py)
    )


SETUPS = {
    setup.name: setup
    for setup in (
        Setup(
            "fp32keep (control)",
            "pytest-fp32keep",
            "the contract's defaults (`fp32keep`'s cast, `apply_fsdp2`, loader) through the same "
            "harness: no row, so the other setups' rows are the frameworks' own",
            _on_zoo,
        ),
        Setup(
            "fp32keep under accelerate's policy",
            "pytest-fp32keep",
            "the contract's defaults with accelerate's out-of-the-box policy (param, reduce and "
            "output dtype all low precision; inputs cast) over FP32 master weights: the fix "
            "passes under accelerate's own settings",
            _fp32keep_under_accelerates_policy,
        ),
        Setup(
            "fp32keep under transformers' policy",
            "pytest-fp32keep",
            "the contract's defaults with the policy `distributed_config` shards with (bf16 "
            "compute over the storage dtype, FP32 reduce): the fix passes under Transformers' "
            "own settings",
            _fp32keep_under_transformers_policy,
        ),
        Setup(
            "accelerate",
            "accelerate",
            "`Accelerator(mixed_precision=...)` and its policy (param, reduce and output dtype "
            "all low precision; inputs cast), FP32 master weights, its own loader",
            _accelerate(accelerate_policy),
        ),
        Setup(
            "accelerate, contract policy",
            "accelerate",
            "the same with the contract's default policy passed as `mixed_precision_policy` "
            "(reduce in FP32, `cast_forward_inputs=False`)",
            _accelerate(lambda dtype: None),
        ),
        Setup(
            "transformers",
            "transformers",
            "`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2, "
            "fsdp_mixed_precision=True))`'s sharding and policy (bf16 compute, FP32 reduce)",
            _transformers,
        ),
    )
}

ACCELERATE_ROWS = frozenset(
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
"""accelerate on Ernie4.5-MoE and GPT-OSS, with either policy."""
EXPECTED: dict[tuple[str, str], frozenset[str]] = {
    **{("fp32keep (control)", model): frozenset() for model in MODELS},
    **{("fp32keep under accelerate's policy", model): frozenset() for model in MODELS},
    **{("fp32keep under transformers' policy", model): frozenset() for model in MODELS},
    # accelerate's loader corrupts what it loads (round trip); on T5 the model then fails in its
    # forward (crashed), on Ernie and GPT-OSS it computes NaN from the loaded weights (parity);
    # on DeepSeek-V3 the loader itself raises (crashed load)
    ("accelerate", "t5"): frozenset(
        {"crashed (forward)", "round trip (kept)", "round trip (not kept)"}
    ),
    ("accelerate", "ernie4_5_moe"): ACCELERATE_ROWS,
    ("accelerate", "deepseek_v3"): frozenset({"crashed (load)"}),
    ("accelerate", "gpt_oss"): ACCELERATE_ROWS,
    ("accelerate, contract policy", "t5"): frozenset(
        {"crashed (forward)", "round trip (kept)", "round trip (not kept)"}
    ),
    ("accelerate, contract policy", "ernie4_5_moe"): ACCELERATE_ROWS,
    ("accelerate, contract policy", "deepseek_v3"): frozenset({"crashed (load)"}),
    ("accelerate, contract policy", "gpt_oss"): ACCELERATE_ROWS,
    # T5 under fp16: Transformers' policy computes in bf16 whatever the storage dtype (outputs);
    # the kept units' bf16 all-gather moves their gradients past the control's (parity)
    ("transformers", "t5"): frozenset(
        {
            "boundary (kept)",
            "materialized (kept)",
            "operators (kept)",
            "parity (kept)",
            "parity (not kept)",
            "parity (output)",
        }
    ),
    ("transformers", "ernie4_5_moe"): frozenset(
        {
            "boundary (kept)",
            "materialized (kept)",
            "operators (kept)",
            "parity (kept)",
            "parity (not kept)",
        }
    ),
    ("transformers", "deepseek_v3"): frozenset({"materialized (kept)", "operators (kept)"}),
    ("transformers", "gpt_oss"): frozenset({"crashed (forward)"}),
}
"""The failing rows observed with accelerate 1.15.0 and Transformers 5.24.0 on torch 2.13.0."""


_ACCELERATE_WHY = {
    "t5": "accelerate puts the tied `shared` embedding (with `lm_head`) in a tail unit, but T5's "
    "encoder and decoder `embed_tokens` tie the same parameter and stay in the root unit: torch "
    "2.13 refuses a parameter managed by two FSDP groups at the first forward, in FSDP2's lazy "
    "init (crashed forward); the loaded weights already differ before it (round trip, as for "
    "Ernie4.5-MoE)",
    "ernie4_5_moe": "every trainable parameter is upcast to FP32 and all-gathered in the policy's "
    "bf16, the kept router too (materialized, and its operators see the bf16 weight); the loader "
    "broadcasts rank 0's checkpoint dtype (bf16) into buffers the other ranks allocate in the "
    "model's FP32, a dtype mismatch gloo does not detect (round trip), and the model computes "
    "with what arrived: NaN outputs and gradients (parity)",
    "gpt_oss": "as for Ernie4.5-MoE, with the kept norms all-gathered in fp16",
    "deepseek_v3": "`fsdp2_load_full_state_dict` reads `.device_mesh` of every state-dict entry; "
    "the persistent router buffer `e_score_correction_bias` is a plain tensor, so the loader "
    "crashes (crashed load; the forward and backward that need the loaded weights are not run)",
}
WHY: dict[tuple[str, str], str] = {
    **{("accelerate", model): why for model, why in _ACCELERATE_WHY.items()},
    **{("accelerate, contract policy", model): why for model, why in _ACCELERATE_WHY.items()},
    ("transformers", "t5"): "each kept `wo` gets its own unit, with the same bf16 policy: "
    "all-gathered in bf16 and its input cast to bf16 (boundary); so `wo` computes in bf16, and "
    "the logits and gradients differ from a correct keep under the same bf16 compute, beyond "
    "the control's (the same units, the tied embedding gathered in three of them, with the "
    "correct policy) (parity)",
    ("transformers", "ernie4_5_moe"): "the router gets its own unit with the bf16 policy: "
    "all-gathered in bf16, its `moe_statics` input cast to bf16 (boundary); so the router's "
    "gradient is no longer bit-identical, as the control's (the same units, the grouped "
    "`embed_tokens`+`norm` among them, with the correct policy) is, and the routing it feeds "
    "moves other gradients past the control's (parity)",
    ("transformers", "gpt_oss"): "the kept final `norm` and the fp16 `lm_head` are one "
    "`keep_full_weight` unit (its plan's norm-and-head pair), so FSDP2 refuses the unit's mixed "
    "dtypes at the first forward",
    ("transformers", "deepseek_v3"): "the router weight gets its own unit with the bf16 policy: "
    "all-gathered in bf16 (materialized, and its matmul runs in bf16: operators)",
}
"""Why each case fails as it does (read from the frameworks' 1.15.0 / 5.24.0 sources); the
table shows it beside the rows."""


@pytest.mark.fsdp2(nproc=2)
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("setup", list(SETUPS))
def test_framework_fails_exactly_the_recorded_rows(
    fsdp2_mesh: DeviceMesh, fsdp2_rank: int, setup: str, model: str
) -> None:
    chosen = SETUPS[setup]
    dtype = MODELS[model]
    outcome = observe(lambda: chosen.run(fsdp2_mesh, model, DTYPES[dtype]))
    if fsdp2_rank == 0:
        why = WHY.get((setup, model), "")
        record(chosen.name, chosen.dist, chosen.description, model, dtype, outcome, why=why)
    assert outcome.rows == EXPECTED[setup, model], outcome.crash or "\n".join(outcome.examples)
