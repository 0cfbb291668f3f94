"""One module per framework: its setups (:class:`tests.frameworks.harness.Setup`) at the pinned
versions. ``tests/frameworks/test_frameworks.py`` runs every setup of :data:`MODULES`."""
