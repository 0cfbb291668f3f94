"""Per-family values that the automatic shrinking (:mod:`.shrink`) and discovery cannot derive.

:data:`OVERRIDES`: ``family -> {field: value}``; a nested mapping under a sub-config's key (for
example ``"text_config"``) applies to that sub-config. Keep this table small: a field that
several families share belongs in :data:`.shrink.TINY`. Every entry says why it is needed.

:data:`DEFAULT_SUB_CONFIGS`: the sub-configs a config class cannot default itself.
:data:`SAME_LAYOUT_AS`: families that are a copy of a curated zoo entry's model.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

OVERRIDES: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        # Its default config has no routed experts (a dense model); the keep list is the
        # router's e_score_correction_bias, which exists only with experts.
        "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
        # Its validator wants the sliding-window layers' head_dim to be the MLA layers'
        # qk_nope_head_dim + qk_rope_head_dim (8 + 8), a relation of this family only.
        "dots3_note": {"text_config": {"head_dim": 16}},
        # Its text config has no M-RoPE sections: the modeling code's default [22, 22, 20]
        # splits a rotary half of 64; with head_dim 8 they must sum to 4 (HEAD_DIM // 2), and
        # its 3-D recomposition interleaves h with w, so those two sections are equal.
        "ernie4_5_vl_moe": {
            "text_config": {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "mrope_section": [1, 1, 2],
                }
            }
        },
        # 5.25: its indexer layers (index_layers, [4, 14, 19, 29] by default) and the layer
        # whose K/V each layer reads (kv_source_layers) are layer indices its __post_init__
        # derives from layer_types when unset; the defaults name layers the cut drops (its
        # validator: "`index_layers` must be increasing indexed-attention layers"). Unset, they
        # are derived from the cut layer_types ([sliding, indexed]: indexer 1, each layer its
        # own K/V). Its validator also wants a head_dim that is a multiple of 16 (NVFP4 rounding
        # of keys and values) and at most heads / kv heads (4 / 2) indexer heads (12 by default).
        # Its first two layers are dense (mlp_only_layers [0, 1]): only the first stays so, so
        # that the second has the MoE router whose e_score_correction_bias is its keep list.
        "kolibri1_1": {
            "index_layers": None,
            "kv_source_layers": None,
            "head_dim": 16,
            "index_num_heads": 2,
            "mlp_only_layers": [0],
        },
        # Its image and audio tokenizers' codes are vocabulary ranges: image codes start at
        # image_token_offset and end where audio codes start (audio_token_offset), and those
        # end inside the vocabulary (its validator). With 16-entry codebooks (shrink.TINY) in
        # the tiny vocabulary: two ranges of 16, below the placeholders at the top.
        "apertus1p5": {"image_token_offset": 64, "audio_token_offset": 80},
        # Its head decodes max_text_length + 1 steps one by one (500 by default: a minute
        # per forward on CPU); its neck's output_channels feed post_conv_in_channels, two
        # fields whose names other configs use for other things, so set together here.
        "slanext": {
            "max_text_length": 4,
            "post_conv_in_channels": 32,
            "post_conv_out_channels": 32,
            "vision_config": {"output_channels": 32},
        },
        # The whole OCR model's SAM encoder: its neck width (output_channels, 256) and its
        # downsampling convs' channels (a list, [512, 896], whose last entry is the vision
        # encoder's default width) are not size fields elsewhere: 6 M parameters unshrunk, so
        # only the text model was checked. Set together here.
        **{
            family: {
                "vision_config": {
                    "sam_config": {"output_channels": 32, "downsample_channels": [32, 32]}
                }
            }
            for family in ("deepseek_ocr2", "unlimited_ocr")
        },
        # The model code's default M-RoPE sections [8, 12, 12] split a rotary half of 64; with
        # head_dim 8 the whole head rotates and the sections must sum to 4.
        "glm4v_moe": {
            "text_config": {
                "partial_rotary_factor": 1.0,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 1.0,
                    "mrope_section": [2, 1, 1],
                },
            }
        },
    }
)

#: Config class name -> ``{field: model_type}``: sub-configs the class requires but does not
#: default in some release, so that its "default config" (:func:`.shrink.default_config`, which
#: both discovery and shrinking start from) is the same in every release. 5.10's
#: ``MusicgenConfig()`` raises without its three sub-configs; 5.25 defaults them to T5, Encodec
#: and its own decoder, the types written here.
DEFAULT_SUB_CONFIGS: Mapping[str, Mapping[str, str]] = MappingProxyType(
    {
        "MusicgenConfig": {
            "text_encoder": "t5",
            "audio_encoder": "encodec",
            "decoder": "musicgen_decoder",
        },
        "MusicgenMelodyConfig": {
            "text_encoder": "t5",
            "audio_encoder": "encodec",
            "decoder": "musicgen_melody_decoder",
        },
    }
)

#: Family -> curated zoo entry (:data:`pytest_fp32keep.check.zoo.ZOO`) whose model it copies:
#: Transformers generates the family's modeling file from that entry's classes (its
#: ``modular_*.py``), so the same tensors sit in the same modules and the entry's written
#: expectations (which dtypes ``apply_fsdp2`` must refuse, and why) are the family's too.
#: A family whose class *is* a zoo entry's class needs no line here
#: (:func:`.entries.curated_entry`).
SAME_LAYOUT_AS: Mapping[str, str] = MappingProxyType(
    {
        # InstructBlipVideo: InstructBlip with video frames; root-owned query_tokens, T5's wo
        "instructblipvideo": "instructblip",
    }
)
