"""What the nemo-automodel adapter claims about nemo-automodel's own code, checked in one process.

``nemo_policy`` is ``FSDP2Config``'s default policy (bf16: exactly; fp16: only ``param_dtype``
differs); ``nemo_checkpoint_cast`` is Transformers' keep-aware load followed by nemo-automodel's
``_restore_loaded_model_dtype``, so the kept tensors end in the checkpoint's dtype, where the
keep-aware load alone (the negative control) leaves them FP32; ``nemo_load`` refuses a rank
without the state dict, naming the option that hands it over.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from nemo_automodel.components.distributed.config import FSDP2Config

import fp32keep
from examples.frameworks.nemo_automodel_fsdp2 import (
    nemo_checkpoint_cast,
    nemo_load,
    nemo_policy,
)
from pytest_fp32keep.check.zoo import ZOO
from tests.frameworks.harness import DTYPES, MODELS

pytestmark = pytest.mark.slow  # breadth at pinned versions (conftest.py)


def test_the_policy_is_fsdp2configs_default_with_the_models_dtype() -> None:
    default = FSDP2Config().to_dict()["mp_policy"]
    assert nemo_policy(torch.bfloat16) == default
    fp16 = nemo_policy(torch.float16)
    assert fp16 != default
    assert dataclasses.replace(fp16, param_dtype=torch.bfloat16) == default


def _kept_dtypes(model: str, cast: str) -> set[torch.dtype]:
    dtype = DTYPES[MODELS[model]]
    built = ZOO[model].build()
    plan = fp32keep.resolve_keep_plan(built, dtype)
    assert plan.param_names, f"{model} keeps nothing at {dtype}"
    if cast == "nemo":
        nemo_checkpoint_cast(built, dtype, plan)
    else:
        fp32keep.keep_aware_cast(built, dtype, plan=plan)
    params = dict(built.named_parameters())
    return {params[name].dtype for name in plan.param_names if name in params}


@pytest.mark.parametrize("model", ["ernie4_5_moe", "gpt_oss"])
def test_the_checkpoint_cast_restores_the_kept_tensors_to_the_checkpoints_dtype(
    model: str,
) -> None:
    assert _kept_dtypes(model, "keep-aware") == {torch.float32}  # the negative control
    assert _kept_dtypes(model, "nemo") == {DTYPES[MODELS[model]]}


def test_the_loader_refuses_a_rank_without_the_state_dict() -> None:
    with pytest.raises(ValueError, match="load_on_every_rank=True"):
        nemo_load(ZOO["gpt_oss"].build(), None)
