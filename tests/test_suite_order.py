"""The suite's own scheduling (tests/conftest.py): the long poles are collected first."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests.conftest import LONG_POLES, long_poles_first

ROOT = Path(__file__).resolve().parent.parent


def test_every_long_pole_is_a_module_of_the_suite() -> None:
    # A renamed or deleted module would silently drop out of the order.
    missing = [module for module in LONG_POLES if not (ROOT / module).is_file()]
    assert not missing, f"LONG_POLES names modules that do not exist: {missing}"
    assert len(set(LONG_POLES)) == len(LONG_POLES)


def test_long_poles_come_first_in_their_order_and_the_rest_keep_theirs() -> None:
    def item(module: str, name: str) -> Any:
        return SimpleNamespace(path=ROOT / module, name=name)

    short_a, short_b = "tests/test_zoo.py", "tests/core/test_cast.py"
    first, second = LONG_POLES[0], LONG_POLES[1]
    items = [
        item(short_a, "a1"),
        item(second, "s1"),
        item(short_b, "b1"),
        item(first, "f1"),
        item(short_a, "a2"),
        item(second, "s2"),
        item(first, "f2"),
    ]
    outside = SimpleNamespace(path=Path("/elsewhere/test_x.py"), name="x")
    ordered = [i.name for i in long_poles_first([*items, outside], ROOT)]
    assert ordered == ["f1", "f2", "s1", "s2", "a1", "b1", "a2", "x"]


def test_xdist_keeps_the_collection_order() -> None:
    # pytest-xdist reorders loadfile scopes by their number of tests unless told not to, and the
    # long poles (few tests, long setups) would start last: LONG_POLES would order nothing.
    import tomllib

    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    options = ini["addopts"]
    assert "--dist=loadfile" in options
    assert "--no-loadscope-reorder" in options
