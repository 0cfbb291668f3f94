"""CI tooling for pytest-fp32keep: the version matrix (``ci/matrix.toml``) and its readers.

Not shipped in the distribution. Run the modules from the repository root, e.g.
``python -m ci.matrix github cpu`` or ``python -m ci.matrix_report render``.
"""
