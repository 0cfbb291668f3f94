"""Families whose layout FSDP2 cannot hold: the refusal each must get, and why, from its code.

``fp32keep.apply_fsdp2`` refuses a kept parameter owned directly by a module that also owns
parameters the plan does not keep (``[mixed-unit]``): FSDP2 puts a module's own parameters in
one unit, all-gathered in one dtype, so the kept one would be cast with the others. Where a
family's modeling code reads such a pair in one forward, the refusal is the correct fail-closed
outcome; it is written here, as the curated zoo writes Rwkv's (``zoo/models.py``), so that
``fp32keep check --all-families`` passes it, and only it: a refusal with another reason tag, or
naming tensors the patterns do not match, or missing one a pattern names, fails
(:meth:`pytest_fp32keep.check.zoo.ZooEntry.refusal_mismatch`).

Each ``why`` cites the module class, its kept parameters and the non-kept ones it owns beside
them, read in the modeling code of the releases of ``versions``. A family with a curated zoo
entry (:func:`.entries.curated_entry`) takes that entry's expectations instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

from pytest_fp32keep.check.zoo.entry import KeepExpectation

#: Where these expectations are written, as a report names it.
WRITTEN_IN = "pytest_fp32keep/check/families/refusals.py"
_BOTH = (torch.float16, torch.bfloat16)  # their lists are strict: kept under fp16 and bf16
#: 5.24.0 and 5.25.0 were read (the module classes and the keep lists are the same in both);
#: 4.56 and 5.10 have none of these families.
_SINCE_5_24 = ">=5.24"

REFUSALS: Mapping[str, tuple[KeepExpectation, ...]] = MappingProxyType(
    {
        "glm5_next": (
            KeepExpectation(
                _SINCE_5_24,
                _BOTH,
                None,
                "mixed-unit",
                refused=(r"model\.language_model\.layers\.\d+\.(attn|ffn)_hc\.(base|scale)",),
                why="Glm5NextTextHyperConnection (attn_hc, ffn_hc) owns base and scale, kept "
                "('attn_hc.base', 'attn_hc.scale', ...), beside fn, not kept; its forward reads "
                "all three: F.linear(flattened, fn) then `w * scale + base`.",
            ),
        ),
        "kimi_linear": (
            KeepExpectation(
                _SINCE_5_24,
                _BOTH,
                None,
                "mixed-unit",
                refused=(r"model\.layers\.\d+\.self_attn\.forget_gate\.dt_bias",),
                why="KimiLinearForgetGate owns dt_bias, kept ('dt_bias'), beside A_log, not kept "
                "(the list has no 'A_log', unlike Glm5Next's); its forward adds dt_bias to its "
                "f_b_proj(f_a_proj(x)) and scales the softplus by exp(A_log).",
            ),
        ),
        "inkling": (
            KeepExpectation(
                _SINCE_5_24,
                _BOTH,
                None,
                "mixed-unit",
                refused=(r"model\.language_model\.layers\.\d+\.mlp\.gate\.global_scale",),
                why="InklingTopkRouter (mlp.gate) owns global_scale, kept ('gate.global_scale'), "
                "beside the router weight, not kept (the list has no 'gate.weight'); its forward "
                "computes F.linear(x, weight) and multiplies the top-k weights by global_scale.",
            ),
        ),
    }
)
