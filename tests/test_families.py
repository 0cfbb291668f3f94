"""Every Transformers family from a shrunk config (:mod:`pytest_fp32keep.check.families`).

Fast checks of discovery, shrinking, probing and the ``docs/families.md`` table, and the plan
oracle for families: :func:`fp32keep.resolve_keep_plan` on the family's tiny model names exactly
the persistent floating tensors that ``save_pretrained`` -> ``from_pretrained(dtype=D)`` leaves
in FP32 (the mechanism of ``tests/test_plan_oracle.py``). The default suite runs the oracle on a
slice (:data:`ORACLE_SLICE`); ``--slow`` (``nox -s families``, once per Transformers label) runs it
on every family. A family whose tiny model fails to build fails its case (a shrinker regression
must not read as a skip), unless :data:`NOT_BUILDABLE` names it, written down with the reason; one
of those that builds fails too. The run records the installed Transformers version in its JUnit
XML, from which :func:`pytest_fp32keep.check.families.table.read_oracle` counts the families
compared.
"""

from __future__ import annotations

import dataclasses
import inspect
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import torch

from fp32keep import KeepPlan, resolve_keep_plan
from pytest_fp32keep.check import families
from pytest_fp32keep.check.families import discovery, entries, shrink, table
from pytest_fp32keep.check.families.discovery import pick_class
from pytest_fp32keep.check.zoo import ZOO, transformers_version
from tests.conftest import slow_tier_selected
from tests.test_plan_oracle import OracleResult, _oracle, _parity_message

#: Families of the default suite's oracle slice: a strict list on an attention parameter
#: (``sinks``, token classification), a strict router buffer (MoE), an audio tower's strict
#: ``embed_positions``; each one where the installed Transformers has it.
ORACLE_SLICE = ("openai_privacy_filter", "glm4_moe", "voxtral")
LOW_PRECISION = (torch.float16, torch.bfloat16)


#: Families whose tiny model does not build where the installed Transformers has them, and why
#: (docs/families.md, "not buildable"): ``family -> (error, reason)``. Written here, not found by
#: the test: any other build error fails its case; one of these raises the written error or
#: fails (strict xfail). None today: esmfold2 and fun_asr_nano, whose 5.24+ config validators
#: rejected the shrunk config, build with their overrides (tests/test_family_builds.py).
NOT_BUILDABLE: Mapping[str, tuple[type[Exception], str]] = MappingProxyType({})

#: Families whose plan differs from what ``from_pretrained`` keeps, found by the oracle and
#: written with why: their cases must fail with the oracle's ``AssertionError`` (strict xfail,
#: so a fix shows); docs/families.md counts them as differing.
#: None today: esmfold2's ``parcae.log_delta``, built FP32 by its code and in no list, is kept by
#: the plan since it observes construction (:mod:`fp32keep.plan.constructed`).
KNOWN_DIFFERENCES: Mapping[str, str] = MappingProxyType({})


def _oracle_cases(config: pytest.Config) -> list[Any]:
    """The oracle's families: the slice, and with ``--slow`` every family (slow-marked).

    The slice is named, not looked up: listing every family imports all their modeling code,
    which collection of the default suite should not pay for.
    """
    names = families.keep_families() if slow_tier_selected(config) else ORACLE_SLICE
    cases = []
    for family in names:
        marks: list[pytest.MarkDecorator] = [] if family in ORACLE_SLICE else [pytest.mark.slow]
        if family in NOT_BUILDABLE:
            error, reason = NOT_BUILDABLE[family]
            marks.append(pytest.mark.xfail(raises=error, reason=f"not buildable: {reason}"))
        if family in KNOWN_DIFFERENCES:
            why = KNOWN_DIFFERENCES[family]
            marks.append(pytest.mark.xfail(raises=AssertionError, strict=True, reason=why))
        cases.append(pytest.param(family, marks=marks, id=family))
    return cases


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Family then dtype, so that ids read ``[FAMILY-DTYPE]`` (``table.read_oracle``)."""
    if metafunc.definition.name == "test_family_plan_matches_from_pretrained":
        metafunc.parametrize("family", _oracle_cases(metafunc.config))
        metafunc.parametrize("dtype", LOW_PRECISION, ids=_dtype_id)


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def assert_plan_matches(plan: KeepPlan, oracle: OracleResult, family: str) -> None:
    """The oracle's verdict: ``plan`` keeps exactly the persistent tensors the loader kept.

    Non-persistent buffers are left out (model code, not the loader, decides their dtype; see
    ``tests/test_plan_oracle.py``); a plan name that is no floating tensor is an error too.
    """
    assert not oracle.missing_keys, sorted(oracle.missing_keys)
    assert plan.names <= oracle.floating, sorted(plan.names - oracle.floating)
    assert plan.names & oracle.persistent == oracle.kept, _parity_message(plan, oracle, family)


@pytest.fixture(autouse=True)
def _junit_transformers_version(record_property: Callable[[str, object], None]) -> None:
    """The JUnit XML says which Transformers the oracle ran under (``table.read_oracle``): a
    property of each case, which pytest-xdist carries to the controller's report (a test-suite
    property recorded in a worker never reaches it, and the page read "transformers ?")."""
    record_property("transformers", transformers_version())


def test_family_plan_matches_from_pretrained(
    family: str, dtype: torch.dtype, tmp_path: Path
) -> None:
    """The plan of the family's tiny model is what the installed ``from_pretrained`` keeps.

    Its id is ``[FAMILY-DTYPE]``, which ``table.read_oracle`` reads back from the JUnit XML. The
    build is not guarded: it fails the case, unless :data:`NOT_BUILDABLE` expects it to.
    """
    if not families.listed(family):
        pytest.skip(f"transformers has no family {family} whose model keeps a tensor")
    fresh: Any = entries.build_family_model(family)  # the oracle needs no batch or forward
    plan = resolve_keep_plan(fresh, dtype)
    oracle, _ = _oracle(fresh, dtype, tmp_path)
    assert_plan_matches(plan, oracle, family)


def test_a_family_that_stops_building_fails_its_oracle_case(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Negative control of the unguarded build: a shrinker regression (here the size guard
    lowered, the same code path as a size field the shrinker misses) is the case's error, not a
    skip; only :data:`NOT_BUILDABLE` families may raise, and only the error written there."""
    monkeypatch.setattr(entries, "MAX_PARAMETERS", 1000)
    with pytest.raises(ValueError, match="parameters after shrinking"):
        test_family_plan_matches_from_pretrained("t5", torch.float16, tmp_path)


