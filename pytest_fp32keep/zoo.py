"""The built-in zoo: real Transformers model classes built from tiny configs.

Every entry is a real ``PreTrainedModel`` subclass whose FP32-keep declarations
(``_keep_in_fp32_modules`` / ``_keep_in_fp32_modules_strict``) make it interesting for
the keep contract: what the declaration catches, under which dtype, with which layout. Nothing is
downloaded: each model is instantiated from a config of a few layers, hidden size 32 and
a vocabulary of 64, in FP32, from a fixed seed, and builds in a fraction of a second on
a CPU.

Importing this module is cheap: ``transformers`` is imported inside the builders and
availability checks only. The configs work unchanged on every Transformers version the
project supports (4.56 to the newest 5.x); where an argument or a class differs between
versions, :func:`_config` is the one place that knows.

Use :data:`ZOO` for the full registry and :func:`available_entries` for what the
installed Transformers version can build, with a reason for everything it cannot.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = [
    "ZOO",
    "ZooAvailability",
    "ZooEntry",
    "available_entries",
    "transformers_version",
]

#: Seed used by every builder, so the same entry always yields the same weights.
BUILD_SEED = 0

#: Batch geometry shared by every entry.
BATCH_SIZE = 2
SEQ_LEN = 8


@dataclasses.dataclass(frozen=True)
class ZooEntry:
    """One zoo model: how to build it, how to feed it, and what to expect from it.

    Attributes:
        name: Registry key, lower case (``"t5"``, ``"gpt_oss"``, ...).
        model_class: Name of the Transformers class ``build`` instantiates; the entry is
            unavailable when the installed Transformers does not export it.
        build: Returns a fresh FP32 model built from a tiny config with :data:`BUILD_SEED`
            (same weights on every call). Imports ``transformers`` lazily.
        make_batch: ``make_batch(model, seed)`` returns the keyword arguments of one
            forward pass (always with ``labels``, so the output carries a loss) on the
            model's device; ``seed`` is an ``int`` or a ``torch.Generator``. The same seed
            gives the same batch.
        dtypes: The low-precision dtypes under which the model's declarations keep
            something in a 5.1+ ``from_pretrained`` (regular list: fp16; strict list:
            fp16 and bf16). What the *installed* version keeps is the plan's business:
            5.0.0 applies the regular list under bf16 too, and a class may declare
            nothing in older versions (see ``notes``).
        expect_layout_error: ``True`` when FSDP2 cannot isolate the kept tensors as
            units of their own, so ``fp32keep.apply_fsdp2`` must raise
            ``KeepLayoutError`` naming them (under every dtype in ``dtypes``).
        min_transformers: Lowest Transformers version the entry is meant for, or
            ``None``; below it the entry is reported unavailable.
        notes: Why the entry is in the zoo, in one or two sentences.
    """

    name: str
    model_class: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[nn.Module, int | torch.Generator], dict[str, torch.Tensor]]
    dtypes: tuple[torch.dtype, ...]
    expect_layout_error: bool = False
    min_transformers: str | None = None
    notes: str = ""

    def unavailable_reason(self) -> str | None:
        """Why the installed Transformers cannot build this entry, or ``None`` if it can."""
        from packaging.version import Version

        installed = transformers_version()
        if self.min_transformers is not None and Version(installed) < Version(
            self.min_transformers
        ):
            return (
                f"{self.model_class} needs transformers>={self.min_transformers}; "
                f"installed {installed}"
            )
        transformers = importlib.import_module("transformers")
        try:
            getattr(transformers, self.model_class)
        except AttributeError:
            return f"transformers {installed} has no {self.model_class}"
        except ImportError as exc:  # the class exists but needs a missing dependency
            return f"transformers {installed} cannot import {self.model_class}: {exc}"
        return None


class ZooAvailability(NamedTuple):
    """What the installed Transformers can build.

    Attributes:
        available: Entries that build, in registry order.
        unavailable: Entry name → reason, for the entries that do not.
    """

    available: Mapping[str, ZooEntry]
    unavailable: Mapping[str, str]


def transformers_version() -> str:
    """The installed Transformers version string (read from metadata, no import)."""
    return importlib.metadata.version("transformers")


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


# --------------------------------------------------------------------------------------
# Version shims: the one place that knows how config arguments differ between versions.
# --------------------------------------------------------------------------------------


#: Config arguments whose name changed between supported versions:
#: ``(config class, zoo spelling) -> ((first version, spelling from that version on), ...)``.
#: Empty today: every argument the zoo passes is spelled the same from 4.56.0 to 5.24.0.
#: The zoo deliberately passes no rotary arguments (``rope_scaling`` in 4.x became
#: ``rope_parameters`` in 5.x) and relies on each class's default rotary setup instead.
_RENAMED_CONFIG_ARGS: Mapping[tuple[str, str], tuple[tuple[str, str], ...]] = MappingProxyType({})


def _config(class_name: str, **kwargs: Any) -> Any:
    """Instantiate ``transformers.<class_name>`` from version-neutral keyword arguments.

    Arguments are renamed for the installed version per :data:`_RENAMED_CONFIG_ARGS`, then
    every scalar argument is checked to have reached the config: a config class that
    silently swallows an argument it no longer knows (and so builds a much larger model, or
    a different one) fails here, naming the argument and the version, instead of later.
    Attention is set to eager on the config and its sub-configs.
    """
    from packaging.version import Version

    transformers = importlib.import_module("transformers")
    installed = Version(transformers_version())
    spelled: dict[str, Any] = {}
    for key, value in kwargs.items():
        name = key
        for first, renamed in _RENAMED_CONFIG_ARGS.get((class_name, key), ()):
            if installed >= Version(first):
                name = renamed
        spelled[name] = value
    config = getattr(transformers, class_name)(**spelled)
    for key, value in spelled.items():
        if isinstance(value, dict):
            continue
        if getattr(config, key, _MISSING) != value:
            raise RuntimeError(
                f"{class_name}({key}={value!r}) did not take effect under transformers "
                f"{installed} (config has {getattr(config, key, '<nothing>')!r}); add the "
                "argument's new name to pytest_fp32keep.zoo._RENAMED_CONFIG_ARGS"
            )
    _set_eager_attention(config)
    return config


_MISSING = object()


def _set_eager_attention(config: Any) -> None:
    """Ask for the eager attention kernel on ``config`` and every nested sub-config.

    Eager attention is the same code path on every version and every CPU, so two runs
    of the same model give bit-identical results.
    """
    config._attn_implementation = "eager"
    for key in ("text_config", "vision_config", "qformer_config"):
        sub = getattr(config, key, None)
        if sub is not None:
            sub._attn_implementation = "eager"


def _instantiate(class_name: str, config: Any) -> nn.Module:
    """Build ``transformers.<class_name>(config)`` in FP32 from :data:`BUILD_SEED`.

    The global RNG state is restored afterwards, so building a zoo model does not
    perturb the caller's random stream.
    """
    transformers = importlib.import_module("transformers")
    cls = getattr(transformers, class_name)
    previous_default = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(BUILD_SEED)
        torch.set_default_dtype(torch.float32)
        try:
            model: nn.Module = cls(config)
        finally:
            torch.set_default_dtype(previous_default)
    return model


# --------------------------------------------------------------------------------------
# Batches.
# --------------------------------------------------------------------------------------


def _generator(seed: int | torch.Generator) -> torch.Generator:
    """A CPU generator: ``seed`` itself if it already is one, else a fresh seeded one."""
    if isinstance(seed, torch.Generator):
        return seed
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int(seed))
    return generator


def _hf(model: nn.Module) -> Any:
    """``model`` seen as the untyped Transformers model it is (for ``.config``)."""
    return model


def _device_of(model: nn.Module) -> torch.device:
    """Where the model's first parameter lives (CPU for a parameterless module)."""
    for param in model.parameters():
        return param.device
    return torch.device("cpu")


