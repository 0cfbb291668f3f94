"""Which FSDP2 units keep the plan: decided before the first ``fully_shard``, pure (no collective).

- :mod:`.units`: the records, :class:`~.units.Unit` (one ``fully_shard`` call) and
  :class:`fp32keep.Layout`;
- :mod:`.planning`: :func:`~.planning.plan_layout`, every unit in sharding order, or a refusal;
- :mod:`.targets`: the caller's standard units (``wrap``, or ``_no_split_modules``);
- :mod:`.kept`: which modules become kept units;
- :mod:`.tied`: tied parameters whose aliases would fall in different units;
- :mod:`.reach`: parameters of fp32keep's units that code outside the unit reaches;
- :mod:`.problems`: what a refusal says, with the dtypes and the fix.
"""