def test_a_wrong_family_plan_fails_the_oracle(tmp_path: Path) -> None:
    """Negative control: the oracle catches a plan that misses a kept tensor, one that keeps a
    tensor the loader casts, and the plan of the wrong dtype; the real plan passes.

    T5 at fp16 (its regular ``["wo"]`` applies there in every release) exists in every
    supported version. The wrong dtype is one under which the installed release keeps nothing
    of T5, read from the zoo's written table (``ZOO["t5"].expectations``): bf16 in 4.x and 5.1+;
    5.0.0 applies the regular list under bf16 too (docs/transformers-keep-semantics.md,
    group B), so there it is FP32, which keeps nothing in every release.
    """
    fresh: Any = entries.build_family_model("t5")
    plan = resolve_keep_plan(fresh, torch.float16)
    oracle, _ = _oracle(fresh, torch.float16, tmp_path)
    assert oracle.kept and plan.param_names, "T5 at fp16 keeps its `wo` weights"
    assert_plan_matches(plan, oracle, "t5")
    dropped = sorted(plan.param_names)[0]
    missing_one = dataclasses.replace(plan, param_names=plan.param_names - {dropped})
    cast_name = sorted(oracle.persistent - oracle.kept)[0]
    one_too_many = dataclasses.replace(plan, param_names=plan.param_names | {cast_name})
    other = next(d for d in (torch.bfloat16, torch.float32) if ZOO["t5"].expectation(d) is None)
    wrong_dtype = resolve_keep_plan(fresh, other)  # keeps nothing for T5
    for wrong, named in ((missing_one, dropped), (one_too_many, cast_name), (wrong_dtype, "wo")):
        with pytest.raises(AssertionError, match="from_pretrained") as raised:
            assert_plan_matches(wrong, oracle, "t5")
        assert named in str(raised.value)


def test_oracle_counts_read_from_junit(tmp_path: Path) -> None:
    """``table.read_oracle`` counts only oracle cases: equal, differing (an ``AssertionError``:
    the verdict, or a written difference's expected failure), not compared (any other failure,
    or an error), skipped; the page's section names every differing and uncompared case and
    says which label was not run."""
    cases = [
        ("t5", "float16", ""),
        ("t5", "bfloat16", '<failure message="AssertionError: t5 at bfloat16 ..."/>'),
        ("blip_2", "float16", '<failure message="RuntimeError: no safetensors"/>'),
        ("blip_2", "bfloat16", '<error message="fixture tmp_path failed"/>'),
        ("udop", "float16", '<skipped message="not buildable"/>'),
        ("esmfold2", "float16", '<skipped type="pytest.xfail" message="log_delta"/>'),
    ]
    body = "".join(
        f'<testcase name="{table.ORACLE_TEST}[{f}-{d}]">{extra}</testcase>' for f, d, extra in cases
    )
    xml = (
        '<testsuites><testsuite name="pytest"><properties>'
        '<property name="transformers" value="5.10.4"/></properties>'
        f'{body}<testcase name="test_other"><failure message="z"/></testcase>'
        "</testsuite></testsuites>"
    )
    path = tmp_path / "oracle.xml"
    ElementTree.ElementTree(ElementTree.fromstring(xml)).write(path)
    run = table.read_oracle(path)
    assert run.transformers == "5.10.4"
    assert (run.equal, run.differing, run.errors, run.skipped) == (
        ("t5-float16",),
        ("t5-bfloat16", "esmfold2-float16 (written)"),  # a KNOWN_DIFFERENCES xfail differs
        ("blip_2-float16", "blip_2-bfloat16"),
        ("udop-float16",),
    )
    assert run.compared == 3
    text = table.render([], ["4.56", "5.10", "latest"], [run])
    assert "- 4.56: not yet run" in text
    assert "- 5.10: transformers 5.10.4: 3 family x dtype cases compared" in text
    assert "1 equal, 2 differing (t5-bfloat16, esmfold2-float16 (written)), 2 not compared" in text
    assert "(blip_2-float16, blip_2-bfloat16), 1 skipped (not buildable)" in text
    assert "## Plan oracle" not in table.render([], ["5.10"])


