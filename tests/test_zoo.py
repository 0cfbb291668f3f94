"""The built-in zoo: every entry the installed Transformers has builds, runs and trains.

Entries the installed version lacks are skipped with the reason ``available_entries`` gives.
"""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
import time
from pathlib import Path

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
from pytest_fp32keep.check.zoo.entry import KeepExpectation
from tests.zoo_entries import available_or_skip

ALL_NAMES = list(ZOO)
_NONE = KeepExpectation("", (), ())  # stands for "no row": nothing kept, nothing refused


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
    # Blip2 and InstructBlip's root-owned query_tokens is an FP32 root unit since issue 23.
    assert {name for name, entry in ZOO.items() if entry.expect_layout_error} == {"rwkv"}


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
    entry = available_or_skip(name)
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
    entry = available_or_skip(name)
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
    entry = available_or_skip(name)
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
    entry = available_or_skip(name)
    declared = _declarations(entry.build())
    if name == "llama" or (name == "deepseek_v3" and Version(transformers_version()).major < 5):
        assert declared == set()
    else:
        assert declared, f"{entry.model_class} declares nothing in {transformers_version()}"


def disagreements(entry: ZooEntry, dtype: torch.dtype) -> list[str]:
    """Where the plan under test (and the layout it leads to) differs from what the entry's
    table, written from the semantics doc, says the installed Transformers does."""
    from fp32keep import KeepLayoutError, keep_aware_cast, plan_layout, resolve_keep_plan

    expected = entry.expectation(dtype)
    model = entry.build()
    plan = resolve_keep_plan(model, dtype)
    names = sorted(plan.names)
    found: list[str] = []
    if expected is None:
        found += [f"kept {name}, the table keeps nothing" for name in names]
    elif expected.kept is not None:
        found += [
            f"kept {name}, matched by no pattern" for name in names if not expected.matches(name)
        ]
        found += [
            f"pattern {pattern!r} matches no kept tensor"
            for pattern in expected.kept
            if not any(re.fullmatch(pattern, name) for name in names)
        ]
    keep_aware_cast(model, dtype, plan=plan)
    try:
        plan_layout(model, plan)
        refused = None
    except KeepLayoutError as error:
        refused = ", ".join(sorted({problem.reason for problem in error.problems}))
    want = None if expected is None else expected.refusal
    if refused != want:
        found.append(f"layout refused for {refused!r}, the table says {want!r}")
    return found


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ALL_NAMES)
def test_plan_agrees_with_the_written_expectation(name: str, dtype: torch.dtype) -> None:
    """The kept FQNs and the refusal, per release line and dtype, written independently of the
    plan (from docs/transformers-keep-semantics.md), are what the plan and layout give."""
    entry = available_or_skip(name)
    assert entry.covers(), (
        f"{name}: no expectation row covers transformers {transformers_version()}"
    )
    assert disagreements(entry, dtype) == []
    refused = entry.refused_under()
    assert (dtype in refused) == ((entry.expectation(dtype) or _NONE).refusal is not None)
    assert entry.expect_layout_error == any(row.refusal for row in entry.expectations)


def test_a_wrong_expectation_is_caught() -> None:
    """The negative control: tables that say too much, too little or the wrong refusal."""
    t5, rwkv = available_or_skip("t5"), available_or_skip("rwkv")
    version = transformers_version()
    loose = dataclasses.replace(  # T5's 'wo' kept under bf16 too, and every 'wo' bias
        t5,
        expectations=(
            KeepExpectation(f"=={version}", (torch.float16, torch.bfloat16), (r".*\.wo\.bias",)),
        ),
    )
    # Whether the installed release keeps T5's 'wo' under a dtype is the real table's row
    # (bf16: 5.0.0 only, whose regular list has no dtype gate; semantics doc, group B).
    no_bias = r"pattern '.*\\.wo\\.bias' matches no kept tensor"
    for dtype in (torch.float16, torch.bfloat16):
        found = disagreements(loose, dtype)
        assert found[-1] == no_bias, found
        if t5.expectation(dtype) is None:  # nothing kept: the pattern alone is wrong
            assert found == [no_bias]
        else:  # the kept weights are named too
            assert any(line.startswith("kept encoder.block.0.") for line in found), found
    assert t5.expectation(torch.float16) is not None  # so the second branch runs everywhere
    unrefused = dataclasses.replace(
        rwkv, expectations=(KeepExpectation(f"=={version}", (torch.float16,), None),)
    )
    assert disagreements(unrefused, torch.float16) == [
        "layout refused for 'mixed-unit', the table says None"
    ]
    assert unrefused.refused_under() == frozenset()  # what fp32keep check would then expect
    # Rwkv's regular list applies at fp16 in every release, and at bf16 too in 5.0.0 alone (no
    # dtype gate: docs/transformers-keep-semantics.md, group B)
    no_gate = Version(version).release == (5, 0, 0)
    assert rwkv.refused_under() == frozenset(
        {torch.float16, torch.bfloat16} if no_gate else {torch.float16}
    )
    uncovered = dataclasses.replace(rwkv, expectations=(KeepExpectation("<1", (), ()),))
    assert not uncovered.covers()
    assert uncovered.refused_under() == frozenset(rwkv.dtypes)  # the 5.1+ gates, by default


def test_check_targets_take_refusals_from_the_table_not_the_plan() -> None:
    """``fp32keep check`` decides "must be refused" from the zoo's table (its rank-side
    ``_run_case`` calls ``Target.refusal_expected``), never from ``resolve_keep_plan``."""
    from pytest_fp32keep.check import ranks
    from pytest_fp32keep.check.targets import zoo_targets

    targets, _ = zoo_targets()
    by_name = {target.name: target for target in targets}
    for name, target in by_name.items():
        assert target.refused_under == ZOO[name].refused_under(), name
    assert by_name["rwkv"].refusal_expected(torch.float16)
    assert not by_name["rwkv"].refusal_expected(torch.bfloat16) or (
        torch.bfloat16 in ZOO["rwkv"].refused_under()
    )
    assert not by_name["blip2"].refusal_expected(torch.float16)
    assert not by_name["t5"].refusal_expected(torch.float16)
    assert "resolve_keep_plan" not in Path(ranks.__file__).read_text()
