"""How a model reaches its parameters: which kept modules an ancestor reads without calling them,
which methods other than ``forward`` run a unit's parameters.

One answer type, observation first: :class:`fp32keep.ParameterUse`, what one forward of the
unsharded model used (:mod:`fp32keep.uses.observe`), agreed over the mesh (:mod:`.agree`: on
``example_inputs=`` :func:`fp32keep.apply_fsdp2` observes the forward itself). Without inputs
or an observation, one syntax-tree rule over the model's source is the fallback (:mod:`.source`),
with a :class:`fp32keep.SourceFallbackWarning` naming what it cannot see.
"""