@pytest.mark.slow
def test_every_listed_family_keeps_a_tensor() -> None:
    """Every listed family's checked class keeps a tensor at fp16 or bf16 in a fresh build
    (the plan, resolved here again, not the listing's cached answer); every candidate left out
    builds and keeps nothing. Slow: it builds every candidate (``--all-families``' listing)."""
    listed = families.keep_families()
    assert "t5" in listed
    for family in listed:
        try:
            model = entries.build_family_model(family)
        except Exception:  # not buildable: listed with its reason (probe), nothing to judge
            continue
        assert any(resolve_keep_plan(model, dtype).names for dtype in LOW_PRECISION), family
    for family in sorted(set(discovery.candidate_families()) - set(listed)):
        pick = families.family_pick(family)  # raises for a candidate that does not build
        assert pick.cls is None and pick.passed_over, family


def _t5_wo(model: Any, prefix: str) -> set[str]:
    """T5's regular ``["wo"]`` read independently of the plan: the FFN output Linear of every
    block under ``prefix`` (the names of 5.x's substring rule and 4.x's segment rule alike,
    since a T5 stack has no other name containing ``wo``)."""
    return {
        name
        for name, _ in model.named_parameters()
        if name.startswith(prefix) and name.endswith(".DenseReluDense.wo.weight")
    }


def test_a_composed_family_is_listed_by_the_plan_of_its_built_model() -> None:
    """MusicGen declares nothing in its own files, but its default config holds a T5 text
    encoder: a candidate. 5.1+'s ``post_init`` merges T5's ``["wo"]`` into the whole model, so
    its built model keeps the encoder's ``wo`` weights at fp16 (a regular list: nothing at
    bf16) and it is listed, with its whole model checked. Negative control in 4.x: only the
    top model's lists are read there, so the same model keeps nothing and is not listed."""
    from packaging.version import Version

    assert "musicgen" not in discovery.mentioning_families()
    assert discovery.is_candidate("musicgen")
    model: Any = entries.build_family_model("musicgen") if families.listed("musicgen") else None
    if Version(transformers_version()) < Version("5.1"):
        assert model is None and families.family_pick("musicgen").cls is None
        with pytest.raises(families.FamilyError, match="keeps nothing"):
            families.check_family_names(["musicgen"])
        return
    assert type(model).__name__ == "MusicgenForConditionalGeneration"
    wo = _t5_wo(model, "text_encoder.")
    assert len(wo) == shrink.LAYERS
    assert resolve_keep_plan(model, torch.float16).names == wo
    assert not resolve_keep_plan(model, torch.bfloat16).names
    families.check_family_names(["musicgen"])
    assert families.family_entry("musicgen").dtypes == (torch.float16,)


def test_a_family_whose_built_model_keeps_nothing_is_not_listed() -> None:
    """Negative controls of discovery.

    Granite Speech holds Blip2's ``Blip2QFormerConfig``, yet no declaring class is built from
    it (``Blip2QFormerModel`` declares nothing): not even a candidate. Llama declares nothing.
    GlmAsr (5.x) mentions a keep list (5.10 declares a strict ``embed_positions`` on its whole
    model, 5.25 an empty one), yet no tensor of its built model is kept: its plan keeps nothing
    at either dtype, so it is not listed."""
    assert "blip_2" in {
        cls.__module__.split(".")[2]
        for config_class in discovery.config_classes("granite_speech")
        for cls in discovery.held_config_classes(config_class)
    }
    assert not discovery.is_candidate("granite_speech")
    assert not families.listed("granite_speech") and not families.listed("llama")
    if not (discovery.models_dir() / "glmasr").is_dir():
        return  # 4.x has no GlmAsr
    assert discovery.is_candidate("glmasr")
    model = entries.build_class(pick_class(discovery.model_classes("glmasr")), "glmasr")
    assert not any(resolve_keep_plan(model, dtype).names for dtype in LOW_PRECISION)
    pick = families.family_pick("glmasr")
    assert pick.cls is None and pick.passed_over
    assert not families.listed("glmasr")
    with pytest.raises(families.FamilyError, match=r"'glmasr' .*keeps nothing"):
        families.check_family_names(["glmasr"])


def test_a_copy_of_a_zoo_model_takes_its_written_expectations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """InstructBlipVideo is generated from InstructBlip's classes: its target expects a refusal
    exactly where the curated ``instructblip`` entry's rows say (whatever they say), as
    InstructBlip's own family does; a family without a zoo entry expects none. Negative
    control: without its ``SAME_LAYOUT_AS`` line, InstructBlipVideo expects nothing."""
    from pytest_fp32keep.check.families import overrides
    from pytest_fp32keep.check.ranks import DTYPES
    from pytest_fp32keep.check.targets import family_targets

    written = ZOO["instructblip"].refused_under()

    def expected(family: str) -> frozenset[torch.dtype]:
        (target,) = family_targets([family])
        return frozenset(d for d in DTYPES.values() if target.refusal_expected(d))

    assert families.curated_entry("instructblipvideo") is ZOO["instructblip"]
    assert expected("instructblipvideo") == expected("instructblip") == written
    assert families.family_entry("instructblipvideo").expect_layout_error == (
        ZOO["instructblip"].expect_layout_error
    )
    assert families.curated_entry("mt5") is None and expected("mt5") == frozenset()
    monkeypatch.setattr(entries, "SAME_LAYOUT_AS", {})
    assert "instructblipvideo" in overrides.SAME_LAYOUT_AS
    families.family_entry.cache_clear()
    try:
        assert families.curated_entry("instructblipvideo") is None
        assert expected("instructblipvideo") == frozenset()
    finally:
        families.family_entry.cache_clear()


