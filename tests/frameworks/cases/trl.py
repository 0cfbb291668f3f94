"""trl's FSDP2 path for the models it only runs forward (``prepare_fsdp``: DPO's and GRPO's
reference model, the SDFT/SDPO teacher) at the pinned 1.16.0, and fp32keep under the policy trl
shards them with, on the same models."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from examples.frameworks.trl_fsdp2 import reference_cast, teacher_cast, trl_policy, trl_shard
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

_ADAPTER = f"{ADAPTERS}.trl_fsdp2"
_POLICY_OPTION = f"--policy {_ADAPTER}:trl_policy"
_TRL_SHARD = f"--shard {_ADAPTER}:trl_shard --load none {_POLICY_OPTION}"
_TEACHER_CAST = f"--cast {_ADAPTER}:teacher_cast"
_UTILS = "trl/models/utils.py"
_ONE_UNIT = Source(
    _UTILS,
    338,
    "fully_shard(model, **fsdp2_kwargs)",
    "the whole model sharded as one unit",
)
_POLICY = Source(
    _UTILS,
    332,
    '"mp_policy": fsdp_plugin.mixed_precision_policy or MixedPrecisionPolicy(),',
    "with the trainer's policy: every parameter all-gathered in its low-precision `param_dtype`",
)
_REFERENCE_DTYPE = Source(
    "trl/trainer/dpo_trainer.py",
    924,
    'ref_model_init_kwargs.setdefault("dtype", self.model.dtype)',
    "the reference model loaded in the policy model's low precision, kept tensors FP32, trainable",
)
_FROZEN = Source(
    "trl/experimental/sdft/sdft_trainer.py",
    530,
    "self.teacher_model.requires_grad_(False)",
    "the teacher frozen before `prepare_fsdp`",
)
_REFERENCE_CAUSE = Cause(
    "trl loads the reference model in the policy model's dtype (kept tensors FP32, the rest "
    "low precision, all trainable: trl only wraps its forward in `torch.no_grad()`) and "
    "`prepare_fsdp` shards it as one unit, without the FP32 upcast accelerate gives the policy "
    "model: FSDP2 refuses a unit whose trainable parameters have two dtypes at the first "
    "forward (crashed forward: uniform original parameter dtype)",
    (_REFERENCE_DTYPE, _ONE_UNIT, _POLICY),
)
_TEACHER_WHY = (
    "the frozen teacher is one unit with the trainer's policy: {kept} all-gathered in {dtype} "
    "(materialized) and computed with in it (operators){more}; forward only, gradients not judged"
)


def _teacher_cause(kept: str, dtype: str, more: str = "") -> Cause:
    return Cause(
        _TEACHER_WHY.format(kept=kept, dtype=dtype, more=more), (_FROZEN, _ONE_UNIT, _POLICY)
    )


_TEACHER_CAUSES = {
    "t5": _teacher_cause(
        "every kept `wo`", "fp16", ", and T5 leaves `wo`'s input in fp16 (boundary)"
    ),
    "ernie4_5_moe": _teacher_cause("the kept router", "bf16"),
    "deepseek_v3": _teacher_cause("the kept router weight", "bf16"),
    "gpt_oss": _teacher_cause("every kept norm", "fp16"),
}
_TEACHER_ROWS = frozenset({"materialized (kept)", "operators (kept)"})


def _trl(cast: Any) -> Run:
    def run(mesh: DeviceMesh, model: str, dtype: torch.dtype) -> ContractReport:
        return on_zoo(
            mesh,
            model,
            dtype,
            mp_policy=trl_policy(dtype),
            cast=cast,
            shard=trl_shard,
            check_state_dict=False,  # from_pretrained loads before prepare_fsdp (trl_fsdp2.py)
        )

    return run


def _fp32keep_under_trls_policy(**plugged: Any) -> Run:
    def run(mesh: DeviceMesh, model: str, dtype: torch.dtype) -> ContractReport:
        return on_zoo(mesh, model, dtype, mp_policy=trl_policy(dtype), **plugged)

    return run


_FROZEN_NOTE = (
    "; frozen in the cast as trl freezes it (`requires_grad_(False)`, `eval()`), which the "
    "contract's reference follows: judged forward only"
)
SETUPS = (
    Setup(
        "trl (reference model)",
        "trl",
        "DPO's/GRPO's reference model: loaded in the policy model's dtype, sharded by "
        "`prepare_fsdp` (one unit, accelerate's out-of-the-box policy: param, reduce and output "
        "dtype all low precision, inputs cast); no loader of its own",
        _trl(reference_cast),
        {model: frozenset({"crashed (forward)"}) for model in passes_everywhere()},
        dict.fromkeys(passes_everywhere(), _REFERENCE_CAUSE),
        f"--cast {_ADAPTER}:reference_cast {_TRL_SHARD}",
    ),
    Setup(
        "trl (teacher model)",
        "trl",
        "the SDFT/SDPO teacher: the same, frozen before `prepare_fsdp`" + _FROZEN_NOTE,
        _trl(teacher_cast),
        dict.fromkeys(passes_everywhere(), _TEACHER_ROWS)
        | {"t5": _TEACHER_ROWS | {"boundary (kept)"}},
        _TEACHER_CAUSES,
        f"{_TEACHER_CAST} {_TRL_SHARD}",
    ),
    Setup(
        "fp32keep under trl's policy (reference model)",
        "pytest-fp32keep",
        "the contract's defaults with the policy `prepare_fsdp` shards with (accelerate's out of "
        "the box), over `from_pretrained`'s storage: the fix passes under trl's own settings",
        _fp32keep_under_trls_policy(),
        passes_everywhere(),
        check_options=_POLICY_OPTION,
    ),
    Setup(
        "fp32keep under trl's policy (teacher model)",
        "pytest-fp32keep",
        "the same on the teacher" + _FROZEN_NOTE,
        _fp32keep_under_trls_policy(cast=teacher_cast),
        passes_everywhere(),
        check_options=f"{_TEACHER_CAST} {_POLICY_OPTION}",
    ),
)
