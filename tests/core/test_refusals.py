"""Library refusals that need no process group: each one bounded, naming the culprit, harmless.

The multi-rank refusals (layouts, meshes, policies, state dicts) are in
tests/multirank/test_core_fsdp2.py; docs/errors.md lists them all.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

import fp32keep
from fp32keep import Fp32KeepRuntimeError, KeepDeclarationError
from tests.core.toys import model_with_names, stack_class
from tests.error_bounds import LIBRARY_BOUND_S, within
from tests.untouched import assert_same_parameters, assert_unchanged, snapshot

BF16 = torch.bfloat16


def test_apply_without_a_process_group_is_refused() -> None:
    assert not dist.is_initialized()  # this process never starts one
    model = stack_class(strict=["wo"])()
    before = snapshot(model)
    policy = MixedPrecisionPolicy(param_dtype=BF16)
    with (
        within(LIBRARY_BOUND_S),
        pytest.raises(
            Fp32KeepRuntimeError, match="apply_fsdp2 needs an initialised process group"
        ) as error,
    ):
        fp32keep.apply_fsdp2(model, mesh=None, mp_policy=policy)  # type: ignore[arg-type]
    assert isinstance(error.value, RuntimeError)  # what it was before the common base
    assert "torch.distributed.init_process_group(...) (or launch with torchrun)" in str(error.value)
    assert_unchanged(model, before)


def test_unusable_keep_declaration_is_refused_naming_the_attribute() -> None:
    # A bare string where Transformers expects a list: 4.x and 5.1+ refuse it when loading.
    model = model_with_names(["a.wo.weight"], regular="wo")
    before = snapshot(model)
    with within(LIBRARY_BOUND_S), pytest.raises(KeepDeclarationError) as error:
        fp32keep.resolve_keep_plan(model, BF16, transformers_version="5.10.4")
    assert "Toy._keep_in_fp32_modules" in str(error.value)  # the culprit
    assert "string 'wo'" in str(error.value)
    assert_same_parameters(model, before)
