"""The keep plan: dtype gates, match rules, validation and declarations, per Transformers group.

The rules and edge cases of docs/transformers-keep-semantics.md (whose two tables
tests/core/test_semantics_doc.py checks cell by cell) are tested here case by case, resolved as
each behaviour group would (``transformers_version=``); the oracle test
(tests/test_plan_oracle.py) checks the installed version against ``from_pretrained`` itself.
"""

from __future__ import annotations

import collections.abc
import dataclasses
from collections.abc import Iterator

import pytest
import torch

from fp32keep import KeepDeclarationError, resolve_keep_plan
from fp32keep.plan.compat import installed_transformers_version, semantics_for
from tests.core.toys import model_with_names

GROUP_A, GROUP_B, GROUP_C = "4.56.2", "5.0.0", "5.10.4"
ALL_GROUPS = (GROUP_A, GROUP_B, GROUP_C)
GLOB_GROUPS = (GROUP_B, GROUP_C)
FP16, BF16, FP32 = torch.float16, torch.bfloat16, torch.float32


def kept(names: list[str], version: str, dtype: torch.dtype = FP16, **declared: object) -> set[str]:
    model = model_with_names(names, **declared)
    return set(resolve_keep_plan(model, dtype, transformers_version=version).param_names)


@pytest.mark.parametrize(
    ("version", "group"),
    [
        ("4.56.0", "A"),
        ("4.57.6", "A"),
        ("5.0.0rc1", "B"),
        ("5.0.0", "B"),
        ("5.0.1", "B"),
        ("5.1.0", "C"),
        ("5.10.4", "C"),
        ("5.24.0", "C"),
        ("5.25.0", "C"),  # its _get_dtype_plan, post_init and build_glob_alternation are 5.24's
        ("6.0.0", "C"),
    ],
)
def test_version_groups(version: str, group: str) -> None:
    assert semantics_for(version).group == group


def test_installed_version_is_used_by_default() -> None:
    model = model_with_names(["a.wo.weight"], regular=["wo"])
    plan = resolve_keep_plan(model, FP16)
    assert plan.transformers_version == installed_transformers_version()
    assert plan.semantics_group == semantics_for(installed_transformers_version()).group


# --- dtype gates ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "dtype", "expected"),
    [
        (GROUP_A, FP16, {"a.wo.weight", "a.gate.weight"}),
        (GROUP_A, BF16, {"a.gate.weight"}),
        (GROUP_B, FP16, {"a.wo.weight", "a.gate.weight"}),
        (GROUP_B, BF16, {"a.wo.weight", "a.gate.weight"}),  # 5.0.0 has no dtype gate
        (GROUP_C, FP16, {"a.wo.weight", "a.gate.weight"}),
        (GROUP_C, BF16, {"a.gate.weight"}),
    ],
)
def test_regular_list_needs_fp16_strict_list_needs_low_precision(
    version: str, dtype: torch.dtype, expected: set[str]
) -> None:
    names = ["a.wo.weight", "a.gate.weight", "a.other.weight"]
    assert kept(names, version, dtype, regular=["wo"], strict=["gate"]) == expected


@pytest.mark.parametrize("version", ALL_GROUPS)
@pytest.mark.parametrize("dtype", [FP32, torch.float64])
def test_full_precision_keeps_nothing(version: str, dtype: torch.dtype) -> None:
    plan = resolve_keep_plan(
        model_with_names(["a.wo.weight"], regular=["wo"], strict=["wo"]),
        dtype,
        transformers_version=version,
    )
    assert plan.is_empty
    assert plan.names == frozenset()


@pytest.mark.parametrize("bad", [torch.int8, "bf16", None])
def test_dtype_must_be_a_floating_torch_dtype(bad: object) -> None:
    model = model_with_names(["a.wo.weight"], regular=["wo"])
    with pytest.raises((TypeError, ValueError), match="dtype"):
        resolve_keep_plan(model, bad)  # type: ignore[arg-type]


# --- match rules: the edge-case table ------------------------------------------------------


