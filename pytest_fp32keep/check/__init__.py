"""``fp32keep check``: the contract on the built-in zoo or a user's models, from the shell.

It owns the command line (:mod:`.cli`), the targets it checks (:mod:`.targets`: zoo names or a
user's ``module:factory``), the curated zoo of real Transformers models built from tiny configs
(:mod:`.zoo`), the program each rank runs (:mod:`.ranks`, its stdout filtered by
:mod:`.rank_output`) and the rendering of the results (:mod:`.render`).

It is built on both other rooms: it starts and stops its ranks with
:mod:`pytest_fp32keep.runner.processes` and runs :mod:`pytest_fp32keep.contract` in them.
Nothing else in the package imports it.
"""
