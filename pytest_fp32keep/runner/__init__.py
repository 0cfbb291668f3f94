"""The runner: pytest tests whose body runs in N ``torchrun`` ranks, kept alive across tests.

It owns the ``fsdp2`` marker and the ``--fsdp-*`` options (:mod:`.options`; a marker's list of
world sizes is expanded by :mod:`.world_sizes`), the controller in
the pytest process that groups and dispatches marked tests (:mod:`.controller`, one test in
flight at a time in :mod:`.flight`), the torchrun processes (:mod:`.processes` spawns and kills
them; :mod:`.launcher` connects a group of ranks to the controller), the wire protocol
(:mod:`.protocol`), the pytest session inside each rank (:mod:`.rank_session`,
:mod:`.rank_context`), the merging of the ranks' reports (:mod:`.reports`), the CUDA device count
(:mod:`.devices`) and the rank fixtures (:mod:`.fixtures`).

It knows nothing of FP32, Hugging Face or the contract: it may import pytest, the standard
library and (inside the ranks) torch, never :mod:`fp32keep`, :mod:`pytest_fp32keep.contract` or
:mod:`pytest_fp32keep.check`. This ``__init__`` imports nothing, so that loading the plugin
stays cheap.
"""
