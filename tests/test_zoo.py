"""The built-in zoo: every entry the installed Transformers has builds, runs and trains.

Entries the installed version lacks are skipped with the reason ``available_entries`` gives.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import time

import pytest
import torch
from packaging.version import Version
from torch import nn

from pytest_fp32keep.check.zoo import (
    ZOO,
    ZooEntry,
    available_entries,
    transformers_version,
)

ALL_NAMES = list(ZOO)


def _available(name: str) -> ZooEntry:
    entry = ZOO[name]
    reason = entry.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    return entry


def _declarations(model: nn.Module) -> set[str]:
    entries: set[str] = set()
    for attribute in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        entries.update(getattr(model, attribute, None) or ())
    return entries


def test_registry_is_consistent() -> None:
    """Keys are entry names; every field holds what the docs promise."""
    assert ALL_NAMES, "the zoo is empty"
    for name, entry in ZOO.items():
        assert entry.name == name
        assert dataclasses.is_dataclass(entry)
        assert entry.dtypes, name
        assert set(entry.dtypes) <= {torch.float16, torch.bfloat16}, name
        assert entry.notes, name
        assert entry.model_class[:1].isupper(), name
    with pytest.raises(dataclasses.FrozenInstanceError):
        ZOO["t5"].name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        ZOO["other"] = ZOO["t5"]  # type: ignore[index]
    assert {name for name, entry in ZOO.items() if entry.expect_layout_error} == {
        "rwkv",
        "blip2",
        "instructblip",
    }


def test_import_does_not_import_transformers() -> None:
    """Importing the zoo is cheap: Transformers is imported by builders only."""
    code = (
        "import sys, pytest_fp32keep.check.zoo as z; "
        "assert 'transformers' not in sys.modules, 'transformers imported'; "
        "print(len(z.ZOO))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(len(ZOO))


def test_available_entries_partition_the_zoo() -> None:
    """Every entry is either available or unavailable with a reason naming its class."""
    availability = available_entries()
    assert set(availability.available) | set(availability.unavailable) == set(ZOO)
    assert not set(availability.available) & set(availability.unavailable)
    assert list(availability.available) == [n for n in ZOO if n in availability.available]
    for name, reason in availability.unavailable.items():
        assert ZOO[name].model_class in reason, reason
    # Classes present in every supported version are always available.
    for name in ("t5", "gpt_oss", "ernie4_5_moe", "deepseek_v3", "rwkv", "blip2", "llama"):
        assert name in availability.available, availability.unavailable.get(name)
    assert list(available_entries(["t5"]).available) == ["t5"]
    with pytest.raises(KeyError):
        available_entries(["no-such-entry"])


def test_unavailable_entry_reports_instead_of_failing() -> None:
    """A missing class or a too-old Transformers gives a reason, not an exception."""
    base = ZOO["llama"]
    missing = dataclasses.replace(base, name="ghost", model_class="GhostModelForCausalLM")
    reason = missing.unavailable_reason()
    assert reason is not None
    assert "GhostModelForCausalLM" in reason
    assert transformers_version() in reason
    too_new = dataclasses.replace(base, name="future", min_transformers="999.0")
    reason = too_new.unavailable_reason()
    assert reason is not None
    assert "999.0" in reason


@pytest.mark.parametrize("name", ALL_NAMES)
def test_entry_builds_fast_and_deterministically(name: str) -> None:
    """Tiny, FP32, same weights on every build, global RNG left alone."""
    entry = _available(name)
    entry.build()  # first build pays for importing the model's module
    rng_before = torch.get_rng_state()
    started = time.process_time()  # CPU time: robust to other load on a shared runner
    model = entry.build()
    elapsed = time.process_time() - started
    assert torch.equal(torch.get_rng_state(), rng_before), "build changed the global RNG"
    assert elapsed < 1.0, f"{name} took {elapsed:.2f} s of CPU time to build"
    assert type(model).__name__ == entry.model_class
    params = list(model.parameters())
    assert sum(p.numel() for p in params) < 200_000
    floating = [t for t in [*params, *model.buffers()] if t.is_floating_point()]
    assert all(t.dtype == torch.float32 for t in floating)
    again = entry.build()
    expected = model.state_dict()
    for key, value in again.state_dict().items():
        assert torch.equal(value, expected[key]), key


@pytest.mark.parametrize("name", ALL_NAMES)
def test_entry_batch_is_deterministic(name: str) -> None:
    """Same seed, same batch; another seed, another batch; a Generator works too."""
    entry = _available(name)
    model = entry.build()
    first = entry.make_batch(model, 0)
    second = entry.make_batch(model, 0)
    other = entry.make_batch(model, 1)
    from_generator = entry.make_batch(model, torch.Generator().manual_seed(0))
    assert "labels" in first
    assert first.keys() == second.keys() == other.keys() == from_generator.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)
    assert all(torch.equal(first[key], from_generator[key]) for key in first)
    assert not all(torch.equal(first[key], other[key]) for key in first)


@pytest.mark.parametrize("name", ALL_NAMES)
def test_entry_trains_in_fp32(name: str) -> None:
    """Forward and backward in FP32 give a finite loss and finite, non-zero gradients."""
    entry = _available(name)
    model = entry.build()
    batch = entry.make_batch(model, 0)
    output = model(**batch)
    loss = output.loss
    assert loss is not None
    assert loss.dtype == torch.float32
    assert math.isfinite(loss.item())
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads, "no gradient reached any parameter"
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert any(g.abs().sum() > 0 for g in grads.values())


@pytest.mark.parametrize("name", ALL_NAMES)
def test_entry_declares_what_it_is_in_the_zoo_for(name: str) -> None:
    """Every entry but the control declares keep entries (DeepseekV3: 5.x only)."""
    entry = _available(name)
    declared = _declarations(entry.build())
    if name == "llama" or (name == "deepseek_v3" and Version(transformers_version()).major < 5):
        assert declared == set()
    else:
        assert declared, f"{entry.model_class} declares nothing in {transformers_version()}"
