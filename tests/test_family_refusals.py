"""Written family refusals (``pytest_fp32keep/check/families/refusals.py``): the families whose
layout FSDP2 cannot hold pass ``fp32keep check`` only with the refusal written for them.

The real refusals come from the real tiny models (``plan_layout``, what ``apply_fsdp2`` checks
before it shards anything); the negative controls change one thing of what is written (a
pattern, the reason tag) or of what is refused (one more tensor) and the case must fail.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from fp32keep import KeepLayoutError, LayoutProblem, keep_aware_cast, plan_layout, resolve_keep_plan
from pytest_fp32keep.check import families
from pytest_fp32keep.check.families import refusals, table
from pytest_fp32keep.check.ranks import judge_refusal
from pytest_fp32keep.check.render import case_details, case_result
from pytest_fp32keep.check.targets import Target, family_targets
from pytest_fp32keep.check.zoo import ZOO, ZooEntry
from tests.error_bounds import PARENT_BOUND_S, within

LOW_PRECISION = (torch.bfloat16, torch.float16)
#: Kimi-Linear's first refused tensor, as its tiny model names it (5.24, 5.25).
KIMI_DT_BIAS = "model.layers.0.self_attn.forget_gate.dt_bias"


def _refusal(family: str, dtype: torch.dtype) -> KeepLayoutError:
    """What ``apply_fsdp2`` raises for ``family``'s tiny model under ``dtype``."""
    model: Any = families.build_family_model(family)
    plan = resolve_keep_plan(model, dtype)
    keep_aware_cast(model, dtype, plan=plan)
    with pytest.raises(KeepLayoutError) as raised:
        plan_layout(model, plan)
    return raised.value


def _written_family(family: str) -> None:
    if not families.listed(family):
        pytest.skip(f"this Transformers has no {family} that keeps a tensor")
    reason = families.probe(family).reason
    if reason is not None and "No module named" in reason:
        pytest.skip(f"{family} needs a soft dependency here: {reason}")


def _case(target: Target, dtype: torch.dtype) -> dict[str, Any]:
    return {"expect_layout_error": target.refusal_expected(dtype)}


@pytest.mark.parametrize("family", sorted(refusals.REFUSALS))
def test_a_written_refusal_passes_and_says_where_and_why(family: str) -> None:
    """Each written family, under fp16 and bf16: its tiny model is refused, with the written
    tag and tensors, so the case passes; the report carries where it is written and why, and
    the why names the module class the refusal names."""
    _written_family(family)
    (target,) = family_targets([family])
    for dtype in LOW_PRECISION:
        error = _refusal(family, dtype)
        case = _case(target, dtype)
        assert case["expect_layout_error"], (family, dtype)
        judge_refusal(case, target, dtype, error)
        assert case["ok"], case.get("refusal_mismatch")
        assert case["written"]["written_in"] == refusals.WRITTEN_IN
        owner = case["written"]["why"].split()[0]  # the class that owns the kept parameters
        assert f"({owner})" in str(error), (owner, str(error).splitlines()[1])


def _kimi_entry(**row_changes: Any) -> ZooEntry:
    """A family entry with Kimi-Linear's written rows, ``row_changes`` applied to each."""
    rows = tuple(
        dataclasses.replace(row, **row_changes) for row in refusals.REFUSALS["kimi_linear"]
    )
    return ZooEntry(
        name="kimi_linear",
        model_class="KimiLinearForCausalLM",
        build=torch.nn.Identity,
        make_batch=lambda model, seed: {},
        dtypes=LOW_PRECISION,
        expect_layout_error=True,
        expectations=rows,
        written_in=refusals.WRITTEN_IN,
    )


def _error(*problems: tuple[str, str]) -> KeepLayoutError:
    return KeepLayoutError([LayoutProblem(fqn, reason, "detail") for fqn, reason in problems])


def _judge(entry: ZooEntry, error: KeepLayoutError) -> dict[str, Any]:
    target = Target("family/kimi_linear", entry.build, dict, True, None, entry)
    case: dict[str, Any] = {"expect_layout_error": True}
    judge_refusal(case, target, torch.bfloat16, error)
    return case


def test_only_the_written_refusal_passes() -> None:
    """The written refusal passes; a pattern that matches nothing, another tag, or one more
    refused tensor fail, each saying how the refusal differs and where it is written."""
    written = _error((KIMI_DT_BIAS, "mixed-unit"))
    assert case_result(_judge(_kimi_entry(), written)) == "pass (refused)"
    assert _kimi_entry().refusal_mismatch(torch.bfloat16, written, "5.24.0") is None

    with within(PARENT_BOUND_S):  # decided in the rank, from what is written: no wait
        wrong_pattern = _judge(_kimi_entry(refused=(r"model\.layers\.\d+\.nothing",)), written)
    assert not wrong_pattern["ok"]
    assert wrong_pattern["refusal_mismatch"].startswith(
        f"not the refusal written in {refusals.WRITTEN_IN}: refused {KIMI_DT_BIAS}, which no "
        r"written pattern matches; written pattern(s) model\.layers\.\d+\.nothing match no "
        "refused tensor"
    )
    assert wrong_pattern["message"].endswith("\n" + wrong_pattern["refusal_mismatch"])
    assert case_result(wrong_pattern) == "FAIL (refused)"  # what the command prints
    assert wrong_pattern["refusal_mismatch"] in "\n".join(case_details(wrong_pattern))

    other_tag = _judge(_kimi_entry(), _error((KIMI_DT_BIAS, "root-owned")))
    assert not other_tag["ok"]
    assert "written [mixed-unit], refused [root-owned]" in other_tag["refusal_mismatch"]

    one_more = _judge(
        _kimi_entry(), _error((KIMI_DT_BIAS, "mixed-unit"), ("lm_head.weight", "mixed-unit"))
    )
    assert not one_more["ok"]
    assert (
        "refused lm_head.weight, which no written pattern matches" in one_more["refusal_mismatch"]
    )


