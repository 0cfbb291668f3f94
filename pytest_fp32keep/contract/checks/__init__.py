"""The contract items, one module per family; each compares the sharded model to the reference.

* :mod:`.storage`: ``stored`` (each tensor's local shard) and ``materialized`` (what FSDP2
  all-gathers);
* :mod:`.boundary`: the modules that are kept, their activation ``boundary`` dtypes and the
  ``operators`` run inside them;
* :mod:`.parity`: logits, loss and gradients (``parity``), within the bound of
  :mod:`pytest_fp32keep.contract.parity_policy`;
* :mod:`.round_trip`: loading a low-precision full state dict and gathering it back
  (``round trip``).

Every check returns :class:`~pytest_fp32keep.contract.report.Finding` rows, passing ones included
where the contract names a tensor.
"""
