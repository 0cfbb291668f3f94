"""Tensors the model code builds in FP32, in no keep list: the plan observes construction.

``from_pretrained(dtype=D)`` builds the model under the default dtype D and loads each tensor into
the dtype it was built with, so ``nn.Parameter(torch.empty(n, dtype=torch.float32))`` comes back
FP32 (esmfold2's ``parcae.log_delta`` on 5.24). The expectation here is the installed
``from_pretrained`` itself (``tests/test_plan_oracle.py``'s round trip), never the plan's code;
the negative controls show that a plan ignoring construction disagrees with it, that a non-
persistent FP32 buffer is not named, and that a model without a config or with a failing rebuild
adds nothing and says so.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import fp32keep.plan.constructed
import fp32keep.plan.keep_plan
from fp32keep import KeepPlan, resolve_keep_plan
from fp32keep.plan.constructed import clear_cache, plan_divergence
from tests.test_plan_oracle import _oracle

transformers = pytest.importorskip("transformers")

LOW_PRECISION = (torch.float16, torch.bfloat16)


class ToyConfig(transformers.PretrainedConfig):  # type: ignore[misc]
    model_type = "fp32keep_constructed_toy"

    def __init__(self, hidden: int = 8, fail: bool = False, **kwargs: Any) -> None:
        self.hidden = hidden
        self.fail = fail
        super().__init__(**kwargs)


class Decay(nn.Module):
    """Builds an explicit FP32 parameter and FP32 buffers next to default-dtype ones."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.log_delta = nn.Parameter(torch.zeros(hidden, dtype=torch.float32))
        self.register_buffer("scale", torch.ones(hidden, dtype=torch.float32))
        self.register_buffer("cache", torch.ones(hidden, dtype=torch.float32), persistent=False)
        self.proj = nn.Linear(hidden, hidden)


class ToyModel(transformers.PreTrainedModel):  # type: ignore[misc]
    """Declares no keep list; its code builds ``decay.log_delta`` and ``decay.scale`` in FP32."""

    config_class = ToyConfig
    base_model_prefix = "toy"

    def __init__(self, config: ToyConfig) -> None:
        super().__init__(config)
        if config.fail:
            raise RuntimeError("this toy refuses to be rebuilt")
        self.decay = Decay(config.hidden)
        self.head = nn.Linear(config.hidden, 2)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        pass


def toy() -> Any:
    return ToyModel(ToyConfig())


