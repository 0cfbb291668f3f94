"""Per-family values that the automatic shrinking (:mod:`.shrink`) and discovery cannot derive.

:data:`OVERRIDES`: ``family -> {field: value}``; a nested mapping under a sub-config's key (for
example ``"text_config"``) applies to that sub-config. Keep this table small: a field that
several families share belongs in :data:`.shrink.TINY`. Every entry says why it is needed.

:data:`DEFAULT_SUB_CONFIGS`: the sub-configs a config class cannot default itself.
:data:`SAME_LAYOUT_AS`: families that are a copy of a curated zoo entry's model.
:data:`STOCHASTIC`: families whose forward is random by design, with why.
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
        # Its head decodes max_text_length + 1 steps, as SLANeXt's does (above). Its config has
        # no image_size (its PPLCNet backbone is convolutional: any size runs), so the batch
        # would have no pixels (vision.whole_image_size) and its forward no input. At 64 its
        # deepest map (stride 32: the stem and four stride-2 stages) is 2 x 2, not one pixel.
        "slanet": {"max_text_length": 4, "image_size": 64},
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
        # Its validator ties the adaptor's intermediate_size to text_config.hidden_size // 4
        # (256 for the default 1024): the shrink makes every intermediate_size 64 and every
        # hidden_size 32, so the adaptor's must be 8.
        "fun_asr_nano": {"adaptor_config": {"intermediate_size": 8}},
        # ESMFold2 (5.24+): its validators want each atom encoder's 3-D rotary embedding (3
        # spatial axes x num_spatial_rope_pairs_per_axis + num_uid_rope_pairs: 3 x 2 + 10 = 16
        # frequency pairs) within half a head (4 pairs at head_dim 8): 1 + 1 per axis and uid; and
        # single_inputs_size to be the atom encoder's output_dim (shrunk to 32) plus the
        # residue-type features (2 x num_res_types 33 + 1). Its pair widths, trunk depth and
        # refinement loops are not size fields elsewhere: 53 M parameters with only those set.
        # Its trunk drops the language model's pair states out at every loop with
        # F.dropout(..., training=True) (lm_dropout 0.25), even in eval(): random per run, so
        # nothing could be compared with the reference; 0 here, as the shrink's other dropouts.
        "esmfold2": {
            "lm_encoder": {"lm_dropout": 0.0},
            "single_inputs_size": 32 + 2 * 33 + 1,
            "pairwise_hidden_size": 32,
            "pair_transition_intermediate_size": 64,
            "folding_trunk_num_hidden_layers": 2,
            "num_loops": 1,
            "atom_encoder": {"num_spatial_rope_pairs_per_axis": 1, "num_uid_rope_pairs": 1},
            "structure_head": {
                "diffusion_module": {
                    "fourier_dim": 32,
                    "pair_intermediate_size": 64,
                    "atom_encoder": {"num_spatial_rope_pairs_per_axis": 1, "num_uid_rope_pairs": 1},
                }
            },
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

#: Family -> why its forward is random by design: it draws from the global generator on every
#: call, so no two runs of one batch agree and the contract, which compares runs with its
#: unsharded reference, cannot judge it. The command builds it and runs it once (the probe),
#: then reports it ``not runnable`` with this reason instead of a parity failure.
STOCHASTIC: Mapping[str, str] = MappingProxyType(
    {
        "esmfold2": "its forward starts the folding trunk from a random pair state "
        "(EsmFold2Model._init_pair_state: trunc_normal_ on a new tensor, every call), so two "
        "forwards of one batch differ",
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
