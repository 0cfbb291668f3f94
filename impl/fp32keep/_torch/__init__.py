"""The torch internals the library reads, one shim per concern, each listing what it reads and the
torch versions it was verified on (``tests/test_torch_shims.py`` runs them on the torch axis):

- :mod:`.modules`: ``nn.Module`` internals;
- :mod:`.dispatch`: dispatch and autograd internals;
- :mod:`.fsdp_hooks`: FSDP2's state, a unit's forward pre- and post-hook.

Nothing else in the library reads a torch private (``tests/test_architecture.py`` checks).
"""