def ignoring_construction(model: nn.Module, dtype: torch.dtype) -> KeepPlan:
    """The plan of a resolver that reads the keep lists only (construction not observed)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fp32keep.plan.keep_plan, "_observe_constructions", lambda *_: [])
        return resolve_keep_plan(model, dtype)


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_constructed_fp32_tensors_are_what_from_pretrained_keeps(
    dtype: torch.dtype, tmp_path: Path
) -> None:
    fresh = toy()
    plan = resolve_keep_plan(fresh, dtype)
    oracle, _ = _oracle(fresh, dtype, tmp_path)
    assert oracle.kept == {"decay.log_delta", "decay.scale"}, sorted(oracle.kept)
    assert plan.names & oracle.persistent == oracle.kept, plan.describe()
    assert plan.param_names == {"decay.log_delta"} and plan.buffer_names == {"decay.scale"}
    match = plan.match_for("decay.log_delta")
    assert match is not None and match.list_kind == "constructed"
    assert match.entry == "constructed in torch.float32 by Decay"
    assert "constructed in torch.float32 by Decay" in plan.describe()
    # Negative control: without the observation the plan keeps nothing, the loader keeps two.
    lists_only = ignoring_construction(fresh, dtype)
    assert lists_only.names & oracle.persistent != oracle.kept
    assert oracle.kept - lists_only.names == {"decay.log_delta", "decay.scale"}


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_a_non_persistent_fp32_buffer_is_not_named(dtype: torch.dtype, tmp_path: Path) -> None:
    # Not in the checkpoint: model code alone decides it (as for rotary inv_freq).
    fresh = toy()
    plan = resolve_keep_plan(fresh, dtype)
    oracle, _ = _oracle(fresh, dtype, tmp_path)
    assert "decay.cache" in oracle.non_persistent
    assert "decay.cache" not in plan


def test_fp32_keeps_nothing_and_a_meta_model_plans_the_same() -> None:
    assert resolve_keep_plan(toy(), torch.float32).is_empty
    with torch.device("meta"):
        on_meta = toy()
    assert resolve_keep_plan(on_meta, torch.bfloat16).names == {"decay.log_delta", "decay.scale"}


def test_a_wrapped_model_is_observed_under_its_prefix() -> None:
    class ValueHead(nn.Module):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.pretrained_model = model
            self.v_head = nn.Linear(8, 1)

    plan = resolve_keep_plan(ValueHead(toy()), torch.bfloat16)
    assert plan.declared_by == ("pretrained_model",)
    assert plan.names == {"pretrained_model.decay.log_delta", "pretrained_model.decay.scale"}


def test_a_module_without_a_config_adds_nothing() -> None:
    class Plain(nn.Module):
        _keep_in_fp32_modules: ClassVar[list[str]] = ["proj"]

        def __init__(self) -> None:
            super().__init__()
            self.decay = Decay(8)

    plan = resolve_keep_plan(Plain(), torch.float16)
    assert plan.names == {"decay.proj.weight", "decay.proj.bias"}  # the list, nothing built
    assert plan.unobserved == ()  # not a Transformers model: nothing to observe


def test_a_rebuild_that_fails_adds_nothing_and_says_why() -> None:
    clear_cache()
    model = toy()
    model.config.fail = True  # the rebuild raises; the model in hand exists
    with pytest.warns(RuntimeWarning, match="rebuild from its config failed"):
        plan = resolve_keep_plan(model, torch.bfloat16)
    assert plan.is_empty
    assert plan.unobserved and "this toy refuses to be rebuilt" in plan.unobserved[0]
    assert "construction not observed" in plan.describe()
    model.config.fail = False  # the config is the cache key: a changed config is observed anew
    assert resolve_keep_plan(model, torch.bfloat16).names == {"decay.log_delta", "decay.scale"}


def test_a_failed_rebuild_under_warnings_as_errors_raises_once_then_fails_open() -> None:
    clear_cache()
    model = toy()
    model.config.fail = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeWarning, match="rebuild from its config failed"):
            resolve_keep_plan(model, torch.bfloat16)
        plan = resolve_keep_plan(model, torch.bfloat16)  # the failure was cached before warning
    assert plan.is_empty
    assert plan.unobserved and "this toy refuses to be rebuilt" in plan.unobserved[0]


def test_a_rebuild_failing_for_its_environment_is_not_cached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An ``OSError`` (a file, a full disk: constructed.LOCAL_ERRORS) may pass on the next try
    and on another rank: it fails open without being cached, so the next plan observes again.
    A failure of the class and config themselves stays cached (the test above)."""
    clear_cache()
    model = toy()
    observe = fp32keep.plan.constructed._observe

    def full(*_: Any) -> dict[str, str]:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fp32keep.plan.constructed, "_observe", full)
    with pytest.warns(RuntimeWarning, match="OSError"):
        assert resolve_keep_plan(model, torch.bfloat16).unobserved
    monkeypatch.setattr(fp32keep.plan.constructed, "_observe", observe)
    plan = resolve_keep_plan(model, torch.bfloat16)
    assert plan.unobserved == () and plan.names == {"decay.log_delta", "decay.scale"}


def test_plans_that_differ_are_named_with_what_each_rank_could_not_observe() -> None:
    """The text every rank raises (apply_fsdp2, the contract) is built from gathered data."""
    clear_cache()
    kept = resolve_keep_plan(toy(), torch.bfloat16)
    assert plan_divergence("here", [(0, kept.digest(), ()), (1, kept.digest(), ())]) is None
    failed = ("ToyModel: rebuild from its config failed (OSError: full)",)
    text = plan_divergence("here", [(0, kept.digest(), ()), (1, "other", failed)])
    assert text is not None and text.startswith(
        "here: the keep plan on ranks [1] differs from rank 0's; construction not observed on "
        "rank 1: ToyModel: rebuild from its config failed (OSError: full)"
    )


def test_the_default_dtype_is_restored() -> None:
    clear_cache()
    before = torch.get_default_dtype()
    resolve_keep_plan(toy(), torch.float16)
    assert torch.get_default_dtype() == before


def test_a_repeated_plan_does_not_rebuild() -> None:
    clear_cache()
    model = toy()
    start = time.perf_counter()
    resolve_keep_plan(model, torch.bfloat16)
    first = time.perf_counter() - start
    calls = 0
    original = ToyModel.__init__

    def counting(self: Any, config: ToyConfig) -> None:
        nonlocal calls
        calls += 1
        original(self, config)

    ToyModel.__init__ = counting  # type: ignore[method-assign]
    try:
        resolve_keep_plan(model, torch.bfloat16)
        assert calls == 0
        resolve_keep_plan(model, torch.float16)  # another dtype is another observation
        assert calls == 1
    finally:
        ToyModel.__init__ = original  # type: ignore[method-assign]
    assert first < 5.0


