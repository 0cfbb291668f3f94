"""Per-family config values that the automatic shrinking (:mod:`.shrink`) cannot derive.

Each entry is ``family -> {field: value}``; a nested mapping under a sub-config's key (for
example ``"text_config"``) applies to that sub-config. Keep this table small: a field that
several families share belongs in :data:`.shrink.TINY`. Every entry says why it is needed.
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
