"""Loading a full state dict into a model FSDP2 sharded, in the dtypes the model holds.

- :mod:`.loader`: :func:`fp32keep.load_full_state_dict` and :func:`fp32keep.gather_full_state_dict`,
  the steps in order (agree, validate, allocate, move);
- :mod:`.validate`: what every rank agrees on before a tensor moves;
- :mod:`.meta`: storage for a rank's meta-device tensors;
- :mod:`.move`: how the tensors travel (each rank's box of a sharded tensor; broadcast, the rest).
"""
