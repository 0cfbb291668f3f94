"""Keep Hugging Face FP32-keep parameters in FP32 under PyTorch FSDP2.

Data flows one way: declarations → :func:`resolve_keep_plan` (pure) → :func:`keep_aware_cast`
→ :func:`apply_fsdp2` (validates the whole layout, then shards; laid out from one observed
forward on ``example_inputs=``, or from what :func:`observe_parameter_use` saw)
→ :func:`load_full_state_dict`.

Every error the library raises derives from :class:`Fp32KeepError` (and from the built-in
exception it has always been: ``ValueError``, ``TypeError``, ...). The lower-level names at the
end of ``__all__`` (:func:`plan_divergence`, :func:`methods_to_gather`,
:func:`register_gathered_methods`, :class:`UnitMembers`) are what a framework that shards its
own units needs to gather them as :func:`apply_fsdp2` does (the contract's control uses them).
"""

from fp32keep.cast import keep_aware_cast, upcast_to_fp32_master
from fp32keep.errors import (
    Fp32KeepError,
    Fp32KeepNotImplementedError,
    Fp32KeepRuntimeError,
    Fp32KeepTypeError,
    Fp32KeepValueError,
    KeepDeclarationError,
    KeepLayoutError,
    KeepPlanError,
    LayoutProblem,
    SourceFallbackWarning,
    StateDictError,
)
from fp32keep.layout.planning import plan_layout
from fp32keep.layout.targets import WrapSpec
from fp32keep.layout.units import Layout, Unit
from fp32keep.load.loader import LoadResult, gather_full_state_dict, load_full_state_dict
from fp32keep.plan.constructed import plan_divergence
from fp32keep.plan.keep_plan import KeepMatch, KeepPlan, resolve_keep_plan
from fp32keep.shard.apply import apply_fsdp2, infer_low_precision_dtype, sharded_layout
from fp32keep.shard.gathered import methods_to_gather, register_gathered_methods
from fp32keep.shard.keep_policy import keep_policy, policy_blocker
from fp32keep.uses.observe import ParameterUse, UnitMembers, observe_parameter_use

__all__ = [
    "Fp32KeepError",
    "Fp32KeepNotImplementedError",
    "Fp32KeepRuntimeError",
    "Fp32KeepTypeError",
    "Fp32KeepValueError",
    "KeepDeclarationError",
    "KeepLayoutError",
    "KeepMatch",
    "KeepPlan",
    "KeepPlanError",
    "Layout",
    "LayoutProblem",
    "LoadResult",
    "ParameterUse",
    "SourceFallbackWarning",
    "StateDictError",
    "Unit",
    "UnitMembers",
    "WrapSpec",
    "apply_fsdp2",
    "gather_full_state_dict",
    "infer_low_precision_dtype",
    "keep_aware_cast",
    "keep_policy",
    "load_full_state_dict",
    "methods_to_gather",
    "observe_parameter_use",
    "plan_divergence",
    "plan_layout",
    "policy_blocker",
    "register_gathered_methods",
    "resolve_keep_plan",
    "sharded_layout",
    "upcast_to_fp32_master",
]
__version__ = "0.1.0"