@pytest.mark.parametrize("family", ["nemotron3_5_transcribe", "deepseek_ocr2", "unlimited_ocr"])
def test_the_whole_multimodal_model_is_checked(family: str) -> None:
    """These families declare their strict list on a base or text model only; their whole
    model (towers and head) merges it in 5.1+ and is the class checked, keeping what the
    declaring model alone keeps, under the whole model's prefix. No class was passed over."""
    if not families.listed(family):
        pytest.skip(f"transformers {transformers_version()} has no {family}")
    pick = families.family_pick(family)
    assert pick.cls is not None and pick.cls.__name__.endswith("ForConditionalGeneration")
    assert pick.passed_over == ()
    (declaring,) = families.declaring_classes(family)
    base_kept = resolve_keep_plan(entries.build_class(declaring, family), torch.bfloat16).names
    whole_kept = resolve_keep_plan(entries.build_family_model(family), torch.bfloat16).names
    assert base_kept and whole_kept == pick.kept[torch.bfloat16]
    assert all(any(name.endswith("." + kept) for name in whole_kept) for kept in base_kept)


def test_the_whole_model_class_is_picked() -> None:
    """ForConditionalGeneration before ForCausalLM before other heads before the base model."""

    def named(name: str) -> type:
        return type(name, (), {})

    classes = [named(n) for n in ("FooModel", "FooForTokenClassification", "FooForCausalLM")]
    assert pick_class(classes).__name__ == "FooForCausalLM"
    classes.append(named("FooForConditionalGeneration"))
    assert pick_class(classes).__name__ == "FooForConditionalGeneration"
    assert pick_class(classes[:2]).__name__ == "FooForTokenClassification"
    assert families.family_entry("t5").notes.startswith("T5ForConditionalGeneration ")


def test_unknown_family_names_itself_and_how_to_list() -> None:
    with pytest.raises(families.FamilyError) as raised:
        families.check_family_names(["t5", "no_such_family"])
    message = str(raised.value)
    assert "'no_such_family'" in message and "'t5'" not in message
    assert "fp32keep check --list --all-families" in message


def test_shrunk_config_is_tiny_and_consistent() -> None:
    """Sizes by field name, consistent, in every sub-config; special ids inside the vocabulary."""
    import transformers

    config = shrink.tiny_config(transformers.Blip2Config)
    for sub in (config.vision_config, config.qformer_config, config.text_config):
        assert sub.hidden_size == shrink.HIDDEN
        assert sub.num_hidden_layers == shrink.LAYERS
        assert sub.hidden_size % sub.num_attention_heads == 0
    assert config.text_config.vocab_size == shrink.VOCAB
    assert shrink.TEXT_HIGH <= config.image_token_index < shrink.VOCAB
    assert config.text_config._attn_implementation == "eager"
    gpt = shrink.tiny_config(transformers.GptOssConfig)
    assert gpt.num_experts_per_tok <= gpt.num_local_experts == 4
    assert gpt.num_attention_heads % gpt.num_key_value_heads == 0
    assert len(gpt.layer_types) == gpt.num_hidden_layers == shrink.LAYERS