def _tokens(
    generator: torch.Generator, vocab_size: int, low: int = 2, length: int = SEQ_LEN
) -> torch.Tensor:
    """Random token ids in ``[low, vocab_size)`` of shape ``(BATCH_SIZE, length)``."""
    return torch.randint(low, vocab_size, (BATCH_SIZE, length), generator=generator)


def _to_device(batch: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    device = _device_of(model)
    return {key: value.to(device) for key, value in batch.items()}


def _causal_lm_batch(model: nn.Module, seed: int | torch.Generator) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``labels`` (the same ids: the model shifts them) for a causal LM."""
    generator = _generator(seed)
    vocab_size = int(_hf(model).config.vocab_size)
    input_ids = _tokens(generator, vocab_size)
    return _to_device({"input_ids": input_ids, "labels": input_ids.clone()}, model)


def _seq2seq_batch(model: nn.Module, seed: int | torch.Generator) -> dict[str, torch.Tensor]:
    """Encoder ``input_ids``, ``decoder_input_ids`` and ``labels`` for T5."""
    generator = _generator(seed)
    config = _hf(model).config
    vocab_size = int(config.vocab_size)
    input_ids = _tokens(generator, vocab_size)
    labels = _tokens(generator, vocab_size)
    start = torch.full((BATCH_SIZE, 1), int(config.decoder_start_token_id), dtype=torch.long)
    decoder_input_ids = torch.cat([start, labels[:, :-1]], dim=1)
    return _to_device(
        {"input_ids": input_ids, "decoder_input_ids": decoder_input_ids, "labels": labels},
        model,
    )


def _pixel_values(generator: torch.Generator, vision_config: Any) -> torch.Tensor:
    size = int(vision_config.image_size)
    channels = int(getattr(vision_config, "num_channels", 3))
    return torch.randn((BATCH_SIZE, channels, size, size), generator=generator)


def _vision_language_batch(
    model: nn.Module, seed: int | torch.Generator
) -> dict[str, torch.Tensor]:
    """``pixel_values``, text with the image placeholder tokens, and ``labels``.

    The text starts with ``num_query_tokens`` image tokens, which the model replaces by
    the Q-Former outputs (4.56+ placeholder layout). InstructBlip also gets the
    instruction for its Q-Former (``qformer_input_ids``). With an encoder-decoder
    language model (T5) the labels go to the decoder; with a decoder-only one they cover
    the whole input, placeholders set to the ignore index -100.
    """
    generator = _generator(seed)
    config = _hf(model).config
    text_vocab = int(config.text_config.vocab_size)
    image_token = int(config.image_token_index)
    num_query = int(config.num_query_tokens)
    pixel_values = _pixel_values(generator, config.vision_config)
    text = _tokens(generator, image_token, low=2)  # ids below the image token
    image_tokens = torch.full((BATCH_SIZE, num_query), image_token, dtype=torch.long)
    input_ids = torch.cat([image_tokens, text], dim=1)
    batch = {"pixel_values": pixel_values, "input_ids": input_ids}
    if getattr(config, "use_decoder_only_language_model", True):
        # Full-length labels, placeholders ignored: with shorter labels 5.24's Blip2 slices
        # the logits to a non-contiguous view that its loss function cannot ``.view``.
        batch["labels"] = torch.cat([torch.full_like(image_tokens, -100), text], dim=1)
    else:
        batch["labels"] = _tokens(generator, text_vocab)
    if hasattr(config, "qformer_config") and "InstructBlip" in type(model).__name__:
        batch["qformer_input_ids"] = _tokens(generator, int(config.qformer_config.vocab_size))
        batch["qformer_attention_mask"] = torch.ones_like(batch["qformer_input_ids"])
    return _to_device(batch, model)


# --------------------------------------------------------------------------------------
# Tiny configs and builders.
# --------------------------------------------------------------------------------------

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
    return _instantiate("T5ForConditionalGeneration", _config("T5Config", **_t5_kwargs()))


def _build_gpt_oss() -> nn.Module:
    common = _decoder_common()
    # The default YaRN rope scaling assumes the default context length; keep it.
    del common["max_position_embeddings"]
    config = _config(
        "GptOssConfig",
        **common,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        attention_dropout=0.0,
    )
    return _instantiate("GptOssForCausalLM", config)


def _build_ernie4_5_moe() -> nn.Module:
    config = _config(
        "Ernie4_5_MoeConfig",
        **_decoder_common(),
        moe_intermediate_size=16,
        moe_k=2,
        moe_num_experts=4,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
    )
    return _instantiate("Ernie4_5_MoeForCausalLM", config)


def _build_deepseek_v3() -> nn.Module:
    common = _decoder_common()
    common["num_key_value_heads"] = _HEADS
    config = _config(
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
    return _instantiate("DeepseekV3ForCausalLM", config)


def _build_rwkv() -> nn.Module:
    config = _config(
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
    return _instantiate("RwkvForCausalLM", config)


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
    config = _config(
        "Blip2Config",
        vision_config=_vision_kwargs(),
        qformer_config=_qformer_kwargs(),
        text_config=_opt_kwargs(),
        num_query_tokens=4,
        image_token_index=_VOCAB - 1,
    )
    return _instantiate("Blip2ForConditionalGeneration", config)


def _build_instructblip() -> nn.Module:
    text = {"model_type": "t5", **_t5_kwargs()}
    config = _config(
        "InstructBlipConfig",
        vision_config=_vision_kwargs(),
        qformer_config=_qformer_kwargs(),
        text_config=text,
        num_query_tokens=4,
        image_token_index=_VOCAB - 1,
    )
    return _instantiate("InstructBlipForConditionalGeneration", config)


def _build_afmoe() -> nn.Module:
    config = _config(
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
    return _instantiate("AfmoeForCausalLM", config)


def _build_llama() -> nn.Module:
    config = _config("LlamaConfig", **_decoder_common(), attention_dropout=0.0)
    return _instantiate("LlamaForCausalLM", config)


_FP16 = (torch.float16,)
_FP16_BF16 = (torch.float16, torch.bfloat16)

_ENTRIES = (
    ZooEntry(
        name="t5",
        model_class="T5ForConditionalGeneration",
        build=_build_t5,
        make_batch=_seq2seq_batch,
        dtypes=_FP16,
        notes="Regular ['wo']: the FFN output Linear of every block, kept only under fp16. "
        "Encoder-decoder, tied embeddings (four aliases), FP32 relative position bias.",
    ),
    ZooEntry(
        name="gpt_oss",
        model_class="GptOssForCausalLM",
        build=_build_gpt_oss,
        make_batch=_causal_lm_batch,
        dtypes=_FP16,
        notes="Regular norms ['post_attention_layernorm', 'input_layernorm', 'norm']: whole "
        "segments in 4.x, substrings in 5.x (the same names here). MoE with 4 experts.",
    ),
    ZooEntry(
        name="ernie4_5_moe",
        model_class="Ernie4_5_MoeForCausalLM",
        build=_build_ernie4_5_moe,
        make_batch=_causal_lm_batch,
        dtypes=_FP16_BF16,
        notes="Strict router: ['gate', 'moe_statics'] in 4.x, ['gate.weight', 'moe_statics'] "
        "in 5.x; kept under bf16 too. Layer 0 dense, layer 1 MoE with 4 experts.",
    ),
    ZooEntry(
        name="deepseek_v3",
        model_class="DeepseekV3ForCausalLM",
        build=_build_deepseek_v3,
        make_batch=_causal_lm_batch,
        dtypes=_FP16_BF16,
        notes="Strict ['e_score_correction_bias'] (a router buffer) in 5.x only, 5.24 adds "
        "'gate.weight'; 4.x declares nothing. Layer 0 dense, layer 1 MoE (4 routed experts).",
    ),
    ZooEntry(
        name="rwkv",
        model_class="RwkvForCausalLM",
        build=_build_rwkv,
        make_batch=_causal_lm_batch,
        dtypes=_FP16,
        expect_layout_error=True,
        notes="Regular ['time_decay', 'time_first']: parameters of the attention module that "
        "also owns its low-precision projections, so FSDP2 cannot make them a unit.",
    ),
    ZooEntry(
        name="blip2",
        model_class="Blip2ForConditionalGeneration",
        build=_build_blip2,
        make_batch=_vision_language_batch,
        dtypes=_FP16,
        expect_layout_error=True,
        notes="Regular ['query_tokens', 'qformer']: 'query_tokens' is a parameter of the root "
        "model, which FSDP2 cannot shard apart from the root's low-precision parameters.",
    ),
    ZooEntry(
        name="instructblip",
        model_class="InstructBlipForConditionalGeneration",
        build=_build_instructblip,
        make_batch=_vision_language_batch,
        dtypes=_FP16,
        expect_layout_error=True,
        notes="Nested declarations: its own ['query_tokens'] plus the T5 language model's "
        "['wo'], hand-merged after 5.0.0 had built its dtype plan (so 5.0.0 keeps query_tokens "
        "only); in 5.1+ 'wo' also catches the Q-Former's 'word_embeddings' (substring).",
    ),
    ZooEntry(
        name="afmoe",
        model_class="AfmoeForCausalLM",
        build=_build_afmoe,
        make_batch=_causal_lm_batch,
        dtypes=_FP16_BF16,
        notes="Norms and the router's 'expert_bias': all regular up to 5.10 (nothing kept "
        "under bf16), 'expert_bias' strict in 5.24 (both lists). Layer 1 MoE, 4 experts.",
    ),
    ZooEntry(
        name="llama",
        model_class="LlamaForCausalLM",
        build=_build_llama,
        make_batch=_causal_lm_batch,
        dtypes=_FP16_BF16,
        notes="Control: declares nothing, so nothing is kept; only its non-persistent "
        "rotary 'inv_freq' buffer stays FP32, by model code.",
    ),
)

#: The registry, in a stable order: name → entry.
ZOO: Mapping[str, ZooEntry] = MappingProxyType({entry.name: entry for entry in _ENTRIES})
