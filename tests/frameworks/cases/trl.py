"""trl's FSDP2 path for the models it only runs forward (``prepare_fsdp``: DPO's and GRPO's
reference model, the SDFT/SDPO teacher) at the pinned 1.16.0, and fp32keep under the policy trl
shards them with, on the same models."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from examples.frameworks.trl_fsdp2 import freeze, reference_cast, trl_policy, trl_shard
from pytest_fp32keep import ContractReport, assert_fp32_keep_contract
from pytest_fp32keep.check.zoo import ZOO
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
_PLUGGED = (
    f"--cast {_ADAPTER}:reference_cast --shard {_ADAPTER}:trl_shard --load none {_POLICY_OPTION}"
)
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


def on_frozen_zoo(
    mesh: DeviceMesh, model: str, dtype: torch.dtype, **plugged: Any
) -> ContractReport:
    """:func:`~tests.frameworks.harness.on_zoo` on the zoo model frozen as trl freezes a teacher:
    the factory freezes it, so the contract's unsharded reference is the same frozen model."""
    entry = ZOO[model]
    return assert_fp32_keep_contract(
        lambda: freeze(entry.build()),
        functools.partial(entry.make_batch, seed=0),
        mesh=mesh,
        dtype=dtype,
        autocast=True,
        **plugged,
    )


def _trl(contract: Any) -> Run:
    def run(mesh: DeviceMesh, model: str, dtype: torch.dtype) -> ContractReport:
        return contract(
            mesh,
            model,
            dtype,
            mp_policy=trl_policy(dtype),
            cast=reference_cast,
            shard=trl_shard,
            check_state_dict=False,  # from_pretrained loads before prepare_fsdp (trl_fsdp2.py)
        )

    return run


def _fp32keep_under_trls_policy(contract: Any) -> Run:
    def run(mesh: DeviceMesh, model: str, dtype: torch.dtype) -> ContractReport:
        return contract(mesh, model, dtype, mp_policy=trl_policy(dtype))

    return run


_FROZEN_NOTE = (
    "; the model frozen in the contract's factory (`requires_grad_(False)`, `eval()`), so its "
    "reference is too: judged forward only"
)
SETUPS = (
    Setup(
        "trl (reference model)",
        "trl",
        "DPO's/GRPO's reference model: loaded in the policy model's dtype, sharded by "
        "`prepare_fsdp` (one unit, accelerate's out-of-the-box policy: param, reduce and output "
        "dtype all low precision, inputs cast); no loader of its own",
        _trl(on_zoo),
        {model: frozenset({"crashed (forward)"}) for model in passes_everywhere()},
        dict.fromkeys(passes_everywhere(), _REFERENCE_CAUSE),
        _PLUGGED,
    ),
    Setup(
        "trl (teacher model)",
        "trl",
        "the SDFT/SDPO teacher: the same, frozen before `prepare_fsdp`" + _FROZEN_NOTE,
        _trl(on_frozen_zoo),
        dict.fromkeys(passes_everywhere(), _TEACHER_ROWS)
        | {"t5": _TEACHER_ROWS | {"boundary (kept)"}},
        _TEACHER_CAUSES,
        _PLUGGED,  # the command line cannot freeze the model: it checks the reference model
    ),
    Setup(
        "fp32keep under trl's policy (reference model)",
        "pytest-fp32keep",
        "the contract's defaults with the policy `prepare_fsdp` shards with (accelerate's out of "
        "the box), over `from_pretrained`'s storage: the fix passes under trl's own settings",
        _fp32keep_under_trls_policy(on_zoo),
        passes_everywhere(),
        check_options=_POLICY_OPTION,
    ),
    Setup(
        "fp32keep under trl's policy (teacher model)",
        "pytest-fp32keep",
        "the same on the frozen model" + _FROZEN_NOTE,
        _fp32keep_under_trls_policy(on_frozen_zoo),
        passes_everywhere(),
        check_options=_POLICY_OPTION,
    ),
)
