"""Sharding a model with FSDP2 so that the plan stays FP32.

- :mod:`.apply`: :func:`fp32keep.apply_fsdp2` (lays out with :mod:`fp32keep.layout`, then shards)
  and :func:`fp32keep.sharded_layout`;
- :mod:`.keep_policy`: :func:`fp32keep.keep_policy`, the policy-level keep of torch >= 2.15;
- :mod:`.gathered`: the methods other than ``forward`` a unit is gathered around.
"""
