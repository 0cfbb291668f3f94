"""Families that build only with an override (``pytest_fp32keep/check/families/overrides.py``):
what each override is for, and what the family then is (5.24+, where they exist).

FunAsrNano's validator ties two widths the generic shrink sets apart; built, its model keeps
nothing (it declares no keep list, nor does its Qwen3 text model), so it is not listed.
ESMFold2's validators tie its rotary pairs to its head width and its input width to its atom
encoder's; built, it runs, but its forward is random by design (:data:`.overrides.STOCHASTIC`):
not runnable, with why, rather than a parity failure.
SLANet's config has no image size (its PPLCNet backbone is convolutional): without the one its
override gives, its batch has no pixels and its forward no input.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pytest_fp32keep.check import families
from pytest_fp32keep.check.families import discovery, entries, overrides
from pytest_fp32keep.check.families.batches import family_batch
from pytest_fp32keep.check.targets import family_availability, family_spec
from pytest_fp32keep.contract.steps import logits_and_loss


def _needs(family: str) -> None:
    if not (discovery.models_dir() / family).is_dir():
        pytest.skip(f"this Transformers has no {family}")


def _needs_listed(family: str) -> None:
    """Skip where the installed Transformers' ``family`` keeps no tensor (so it is not checked:
    SLANet builds its FP32 head only from 5.24)."""
    _needs(family)
    if not families.listed(family):
        pytest.skip(f"this Transformers' {family} keeps no tensor, so it is not checked")


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


def _forget_probes() -> None:
    for cached in (entries.probe, entries.family_entry):
        cached.cache_clear()


def _probe_afresh(family: str) -> entries.Probe:
    _forget_probes()
    return entries.probe(family)


def test_slanet_gets_pixels_from_its_override_and_its_probe_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With its override (an image size, a short decode) SLANet's batch is 64 x 64 pixels and
    nothing else (an image-only model, as SLANeXt), and its probe passes with the kind
    ``buildable``; without the image size (the negative control) the batch has no pixels and
    the probe says why: the forward's missing ``pixel_values``, never a reason of ``None``."""
    _needs_listed("slanet")
    model: Any = families.build_family_model("slanet")
    batch = family_batch(model, 0)
    assert list(batch) == ["pixel_values"] and batch["pixel_values"].shape == (2, 3, 64, 64)
    probed = _probe_afresh("slanet")
    assert (probed.entry is not None, probed.reason, probed.kind) == (True, None, "buildable")
    without = {k: v for k, v in overrides.OVERRIDES["slanet"].items() if k != "image_size"}
    monkeypatch.setattr(entries, "OVERRIDES", {**overrides.OVERRIDES, "slanet": without})
    try:
        probed = _probe_afresh("slanet")
    finally:
        monkeypatch.undo()
        _forget_probes()  # the probes of the patched overrides
    assert probed.entry is None and probed.kind == "not buildable"
    assert probed.reason is not None and "pixel_values" in probed.reason


def test_slanet_without_a_loss_gets_gradients_from_the_contracts_loss() -> None:
    """SLANet returns softmax probabilities and no loss. The contract's loss (the mean square
    of them, which the probe now takes too) reaches the kept head's weights; the plain mean the
    probe took before is a constant (each row sums to one), and gives them no gradient."""
    _needs_listed("slanet")
    model: Any = families.build_family_model("slanet")
    batch = family_batch(model, 0)
    head = model.head.structure_generator.fc2.weight
    _, loss = logits_and_loss(model(**batch))
    loss.backward()  # type: ignore[no-untyped-call]
    assert head.grad is not None and head.grad.abs().max() > 0
    model.zero_grad(set_to_none=True)
    model(**batch)[0].float().mean().backward()
    assert head.grad is not None and head.grad.abs().max() < 1e-9
