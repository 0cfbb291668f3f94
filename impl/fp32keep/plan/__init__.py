"""Which tensors stay FP32: the keep plan, resolved as the installed Transformers resolves it.

- :mod:`.keep_plan`: :class:`fp32keep.KeepPlan` and :func:`fp32keep.resolve_keep_plan`;
- :mod:`.compat`: what differs between Transformers versions (docs/transformers-keep-semantics.md);
- :mod:`.constructed`: tensors a model's code builds in FP32 whatever the load dtype, observed;
- :mod:`.use`: whether a plan fits where it is used (the model, the cast's dtype, the policy's).
"""
