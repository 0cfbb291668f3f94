"""pytest entry point (``pytest11``): hooks in lifecycle order, each one thin.

Loading this module imports neither torch nor the controller's dependencies beyond the
standard library and pytest: a project that installs the plugin but marks no test pays for
option parsing and one marker line. The fixtures are registered here too (they import torch
inside their bodies, in the ranks).
"""

from __future__ import annotations

import pytest

from pytest_fp32keep import options
from pytest_fp32keep.rank_context import RANK_CONTEXT_KEY

#: The fixtures live in their own module; registering it as a plugin of this one makes them
#: available wherever this plugin is loaded (the pytest process and every rank).
pytest_plugins = ["pytest_fp32keep.fixtures"]

CONTROLLER_PLUGIN_NAME = "fp32keep-controller"


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--fsdp-nproc``, ``--fsdp-backend``, ``--fsdp-timeout`` and their ini keys."""
    options.add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker, validate the settings, and (outside the ranks) the controller."""
    options.register_marker(config)
    settings = options.session_settings(config)  # raises pytest.UsageError on a bad value
    if RANK_CONTEXT_KEY in config.stash:
        return  # inside a rank: the rank session drives the tests
    from pytest_fp32keep.controller import Fsdp2Controller

    config.pluginmanager.register(Fsdp2Controller(config, settings), CONTROLLER_PLUGIN_NAME)
