"""axolotl's FSDP2 path (its ``ModelLoader``'s dtype pass, its ``fsdp2_prepare_model`` in place
of accelerate's, its loader) at the pinned 0.21.0, with and without ``fp32_norms``; and fp32keep
under axolotl's policy."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh

from examples.frameworks.axolotl_fsdp2 import (
    axolotl_cast,
    axolotl_cast_fp32_norms,
    axolotl_load,
    axolotl_policy,
    axolotl_shard,
)
from fp32keep import KeepPlan
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

_ADAPTER = f"{ADAPTERS}.axolotl_fsdp2"
_PREPARE = "axolotl/monkeypatch/accelerate/fsdp2.py"
_REPLACED = Source(
    _PREPARE,
    1158,
    "accelerate.accelerator.fsdp2_prepare_model = fsdp2_prepare_model",
    "axolotl replaces accelerate's `fsdp2_prepare_model`, and with it accelerate's FP32 upcast "
    "of trainable parameters",
)
_LAYER_UNIT = Source(
    _PREPARE,
    924,
    "fully_shard(module, **fsdp2_kwargs)",
    "each decoder layer one unit with the one policy, whatever dtypes its parameters have",
)
_NO_CARVE = Source(
    "axolotl/monkeypatch/accelerate/fsdp2_grouping.py",
    157,
    "leaving it to FSDP2, which will reject the unit",
    "only PEFT adapter modules are split out of a unit with two trainable dtypes",
)
_NORM_BY_NAME = Source(
    "axolotl/loaders/model.py",
    1459,
    'elif "norm" in name:',
    "the loader casts every module named `*norm*` to `torch_dtype` under FSDP, kept ones too",
)
_BY_CLASS = Source(
    "axolotl/utils/fp32_norms.py",
    34,
    "elif cls_name.endswith(pattern):",
    "`fp32_norms` picks modules by class name (`RMSNorm`, `LayerNorm`), not by the keep lists",
)
_FP32_UNIT = Source(
    "axolotl/utils/fp32_norms.py",
    90,
    "fp32_policy = MixedPrecisionPolicy(",
    "each matched norm one FP32 unit, its forward inputs cast to FP32",
)
_MIXED = (
    "the decoder layer holding the kept {kept} (FP32) and its {dtype} weights is one unit: "
    "axolotl does not upcast to FP32 as accelerate does, and splits only adapter modules out, so "
    "FSDP2 refuses two trainable dtypes in one unit at the first forward (crashed forward)"
)
_CAUSES = {
    "t5": Cause(_MIXED.format(kept="`wo`", dtype="fp16"), (_REPLACED, _LAYER_UNIT, _NO_CARVE)),
    "ernie4_5_moe": Cause(
        _MIXED.format(kept="router", dtype="bf16"), (_REPLACED, _LAYER_UNIT, _NO_CARVE)
    ),
    "deepseek_v3": Cause(
        _MIXED.format(kept="router weight", dtype="bf16"), (_REPLACED, _LAYER_UNIT, _NO_CARVE)
    ),
    "gpt_oss": Cause(
        "axolotl's loader casts every module named `*norm*` to fp16, the kept norms too: they are "
        "stored, loaded, all-gathered and computed with in fp16, and their gradients are fp16 "
        "(stored, round trip, materialized, operators, parity)",
        (_NORM_BY_NAME,),
    ),
}
_FP32_NORMS_STORED = (
    "`fp32_norms` keeps every `*RMSNorm`/`*LayerNorm` class in FP32, kept or not, so the norms "
    "that are not kept are stored and loaded in FP32 (stored, round trip); "
)
_FP32_NORMS_CAUSES = {
    model: Cause(
        _FP32_NORMS_STORED
        + "and the kept tensors that are not norms still crash as without it: "
        + cause.why,
        (_BY_CLASS, *cause.sources),
    )
    for model, cause in _CAUSES.items()
    if model != "gpt_oss"
} | {
    "gpt_oss": Cause(
        "`fp32_norms` matches GPT-OSS's kept norms by class name and gives each an FP32 unit: "
        "kept as they should be, but the unit's policy casts the norm's fp16 input to FP32 "
        "(boundary), where the model's own norm upcasts it (operators)",
        (_BY_CLASS, _FP32_UNIT),
    )
}
_FP32_NORMS_ROWS = frozenset({"crashed (forward)", "round trip (not kept)", "stored (not kept)"})

CastFn = Callable[[torch.nn.Module, torch.dtype, KeepPlan], None]


def _axolotl(cast: CastFn) -> Run:
    def run(mesh: DeviceMesh, model: str, dtype: torch.dtype) -> ContractReport:
        return on_zoo(
            mesh,
            model,
            dtype,
            mp_policy=axolotl_policy(dtype),
            cast=cast,
            shard=axolotl_shard,
            load=axolotl_load,
        )

    return run


def _fp32keep_under_axolotls_policy(
    mesh: DeviceMesh, model: str, dtype: torch.dtype
) -> ContractReport:
    """fp32keep's cast, wrapping and loader with axolotl's policy over `from_pretrained`'s
    storage (axolotl keeps no FP32 master weights)."""
    return on_zoo(mesh, model, dtype, mp_policy=axolotl_policy(dtype))


_OPTIONS = (
    f"--shard {_ADAPTER}:axolotl_shard --load {_ADAPTER}:axolotl_load "
    f"--policy {_ADAPTER}:axolotl_policy"
)
SETUPS = (
    Setup(
        "axolotl",
        "axolotl",
        "a full fine-tune under `fsdp_version: 2`: `from_pretrained`'s storage and axolotl's "
        "loader's dtype pass, its `fsdp2_prepare_model` with accelerate's policy (param, reduce "
        "and output dtype all low precision, inputs cast), its loader",
        _axolotl(axolotl_cast),
        {
            "t5": frozenset({"crashed (forward)"}),
            "ernie4_5_moe": frozenset({"crashed (forward)"}),
            "deepseek_v3": frozenset({"crashed (forward)"}),
            "gpt_oss": frozenset(
                {
                    "materialized (kept)",
                    "operators (kept)",
                    "parity (kept)",
                    "round trip (kept)",
                    "stored (kept)",
                }
            ),
        },
        _CAUSES,
        f"--cast {_ADAPTER}:axolotl_cast {_OPTIONS}",
    ),
    Setup(
        "axolotl, fp32_norms",
        "axolotl",
        "the same with `fp32_norms: true` (norm modules, picked by class name, kept in FP32 in "
        "units of their own)",
        _axolotl(axolotl_cast_fp32_norms),
        dict.fromkeys(("t5", "ernie4_5_moe", "deepseek_v3"), _FP32_NORMS_ROWS)
        | {"gpt_oss": frozenset({"boundary (kept)", "operators (kept)"})},
        _FP32_NORMS_CAUSES,
        f"--cast {_ADAPTER}:axolotl_cast_fp32_norms {_OPTIONS}",
    ),
    Setup(
        "fp32keep under axolotl's policy",
        "pytest-fp32keep",
        "the contract's defaults with axolotl's policy (accelerate's: param, reduce and output "
        "dtype all low precision, inputs cast) over `from_pretrained`'s storage: the fix passes "
        "under axolotl's own settings",
        _fp32keep_under_axolotls_policy,
        passes_everywhere(),
        check_options=f"--policy {_ADAPTER}:axolotl_policy",
    ),
)
