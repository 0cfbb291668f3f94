"""Refusals in the words peers match (issue 23), each on a real case with its negative control.

Tools and tests written for verl's keep-FP32 path (PR 7165) match dtypes as torch prints them
(``torch.bfloat16``), "tied across FSDP2 unit boundaries" with a ``tie_word_embeddings`` hint,
"no fp32-keep unit owns it" and "already in a lower precision". A kept parameter in a
forward-less ``ParameterList``/``ParameterDict`` is named with its real owner and the module that
reads it, not as the root's own. (PEFT adapters of a kept module: tests/test_plan_wrappers.py.)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import ClassVar

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers import LlamaConfig, LlamaForCausalLM

from fp32keep import KeepLayoutError, keep_aware_cast, observe_parameter_use, resolve_keep_plan
from fp32keep.layout.planning import plan_layout
from fp32keep.load.move import Target
from fp32keep.load.validate import entry_problem
from fp32keep.shard.apply import infer_low_precision_dtype
from fp32keep.uses.source import find_direct_read
from tests.core.kept_toys import ReadStack
from tests.core.toys import Stack, stack_class
from tests.error_bounds import LIBRARY_BOUND_S, within

SEMANTICS = "5.10.4"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
#: A dtype spelled without torch's prefix: "bfloat16" where peers grep "torch.bfloat16".
BARE_DTYPE = re.compile(r"(?<!torch\.)\b(?:bfloat16|float16|float32|float64)\b")
TIED = "is tied across FSDP2 unit boundaries"
F32, B16 = "torch.float32", "torch.bfloat16"  # torch's own spelling: str(torch.float32)


def cast_and_plan(model: nn.Module, dtype: torch.dtype = BF16) -> nn.Module:
    plan = resolve_keep_plan(model, dtype, transformers_version=SEMANTICS)
    keep_aware_cast(model, dtype, plan=plan)
    return model


def refusal(model: nn.Module, **kwargs: object) -> KeepLayoutError:
    plan = resolve_keep_plan(model, BF16, transformers_version=SEMANTICS)
    with within(LIBRARY_BOUND_S), pytest.raises(KeepLayoutError) as error:
        plan_layout(model, plan, **kwargs)  # type: ignore[arg-type]
    return error.value


# --- dtypes as torch prints them, in every refusal ----------------------------------------------


def root_owned() -> nn.Module:
    # The root also owns a parameter that is not kept: it cannot be an FP32 unit (issue 23).
    model = stack_class(strict=["query_tokens"])()
    model.register_parameter("query_tokens", nn.Parameter(torch.randn(2, 8)))
    model.register_parameter("scale", nn.Parameter(torch.ones(8)))
    return cast_and_plan(model)


def mixed_unit() -> nn.Module:
    model = stack_class(strict=["time_decay"])()
    for layer in model.layers:
        layer.attn.register_parameter("time_decay", nn.Parameter(torch.randn(8)))
    return cast_and_plan(model)


def tied_across_units() -> nn.Module:
    # An alias on the root: no one unit can hold the root and a block's module (issue 23).
    model = Stack().to(BF16)
    model.register_parameter("tied", model.layers[0].attn.weight)
    return model


def degraded() -> nn.Module:
    return stack_class(strict=["wo"])().to(BF16)  # a blanket cast instead of keep_aware_cast


def mixed_dtype_unit() -> nn.Module:
    model = Stack().to(BF16)
    for layer in model.layers:
        layer.input_layernorm.to(FP32)
    return model


def read_not_called() -> nn.Module:
    model = ReadStack()
    model.encoder.embed_positions.requires_grad_(True)
    model.encoder.register_parameter("scale", nn.Parameter(torch.ones(8)))
    return cast_and_plan(model)


@pytest.mark.parametrize(
    ("build", "reason", "dtypes"),
    [
        pytest.param(root_owned, "root-owned", [F32, B16], id="root-owned"),
        pytest.param(mixed_unit, "mixed-unit", [F32, B16], id="mixed-unit"),
        pytest.param(tied_across_units, "tied-across-units", [B16], id="tied-across-units"),
        pytest.param(degraded, "degraded", [B16], id="degraded"),
        pytest.param(mixed_dtype_unit, "mixed-dtype-unit", [F32, B16], id="mixed-dtype-unit"),
        pytest.param(read_not_called, "read-not-called", [F32, B16], id="read-not-called"),
    ],
)
def test_every_layout_refusal_spells_dtypes_as_torch_prints_them(
    build: Callable[[], nn.Module], reason: str, dtypes: list[str]
) -> None:
    error = refusal(build())
    text = str(error)
    assert {problem.reason for problem in error.problems} == {reason}
    for dtype in dtypes:
        assert dtype in text, dtype
    assert BARE_DTYPE.findall(text) == [], text


def test_negative_control_the_bare_spelling_is_what_the_pattern_catches() -> None:
    # The pattern above must see the spelling peers cannot match, and pass torch's own.
    assert BARE_DTYPE.findall("is stored as bfloat16 in unit 'x' (1 float32)") == [
        "bfloat16",
        "float32",
    ]
    assert BARE_DTYPE.findall("torch.bfloat16, torch.float16, _keep_in_fp32_modules") == []


def test_the_degraded_refusal_says_already_in_a_lower_precision() -> None:
    error = refusal(degraded())
    assert {problem.reason for problem in error.problems} == {"degraded"}
    text = str(error)
    assert "is kept by the plan but already in a lower precision: stored as torch.bfloat16" in text


def test_the_loaders_dtype_messages_spell_dtypes_as_torch_prints_them() -> None:
    # The loader's "same concept": an entry of another dtype family than the model's tensor.
    target = Target(("wo.weight",), (2, 2), FP32, False, True, torch.empty(2, 2))
    problem = entry_problem(torch.zeros(2, 2, dtype=torch.int64), target)
    assert problem == "is torch.int64 (integer) but the model's tensor is torch.float32 (floating)"
    # Negative control: a floating entry of another precision loads (the destination wins).
    assert entry_problem(torch.zeros(2, 2, dtype=BF16), target) is None


def test_a_model_stored_in_two_low_precisions_is_refused_naming_both_as_torch_prints_them() -> None:
    model = Stack()
    model.layers[0].to(FP16)
    model.layers[1].to(BF16)
    both = "stores parameters in both torch.float16 and torch.bfloat16"
    with pytest.raises(ValueError, match=both):
        infer_low_precision_dtype(model, MixedPrecisionPolicy())
    model.layers[0].to(BF16)  # negative control: one low precision is the plan's dtype
    assert infer_low_precision_dtype(model, MixedPrecisionPolicy()) == BF16


# --- tied weights: verl's phrase, and tie_word_embeddings where the tie is the embeddings ------


def llama(*, tie_word_embeddings: bool) -> nn.Module:
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=tie_word_embeddings,
    )
    return cast_and_plan(LlamaForCausalLM(config))


#: The embedding a unit of its own, the head in the root: the tied pair spans two units.
EMBEDDING_UNIT = ["LlamaDecoderLayer", "Embedding"]


def test_tied_input_and_output_embeddings_across_units_say_tie_word_embeddings_false() -> None:
    # Since issue 23 the embedding and its tied head get one unit where they can; an alias the
    # root owns too leaves no one unit for all three names.
    model = llama(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.register_parameter("logit_scale_weight", model.lm_head.weight)
    error = refusal(model, wrap=EMBEDDING_UNIT)
    assert [(p.fqn, p.reason) for p in error.problems] == [
        ("logit_scale_weight", "tied-across-units")
    ]
    text = str(error)
    assert f"logit_scale_weight  [tied-across-units] {TIED}: one torch.bfloat16" in text
    assert "'model.embed_tokens.weight', 'lm_head.weight']" in text
    assert "['<root>', 'model.embed_tokens']" in text  # both units
    assert "set tie_word_embeddings=False in the model's config" in text


def test_negative_control_untied_embeddings_in_the_same_units_are_accepted() -> None:
    model = llama(tie_word_embeddings=False)
    plan = resolve_keep_plan(model, BF16, transformers_version=SEMANTICS)
    layout = plan_layout(model, plan, wrap=EMBEDDING_UNIT)
    assert layout.owner["model.embed_tokens.weight"] == "model.embed_tokens"
    assert layout.owner["lm_head.weight"] == "<root>"


def test_other_tied_weights_across_units_get_the_general_fix_not_tie_word_embeddings() -> None:
    # A model with input and output embeddings whose tie is elsewhere: untying the embeddings
    # would not help, so the hint must not say so.
    model = llama(tie_word_embeddings=False)
    layers = model.model.layers
    model.register_parameter("q_alias", layers[0].self_attn.q_proj.weight)  # on the root
    error = refusal(model)
    assert [(p.fqn, p.reason) for p in error.problems] == [("q_alias", "tied-across-units")]
    text = str(error)
    assert TIED in text and "torch.bfloat16" in text
    assert "Wrap a common ancestor of all its owners as one unit (wrap=...)" in text
    assert "tie_word_embeddings" not in text


# --- a kept ParameterList / ParameterDict: its real owner and its reader -----------------------


class ScaledStack(Stack):
    """Kept output gains in a forward-less container the root reads by index."""

    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["gains"]

    def __init__(self, container: str) -> None:
        super().__init__()
        gain = nn.Parameter(torch.ones(16))
        self.key: int | str = 0 if container == "ParameterList" else "out"
        self.gains: nn.ParameterList | nn.ParameterDict = (
            nn.ParameterList([gain])
            if container == "ParameterList"
            else nn.ParameterDict({"out": gain})
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.gains[self.key].to(self.head.weight.dtype)


class UnreadGains(Stack):
    """The same container, assigned and never read: no reader to name."""

    _keep_in_fp32_modules_strict: ClassVar[list[str]] = ["gains"]

    def __init__(self) -> None:
        super().__init__()
        self.gains = nn.ParameterList([nn.Parameter(torch.ones(16))])


@pytest.mark.parametrize(
    ("container", "fqn"),
    [
        pytest.param("ParameterList", "gains.0", id="list"),
        pytest.param("ParameterDict", "gains.out", id="dict"),
    ],
)
def test_a_kept_parameter_container_is_named_with_its_reader_not_as_the_roots_own(
    container: str, fqn: str
) -> None:
    model = cast_and_plan(ScaledStack(container))
    error = refusal(model)
    assert [(p.fqn, p.reason) for p in error.problems] == [(fqn, "root-owned")]
    text = str(error)
    assert "no fp32-keep unit owns it" in text
    assert (
        f"it is owned by 'gains' ({container}, read by '<root>' (ScaledStack: "
        "gains[self.key])), which has no forward of its own" in text
    )
    assert "owned directly by the root module" not in text  # the old, false wording
    assert "(the plan is for torch.bfloat16)" in text
    # Observed instead of read from the source: the same owner, the reader seen running.
    ids = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(0))
    with observe_parameter_use(model) as observed:
        model(ids)
    text = str(refusal(model, observed=observed))
    assert f"owned by 'gains' ({container}, read by '<root>' (ScaledStack: {fqn}; " in text
    assert "observed in ScaledStack.forward" in text


def test_negative_control_a_container_only_assigned_has_no_reader_to_name() -> None:
    model = cast_and_plan(UnreadGains())
    assert find_direct_read(model, "gains") is None  # `self.gains = ...` is no read
    text = str(refusal(model))
    assert "it is owned by 'gains' (ParameterList), which has no forward of its own" in text
    assert "read by" not in text