@pytest.mark.parametrize("version", ALL_GROUPS)
def test_whole_segment_matches_in_every_group(version: str) -> None:
    assert kept(["a.wo.weight", "b.x.weight"], version, regular=["wo"]) == {"a.wo.weight"}


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        (GROUP_A, {"a.wo.weight"}),
        (GROUP_B, {"a.wo.weight", "a.wo_proj.weight", "a.two.weight", "wo_x.bias"}),
        (GROUP_C, {"a.wo.weight", "a.wo_proj.weight", "a.two.weight", "wo_x.bias"}),
    ],
)
def test_substring_matches_only_in_5x(version: str, expected: set[str]) -> None:
    names = ["a.wo.weight", "a.wo_proj.weight", "a.two.weight", "wo_x.bias", "a.w.weight"]
    assert kept(names, version, regular=["wo"]) == expected


@pytest.mark.parametrize("entry", ["layer.1", "block.*.wo", "gate.weight", ""])
def test_group_a_refuses_entries_that_are_not_one_segment(entry: str) -> None:
    names = ["layer.1.x.weight", "encoder.block.0.x.wo.weight", "mlp.gate.weight"]
    with pytest.raises(KeepDeclarationError, match=r"_keep_in_fp32_modules entry") as info:
        kept(names, GROUP_A, regular=[entry])
    assert repr(entry) in str(info.value)
    assert "Transformers >= 5.0" in str(info.value)


@pytest.mark.parametrize("version", GLOB_GROUPS)
def test_dotted_entry_is_an_unanchored_pattern_in_5x(version: str) -> None:
    names = ["layer.1.x.weight", "layer.10.x.weight", "a.layer_1.weight", "player.1.weight"]
    names += ["layer.2.x.weight"]
    assert kept(names, version, regular=["layer.1"]) == set(names[:4])


@pytest.mark.parametrize("version", GLOB_GROUPS)
def test_glob_entry_in_5x(version: str) -> None:
    names = ["encoder.block.0.x.wo.weight", "block.3.wo_proj.weight", "block.wo.weight"]
    assert kept(names, version, regular=["block.*.wo"]) == set(names[:2])


@pytest.mark.parametrize("version", GLOB_GROUPS)
def test_real_5x_entry_gate_weight(version: str) -> None:
    names = ["mlp.gate.weight", "shared_expert_gate.weight", "gate.weight_scale"]
    names += ["mlp.gate_proj.weight"]
    assert kept(names, version, strict=["gate.weight"]) == set(names[:3])


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        (GROUP_A, {"model.norm.weight"}),
        (GROUP_C, {"model.norm.weight", "l.0.input_layernorm.weight", "l.0.attn.q_norm.weight"}),
    ],
)
def test_norm_entry(version: str, expected: set[str]) -> None:
    names = ["model.norm.weight", "l.0.input_layernorm.weight", "l.0.attn.q_norm.weight"]
    names += ["l.0.attn.q.weight"]
    assert kept(names, version, regular=["norm"]) == expected


@pytest.mark.parametrize("version", GLOB_GROUPS)
def test_empty_entry_matches_everything_in_5x(version: str) -> None:
    names = ["a.wo.weight", "b.x.weight"]
    assert kept(names, version, regular=[""]) == set(names)


@pytest.mark.parametrize("version", ALL_GROUPS)
def test_duplicate_entries_are_harmless(version: str) -> None:
    names = ["a.wo.weight", "b.x.weight"]
    model = model_with_names(names, regular=["wo", "wo"], strict=["wo"])
    plan = resolve_keep_plan(model, FP16, transformers_version=version)
    assert set(plan.param_names) == {"a.wo.weight"}
    assert plan.regular_entries == ("wo",)
    match = plan.match_for("a.wo.weight")
    assert match is not None
    assert (match.entry, match.list_kind) == ("wo", "regular")


@pytest.mark.parametrize("version", GLOB_GROUPS)
def test_unbalanced_parenthesis_is_a_declaration_error(version: str) -> None:
    with pytest.raises(KeepDeclarationError, match=r"valid pattern.*escape"):
        kept(["a.wo.weight"], version, regular=["wo("])


