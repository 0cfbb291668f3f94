"""Keep Hugging Face FP32-keep parameters in FP32 under PyTorch FSDP2.

Data flows one way: declarations → :func:`resolve_keep_plan` (pure) → :func:`keep_aware_cast`
→ :func:`apply_fsdp2` (validates the whole layout, then shards; laid out from what
:func:`observe_parameter_use` saw when given) → :func:`load_full_state_dict`.
"""

from fp32keep.cast import keep_aware_cast, upcast_to_fp32_master
from fp32keep.errors import KeepDeclarationError, KeepLayoutError, LayoutProblem, StateDictError
from fp32keep.layout import Layout, Unit, plan_layout
from fp32keep.load import LoadResult, gather_full_state_dict, load_full_state_dict
from fp32keep.observe import ParameterUse, observe_parameter_use
from fp32keep.plan import KeepMatch, KeepPlan, resolve_keep_plan
from fp32keep.wrap import apply_fsdp2, infer_low_precision_dtype

__all__ = [
    "KeepDeclarationError",
    "KeepLayoutError",
    "KeepMatch",
    "KeepPlan",
    "Layout",
    "LayoutProblem",
    "LoadResult",
    "ParameterUse",
    "StateDictError",
    "Unit",
    "apply_fsdp2",
    "gather_full_state_dict",
    "infer_low_precision_dtype",
    "keep_aware_cast",
    "load_full_state_dict",
    "observe_parameter_use",
    "plan_layout",
    "resolve_keep_plan",
    "upcast_to_fp32_master",
]
__version__ = "0.1.0"
