"""nemo-automodel's FSDP2 path for Hugging Face models (``parallelize_model`` ->
``ModelParallelizer._apply``; its loader ``_load_full_state_dict_into_model``, the whole state
dict on every rank) at the pinned 0.7.0; fp32keep under nemo-automodel's policy; and the one-line
fix in nemo-automodel's own sharding on torch >= 2.15 (``keep_policy``).

nemo-automodel's own path is checked three ways: as installed (on the pinned torch 2.15 it raises
before sharding), and past that crash (``examples/frameworks/nemo_automodel_fsdp2.py`` says how)
with the dtypes ``from_pretrained(torch_dtype=<low precision>)`` leaves (kept tensors FP32, the
rest low precision) and with its recommended FP32 master weights (``torch_dtype=float32``).

A fourth way loads a checkpoint stored wholly in the low dtype: ``from_pretrained`` then runs
``_restore_loaded_model_dtype``, which casts the kept tensors back to that dtype.

The path judged is the one for Hugging Face model classes: what every architecture without a
nemo-automodel implementation gets (T5), and what ``force_hf=True`` gives the others
(nemo-automodel 0.7.0 has its own DeepSeek-V3, Ernie4.5 and GPT-OSS, sharded by their own
parallelizers). Not judged: ``fully_shard_by_dtype`` (``parallelizer_utils.py``), which only
those implementations (Nemotron-V3, Qwen3.5, the MoE parallelizer) use, never the Hugging Face
path.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from examples.frameworks.nemo_automodel_fsdp2 import (
    nemo_checkpoint_cast,
    nemo_load,
    nemo_policy,
    nemo_shard,
    nemo_shard_as_installed,
    nemo_shard_keeping,
)
from pytest_fp32keep import ContractReport
from pytest_fp32keep.contract.steps import CastFn, ShardFn
from tests.frameworks.harness import (
    ADAPTERS,
    MODELS,
    Cause,
    Run,
    Setup,
    Source,
    on_zoo,
    passes_everywhere,
)

_ADAPTER = f"{ADAPTERS}.nemo_automodel_fsdp2"
_POLICY_OPTION = f"--policy {_ADAPTER}:nemo_policy"
_LOAD_OPTION = f"--load {_ADAPTER}:nemo_load --load-on-every-rank"
_PARALLELIZER = "nemo_automodel/components/distributed/parallelizer.py"
_LAYER_UNIT = Source(
    _PARALLELIZER,
    744,
    "shard_module(",
    "each layer of a `ModuleList` one unit, whatever dtypes its parameters have and whether the "
    "keep lists name them",
)
_ONE_POLICY = Source(
    _PARALLELIZER,
    747,
    "mp_policy=mp_policy,",
    "every layer unit sharded with the one `FSDP2Config.mp_policy`, the kept parameters' too",
)
_GUARD_CALL = Source(
    _PARALLELIZER,
    439,
    "_patch_fsdp_accumulated_grad_guard()",
    "the guard installed before any unit is sharded",
)
_GUARD_TARGET = Source(
    "nemo_automodel/components/distributed/fsdp_patches.py",
    162,
    "orig = FSDPParam.to_accumulated_grad_if_needed",
    "reads a private FSDP2 method torch 2.15 no longer has",
)

_MODEL_INIT = "nemo_automodel/_transformers/model_init.py"
_RESTORE = (
    Source(
        _MODEL_INIT,
        1451,
        "_restore_loaded_model_dtype(",
        "`from_pretrained` re-casts every loaded tensor after Transformers' keep-aware load",
    ),
    Source(
        _MODEL_INIT,
        1173,
        "target_dtype = torch.promote_types(effective_checkpoint_dtype, requested_dtype)",
        "the target is the wider of the checkpoint's dtype and the requested one, the keep "
        "lists unread",
    ),
    Source(
        _MODEL_INIT,
        1189,
        "tensor.data = tensor.data.to(dtype=target_dtype)",
        "a kept FP32 tensor cast back down to the checkpoint's dtype",
    ),
)
_RESTORED = (
    "`_restore_loaded_model_dtype` casts {kept} back to the checkpoint's {dtype} after "
    "Transformers kept {them} FP32 (stored), so what the loader loads lands in {dtype} (round "
    "trip), {it} all-gathers and computes in {dtype} (materialized, operators) and {its} "
    "gradient is {dtype} (parity){more}"
)
_UNIFORM = (
    "nemo-automodel shards each layer as one FSDP2 unit without reading the keep lists; "
    "`from_pretrained(torch_dtype={torch_dtype})` leaves {kept} FP32 beside the layer's {dtype} "
    "weights, so FSDP2 refuses the unit's mixed dtypes at the first forward (uniform original "
    "parameter dtype)"
)
_KEPT_IN_LAYERS = {
    "t5": "each block's kept `wo`",
    "ernie4_5_moe": "the kept router `mlp.gate`",
    "deepseek_v3": "the kept router `mlp.gate` (weight and correction bias)",
    "gpt_oss": "the kept norms",
}
_TORCH_DTYPE = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}
_LOW_STORAGE_CAUSES = {
    model: Cause(
        _UNIFORM.format(torch_dtype=_TORCH_DTYPE[MODELS[model]], dtype=MODELS[model], kept=kept),
        (_LAYER_UNIT,),
    )
    for model, kept in _KEPT_IN_LAYERS.items()
}
_RESTORED_CAUSES = {
    "t5": Cause(
        _RESTORED.format(
            kept="each block's kept `wo`",
            dtype="fp16",
            them="them",
            it="each",
            its="its",
            more="; T5 then feeds `wo` fp16 inputs it would have cast to FP32 (boundary)",
        ),
        _RESTORE,
    ),
    "ernie4_5_moe": Cause(
        _RESTORED.format(
            kept="the kept router", dtype="bf16", them="it", it="it", its="its", more=""
        ),
        _RESTORE,
    ),
    "deepseek_v3": Cause(
        _RESTORED.format(
            kept="the kept router weight", dtype="bf16", them="it", it="it", its="its", more=""
        ),
        _RESTORE,
    ),
    "gpt_oss": Cause(
        _RESTORED.format(
            kept="the kept norms", dtype="fp16", them="them", it="each", its="their", more=""
        ),
        _RESTORE,
    ),
}
_MASTER_CAUSES = {
    "t5": Cause(
        "every parameter is an FP32 master weight and each layer unit all-gathers all of them in "
        "the policy's fp16, the kept `wo` too (materialized); T5 then feeds `wo` its fp16 input "
        "instead of casting it to FP32 (boundary), so `wo` computes in fp16 (operators)",
        (_LAYER_UNIT, _ONE_POLICY),
    ),
    "ernie4_5_moe": Cause(
        "the kept router's FP32 master weight is all-gathered in the policy's bf16 with the rest "
        "of its layer (materialized), and the router upcasts what arrives (operators), so its "
        "gradient is no longer bit-identical, as a correct keep's is (parity)",
        (_LAYER_UNIT, _ONE_POLICY),
    ),
    "deepseek_v3": Cause(
        "the kept router weight's FP32 master is all-gathered in the policy's bf16 with the rest "
        "of its layer (materialized), and the router upcasts what arrives (operators)",
        (_LAYER_UNIT, _ONE_POLICY),
    ),
    "gpt_oss": Cause(
        "the kept norms' FP32 masters are all-gathered in the policy's fp16 with the rest of "
        "their layer (materialized), so the norms multiply by an fp16 weight (operators)",
        (_LAYER_UNIT, _ONE_POLICY),
    ),
}
_AS_INSTALLED_CAUSE = Cause(
    "`ModelParallelizer._apply` installs a guard around FSDP2's private "
    "`FSDPParam.to_accumulated_grad_if_needed` before sharding; torch 2.15 (which "
    "nemo-automodel 0.7.0's `torch>=2.8.0` admits) has no such method, so `parallelize_model` "
    "raises AttributeError on every model (crashed shard)",
    (_GUARD_CALL, _GUARD_TARGET),
)


def _nemo(shard: ShardFn, master_dtype: torch.dtype | None, cast: CastFn | None = None) -> Run:
    def run(mesh: DeviceMesh, model: str, dtype: torch.dtype) -> ContractReport:
        return on_zoo(
            mesh,
            model,
            dtype,
            **({} if cast is None else {"cast": cast}),
            mp_policy=nemo_policy(dtype),
            shard=shard,
            load=nemo_load,
            load_on_every_rank=True,  # nemo-automodel's loader reads the dict on every rank
            master_dtype=master_dtype,
        )

    return run


def _fp32keep(master_dtype: torch.dtype | None) -> Run:
    def run(mesh: DeviceMesh, model: str, dtype: torch.dtype) -> ContractReport:
        """fp32keep's cast, wrapping and loader under nemo-automodel's policy."""
        return on_zoo(mesh, model, dtype, mp_policy=nemo_policy(dtype), master_dtype=master_dtype)

    return run


_NEMO = f"--shard {_ADAPTER}:nemo_shard {_POLICY_OPTION} {_LOAD_OPTION}"
_MASTER = "--master-dtype fp32"
_KEPT_LOW = frozenset(
    {
        "materialized (kept)",
        "operators (kept)",
        "parity (kept)",
        "round trip (kept)",
        "stored (kept)",
    }
)
_ROWS_RESTORED = {
    "t5": _KEPT_LOW | {"boundary (kept)"},
    "ernie4_5_moe": _KEPT_LOW,
    "deepseek_v3": _KEPT_LOW,
    "gpt_oss": _KEPT_LOW,
}
_ROWS_MASTER = {
    "t5": frozenset({"boundary (kept)", "materialized (kept)", "operators (kept)"}),
    "ernie4_5_moe": frozenset({"materialized (kept)", "operators (kept)", "parity (kept)"}),
    "deepseek_v3": frozenset({"materialized (kept)", "operators (kept)"}),
    "gpt_oss": frozenset({"materialized (kept)", "operators (kept)"}),
}

SETUPS = (
    Setup(
        "nemo-automodel as installed",
        "nemo-automodel",
        "`parallelize_model` with `FSDP2Config`'s default policy (compute in the model's dtype, "
        "FP32 reduce, no input cast), FP32 master weights, on the pinned torch 2.15",
        _nemo(nemo_shard_as_installed, torch.float32),
        {model: frozenset({"crashed (shard)"}) for model in MODELS},
        dict.fromkeys(MODELS, _AS_INSTALLED_CAUSE),
        f"{_MASTER} --shard {_ADAPTER}:nemo_shard_as_installed {_POLICY_OPTION} {_LOAD_OPTION}",
    ),
    Setup(
        "nemo-automodel",
        "nemo-automodel",
        "`from_pretrained(torch_dtype=<the model's dtype>)`: kept tensors FP32, the rest low "
        "precision; `parallelize_model` (past its torch-2.15 crash) with `FSDP2Config`'s default "
        "policy; its loader, the state dict on every rank",
        _nemo(nemo_shard, None),
        {model: frozenset({"crashed (forward)"}) for model in MODELS},
        _LOW_STORAGE_CAUSES,
        _NEMO,
    ),
    Setup(
        "nemo-automodel, low-precision checkpoint",
        "nemo-automodel",
        "`from_pretrained(torch_dtype=<the model's dtype>)` of a checkpoint stored wholly in that "
        "dtype, then its `_restore_loaded_model_dtype`; `parallelize_model` (past its torch-2.15 "
        "crash) with `FSDP2Config`'s default policy; its loader",
        _nemo(nemo_shard, None, nemo_checkpoint_cast),
        _ROWS_RESTORED,
        _RESTORED_CAUSES,
        f"--cast {_ADAPTER}:nemo_checkpoint_cast {_NEMO}",
    ),
    Setup(
        "nemo-automodel, FP32 master weights",
        "nemo-automodel",
        "its recommended configuration: `from_pretrained(torch_dtype=torch.float32)`, FP32 "
        "master weights under the default policy (compute in the model's dtype, FP32 reduce, no "
        "input cast); `parallelize_model` (past its torch-2.15 crash); its loader",
        _nemo(nemo_shard, torch.float32),
        _ROWS_MASTER,
        _MASTER_CAUSES,
        f"{_MASTER} {_NEMO}",
    ),
    Setup(
        "fp32keep under nemo-automodel's policy",
        "pytest-fp32keep",
        "the contract's defaults (kept tensors FP32, the rest in the model's dtype) under "
        "`FSDP2Config`'s default policy: the fix passes under nemo-automodel's own settings",
        _fp32keep(None),
        passes_everywhere(),
        check_options=_POLICY_OPTION,
    ),
    Setup(
        "fp32keep under nemo-automodel's policy, FP32 master weights",
        "pytest-fp32keep",
        "the contract's defaults under `FSDP2Config`'s default policy over FP32 master weights, "
        "nemo-automodel's recommended configuration",
        _fp32keep(torch.float32),
        passes_everywhere(),
        check_options=f"{_MASTER} {_POLICY_OPTION}",
    ),
    Setup(
        "nemo-automodel + keep_policy (torch >= 2.15)",
        "nemo-automodel",
        "nemo-automodel's own sharding and loader under FP32 master weights with one line "
        "changed: `FSDP2Config(mp_policy=fp32keep.keep_policy(policy, plan, model))`",
        _nemo(nemo_shard_keeping, torch.float32),
        passes_everywhere(),
        check_options=(
            f"{_MASTER} --shard {_ADAPTER}:nemo_shard_keeping {_POLICY_OPTION} {_LOAD_OPTION}"
        ),
    ),
)
