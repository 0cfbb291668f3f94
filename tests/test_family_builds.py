"""Families that build only with an override (``pytest_fp32keep/check/families/overrides.py``):
what each override is for, and what the family then is (5.24+, where they exist).

FunAsrNano's validator ties two widths the generic shrink sets apart; built, its model keeps
nothing (it declares no keep list, nor does its Qwen3 text model), so it is not listed.
ESMFold2's validators tie its rotary pairs to its head width and its input width to its atom
encoder's; built, it runs, but its forward is random by design (:data:`.overrides.STOCHASTIC`):
not runnable, with why, rather than a parity failure.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pytest_fp32keep.check import families
from pytest_fp32keep.check.families import discovery, entries, overrides
from pytest_fp32keep.check.families.batches import family_batch
from pytest_fp32keep.check.targets import family_availability, family_spec


def _needs(family: str) -> None:
    if not (discovery.models_dir() / family).is_dir():
        pytest.skip(f"this Transformers has no {family}")


def _without_override(monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    monkeypatch.setattr(
        entries, "OVERRIDES", {k: v for k, v in overrides.OVERRIDES.items() if k != family}
    )


@pytest.mark.parametrize(
    ("family", "refused"),
    [
        ("fun_asr_nano", r"adaptor_config\.intermediate_size"),
        ("esmfold2", "3D rotary embedding needs 16 frequency pairs"),
    ],
)
def test_the_override_is_what_makes_the_family_build(
    family: str, refused: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With its override the family's first class builds, tiny; without it (the negative
    control) its config validator refuses the shrunk config, naming the relation."""
    _needs(family)
    cls = discovery.class_order(family)[0]
    model = entries.build_class(cls, family)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    _without_override(monkeypatch, family)
    with pytest.raises(Exception, match=refused):
        entries.build_class(cls, family)


def test_fun_asr_nano_keeps_nothing_so_it_is_not_listed() -> None:
    """Built, no class of FunAsrNano keeps a tensor at fp16 or bf16: not a family to check
    (before its override it was listed only because its build failed)."""
    _needs("fun_asr_nano")
    pick = families.family_pick("fun_asr_nano")
    assert pick.cls is None and pick.passed_over
    assert not families.listed("fun_asr_nano")


def _forward(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch)[0]


def test_esmfold2_runs_but_its_forward_is_random_so_it_is_not_runnable() -> None:
    """ESMFold2 keeps tensors and its batch (a protein's tokens and atoms) runs forward; two
    forwards of one batch differ (the trunk's random initial pair state), and agree when the
    global generator is reseeded before each (the control: nothing else in it is random). So
    the command reports it ``not runnable`` with the written why."""
    _needs("esmfold2")
    assert families.listed("esmfold2")
    model: Any = families.build_family_model("esmfold2")
    batch = family_batch(model, 0)
    assert "atom_inputs" in batch and "input_ids" in batch
    assert not torch.equal(_forward(model, batch), _forward(model, batch))
    outputs = []
    for _ in range(2):
        torch.manual_seed(0)
        outputs.append(_forward(model, batch))
    assert torch.equal(*outputs)
    buildable, unavailable = family_availability(["esmfold2"])
    assert buildable == []
    reason = unavailable[family_spec("esmfold2")]
    assert reason == f"not runnable (random forward: {overrides.STOCHASTIC['esmfold2']})"