# --- declarations --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "container", "expected"),
    [
        (GROUP_A, tuple, {"a.wo.weight"}),
        (GROUP_A, set, {"a.wo.weight"}),
        (GROUP_B, tuple, set()),  # 5.0.0 only honours lists
        (GROUP_B, set, set()),
        (GROUP_B, list, {"a.wo.weight"}),
        (GROUP_C, tuple, {"a.wo.weight"}),
        (GROUP_C, set, {"a.wo.weight"}),
    ],
)
def test_tuple_and_set_declarations(version: str, container: type, expected: set[str]) -> None:
    assert kept(["a.wo.weight", "a.x.weight"], version, strict=container(["wo"])) == expected


@pytest.mark.parametrize("version", ALL_GROUPS)
def test_a_bare_string_declaration_is_refused(version: str) -> None:
    if version == GROUP_B:
        # 5.0.0 silently ignores anything but a list, a string included.
        assert kept(["a.wo.weight"], version, regular="wo") == set()
        return
    with pytest.raises(KeepDeclarationError, match=r"_keep_in_fp32_modules.*string 'wo'"):
        kept(["a.wo.weight"], version, regular="wo")


@pytest.mark.parametrize("version", ALL_GROUPS)
def test_no_declaration_keeps_nothing(version: str) -> None:
    plan = resolve_keep_plan(model_with_names(["a.wo.weight"]), FP16, transformers_version=version)
    assert plan.is_empty
    assert "(nothing kept)" in plan.describe()


# --- which tensors ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", ALL_GROUPS)
def test_floating_buffers_are_kept_integer_buffers_never(version: str) -> None:
    model = model_with_names(
        ["a.wo.weight"], regular=["wo"], buffers=["a.wo.scale"], int_buffers=["a.wo.index"]
    )
    plan = resolve_keep_plan(model, FP16, transformers_version=version)
    assert plan.buffer_names == {"a.wo.scale"}
    assert "a.wo.index" not in plan


@pytest.mark.parametrize("version", ALL_GROUPS)
def test_tied_tensor_is_kept_under_every_alias(version: str) -> None:
    model = model_with_names(["enc.wo.weight", "dec.proj.weight"], regular=["wo"])
    model.dec.proj.weight = model.enc.wo.weight  # tie
    plan = resolve_keep_plan(model, FP16, transformers_version=version)
    assert plan.param_names == {"enc.wo.weight", "dec.proj.weight"}
    direct = plan.match_for("enc.wo.weight")
    via = plan.match_for("dec.proj.weight")
    assert direct is not None and direct.via_alias is None
    assert via is not None and via.via_alias == "enc.wo.weight" and via.entry == "wo"


def test_packed_float8_is_never_kept() -> None:
    model = model_with_names(["a.wo.weight"], regular=["wo"])
    model.a.wo.weight.data = model.a.wo.weight.data.to(torch.float8_e4m3fn)
    assert resolve_keep_plan(model, FP16).is_empty


def test_plan_is_immutable_and_describes_itself() -> None:
    model = model_with_names(["a.wo.weight", "a.x.weight"], regular=["wo"])
    plan = resolve_keep_plan(model, FP16, transformers_version=GROUP_C)
    with pytest.raises(AttributeError):
        plan.dtype = BF16  # type: ignore[misc]
    with pytest.raises(TypeError):
        plan.matches["a.x.weight"] = plan.matches["a.wo.weight"]  # type: ignore[index]
    text = plan.describe()
    assert "a.wo.weight" in text and "regular" in text and "float16" in text
    assert "a.x.weight" not in text


def test_plan_and_semantics_print_their_sets_sorted() -> None:
    # Set order follows hashes, salted per process: unsorted, every rank printed its plan (in a
    # traceback's locals) differently and identical failures never merged (issue 22).
    names = [f"layers.{i}.{part}.weight" for i in range(4) for part in ("wo", "norm")]
    model = model_with_names(names, regular=["wo", "norm"])
    plan = resolve_keep_plan(model, FP16, transformers_version=GROUP_C)
    listed = ", ".join(repr(name) for name in sorted(names))
    assert f"param_names=frozenset({{{listed}}})" in repr(plan)
    assert "buffer_names=frozenset()" in repr(plan)
    assert "matches=" not in repr(plan)  # still left out, as the dataclass field says
    semantics = repr(semantics_for(GROUP_C))
    assert "strict_dtypes=frozenset({torch.bfloat16, torch.float16})" in semantics


