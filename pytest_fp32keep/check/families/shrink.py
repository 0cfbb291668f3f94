"""Shrink any Transformers config to a tiny one, automatically, by the names of its fields.

The default config of a model class (its published size) is turned into a dictionary, every
field this module knows by name is set to a tiny value, consistently (heads x head_dim = hidden
size, kv heads dividing heads, top-k not above the number of experts), in the config and in
every nested sub-config (vision, audio, text towers, Q-Formers), and the config is rebuilt with
``from_dict``: the path ``from_pretrained`` takes, so each class's own ``__init__`` derives what
it derives (``layer_types``, rotary setup) from the shrunk sizes.

What is shrunk is data, not code: :data:`TINY` maps field names to tiny values. Per-layer lists
as long as the old layer count are cut to the new one (the first layers' pattern is kept).
Special token ids are renumbered into the tiny vocabulary (:func:`_token_ids`): text specials
at the bottom, placeholders (image, audio, video tokens) at the top, so a batch's random text
ids (:data:`TEXT_LOW` up to :data:`TEXT_HIGH`) never hit one.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

from pytest_fp32keep.check.families.overrides import DEFAULT_SUB_CONFIGS

#: The tiny vocabulary of every tower.
VOCAB = 128
#: Random text ids of a batch lie in ``[TEXT_LOW, TEXT_HIGH)``: above the text specials, below
#: the placeholders.
TEXT_LOW, TEXT_HIGH = 4, VOCAB - 24
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 32, 4, 2, 8
LAYERS = 2

#: Field name -> tiny value, for the config and every sub-config that has the field.
TINY: Mapping[str, Any] = MappingProxyType(
    {
        # depth
        **dict.fromkeys(
            (
                "num_hidden_layers",
                "num_layers",
                "n_layer",
                "n_layers",
                "encoder_layers",
                "decoder_layers",
                "num_decoder_layers",
                "num_encoder_layers",
                "depth",
            ),
            LAYERS,
        ),
        # widths
        **dict.fromkeys(
            (
                "hidden_size",
                "d_model",
                "n_embd",
                "embed_dim",
                "out_hidden_size",
                "projection_dim",
                "word_embed_proj_dim",
                "hidden_sizes",  # per stage of a hierarchical tower (MuseSpark's audio)
            ),
            HIDDEN,
        ),
        **dict.fromkeys(
            (
                "num_attention_heads",
                "num_heads",
                "n_head",
                "encoder_attention_heads",
                "decoder_attention_heads",
            ),
            HEADS,
        ),
        **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "multi_query_group_num"), KV_HEADS),
        **dict.fromkeys(
            ("head_dim", "d_kv", "kv_channels", "qk_rope_head_dim", "qk_nope_head_dim"), HEAD_DIM
        ),
        **dict.fromkeys(("v_head_dim", "swa_head_dim"), HEAD_DIM),
        **dict.fromkeys(
            (
                "intermediate_size",
                "d_ff",
                "ffn_dim",
                "encoder_ffn_dim",
                "decoder_ffn_dim",
                "n_inner",
                "mlp_dim",  # SAM-style vision encoders (SLANeXt's)
                "projector_hidden_size",
                "projection_hidden_dim",
            ),
            2 * HIDDEN,
        ),
        **dict.fromkeys(
            (
                "moe_intermediate_size",
                "shared_expert_intermediate_size",
                "expert_intermediate_size",
                "moe_ffn_hidden_size",
                "moe_hidden_size",
            ),
            16,
        ),
        **dict.fromkeys(("q_lora_rank", "kv_lora_rank"), 16),
        # derived in __init__ but written back by to_dict(): stale unless shrunk too
        "qk_head_dim": 2 * HEAD_DIM,
        "ffn_hidden_size": 2 * HIDDEN,
        **dict.fromkeys(("expert_ffn_hidden_size", "moe_shared_expert_intermediate_size"), 16),
        # state-space layers (Mamba-2 style): heads x head_dim = expand x hidden
        "ssm_state_size": 16,
        "mamba_num_heads": 8,
        "mamba_head_dim": 8,
        "n_groups": 1,
        "chunk_size": 8,
        # linear-attention layers (Kimi-Linear's KDA)
        "linear_num_heads": HEADS,
        "linear_head_dim": HEAD_DIM,
        # experts
        **dict.fromkeys(
            ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4
        ),
        **dict.fromkeys(("num_experts_per_tok", "moe_k", "moe_topk", "num_experts_per_token"), 2),
        **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
        **dict.fromkeys(("n_group", "topk_group", "num_expert_group"), 1),
        "zero_expert_num": 2,
        **dict.fromkeys(("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index"), 1),
        # vocabulary and vision geometry
        **dict.fromkeys(("vocab_size", "unpadded_vocab_size"), VOCAB),
        "image_size": 16,
        "patch_size": 8,
        "num_query_tokens": 4,
        # audio towers (Whisper-style): 2 x max_source_positions mel frames per clip
        "max_source_positions": 16,
        "num_mel_bins": 16,
        # audio codecs (Encodec, Mimi): the first conv's channels, doubled at each downsampling
        "num_filters": 4,
        # discrete tokenizers' codebooks (Apertus-1.5's image tokenizer: 131,072 entries)
        "codebook_size": 16,
        # no randomness: the contract compares runs bit for bit
        **dict.fromkeys(
            (
                "dropout",
                "attention_dropout",
                "hidden_dropout",
                "dropout_rate",
                "hidden_dropout_prob",
                "attention_probs_dropout_prob",
                "activation_dropout",
                "layerdrop",
                "encoder_layerdrop",
                "decoder_layerdrop",
            ),
            0.0,
        ),
    }
)

#: Text special tokens and where they go; every other ``*_token_id`` / ``*_token_index`` field
#: is a placeholder and goes to the top of the vocabulary.
_TEXT_SPECIALS: Mapping[str, int] = MappingProxyType(
    {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0}
)
#: Placeholder ids that default to ``None`` but that a batch must find in the config.
_PLACEHOLDERS = frozenset(
    {"image_token_index", "image_token_id", "video_token_index", "audio_token_id"}
)
#: Fields that are a tower's width (shrunk to :data:`HIDDEN`).
_WIDTH_KEYS = ("hidden_size", "d_model", "n_embd", "embed_dim")
#: Names of fields that may copy a width (:func:`follow_widths`).
_WIDTH_COPY_SUFFIXES = (
    "_dim",
    "hidden_size",
    "_input_size",
    "_output_size",
    "_groups",
    "_channels",
)
_LAYER_COUNT_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "depth")


def _is_token_field(key: str) -> bool:
    return key.endswith(("_token_id", "_token_index", "_token_ids")) or key in (
        "image_token_index",
        "audio_token_index",
    )


def _token_ids(tree: dict[str, Any], next_top: list[int]) -> None:
    """Renumber the special token ids of ``tree`` (one config level) into the tiny vocabulary."""
    for key, value in list(tree.items()):
        if not _is_token_field(key):
            continue
        if value is None and key in _PLACEHOLDERS:
            value = 0  # a placeholder the batch needs, unset by default (Blip2's image token)
        elif value is None:
            continue
        if key in _TEXT_SPECIALS:
            low = _TEXT_SPECIALS[key]
            tree[key] = [low] * len(value) if isinstance(value, list) else low
        elif isinstance(value, int):
            next_top[0] -= 1
            tree[key] = next_top[0]
        elif isinstance(value, list) and all(isinstance(v, int) for v in value):
            ids = []
            for _ in value:
                next_top[0] -= 1
                ids.append(next_top[0])
            tree[key] = ids


def _old_layers(tree: Mapping[str, Any]) -> int | None:
    for key in _LAYER_COUNT_KEYS:
        value = tree.get(key)
        if isinstance(value, int) and value > LAYERS:
            return value
    return None


def shrink_dict(tree: dict[str, Any], overrides: Mapping[str, Any], next_top: list[int]) -> None:
    """Shrink one config level (a ``to_dict()``) in place, then its sub-configs.

    ``overrides`` (a family's own values, from :mod:`.overrides`) win over :data:`TINY`;
    a nested mapping under a sub-config's key applies to that sub-config.
    """
    old_layers = _old_layers(tree)
    # A model without grouped-query attention (kv heads = heads by default) stays so: some
    # validators refuse GQA (5.24's ESMC).
    heads = tree.get("num_attention_heads", tree.get("num_heads"))
    multi_head = _number(heads) and tree.get("num_key_value_heads") == heads
    for key, value in list(tree.items()):
        if _is_sub_config(value):
            continue  # a sub-config: below
        if key in TINY and _number(value):
            tree[key] = _smaller(value, TINY[key])
        elif key in TINY and isinstance(value, list) and value and all(map(_number, value)):
            # one per tower, or one per stage (MuseSpark's audio hidden_sizes): then cut too
            kept = cut_layers(value) if old_layers and len(value) == old_layers else value
            tree[key] = [_smaller(item, TINY[key]) for item in kept]
        elif old_layers and isinstance(value, list) and len(value) == old_layers:
            tree[key] = cut_layers(value)
        elif old_layers and _is_per_layer_mapping(value, old_layers):
            tree[key] = {k: v for k, v in value.items() if int(k) < LAYERS}
    if multi_head:
        tree["num_key_value_heads"] = tree.get("num_attention_heads", tree.get("num_heads"))
    _consistent(tree)
    _token_ids(tree, next_top)
    for key, value in overrides.items():
        if not (isinstance(value, Mapping) and _is_sub_config(tree.get(key))):
            tree[key] = dict(value) if isinstance(value, Mapping) else value
    for key, value in list(tree.items()):
        if _is_sub_config(value):
            sub_overrides = overrides.get(key, {})
            shrink_dict(
                value, sub_overrides if isinstance(sub_overrides, Mapping) else {}, next_top
            )


def cut_layers(value: list[Any]) -> list[Any]:
    """A per-layer list cut to :data:`LAYERS` entries, keeping as many kinds of layer as fit.

    The first layers alone are often all of one kind (Kimi-Linear's and Bailing-Hybrid's
    first full-attention layer is the 4th or 6th): with only linear-attention layers the
    model's cache has no attention layer to ask its length, and the tiny model would not run
    the layer kind a full one has. So a list of kinds (strings) keeps its first entry, then
    the first entry of each other kind, in order, then fills up from the start; any other list
    keeps its first entries.
    """
    if not all(isinstance(item, str) for item in value):
        return value[:LAYERS]
    kinds = list(dict.fromkeys(value))
    picked = [value.index(kind) for kind in kinds][:LAYERS]
    picked += [index for index in range(len(value)) if index not in picked][: LAYERS - len(picked)]
    return [value[index] for index in sorted(picked)]


def _is_per_layer_mapping(value: Any, old_layers: int) -> bool:
    """A dict keyed by layer indices (Dots3-Note's ``per_layer_config``)."""
    return (
        isinstance(value, dict)
        and bool(value)
        and "model_type" not in value
        and all(isinstance(k, int) or (isinstance(k, str) and k.isdigit()) for k in value)
        and all(int(k) < old_layers for k in value)
    )


def _is_sub_config(value: Any) -> bool:
    return isinstance(value, dict) and "model_type" in value


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _smaller(value: Any, tiny: Any) -> Any:
    """``tiny``, except that a field already smaller is left as it is (never grow a tower)."""
    return tiny if (isinstance(tiny, float) or value > tiny) else value


def _consistent(tree: dict[str, Any]) -> None:
    """Make the shrunk sizes agree with each other where the class derives one from another."""
    heads = tree.get("num_attention_heads", tree.get("num_heads"))
    if isinstance(heads, int) and isinstance(tree.get("num_key_value_heads"), int):
        kv = tree["num_key_value_heads"]
        if kv > heads or heads % kv or "kv_lora_rank" in tree:  # MLA: one kv head per head
            tree["num_key_value_heads"] = heads
    experts = next(
        (
            tree[key]
            for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
            if isinstance(tree.get(key), int)
        ),
        None,
    )
    if experts is not None:
        for key in ("num_experts_per_tok", "moe_k", "moe_topk", "num_experts_per_token"):
            if key in tree and tree[key] is None:
                # unset by default (5.24's DeepseekV2Config), the checkpoints set it; the
                # router's topk(k=None) cannot run without it
                tree[key] = min(TINY[key], experts)
            if isinstance(tree.get(key), int) and tree[key] > experts:
                tree[key] = experts
    if experts is not None and "mlp_layer_types" in tree and tree["mlp_layer_types"] is None:
        # Unset by default and not derived (5.24's DeepseekOcr2TextConfig: its checkpoint sets
        # it), yet every decoder layer indexes it: one dense layer first, as DeepSeek's
        # first_k_dense_replace does, then sparse ones, so the routed experts (and their
        # kept gate) exist.
        layers = next((tree[k] for k in _LAYER_COUNT_KEYS if isinstance(tree.get(k), int)), 0)
        tree["mlp_layer_types"] = ["dense"] + ["sparse"] * (layers - 1) if layers > 1 else None
    rope = tree.get("rope_parameters") or tree.get("rope_scaling")
    if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list):
        # The sections split the rotary half of head_dim: keep their count, rescale the sum.
        rope["mrope_section"] = _split(HEAD_DIM // 2, len(rope["mrope_section"]))
    if "sliding_window" in tree and isinstance(tree["sliding_window"], int):
        tree["sliding_window"] = min(tree["sliding_window"], 4)


def _levels(
    before: dict[str, Any], after: dict[str, Any]
) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """Each config level of ``before`` with the same level of ``after``, sub-configs included."""
    yield before, after
    for key, value in before.items():
        if _is_sub_config(value) and _is_sub_config(after.get(key)):
            yield from _levels(value, after[key])


def follow_widths(before: dict[str, Any], after: dict[str, Any]) -> None:
    """Fields that copy a tower's width take its new width, across the whole config.

    A config often repeats a width under another name, which its validator (5.2x's
    ``validate_architecture``) or its layers require to be equal: a head's
    ``audio_hidden_size`` or a vision tower's ``text_hidden_size`` (another tower's
    ``hidden_size``), a flow head's ``condition_dim`` (its backbone's), a quantizer's
    ``codebook_dim`` without projections, a depthwise conv's ``upsample_groups`` (one group per
    channel). Such names are not in :data:`TINY` (most of them are not widths in other
    configs), so this pass reads the relation from the default values instead: a field named
    ``*_dim``, ``*hidden_size``, ``*_input_size``, ``*_output_size``, ``*_groups`` or
    ``*_channels``, left as it was, whose default equals the default width of some level that
    was shrunk, takes that level's new width.
    ``before`` is the unshrunk ``to_dict()``; ``after`` the shrunk one, changed in place.
    """
    widths: dict[Any, Any] = {}
    for old, new in _levels(before, after):
        for key in _WIDTH_KEYS:
            if _number(old.get(key)) and _number(new.get(key)) and old[key] != new[key]:
                widths.setdefault(old[key], new[key])
    for old, new in _levels(before, after):
        for key, value in old.items():
            if (
                key.endswith(_WIDTH_COPY_SUFFIXES)
                and key not in TINY
                and isinstance(value, int)
                and not isinstance(value, bool)
                and value in widths
                and new.get(key) == value  # not shrunk, not overridden
            ):
                new[key] = widths[value]


def _split(total: int, parts: int) -> list[int]:
    """``total`` as ``parts`` positive integers, largest first (``_split(4, 3) == [2, 1, 1]``)."""
    base, extra = divmod(total, parts)
    return [base + (1 if index < extra else 0) for index in range(parts)]


@contextlib.contextmanager
def quiet_config() -> Iterator[None]:
    """Transformers' warnings about a config being built here, silenced; its errors still show.

    A default config, and even more a shrunk one, trips Transformers' advice meant for a user's
    own config ("pad_token_id must be ... within the vocabulary", sub-configs "initialized with
    default values"): one line per family would bury ``--list --all-families``. An exception, and
    a message Transformers logs as an error, still reach the user.
    """
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers_logging.set_verbosity(verbosity)


def default_config(config_class: Any) -> Any:
    """``config_class``'s default config: ``config_class()``, given the sub-configs it requires
    but does not default (:data:`.overrides.DEFAULT_SUB_CONFIGS`, by their model types)."""
    subs = DEFAULT_SUB_CONFIGS.get(config_class.__name__, {})
    with quiet_config():
        return config_class(**{key: {"model_type": kind} for key, kind in subs.items()})


def tiny_config(config_class: Any, overrides: Mapping[str, Any] | None = None) -> Any:
    """The default config of ``config_class`` (:func:`default_config`), shrunk
    (:func:`shrink_dict`), eager attention."""
    tree = default_config(config_class).to_dict()
    for key in ("transformers_version", "architectures", "_name_or_path"):
        tree.pop(key, None)
    before = copy.deepcopy(tree)
    shrink_dict(tree, overrides or {}, [VOCAB])
    follow_widths(before, tree)
    with quiet_config():
        config = config_class.from_dict(tree)
    set_eager(config)
    return config


def set_eager(config: Any) -> None:
    """Eager attention on ``config`` and every nested sub-config (same kernel everywhere)."""
    seen: set[int] = set()
    stack = [config]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        with contextlib.suppress(AttributeError, ValueError, TypeError):  # no attention here
            current._attn_implementation = "eager"
        for value in vars(current).values():
            if hasattr(value, "to_dict") and hasattr(value, "model_type"):
                stack.append(value)