def test_a_refusal_nobody_wrote_fails_and_a_written_one_only_where_written() -> None:
    """No written entry, no expected refusal: a refusal fails (the families before their rows).
    Under a dtype its release keeps nothing at, a written row is no excuse either."""
    target = Target("module:factory", torch.nn.Identity, dict)
    case = _case(target, torch.bfloat16)
    judge_refusal(case, target, torch.bfloat16, _error((KIMI_DT_BIAS, "mixed-unit")))
    assert case["ok"] is False and "refusal_mismatch" not in case
    fp16_only = _kimi_entry(dtypes=(torch.float16,))
    mismatch = fp16_only.refusal_mismatch(
        torch.bfloat16, _error((KIMI_DT_BIAS, "mixed-unit")), "5.24.0"
    )
    assert mismatch == "no refusal is written for torch.bfloat16 in transformers 5.24.0"


def test_the_zoo_refusal_of_rwkv_is_checked_by_its_kept_patterns() -> None:
    """Rwkv's rows name no ``refused``: its refused tensors are its kept ones."""
    rwkv = ZOO["rwkv"]
    names = ("rwkv.blocks.0.attention.time_decay", "rwkv.blocks.0.attention.time_first")
    error = _error(*((name, "mixed-unit") for name in names))
    assert rwkv.refusal_mismatch(torch.float16, error, "5.24.0") is None
    other = _error(*((name, "mixed-unit") for name in (*names, "rwkv.blocks.0.ln1.weight")))
    assert "rwkv.blocks.0.ln1.weight" in str(rwkv.refusal_mismatch(torch.float16, other, "5.24.0"))


def _refused_case(**extra: Any) -> dict[str, Any]:
    message = (
        "FSDP2 cannot keep the FP32 contract of M: 1 problem(s) (mixed-unit); nothing was "
        "sharded.\n"
        f"  {KIMI_DT_BIAS}  [mixed-unit] is kept (torch.float32) but would be all-gathered with "
        "unit 'model.layers.0': its module 'model.layers.0.self_attn.forget_gate' "
        "(KimiLinearForgetGate) also directly owns parameters the plan does not keep: A_log "
        "(torch.bfloat16); FSDP2 puts a module's own parameters in one unit. Fix: declare it."
    )
    case = {"target": "family/kimi_linear", "dtype": "bf16", "context": "autocast"}
    case.update(outcome="refused", message=message, refused=[KIMI_DT_BIAS], kept=[], failures=[])
    case.update(extra)
    return case


def test_the_table_says_where_a_refusal_is_written_and_why() -> None:
    """An expected refusal's cell names its source (not "the zoo" for a family's row); the
    Refusals section quotes the first problem without the advice and the written why. Negative
    controls: a refusal that differs from the written one is a FAIL cell, and one nobody wrote
    says so."""
    why = refusals.REFUSALS["kimi_linear"][0].why
    written = {"written_in": refusals.WRITTEN_IN, "why": why}
    ok = _refused_case(expect_layout_error=True, ok=True, written=written)
    cell = table.case_cell(ok)
    assert cell == (f"refused (mixed-unit: {KIMI_DT_BIAS}; as written in {refusals.WRITTEN_IN})")
    assert table.kind(cell) == "refused" and "the zoo" not in cell
    report = {"versions": {"transformers": "5.24.0", "torch": "2"}, "cases": [ok]}
    text = table.render([report], ["5.10", "latest"])
    assert "## Refusals" in text
    assert f"- kimi_linear (latest bf16): `{KIMI_DT_BIAS} [mixed-unit] is kept" in text
    assert "(KimiLinearForgetGate) also directly owns parameters the plan does not keep" in text
    assert "Fix:" not in text.split("## Refusals")[1]
    assert f"  Written in {refusals.WRITTEN_IN}: {why}" in text

    differs = _refused_case(
        expect_layout_error=True, ok=False, written=written, refusal_mismatch="written [x]"
    )
    assert table.kind(table.case_cell(differs)) == "FAIL"
    unwritten = _refused_case(expect_layout_error=False, ok=False)
    assert table.case_cell(unwritten).endswith("; no refusal written)")
    report["cases"] = [unwritten]
    assert "  No refusal is written: the check fails." in table.render([report], ["latest"])