def test_plan_does_not_modify_the_model() -> None:
    model = model_with_names(["a.wo.weight"], regular=["wo"], buffers=["a.wo.scale"])
    before = {name: (t.dtype, t.clone()) for name, t in model.state_dict().items()}
    resolve_keep_plan(model, FP16)
    after = model.state_dict()
    assert {name: dtype for name, (dtype, _) in before.items()} == {
        name: t.dtype for name, t in after.items()
    }
    assert all(torch.equal(before[name][1], after[name]) for name in before)


def test_group_b_applies_the_dtype_plan_frozen_at_init() -> None:
    # 5.0.0 builds `dtype_plan` in PreTrainedModel.__init__; InstructBlip appends "wo" to its
    # runtime list afterwards, and loading never applies it.
    model = model_with_names(["query_tokens", "lm.wo.weight"], regular=["query_tokens", "wo"])
    model.dtype_plan = {"query_tokens": FP32}
    b = resolve_keep_plan(model, FP16, transformers_version=GROUP_B)
    c = resolve_keep_plan(model, FP16, transformers_version=GROUP_C)
    assert b.param_names == {"query_tokens"}
    assert c.param_names == {"query_tokens", "lm.wo.weight"}


def test_what_if_needs_no_installed_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    import fp32keep.plan.keep_plan

    def missing() -> None:
        raise metadata.PackageNotFoundError("transformers")

    monkeypatch.setattr(fp32keep.plan.keep_plan, "installed_semantics", missing)
    model = model_with_names(["a.wo.weight", "a.x.weight"], regular=["wo"])
    plan = resolve_keep_plan(model, FP16, transformers_version=GROUP_C)
    assert plan.param_names == {"a.wo.weight"}
    with pytest.raises(metadata.PackageNotFoundError):  # the default needs the installed one
        resolve_keep_plan(model, FP16)


# --- the same plan in every process ----------------------------------------------------------


class _InOrder(collections.abc.Set[str]):
    """A set that iterates in the order given: two of them stand for one set of entries as two
    processes with different string hashing iterate it (5.1+'s post_init leaves sets)."""

    def __init__(self, entries: list[str]) -> None:
        self._entries = entries

    def __contains__(self, entry: object) -> bool:
        return entry in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def test_a_set_of_entries_credits_the_same_entry_whatever_order_it_iterates_in() -> None:
    # gpt_oss on 5.24: 'norm' and 'input_layernorm' both match 'model.layers.0.input_layernorm'.
    # Crediting the set's first in iteration order gave two ranks two plans (and their digests
    # differed, which apply_fsdp2 and the contract refuse).
    names = ["layers.0.input_layernorm.weight", "norm.weight"]
    plans = [
        resolve_keep_plan(
            model_with_names(names, regular=_InOrder(order)), FP16, transformers_version=GROUP_C
        )
        for order in (["norm", "input_layernorm"], ["input_layernorm", "norm"])
    ]
    credited = [{n: m.entry for n, m in plan.matches.items()} for plan in plans]
    assert credited[0] == credited[1]
    assert plans[0].digest() == plans[1].digest()


def test_the_digest_is_what_is_kept_not_which_entry_explains_it() -> None:
    model = model_with_names(["a.wo.weight", "b.wi.weight"], regular=["wo", "wi"])
    plan = resolve_keep_plan(model, FP16)
    recredited = dataclasses.replace(
        plan, matches={n: dataclasses.replace(m, entry="other") for n, m in plan.matches.items()}
    )
    assert recredited.digest() == plan.digest()
    fewer = dataclasses.replace(plan, matches=dict(list(plan.matches.items())[:1]))
    assert fewer.digest() != plan.digest()