def test_a_repeated_plan_does_not_serialise_its_config_but_notices_changes_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Serialising the config for the cache key on every plan cost more than the rest of a
    cached answer: the key is a snapshot of the config's attributes, and the config is not
    serialised at all. A config seen before, in the same state, is not rebuilt again; one
    changed in place, even deep inside (a list appended to), is observed anew."""
    clear_cache()
    model = toy()
    model.config.extra = {"sections": [1]}
    serialised = rebuilt = 0
    to_json, observe = ToyConfig.to_json_string, fp32keep.plan.constructed._observe

    def counting_json(self: Any, *args: Any, **kwargs: Any) -> str:
        nonlocal serialised
        serialised += 1
        return str(to_json(self, *args, **kwargs))

    def counting_observe(*args: Any) -> dict[str, str]:
        nonlocal rebuilt
        rebuilt += 1
        return observe(*args)

    monkeypatch.setattr(ToyConfig, "to_json_string", counting_json)
    monkeypatch.setattr(fp32keep.plan.constructed, "_observe", counting_observe)
    resolve_keep_plan(model, torch.bfloat16)
    assert (serialised, rebuilt) == (0, 1)
    resolve_keep_plan(model, torch.bfloat16)
    assert (serialised, rebuilt) == (0, 1)  # the same config, unchanged: the cached answer
    model.config.extra["sections"].append(2)
    resolve_keep_plan(model, torch.bfloat16)
    assert (serialised, rebuilt) == (0, 2)  # changed in place, deep inside: observed anew
    model.config.fail = True
    with pytest.warns(RuntimeWarning, match="this toy refuses to be rebuilt"):
        assert resolve_keep_plan(model, torch.bfloat16).is_empty  # a new key, observed anew


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_reformers_axial_position_weights_are_what_from_pretrained_keeps(
    dtype: torch.dtype, tmp_path: Path
) -> None:
    """A real class in no keep list and outside the family listing (which reads source for
    declarations): Reformer builds its axial position weights with ``dtype=torch.float32``."""
    config = transformers.ReformerConfig(
        vocab_size=64,
        hidden_size=16,
        num_attention_heads=2,
        attention_head_size=8,
        axial_pos_embds_dim=[8, 8],
        axial_pos_shape=[4, 8],
        feed_forward_size=32,
        num_hashes=1,
        num_buckets=4,
        attn_layers=["local", "lsh"],
        max_position_embeddings=32,
        local_attn_chunk_length=8,
        lsh_attn_chunk_length=8,
        is_decoder=True,
    )
    fresh = transformers.ReformerModel(config)
    plan = resolve_keep_plan(fresh, dtype)
    oracle, _ = _oracle(fresh, dtype, tmp_path)
    assert oracle.kept, "from_pretrained keeps the axial position weights"
    assert plan.names & oracle.persistent == oracle.kept, plan.describe()
    assert ignoring_construction(fresh, dtype).names & oracle.persistent != oracle.kept


def test_a_config_the_snapshot_cannot_take_is_keyed_by_its_json(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An attribute of another kind (an object, not a config, dict, list or scalar): the key
    falls back to the config's JSON, serialised every call, still cached and still noticing a
    change."""
    clear_cache()
    model = toy()

    class Opaque:
        def __init__(self, value: int) -> None:
            self.value = value

        def __repr__(self) -> str:  # what the JSON carries of it
            return f"Opaque({self.value})"

    model.config.opaque = Opaque(1)
    rebuilt = 0
    observe = fp32keep.plan.constructed._observe

    def counting_observe(*args: Any) -> dict[str, str]:
        nonlocal rebuilt
        rebuilt += 1
        return observe(*args)

    monkeypatch.setattr(fp32keep.plan.constructed, "_observe", counting_observe)
    monkeypatch.setattr(ToyConfig, "to_json_string", lambda self, **_: repr(vars(self)))
    first = resolve_keep_plan(model, torch.bfloat16)
    assert resolve_keep_plan(model, torch.bfloat16).names == first.names and rebuilt == 1
    model.config.opaque.value = 2
    resolve_keep_plan(model, torch.bfloat16)
    assert rebuilt == 2
