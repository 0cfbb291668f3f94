"""The tiny configs of the zoo, its registry :data:`ZOO`, and what the installed version builds."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from pytest_fp32keep.check.zoo.batches import causal_lm_batch, seq2seq_batch, vision_language_batch
from pytest_fp32keep.check.zoo.building import (
    instantiate,
    make_config,
    seed_query_tokens,
)
from pytest_fp32keep.check.zoo.entry import KeepExpectation, ZooAvailability, ZooEntry

_VOCAB = 64
_HIDDEN = 32
_HEADS = 4


def _decoder_common() -> dict[str, Any]:
    """Arguments shared by the decoder-only language models."""
    return {
        "vocab_size": _VOCAB,
        "hidden_size": _HIDDEN,
        "intermediate_size": 2 * _HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 1,
    }


def _t5_kwargs() -> dict[str, Any]:
    return {
        "vocab_size": _VOCAB,
        "d_model": _HIDDEN,
        "d_kv": 8,
        "d_ff": 2 * _HIDDEN,
        "num_layers": 2,
        "num_decoder_layers": 2,
        "num_heads": _HEADS,
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 16,
        "dropout_rate": 0.0,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
    }


def _build_t5() -> nn.Module:
    return instantiate("T5ForConditionalGeneration", make_config("T5Config", **_t5_kwargs()))


def _build_gpt_oss() -> nn.Module:
    common = _decoder_common()
    # The default YaRN rope scaling assumes the default context length; keep it.
    del common["max_position_embeddings"]
    config = make_config(
        "GptOssConfig",
        **common,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        attention_dropout=0.0,
    )
    return instantiate("GptOssForCausalLM", config)


def _build_ernie4_5_moe() -> nn.Module:
    config = make_config(
        "Ernie4_5_MoeConfig",
        **_decoder_common(),
        moe_intermediate_size=16,
        moe_k=2,
        moe_num_experts=4,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
    )
    return instantiate("Ernie4_5_MoeForCausalLM", config)


def _build_deepseek_v3() -> nn.Module:
    common = _decoder_common()
    common["num_key_value_heads"] = _HEADS
    config = make_config(
        "DeepseekV3Config",
        **common,
        moe_intermediate_size=16,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        attention_dropout=0.0,
    )
    return instantiate("DeepseekV3ForCausalLM", config)


def _build_rwkv() -> nn.Module:
    config = make_config(
        "RwkvConfig",
        vocab_size=_VOCAB,
        context_length=64,
        hidden_size=_HIDDEN,
        num_hidden_layers=2,
        attention_hidden_size=_HIDDEN,
        intermediate_size=2 * _HIDDEN,
        rescale_every=0,  # no in-place weight rescaling in eval mode
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=1,
    )
    return instantiate("RwkvForCausalLM", config)


def _vision_kwargs() -> dict[str, Any]:
    return {
        "hidden_size": _HIDDEN,
        "intermediate_size": 2 * _HIDDEN,
        "num_hidden_layers": 1,
        "num_attention_heads": _HEADS,
        "image_size": 16,
        "patch_size": 8,
        "attention_dropout": 0.0,
    }


def _qformer_kwargs() -> dict[str, Any]:
    return {
        "vocab_size": _VOCAB,
        "hidden_size": _HIDDEN,
        "num_hidden_layers": 1,
        "num_attention_heads": _HEADS,
        "intermediate_size": 2 * _HIDDEN,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "cross_attention_frequency": 1,
        "encoder_hidden_size": _HIDDEN,
        "max_position_embeddings": 64,
    }


def _opt_kwargs() -> dict[str, Any]:
    return {
        "model_type": "opt",
        "vocab_size": _VOCAB,
        "hidden_size": _HIDDEN,
        "word_embed_proj_dim": _HIDDEN,
        "ffn_dim": 2 * _HIDDEN,
        "num_hidden_layers": 1,
        "num_attention_heads": _HEADS,
        "max_position_embeddings": 64,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 1,
    }


def _build_blip2() -> nn.Module:
    config = make_config(
        "Blip2Config",
        vision_config=_vision_kwargs(),
        qformer_config=_qformer_kwargs(),
        text_config=_opt_kwargs(),
        num_query_tokens=4,
        image_token_index=_VOCAB - 1,
    )
    return instantiate("Blip2ForConditionalGeneration", config)


def _build_instructblip() -> nn.Module:
    text = {"model_type": "t5", **_t5_kwargs()}
    config = make_config(
        "InstructBlipConfig",
        vision_config=_vision_kwargs(),
        qformer_config=_qformer_kwargs(),
        text_config=text,
        num_query_tokens=4,
        image_token_index=_VOCAB - 1,
    )
    model = instantiate("InstructBlipForConditionalGeneration", config)
    seed_query_tokens(model)  # Transformers' zeros give the unsharded fp16 model NaN gradients
    return model


def _build_afmoe() -> nn.Module:
    config = make_config(
        "AfmoeConfig",
        **_decoder_common(),
        head_dim=8,
        moe_intermediate_size=16,
        num_dense_layers=1,
        num_experts=4,
        num_experts_per_tok=2,
        num_shared_experts=1,
        global_attn_every_n_layers=2,
        sliding_window=4,
    )
    return instantiate("AfmoeForCausalLM", config)


def _build_llama() -> nn.Module:
    config = make_config("LlamaConfig", **_decoder_common(), attention_dropout=0.0)
    return instantiate("LlamaForCausalLM", config)


_FP16 = (torch.float16,)
_FP16_BF16 = (torch.float16, torch.bfloat16)

# --- what each release line keeps: written from docs/transformers-keep-semantics.md ----
# Group A (4.56-4.57): regular list under fp16 only, strict under fp16 and bf16, entries match
# whole dot-segments. Group B (5.0.0): both lists under any dtype (no gate), glob substrings; no
# 5.0.0 wheel is checked here, so its rows name no tensors (kept=None), only the refusal. Group C
# (5.1+): the dtype gates of A, the substring match of B, children's lists merged by post_init.
# Ranges a release between two checked ones may differ in (5.11-5.23) name no tensors either.
# The open ranges (">=5.1", ">=5.24") were checked against the 5.25.0 wheel: every declaration of
# these classes and the gates are 5.24.0's (docs/transformers-versions.md).
_A, _B, _C = ">=4.56,<4.58", "==5.0.0", ">=5.1"
_ANY = _FP16_BF16  # group B's "no dtype gate", over the low-precision dtypes the zoo checks
_LAYER = r"(en|de)coder\.block\.\d+\.layer\.\d+\.DenseReluDense\.wo\.weight"  # T5's "wo"
_GPT_OSS_NORMS = (
    r"model\.layers\.\d+\.(input|post_attention)_layernorm\.weight",
    r"model\.norm\.weight",
)
_AFMOE_NORMS = (
    r"model\.layers\.\d+\.(input|post_attention|pre_mlp|post_mlp)_layernorm\.weight",
    r"model\.layers\.\d+\.self_attn\.[qk]_norm\.weight",  # 5.x: "norm" is a substring
    r"model\.norm\.weight",
)
_EXPERT_BIAS = r"model\.layers\.\d+\.mlp\.expert_bias"
_RWKV = (r"rwkv\.blocks\.\d+\.attention\.time_(decay|first)",)
_RWKV_WHY = (
    "RwkvSelfAttention owns time_decay and time_first, kept, beside its time_mix_* parameters, "
    "not kept; its forward mixes the input with time_mix_* and feeds time_decay, time_first to "
    "the WKV recurrence."
)
_BLIP2 = (r"query_tokens", r"qformer\..+")  # "qformer": every tensor of the Q-Former
_INSTRUCTBLIP_A = (r"query_tokens", r"language_model\." + _LAYER)  # 4.x: hand-merged T5 list
# 5.1+: merged by post_init, and "wo" also catches the Q-Former's "word_embeddings"
_INSTRUCTBLIP_C = (*_INSTRUCTBLIP_A, r"qformer\.embeddings\.word_embeddings\.weight")

_EXPECTED: dict[str, tuple[KeepExpectation, ...]] = {
    "t5": (
        KeepExpectation(_A, _FP16, (_LAYER,)),
        KeepExpectation(_B, _ANY, None),
        KeepExpectation(_C, _FP16, (_LAYER,)),
    ),
    "gpt_oss": (
        KeepExpectation(_A, _FP16, _GPT_OSS_NORMS),
        KeepExpectation(_B, _ANY, None),
        KeepExpectation(_C, _FP16, _GPT_OSS_NORMS),
    ),
    "ernie4_5_moe": (  # strict: fp16 and bf16 in every group
        # 4.x ["gate", "moe_statics"]; moe_statics is a child of the MoE block
        KeepExpectation(
            _A,
            _FP16_BF16,
            (
                r"model\.layers\.\d+\.mlp\.gate\.weight",
                r"model\.layers\.\d+\.mlp\.moe_statics\.e_score_correction_bias",
            ),
        ),
        KeepExpectation(_B, _ANY, None),
        # 5.x ["gate.weight", "moe_statics"]; moe_statics now lives under the router
        KeepExpectation(
            _C,
            _FP16_BF16,
            (
                r"model\.layers\.\d+\.mlp\.gate\.weight",
                r"model\.layers\.\d+\.mlp\.gate\.moe_statics\.e_score_correction_bias",
            ),
        ),
    ),
    "deepseek_v3": (  # 4.x declares nothing; 5.x strict
        KeepExpectation(_A, (), ()),
        KeepExpectation(_B, _ANY, None),
        KeepExpectation(
            ">=5.1,<5.11", _FP16_BF16, (r"model\.layers\.\d+\.mlp\.gate\.e_score_correction_bias",)
        ),
        KeepExpectation(">=5.11,<5.24", _FP16_BF16, None),
        KeepExpectation(
            ">=5.24",
            _FP16_BF16,
            (r"model\.layers\.\d+\.mlp\.gate\.(e_score_correction_bias|weight)",),
        ),
    ),
    "rwkv": (
        KeepExpectation(_A, _FP16, _RWKV, "mixed-unit", why=_RWKV_WHY),
        KeepExpectation(_B, _ANY, None, "mixed-unit", why=_RWKV_WHY),
        KeepExpectation(_C, _FP16, _RWKV, "mixed-unit", why=_RWKV_WHY),
    ),
    # Blip2 and InstructBlip: the root's own parameters are `query_tokens` alone (kept in every
    # row), the rest lives in its children (vision tower, Q-Former, projection, language model),
    # and the root calls the text embedding itself (`self.get_input_embeddings()(input_ids)`),
    # tied to the language model's head (OPT, T5: tie_word_embeddings). FSDP2 can hold that:
    # each child a unit, the embedding and its tied head one unit, then the root an FP32 unit
    # of its kept `query_tokens`. Nothing is refused.
    "blip2": (
        KeepExpectation(_A, _FP16, _BLIP2),
        KeepExpectation(_B, _ANY, None),
        KeepExpectation(_C, _FP16, _BLIP2),
    ),
    "instructblip": (
        KeepExpectation(_A, _FP16, _INSTRUCTBLIP_A),
        KeepExpectation(_B, _ANY, None),  # query_tokens only: merged too late
        KeepExpectation(_C, _FP16, _INSTRUCTBLIP_C),
    ),
    "afmoe": (  # a 5.x class: regular norms and expert_bias; 5.24 makes expert_bias strict
        KeepExpectation(_B, _ANY, None),
        KeepExpectation(">=5.1,<5.11", _FP16, (*_AFMOE_NORMS, _EXPERT_BIAS)),
        KeepExpectation(">=5.11,<5.24", _FP16_BF16, None),
        KeepExpectation(">=5.24", _FP16, (*_AFMOE_NORMS, _EXPERT_BIAS)),
        KeepExpectation(">=5.24", (torch.bfloat16,), (_EXPERT_BIAS,)),
    ),
    "llama": (KeepExpectation(">=4.56", (), ()),),  # declares nothing, in every release
}

_ENTRIES = (
    ZooEntry(
        name="t5",
        model_class="T5ForConditionalGeneration",
        build=_build_t5,
        make_batch=seq2seq_batch,
        dtypes=_FP16,
        expectations=_EXPECTED["t5"],
        notes="Regular ['wo']: the FFN output Linear of every block, kept only under fp16. "
        "Encoder-decoder, tied embeddings (four aliases), FP32 relative position bias.",
    ),
    ZooEntry(
        name="gpt_oss",
        model_class="GptOssForCausalLM",
        build=_build_gpt_oss,
        make_batch=causal_lm_batch,
        dtypes=_FP16,
        expectations=_EXPECTED["gpt_oss"],
        notes="Regular norms ['post_attention_layernorm', 'input_layernorm', 'norm']: whole "
        "segments in 4.x, substrings in 5.x (the same names here). MoE with 4 experts.",
    ),
    ZooEntry(
        name="ernie4_5_moe",
        model_class="Ernie4_5_MoeForCausalLM",
        build=_build_ernie4_5_moe,
        make_batch=causal_lm_batch,
        dtypes=_FP16_BF16,
        expectations=_EXPECTED["ernie4_5_moe"],
        notes="Strict router: ['gate', 'moe_statics'] in 4.x, ['gate.weight', 'moe_statics'] "
        "in 5.x; kept under bf16 too. Layer 0 dense, layer 1 MoE with 4 experts.",
    ),
    ZooEntry(
        name="deepseek_v3",
        model_class="DeepseekV3ForCausalLM",
        build=_build_deepseek_v3,
        make_batch=causal_lm_batch,
        dtypes=_FP16_BF16,
        expectations=_EXPECTED["deepseek_v3"],
        notes="Strict ['e_score_correction_bias'] (a router buffer) in 5.x only, 5.24 adds "
        "'gate.weight'; 4.x declares nothing. Layer 0 dense, layer 1 MoE (4 routed experts).",
    ),
    ZooEntry(
        name="rwkv",
        model_class="RwkvForCausalLM",
        build=_build_rwkv,
        make_batch=causal_lm_batch,
        dtypes=_FP16,
        expectations=_EXPECTED["rwkv"],
        expect_layout_error=True,
        notes="Regular ['time_decay', 'time_first']: parameters of the attention module that "
        "also owns its low-precision projections, so FSDP2 cannot make them a unit.",
    ),
    ZooEntry(
        name="blip2",
        model_class="Blip2ForConditionalGeneration",
        build=_build_blip2,
        make_batch=vision_language_batch,
        dtypes=_FP16,
        expectations=_EXPECTED["blip2"],
        notes="Regular ['query_tokens', 'qformer']: 'query_tokens' is a parameter of the root "
        "model, which owns nothing else: the root is an FP32 unit sharded after its children, "
        "and the text embedding it calls is one unit with the LM head tied to it.",
    ),
    ZooEntry(
        name="instructblip",
        model_class="InstructBlipForConditionalGeneration",
        build=_build_instructblip,
        make_batch=vision_language_batch,
        dtypes=_FP16,
        expectations=_EXPECTED["instructblip"],
        notes="Nested declarations: its own ['query_tokens'] plus the T5 language model's "
        "['wo'], hand-merged after 5.0.0 had built its dtype plan (so 5.0.0 keeps query_tokens "
        "only); in 5.1+ 'wo' also catches the Q-Former's 'word_embeddings' (substring).",
    ),
    ZooEntry(
        name="afmoe",
        model_class="AfmoeForCausalLM",
        build=_build_afmoe,
        make_batch=causal_lm_batch,
        dtypes=_FP16_BF16,
        expectations=_EXPECTED["afmoe"],
        notes="Norms and the router's 'expert_bias': all regular up to 5.10 (nothing kept "
        "under bf16), 'expert_bias' strict in 5.24 (both lists). Layer 1 MoE, 4 experts.",
    ),
    ZooEntry(
        name="llama",
        model_class="LlamaForCausalLM",
        build=_build_llama,
        make_batch=causal_lm_batch,
        dtypes=_FP16_BF16,
        expectations=_EXPECTED["llama"],
        notes="Control: declares nothing, so nothing is kept; only its non-persistent "
        "rotary 'inv_freq' buffer stays FP32, by model code.",
    ),
)

#: The registry, in a stable order: name → entry.
ZOO: Mapping[str, ZooEntry] = MappingProxyType({entry.name: entry for entry in _ENTRIES})


def available_entries(names: list[str] | None = None) -> ZooAvailability:
    """Split the zoo (or the named entries) into buildable and unavailable ones.

    Never raises for an entry the installed version lacks: it lands in ``unavailable``
    with the reason. An unknown name is a ``KeyError``, a caller's mistake.
    """
    selected = list(ZOO) if names is None else names
    available: dict[str, ZooEntry] = {}
    unavailable: dict[str, str] = {}
    for name in selected:
        entry = ZOO[name]
        reason = entry.unavailable_reason()
        if reason is None:
            available[name] = entry
        else:
            unavailable[name] = reason
    return ZooAvailability(MappingProxyType(available), MappingProxyType(unavailable))