def test_unshrunk_family_is_not_buildable_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a size the shrinking misses makes a row with the reason, never a raise.

    The guard's limit is lowered rather than a huge model built: the same code path, in a second.
    """
    families.probe.cache_clear()
    monkeypatch.setattr(entries, "MAX_PARAMETERS", 1000)
    try:
        found = families.probe("t5")
        assert found.entry is None
        assert found.reason is not None and found.reason.startswith("build: ValueError: ")
        assert "not in pytest_fp32keep.check.families.shrink.TINY" in found.reason
        monkeypatch.setattr(entries, "MAX_PARAMETERS", 5_000_000)
        families.probe.cache_clear()
        assert families.probe("t5").entry is not None
    finally:
        families.probe.cache_clear()


def test_family_batch_gives_features_in_the_model_dtype() -> None:
    """Floating features come in the model's dtype, as ``processor(...).to(dtype=model.dtype)``
    gives them: GlmAsr feeds ``input_features`` straight to its conv, so FP32 features made the
    batch itself fail on the contract's cast reference (``Input type (float) and bias type
    (c10::BFloat16)``). An FP32 model still gets FP32 features; ids stay integer."""
    if not (discovery.models_dir() / "glmasr").is_dir():
        pytest.skip("transformers has no glmasr family")
    from fp32keep import keep_aware_cast
    from pytest_fp32keep.check.families.batches import family_batch

    # (GlmAsr's model keeps nothing, so it is not listed: its class is built directly)
    model: Any = entries.build_class(pick_class(discovery.model_classes("glmasr")), "glmasr")
    assert family_batch(model, 0)["input_features"].dtype == torch.float32
    keep_aware_cast(model, torch.bfloat16)
    batch = family_batch(model, 0)
    assert batch["input_features"].dtype == torch.bfloat16
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
    model(**batch).loss.backward()  # directly, no autocast: the conv gets bf16 features


def test_qformer_family_batch_casts_pixels_and_the_zoo_batch_does_not() -> None:
    """The families cast the zoo's vision-language batch; the curated zoo's own is unchanged."""
    from fp32keep import keep_aware_cast
    from pytest_fp32keep.check.families.batches import family_batch
    from pytest_fp32keep.check.zoo.batches import vision_language_batch

    model: Any = entries.build_family_model("blip_2")
    # A dtype under which the installed release keeps nothing of Blip2, from the zoo's written
    # table: a kept query_tokens (the first parameter, so model.dtype) would make FP32 pixels
    # the right ones. bf16 in 4.x and 5.1+; 5.0.0 keeps it under bf16 too (semantics doc,
    # group B), so there the model is cast whole, as a plain .to(dtype) does: the claim is
    # that the batch follows model.dtype, which keep semantics do not change.
    if ZOO["blip2"].expectation(torch.bfloat16) is None:
        keep_aware_cast(model, torch.bfloat16)
    else:
        model.to(torch.bfloat16)
    assert family_batch(model, 0)["pixel_values"].dtype == torch.bfloat16
    assert vision_language_batch(model, 0)["pixel_values"].dtype == torch.float32


def _report(version: str, cases: list[dict[str, Any]], unavailable: dict[str, str]) -> Any:
    return {
        "versions": {"transformers": version, "torch": "2.13.0"},
        "date": "2026-12-01 13:00 UTC",
        "commit": "abc1234",
        "seconds": 1.0,
        "cases": cases,
        "unavailable": unavailable,
    }


def _case(family: str, dtype: str, outcome: str, **extra: Any) -> dict[str, Any]:
    case = {"target": f"family/{family}", "dtype": dtype, "context": "autocast"}
    case.update(outcome=outcome, kept=[], failures=[], message="", expect_layout_error=False)
    case.update(extra)
    return case


def test_table_says_what_each_family_did_and_what_was_not_run() -> None:
    report = _report(
        "5.10.4",
        [
            _case("a", "bf16", "pass", kept=[{}, {}]),
            _case("a", "fp16", "pass"),
            _case("b", "bf16", "refused", message="x [root-owned] is kept", refused=["x"]),
            _case("b", "fp16", "fail", failures=[{"check": "parity"}]),
        ],
        {"family/c": "not buildable (build: ValueError: no)"},
    )
    text = table.render([report], ["4.56", "5.10", "latest"])
    assert "| a | not yet run | not yet run | pass (2 kept) | pass (nothing kept) |" in text
    refused = "refused (root-owned: x; no refusal written)"  # expected by nothing: counted refused
    assert f"| b | not yet run | not yet run | {refused} | FAIL (parity) |" in text
    assert "not buildable (build: ValueError: no)" in text
    assert "- 4.56: not yet run" in text and "- latest: not yet run" in text
    assert "| 5.10 | fp16 | 1 | 0 | 1 | 0 | 1 |" in text  # pass, refused, n. buildable, n. runnable


def test_fields_that_copy_a_width_follow_it_across_sub_configs() -> None:
    """A field that repeats some level's width takes its new width (:func:`follow_widths`);
    a field of the same name but another value, and a shrunk field, are left alone."""
    before = {
        "hidden_size": 512,
        "upsample_groups": 512,  # depthwise: one group per channel
        "codebook_dim": 256,  # another size: stays
        "max_position_embeddings": 512,  # not a width's name: stays
        "head_config": {"model_type": "h", "audio_hidden_size": 1280, "hidden_size": 64},
        "audio_config": {"model_type": "a", "hidden_size": 1280},
    }
    after = {
        "hidden_size": 32,
        "upsample_groups": 512,
        "codebook_dim": 256,
        "max_position_embeddings": 512,
        "head_config": {"model_type": "h", "audio_hidden_size": 1280, "hidden_size": 32},
        "audio_config": {"model_type": "a", "hidden_size": 32},
    }
    shrink.follow_widths(before, after)
    assert after["upsample_groups"] == 32
    assert after["head_config"]["audio_hidden_size"] == 32  # another tower's width
    assert (after["codebook_dim"], after["max_position_embeddings"]) == (256, 512)


def test_depthwise_groups_follow_the_width_on_a_real_codec() -> None:
    """Mimi's ``upsample_groups`` (= its hidden size): without the width pass the shrunk codec
    does not build (``in_channels must be divisible by groups``), with it, it does."""
    import transformers

    if not hasattr(transformers, "MimiConfig"):
        pytest.skip("transformers has no Mimi")
    from pytest_fp32keep.check.zoo.building import build_seeded

    tree = transformers.MimiConfig().to_dict()
    for key in ("transformers_version", "architectures", "_name_or_path"):
        tree.pop(key, None)
    before = dict(tree)
    shrink.shrink_dict(tree, {}, [shrink.VOCAB])
    assert tree["upsample_groups"] != tree["hidden_size"]  # the negative control
    with pytest.raises(ValueError, match="divisible by groups"):
        build_seeded(transformers.MimiModel, transformers.MimiConfig.from_dict(tree))
    shrink.follow_widths(before, tree)
    config = transformers.MimiConfig.from_dict(tree)
    assert config.upsample_groups == config.hidden_size == shrink.HIDDEN
    build_seeded(transformers.MimiModel, config)


def test_layer_cut_keeps_every_kind_of_layer_that_fits() -> None:
    """Kimi-Linear's first full-attention layer is its 4th: the first two layers alone would
    be linear only (its cache then has no attention layer to ask its length)."""
    kinds = ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
    assert shrink.cut_layers(kinds) == ["linear_attention", "full_attention"]
    assert shrink.cut_layers(["dense", "sparse", "sparse"]) == ["dense", "sparse"]
    assert shrink.cut_layers(["sliding"] * 5) == ["sliding", "sliding"]
    assert shrink.cut_layers([7, 8, 9]) == [7, 8]  # not kinds: the first layers


def test_shrinking_keeps_multi_head_attention_and_fills_an_unset_top_k() -> None:
    """A default with kv heads = heads stays multi-head (5.24's ESMC refuses GQA); an unset
    ``num_experts_per_tok`` with experts gets one (DeepseekV2's topk(k=None))."""
    mha = {"num_attention_heads": 32, "num_key_value_heads": 32, "hidden_size": 4096}
    gqa = {"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    moe = {"n_routed_experts": 64, "num_experts_per_tok": None}
    for tree in (mha, gqa, moe):
        shrink.shrink_dict(tree, {}, [shrink.VOCAB])
    assert mha["num_key_value_heads"] == mha["num_attention_heads"] == shrink.HEADS
    assert gqa["num_key_value_heads"] == shrink.KV_HEADS
    assert moe["num_experts_per_tok"] == 2 <= moe["n_routed_experts"]


def _tower_gradients(model: Any, batch: dict[str, Any], prefix: str) -> tuple[int, int]:
    """(parameters under ``prefix``, how many of them got a gradient) after one backward."""
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    tower = [p for name, p in model.named_parameters() if name.startswith(prefix)]
    return len(tower), sum(p.grad is not None for p in tower)


@pytest.mark.parametrize(
    ("family", "prefix"),
    [("glm4v_moe", "model.visual."), ("udop", "patch_embed.")],
    ids=["patch-grid", "whole-image"],
)
def test_vision_tower_gets_pixels_and_gradients(family: str, prefix: str) -> None:
    """The family batch gives the vision tower pixels that fit (a patch grid with its
    ``image_grid_thw`` and placeholders; a whole image), so every tower parameter gets a
    gradient. Negative control: the same batch without pixels (the old text-only batch)
    leaves the tower without any."""
    if not families.listed(family):
        pytest.skip(f"transformers has no {family} family")
    from pytest_fp32keep.check.families.batches import family_batch

    model: Any = entries.build_family_model(family)
    batch = family_batch(model, 0)
    count, with_grad = _tower_gradients(model, batch, prefix)
    assert count and with_grad == count
    if family == "glm4v_moe":
        token = model.config.image_token_id
        assert int((batch["input_ids"] == token).sum()) > 0
        # The token types go where forward takes them (5.1+; 5.0.0's Glm4vMoe takes none).
        if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
            assert batch["mm_token_type_ids"].sum() == (batch["input_ids"] == token).sum()
        else:
            assert "mm_token_type_ids" not in batch
    text_only = {k: v for k, v in batch.items() if k not in ("pixel_values", "image_grid_thw")}
    if family == "glm4v_moe":  # no placeholders without an image
        text_only = {
            "input_ids": batch["input_ids"][:, -8:],
            "labels": batch["labels"][:, -8:],
        }
    assert _tower_gradients(model, text_only, prefix) == (count, 0)


def test_multi_codebook_model_gets_one_code_per_codebook() -> None:
    """KyutaiSpeechToText embeds ``(batch, seq, 1 + num_codebooks)`` ids (text, then audio
    codes) and sums them; its codec runs in ``generate`` only. Negative control: the plain
    text ids fail in its embedding (the shapes do not broadcast)."""
    if not families.listed("kyutai_speech_to_text"):
        pytest.skip("transformers has no kyutai_speech_to_text family")
    from pytest_fp32keep.check.families.batches import family_batch

    model: Any = entries.build_family_model("kyutai_speech_to_text")
    batch = family_batch(model, 0)
    ids = batch["input_ids"]
    assert ids.shape[-1] == 1 + model.config.num_codebooks
    assert batch["labels"].shape == ids.shape[:2]
    model(**batch).loss.backward()
    with pytest.raises(RuntimeError, match="must match the size"):
        model(input_ids=ids[..., 0], labels=batch["labels"])


# --- 5.24's families that did not build (each skips where its release has no such family) ---


def _family_or_skip(family: str) -> None:
    if not families.listed(family):
        pytest.skip(f"transformers {transformers_version()} has no {family} family")


def test_shrink_fills_unset_mlp_layer_types_and_cuts_per_stage_widths() -> None:
    """Version-free halves of the two tests below, on config dictionaries: an unset
    ``mlp_layer_types`` with experts becomes dense then sparse (without experts it stays
    unset); per-stage widths as long as the layer count are cut with the other per-stage
    lists, then shrunk."""
    moe = {"n_routed_experts": 64, "num_hidden_layers": 32, "mlp_layer_types": None}
    dense = {"num_hidden_layers": 32, "mlp_layer_types": None}
    stages = {"num_hidden_layers": 4, "hidden_sizes": [256, 512, 1024, 2048]}
    stages |= {"depths": [2, 2, 2, 2], "patch_sizes": [16, 6, 5, 4]}
    for tree in (moe, dense, stages):
        shrink.shrink_dict(tree, {}, [shrink.VOCAB])
    assert moe["mlp_layer_types"] == ["dense", "sparse"]
    assert dense["mlp_layer_types"] is None
    assert stages["hidden_sizes"] == [shrink.HIDDEN] * shrink.LAYERS
    assert (stages["depths"], stages["patch_sizes"]) == ([2, 2], [16, 6])


def test_unset_mlp_layer_types_get_a_dense_then_sparse_pattern() -> None:
    """DeepseekOcr2's text config leaves ``mlp_layer_types`` unset (its checkpoint sets it)
    while every decoder layer indexes it; with experts the shrinker gives one dense layer, then
    sparse ones, so the routed experts and their kept gate exist."""
    _family_or_skip("deepseek_ocr2")
    from pytest_fp32keep.check.zoo.building import build_seeded

    model: Any = entries.build_family_model("deepseek_ocr2")
    assert any(name.endswith("mlp.gate.weight") for name, _ in model.named_parameters())
    config = model.config  # the whole multimodal model: the list is its text config's
    config.get_text_config().mlp_layer_types = None  # negative control: the default, unset
    with pytest.raises(TypeError, match="not subscriptable"):
        build_seeded(type(model), config)


def test_per_stage_widths_are_cut_with_the_stages_and_shrunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hierarchical tower lists one width per stage (MuseSpark's audio ``hidden_sizes``,
    as long as ``num_hidden_layers``): cut with the other per-stage lists, then shrunk.
    Negative control: without ``hidden_sizes`` in TINY, MuseSpark is over the size guard."""
    _family_or_skip("muse_spark")
    entries.build_family_model("muse_spark")
    without = {key: value for key, value in shrink.TINY.items() if key != "hidden_sizes"}
    monkeypatch.setattr(shrink, "TINY", MappingProxyType(without))
    with pytest.raises(ValueError, match="parameters after shrinking"):
        entries.build_family_model("muse_spark")


@pytest.mark.parametrize(
    ("family", "name"),
    [("muse_spark", "input_values"), ("inkling", "audio_input_ids")],
    ids=["waveform", "mel-bin-ids"],
)
def test_raw_audio_tower_gets_its_input_and_gradients(family: str, name: str) -> None:
    """An audio tower that takes no mel features gets what its ``get_audio_features`` takes
    first: a waveform of whole embeddings (MuseSpark), discretised mel-bin ids (Inkling), and
    one placeholder per embedding; every tower parameter gets a gradient. Negative control:
    the text alone leaves the tower without any."""
    _family_or_skip(family)
    if family == "inkling":
        pytest.importorskip("scipy", reason="Inkling's vision tower needs scipy to build")
    from pytest_fp32keep.check.families.batches import family_batch

    model: Any = entries.build_family_model(family)
    batch = family_batch(model, 0)
    assert name in batch and (name == "input_values") == batch[name].is_floating_point()
    placeholders = int((batch["input_ids"] == model.config.audio_token_id).sum())
    assert placeholders > 0 and int((batch["labels"] == -100).sum()) == placeholders
    count, with_grad = _tower_gradients(model, batch, "model.audio_tower.")
    assert count and with_grad == count
    text_only = {"input_ids": batch["input_ids"][:, -8:], "labels": batch["labels"][:, -8:]}
    assert _tower_gradients(model, text_only, "model.audio_tower.") == (count, 0)


def test_token_grid_tower_gets_pixels_and_gradients() -> None:
    """Inkling2's tower takes one row per merged token (a block of pixels), its grid counted
    in tokens: the layout its own ``get_image_features`` accepts is picked, and every tower
    parameter gets a gradient. Negative control: Qwen2-VL's patch rows fail in that tower with
    the reshape error the family used to be unbuildable for."""
    _family_or_skip("inkling2")
    from pytest_fp32keep.check.families import vision
    from pytest_fp32keep.check.families.batches import family_batch

    model: Any = entries.build_family_model("inkling2")
    batch = family_batch(model, 0)
    assert batch["pixel_values"].ndim == 4
    count, with_grad = _tower_gradients(model, batch, "model.vision_tower.")
    assert count and with_grad == count
    rows = vision.grid_pixels(model, model.config, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="is invalid for input of size"):
        vision.image_embeddings(model, rows)


def _refusal_text(family: str) -> str | None:
    """The layout refusal of ``family``'s tiny model under bf16 (``None``: it holds), laid out
    from one observed forward on its own batch (what ``apply_fsdp2(example_inputs=...)`` does:
    Bailing-Hybrid 5.25 hands ``conv1d`` to a function the source fallback does not follow)."""
    from fp32keep import KeepLayoutError, keep_aware_cast, observe_parameter_use, plan_layout
    from pytest_fp32keep.check.families.batches import family_batch

    model: Any = entries.build_family_model(family)
    plan = resolve_keep_plan(model, torch.bfloat16)
    keep_aware_cast(model, torch.bfloat16, plan=plan)
    inputs = family_batch(model, 0)
    with (
        observe_parameter_use(model) as use,
        torch.no_grad(),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        model(**inputs)
    try:
        layout = plan_layout(model, plan, observed=use)
    except KeepLayoutError as error:
        return str(error)
    if family == "bailing_hybrid":  # its attention reads conv1d.weight, never calls conv1d
        owner = layout.owner["model.layers.0.self_attn.conv1d.weight"]
        assert owner == "model.layers.0.self_attn"
    return None


def test_linear_attention_families_hold_the_read_conv_and_refuse_truly_mixed_modules() -> None:
    """5.24: Bailing-Hybrid's kept ``conv1d`` (read by its attention, never called) goes with
    its reader's unit, observed (5.25 hands it to ``causal_conv1d_forward``, which reads its
    weight, also where ``kernels`` makes that an ``nn.Module``:
    ``tests/core/test_reads_handoff.py``); Kimi-Linear's forget gate owns a kept ``dt_bias``
    beside an ``A_log`` its keep list leaves out (bf16), and Glm5-Next's hyper-connections a
    kept ``base`` and ``scale`` beside ``fn``: modules of mixed dtype FSDP2 cannot shard,
    refused, naming the parameters and their dtypes."""
    _family_or_skip("bailing_hybrid")
    assert _refusal_text("bailing_hybrid") is None
    _family_or_skip("kimi_linear")
    text = _refusal_text("kimi_linear")
    assert text is not None and "[mixed-unit]" in text and "read-not-called" not in text
    assert "forget_gate.dt_bias" in text and "is kept (torch.float32)" in text
    assert "also directly owns parameters the plan does not keep: A_log (torch.bfloat16)" in text
    _family_or_skip("glm5_next")  # both: its conv1d is held, its hyper-connections are mixed
    text = _refusal_text("glm5_next")
    assert text is not None and "read-not-called" not in text and "self_attn.conv1d" not in text
    assert "attn_hc.base" in text and "not keep: fn (torch.bfloat16)" in text


def test_code_stream_decoder_gets_one_row_per_codebook() -> None:
    """MusicGen's decoder predicts one stream of audio codes per codebook: its batch has
    labels ``(batch, seq, codebooks)`` and decoder inputs ``(batch * codebooks, seq)``, the text
    ids go to the T5 encoder, whose ``wo`` weights (what the model keeps) get gradients.
    Negative control: the plain seq2seq batch (one text row per example) fails its forward."""
    from pytest_fp32keep.check.families.batches import family_batch

    model: Any = entries.build_class(pick_class(discovery.model_classes("musicgen")), "musicgen")
    codebooks = model.config.decoder.num_codebooks
    batch = family_batch(model, 0)
    rows, seq = batch["decoder_input_ids"].shape
    assert batch["labels"].shape == (rows // codebooks, seq, codebooks)
    assert rows == batch["input_ids"].shape[0] * codebooks
    model(**batch).loss.backward()
    wo = _t5_wo(model, "text_encoder.")
    assert wo and all(model.get_parameter(name).grad is not None for name in wo)
    plain = {**batch, "decoder_input_ids": batch["input_ids"], "labels": batch["input_ids"]}
    with pytest.raises(RuntimeError, match="is invalid for input of size"):
        model(**plain)


def test_kolibri_indexer_layers_are_derived_from_the_cut_layers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """5.25's Kolibri-1.1 names layers by index (``index_layers``, ``kv_source_layers``) and
    derives them from ``layer_types`` when unset: its override unsets them, so the tiny model
    has an indexer among its two layers, and a MoE layer whose router holds the kept
    ``e_score_correction_bias``. Negative control: without the override the 50-layer defaults
    fail its validator."""
    _family_or_skip("kolibri1_1")
    model: Any = entries.build_family_model("kolibri1_1")
    config = model.config
    indexed = [i for i, kind in enumerate(config.layer_types) if kind == "indexed_attention"]
    assert indexed and config.index_layers == indexed[:1]
    plan = resolve_keep_plan(model, torch.bfloat16)
    assert sorted(plan.names) == ["model.layers.1.mlp.gate.e_score_correction_bias"]
    monkeypatch.setattr(entries, "OVERRIDES", MappingProxyType({}))
    # huggingface_hub's StrictDataclassClassValidationError, around the validator's ValueError
    with pytest.raises(Exception, match="`index_layers` must be increasing") as raised:
        entries.build_family_model("kolibri1_1")
    assert isinstance(raised.value.__cause__, ValueError)


def test_query_tokens_are_seeded_not_transformers_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint never holds constant query tokens; Transformers initialises them to zeros,
    which InstructBlip's fp16 Q-Former layernorm (eps 1e-12 is 0 in fp16) turns into NaN
    gradients of the unsharded model itself. The families builder seeds them, as the zoo does.
    Negative control: without the seeding the built tokens are Transformers' zeros."""
    _family_or_skip("instructblip")
    model: Any = entries.build_family_model("instructblip")
    tokens = model.get_parameter("query_tokens")
    assert bool(tokens.std() > 0)
    monkeypatch.setattr(entries, "seed_query_tokens", lambda model: None)
    bare: Any = entries.build_family_model("instructblip")
    assert not bool(bare.get_parameter("query_tokens").any())
