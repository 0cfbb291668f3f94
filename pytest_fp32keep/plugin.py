"""pytest entry point (``pytest11``): hooks in lifecycle order, each one thin.

The glue of the package's rooms: the runner's options, marker and controller
(:mod:`pytest_fp32keep.runner`), the runner's rank fixtures and the contract's fixtures
(:mod:`pytest_fp32keep.fixtures`). Loading this module imports neither torch nor the controller:
a project that installs the plugin but collects no marked test pays for option parsing and one
marker line; the controller is imported and registered only when collection finds a marked test.
The fixtures import torch inside their bodies, in the ranks.
"""

from __future__ import annotations

import os

import pytest

from pytest_fp32keep.runner import launched, options, world_sizes
from pytest_fp32keep.runner.rank_context import RANK_CONTEXT_KEY

#: The fixtures live in their own module; registering it as a plugin of this one makes them
#: available wherever this plugin is loaded (the pytest process and every rank).
pytest_plugins = ["pytest_fp32keep.runner.fixtures", "pytest_fp32keep.fixtures"]

CONTROLLER_PLUGIN_NAME = "fp32keep-controller"
ON_DEMAND_PLUGIN_NAME = "fp32keep-controller-on-demand"


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--fsdp-nproc``, ``--fsdp-backend``, ``--fsdp-timeout``, ``--fsdp-max-nproc`` and their
    ini keys."""
    options.add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker, validate the settings, and (outside the ranks) wait for marked tests."""
    options.register_marker(config)
    settings = options.session_settings(config)  # raises pytest.UsageError on a bad value
    launcher = options.launcher_setting(config)
    if RANK_CONTEXT_KEY in config.stash:
        return  # inside a rank: the rank session drives the tests
    world = launched.detect(launcher, os.environ)
    if world is not None:
        # One process of a world torchrun or srun launched: marked tests run in place, SPMD.
        from pytest_fp32keep.runner import spmd

        spmd.register(config, settings, world)
        return
    config.pluginmanager.register(ControllerOnDemand(config, settings), ON_DEMAND_PLUGIN_NAME)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``@pytest.mark.fsdp2(nproc=[1, 2])``: one case per world size (parent and ranks alike)."""
    world_sizes.parametrize(metafunc)


class ControllerOnDemand:
    """Registers the controller once collection has found a marked test, and only then.

    The controller and what it imports (launcher, reports, protocol: about 20 ms) are the bulk of
    the plugin's start-up cost; a run without marked tests (most runs of a project that marks a
    few) never pays for them.
    """

    def __init__(self, config: pytest.Config, settings: options.SessionSettings) -> None:
        self._config = config
        self._settings = settings

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """Hand the collected items to a new controller if any of them is marked."""
        if not any(options.is_marked(item) for item in session.items):
            return
        from pytest_fp32keep.runner.controller import Fsdp2Controller

        controller = Fsdp2Controller(self._config, self._settings)
        self._config.pluginmanager.register(controller, CONTROLLER_PLUGIN_NAME)
        # Registered during this hook, it would miss the call: give it the items directly.
        controller.pytest_collection_finish(session)
