"""Record what dtypes a model really uses, per module and per forward call.

Three questions are easy to confuse when checking FP32-keep parameters under FSDP2, and
:class:`DtypeProbe` answers each one separately:

1. **Activation boundary** (:class:`BoundaryRecord`): the dtypes of the floating tensors a module's
   ``forward`` receives and the dtypes its caller receives back.
2. **Materialised parameters** (:class:`MaterializedParamRecord`): the dtype and shape of each of
   the module's own parameters as they are while ``forward`` runs, i.e. what FSDP2 all-gathered
   (``param_dtype``), not the sharded storage.
3. **Operators** (:class:`OpRecord`): the aten operators executed while the module is the
   innermost probed module on the stack, with the dtypes of their floating inputs and results.

and optionally a fourth, 4. **gradients** (:class:`GradRecord`): the dtype of the gradient autograd
computes for each materialised parameter.

They differ in practice, which is the point: an "Inkling-style" module that stores an FP32 weight,
receives a bf16 activation, upcasts it, computes in FP32 and casts back has a bf16 boundary, FP32
parameters and FP32 operators. Reading ``module.weight.dtype`` (observation 2) says nothing about
the activation boundary (1) or about the dtype an operator ran in (3); the first version of
verl PR 7165 went wrong exactly there: a weight-dtype hook, taken as evidence of the compute
dtype, could not see that ``param_dtype=torch.float32`` turned the unit's bf16 boundary FP32.

Where each observation is taken, and why
----------------------------------------
``torch.nn.Module.__call__`` runs, in order: global forward pre-hooks, the module's forward
pre-hooks, ``forward``, global forward hooks, the module's forward hooks. FSDP2 registers its
pre-forward hook (unshard + ``cast_forward_inputs``) with ``prepend=True`` and its post-forward
hook (reshard + ``output_dtype`` cast) with ``prepend=False``
(``torch/distributed/fsdp/_fully_shard/_fsdp_state.py``, ``FSDPState.init``).

* Inputs and materialised parameters are read in a forward pre-hook the probe registers without
  ``prepend``. FSDP2's prepended hook therefore runs first whether ``fully_shard`` was applied
  before or after the probe attached, so the probe sees the inputs after FSDP2's cast (what
  ``forward`` receives) and the parameters after the all-gather (unsharded, in ``param_dtype``).
  A non-FSDP pre-hook that rewrites inputs and is registered after the probe, without
  ``prepend``, runs after the probe and is not seen; attach the probe last in that case.
* Outputs are read in a forward hook (``always_call=True``) that the probe moves to the end of
  the module's forward hooks at every call, from its pre-hook (by removing and registering it
  again, with public API only). It runs after FSDP2's post-forward hook in both attach orders, so
  it sees the output after FSDP2's ``output_dtype`` cast, i.e. what the caller receives.
* Operators are recorded by a ``TorchDispatchMode`` entered when the outermost probed module is
  called and left when it returns. The module stack that attributes each operator is kept by the
  same hooks, plus a global forward pre-hook and a global forward hook (both always run before any
  module-level hook). This splits each call in two phases: ``"forward"`` (inside ``forward``
  proper) and ``"hooks"`` (inside the module's other forward pre/post-hooks, e.g. FSDP2's
  all-gather and its input and output casts). Operators of a child unit's FSDP2 hooks are thus
  attributed to that child's ``"hooks"`` phase rather than to the parent's forward.
* Autocast runs above Python dispatch, so the operators seen are those after autocast has
  rewritten them: under ``torch.autocast(dtype=torch.bfloat16)`` an ``nn.Linear`` with an FP32
  weight shows ``_to_copy`` operators and then an ``addmm``/``mm`` on bf16 tensors. That is the
  dtype the operator ran in, which is what observation 3 is for.
* Gradients (optional) come from ``Tensor.register_hook`` on each materialised parameter (for
  FSDP2 the unsharded parameter), i.e. the gradient dtype autograd computes before FSDP2 reduces
  it; ``.grad`` on the sharded parameter (``reduce_dtype``/storage dtype) is not this.

The probe never changes numerics: every hook returns ``None``, the dispatch mode only calls the
operator it intercepts, and nothing it does is visible to autograd.

Calls are counted per module from 0. Activation-checkpoint recomputation during backward is a
forward call too and gets the next index (non-reentrant checkpointing stops a recomputation
early by raising, which shows as ``completed=False``). A forward that raises is recorded with
``completed=False`` and no outputs.

Cost and limits: while attached, the probe's two global hooks put every module call in the
process on ``Module.__call__``'s hook path, and the dispatch mode makes every operator inside a
probed module pass through Python; fine for tests, not for benchmarks. Call stacks are kept per
thread. A module shared under two names is probed under its first name in ``named_modules()``.
Containers walked for tensors are mappings (including Hugging Face ``ModelOutput``), lists,
tuples, named tuples and dataclasses; other objects (e.g. a KV cache) are opaque. A deep copy of
a probed model carries inert copies of the hooks: the probe records only the modules it selected.

Layout
------
:mod:`.records` (record types, dtype names), :mod:`.leaves` (finding floating tensors),
:mod:`.recorder` (module selection, call frames, the dispatch mode), :mod:`.dtype_probe`
(:class:`DtypeProbe`: lifecycle and hooks), :mod:`.queries` (its queries and reports),
:mod:`.compare` (:func:`diff_boundaries`) and :mod:`.render` (text tables).
"""

from pytest_fp32keep.contract.probe.compare import diff_boundaries
from pytest_fp32keep.contract.probe.dtype_probe import DtypeProbe
from pytest_fp32keep.contract.probe.recorder import ModuleSelector
from pytest_fp32keep.contract.probe.records import (
    BoundaryDtypes,
    BoundaryMismatch,
    BoundaryRecord,
    GradRecord,
    MaterializedParamRecord,
    OpDtypes,
    OpRecord,
    Phase,
    TensorLeaf,
    dtype_name,
)
from pytest_fp32keep.contract.probe.render import format_mismatches

__all__ = [
    "BoundaryDtypes",
    "BoundaryMismatch",
    "BoundaryRecord",
    "DtypeProbe",
    "GradRecord",
    "MaterializedParamRecord",
    "ModuleSelector",
    "OpDtypes",
    "OpRecord",
    "Phase",
    "TensorLeaf",
    "diff_boundaries",
    "dtype_name",
    "format_mismatches",
]
