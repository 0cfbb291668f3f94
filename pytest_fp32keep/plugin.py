"""pytest entry point (``pytest11``)."""
