"""The package map holds: each room imports only what its docstring allows, no module is huge.

Read with ``ast`` only (nothing is imported), so a violation is reported with the module and the
import line that breaks the rule.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "pytest_fp32keep"
LIBRARY = ROOT / "impl" / "fp32keep"
MAX_MODULE_LINES = 800
"""A smell, not the rule: a module this long has most likely grown a second concern. The rule is
one concern per module, each named by its docstring and, in the library, by the map in
docs/architecture.md."""
MAX_FUNCTION_LINES = 100
"""Code lines of one function or method (its docstring left out): longer ones get named steps."""


def _module_name(path: Path) -> str:
    base = ROOT / "impl" if path.is_relative_to(LIBRARY) else ROOT
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` for every absolute import in ``path``, lazy ones included."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            # ``from pytest_fp32keep.runner import options`` imports the submodule too
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


#: Git-ignored scratch inside a scanned folder, never the project's sources: bench/out holds
#: what the benchmarks write, bench_check.py's extract of the pre-issue-22 tree among it
#: (tests/test_packaging.py leaves the same folder out of the distributions).
SCRATCH = ("bench/out",)


def _modules(folder: Path) -> list[Path]:
    return sorted(
        path
        for path in folder.rglob("*.py")
        if not any(path.is_relative_to(ROOT / scratch) for scratch in SCRATCH)
    )


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


#: room -> packages it must never import
FORBIDDEN = {
    "fp32keep": ("pytest_fp32keep",),
    "pytest_fp32keep.runner": ("fp32keep", "pytest_fp32keep.contract", "pytest_fp32keep.check"),
    "pytest_fp32keep.contract": ("pytest_fp32keep.runner", "pytest_fp32keep.check"),
}


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_room_imports_only_what_it_may(room: str) -> None:
    folder = LIBRARY if room == "fp32keep" else ROOT.joinpath(*room.split("."))
    offences = [
        f"{_module_name(path)}:{line} imports {imported}"
        for path in _modules(folder)
        for line, imported in _imports(path)
        if any(_within(imported, banned) for banned in FORBIDDEN[room])
    ]
    assert offences == [], f"{room} must not import {FORBIDDEN[room]}:\n" + "\n".join(offences)


def test_only_the_check_tool_and_the_plugin_glue_import_the_check_tool() -> None:
    offences = [
        f"{_module_name(path)}:{line} imports {imported}"
        for path in _modules(PLUGIN)
        if not _within(_module_name(path), "pytest_fp32keep.check")
        for line, imported in _imports(path)
        if _within(imported, "pytest_fp32keep.check")
    ]
    assert offences == []


#: What starting or killing rank processes takes: the launcher, a long-lived child, a group kill.
RANK_PROCESS_MARKS = ("torch.distributed.run", "Popen", "killpg")


def test_one_place_starts_and_kills_rank_processes() -> None:
    """Only :mod:`pytest_fp32keep.runner.processes` launches torchrun or kills process groups
    (``runner.devices`` runs one bounded ``subprocess.run`` probe, not ranks)."""
    owners = sorted(
        _module_name(path)
        for path in _modules(PLUGIN)
        if any(mark in path.read_text(encoding="utf-8") for mark in RANK_PROCESS_MARKS)
    )
    assert owners == ["pytest_fp32keep.runner.processes"]


def test_rooms_say_what_they_own() -> None:
    for room in ("runner", "contract", "check"):
        docstring = ast.get_docstring(ast.parse((PLUGIN / room / "__init__.py").read_text()))
        assert docstring, f"pytest_fp32keep/{room}/__init__.py needs a docstring"
        assert "import" in docstring, f"the {room} docstring must say what it may import"


@pytest.mark.parametrize("folder", [PLUGIN, LIBRARY], ids=["pytest_fp32keep", "fp32keep"])
def test_no_module_over_the_limit(folder: Path) -> None:
    too_long = {
        _module_name(path): lines
        for path in _modules(folder)
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert too_long == {}, f"split these modules (limit {MAX_MODULE_LINES} lines): {too_long}"


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """``{name: code lines}`` of every function in ``source`` longer than ``limit`` lines, its
    docstring not counted (nested functions count inside their parent too)."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0]
            docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            start = first.end_lineno + 1 if docstring and first.end_lineno else first.lineno
            lines = (node.end_lineno or start) - start + 1
            if lines > limit:
                found[node.name] = lines
    return found


@pytest.mark.parametrize("folder", [PLUGIN, LIBRARY], ids=["pytest_fp32keep", "fp32keep"])
def test_no_function_over_the_limit(folder: Path) -> None:
    too_long = {
        f"{_module_name(path)}.{name}": lines
        for path in _modules(folder)
        for name, lines in long_functions(path.read_text(encoding="utf-8")).items()
    }
    assert too_long == {}, f"split into named steps (limit {MAX_FUNCTION_LINES}): {too_long}"


def test_the_function_rule_catches_a_long_one() -> None:
    """Negative control: a docstring does not count, the code does."""
    body = "".join(f"    x{i} = {i}\n" for i in range(4))
    assert long_functions(f'def f():\n    """Doc\n\n    more."""\n{body}', limit=4) == {}
    assert long_functions(f"def f():\n    y = 0\n{body}", limit=4) == {"f": 5}


def _library_map() -> set[str]:
    """The modules the library section of docs/architecture.md names (``layout/kept.py``)."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## `fp32keep/` — the library", 1)[1].split("\n## ", 1)[0]
    return {
        name
        for row in section.splitlines()
        if row.startswith("| `")
        for name in re.findall(r"`([a-z_/]+\.py)`", row.split(" | ")[0])
    }


def test_the_library_map_names_every_module() -> None:
    """docs/architecture.md's library map has one row per module, and no row for a module that
    is gone (a package's ``__init__`` is described by its own docstring)."""
    modules = {
        str(path.relative_to(LIBRARY))
        for path in _modules(LIBRARY)
        if path.name != "__init__.py" or path.parent == LIBRARY
    }
    named = _library_map()
    assert len(named) > 20, named  # the real section, read
    assert modules - named == set(), "add these to the map in docs/architecture.md"
    assert named - modules == set(), "these rows of docs/architecture.md name no module"


def test_the_rule_catches_a_violation(tmp_path: Path) -> None:
    """Negative control: the import reader sees lazy and ``from`` imports alike."""
    module = tmp_path / "bad.py"
    module.write_text(
        "def f():\n    from pytest_fp32keep.contract import probe\n"
        "    import fp32keep.plan.keep_plan\n"
    )
    imported = {name for _, name in _imports(module)}
    assert "pytest_fp32keep.contract.probe" in imported
    assert "fp32keep.plan.keep_plan" in imported
    assert any(_within(name, "fp32keep") for name in imported)


def _import_graph(paths: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``paths`` it imports (anywhere in it: lazy and typing-only
    imports count, since each hides the same circle). A module's own packages are left out:
    ``from fp32keep import fsdp_hooks`` inside ``fp32keep`` imports the submodule, and a package
    importing its own submodules is the map's normal direction."""
    return {
        name: {
            imported
            for _, imported in _imports(path)
            if imported in paths and imported != name and not _within(name, imported)
        }
        for name, path in paths.items()
    }


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import one another in a circle (strongly connected
    components of more than one module, Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while (top := stack.pop()) != module:
                component.append(top)
            if component:
                circles.append(sorted([module, *component]))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_no_import_circle() -> None:
    """No module of fp32keep or pytest_fp32keep reaches itself through imports: each module
    can be read after the ones it imports, and a split never hides a circle behind
    ``TYPE_CHECKING`` or a lazy import."""
    paths = {_module_name(path): path for folder in (PLUGIN, LIBRARY) for path in _modules(folder)}
    assert import_circles(_import_graph(paths)) == []


def test_the_circle_rule_catches_a_circle() -> None:
    """Negative control: a three-module circle and a typing-only pair are both found."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}}
    assert import_circles(graph) == [["a", "b", "c"], ["e", "f"]]


@pytest.mark.parametrize("folder", [PLUGIN, LIBRARY], ids=["pytest_fp32keep", "fp32keep"])
def test_no_module_is_shadowed_by_a_package(folder: Path) -> None:
    """``x.py`` beside ``x/`` is dead code that a wheel would still ship (found after a move)."""
    shadowed = [
        str(path) for path in _modules(folder) if (path.with_suffix("") / "__init__.py").exists()
    ]
    assert shadowed == []


#: FSDP2's private state, as attributes read off it; ``contract/fsdp_state.py`` (the plugin) and
#: ``fsdp_hooks.py`` (the library, which may not import the plugin) are the modules that may read
#: them (each names what it reads and the torch releases it was verified on).
FSDP2_PRIVATE_ATTRIBUTES = frozenset(
    {
        "_fsdp_param_group",
        "_fsdp_param_groups",
        "_get_fsdp_state",
        "_lazy_init",
        "_module_info",
        "_mp_policy",
        "_post_forward",
        "_pre_forward",
        "fsdp_params",
        "mp_policy",
        "post_forward_mesh_info",
    }
)
FSDP2_PRIVATE_MODULES = ("torch.distributed.fsdp._", "torch.distributed._composable")
FSDP2_STATE_READERS = {
    "pytest_fp32keep/contract/fsdp_state.py": "the shim itself",
    "impl/fp32keep/_torch/fsdp_hooks.py": "the library's shim: a unit's forward hooks",
    # builds a unit with two param groups (ShardPlacementResult is exported only privately) and
    # fakes FSDP2's state to test the shim's errors
    "tests/contract/test_fsdp_state.py": "the shim's own tests",
}
SCANNED = ("impl", "pytest_fp32keep", "tests", "bench", "examples", "ci", "noxfile.py")


def _fsdp2_private_reads(path: Path) -> list[str]:
    """``line: what`` for every read of FSDP2's private state in ``path``."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute):
            if node.attr in FSDP2_PRIVATE_ATTRIBUTES:
                found.append(f"{node.lineno}: .{node.attr}")
            elif (
                node.attr == "state"
                and isinstance(node.value, ast.Name)
                and node.value.id == "fully_shard"
            ):
                found.append(f"{node.lineno}: fully_shard.state")
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith(FSDP2_PRIVATE_MODULES)
        ):
            found.append(f"{node.lineno}: from {node.module} import")
    return found


def test_fsdp2_private_state_is_read_in_one_place() -> None:
    paths = [
        path
        for name in SCANNED
        for path in ([ROOT / name] if name.endswith(".py") else _modules(ROOT / name))
    ]
    offences = {
        relative: reads
        for path in paths
        if (relative := str(path.relative_to(ROOT))) not in FSDP2_STATE_READERS
        and (reads := _fsdp2_private_reads(path))
    }
    assert offences == {}, (
        "read FSDP2's private state through pytest_fp32keep/contract/fsdp_state.py (the "
        "library: impl/fp32keep/_torch/fsdp_hooks.py), or use FSDPModule's public methods: "
        f"{offences}"
    )


def test_the_private_state_rule_catches_a_read(tmp_path: Path) -> None:
    """Negative control: the reads the control used to make are all seen."""
    module = tmp_path / "bad.py"
    module.write_text(
        "from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam\n"
        "group = fully_shard.state(module)._fsdp_param_group\n"
        "info = group.fsdp_params[0]._module_info\n"
    )
    reads = _fsdp2_private_reads(module)
    assert {read.split(": ")[1] for read in reads} == {
        "from torch.distributed.fsdp._fully_shard._fsdp_param import",
        "fully_shard.state",
        "._fsdp_param_group",
        ".fsdp_params",
        "._module_info",
    }


#: torch's other privates, by concern, as attributes read off any object (or named to getattr):
#: each concern's shims name what they read (``PRIVATE_READS``) and the torch releases verified
#: (``VERIFIED_TORCH``). The library and the runner may not import the plugin's shims, nor the
#: contract the library's unexported ones, so a concern may have one shim per room.
TORCH_PRIVATE_ATTRIBUTES = {
    "nn.Module internals": frozenset(
        {
            "_apply",
            "_backward_hooks",
            "_buffers",
            "_call_impl",
            "_forward_hooks",
            "_forward_pre_hooks",
            "_load_state_dict_pre_hooks",
            "_modules",
            "_non_persistent_buffers_set",
            "_parameters",
            "_state_dict_hooks",
        }
    ),
    "dispatch and autograd internals": frozenset(
        {"_current_graph_task_id", "_get_current_dispatch_mode", "_python_dispatch", "_version"}
    ),
    "c10d Flight Recorder": frozenset(
        {"_distributed_c10d", "_dump_fr_trace_json", "_dump_nccl_trace_json"}
    ),
    "process-group registry": frozenset(
        {
            "_get_default_group",
            "_get_default_store",
            "_get_process_group_name",
            "_pg_map",
            "_pg_names",
            "_world",
        }
    ),
}
#: The project's own attributes that share a name with one of torch's (``self._world`` in
#: ``runner/spmd.py``): read off ``self``, they are not torch's.
OWN_ATTRIBUTES = frozenset({"_world"})
TORCH_PRIVATE_SHIMS = {
    "impl/fp32keep/_torch/modules.py": "nn.Module internals",
    "impl/fp32keep/_torch/dispatch.py": "dispatch and autograd internals",
    "pytest_fp32keep/contract/torch_dispatch.py": "dispatch and autograd internals",
    "pytest_fp32keep/runner/c10d_recorder.py": "c10d Flight Recorder",
    "pytest_fp32keep/runner/c10d_groups.py": "process-group registry",
}
#: Where a read of torch's privates would ship: the packages and the examples users copy.
SHIPPED = ("impl", "pytest_fp32keep", "examples")
_ACCESSORS = frozenset({"getattr", "hasattr", "setattr", "delattr"})


def _private_torch_module(module: str) -> bool:
    """A torch module under a private name, other than FSDP2's (the FSDP2 rule owns those)."""
    parts = module.split(".")
    return (
        parts[0] == "torch"
        and any(part.startswith("_") for part in parts)
        and not module.startswith(FSDP2_PRIVATE_MODULES)
    )


def _torch_private_reads(path: Path) -> list[str]:
    """``line: what`` for every read of torch's privates (other than FSDP2's) in ``path``."""
    names = frozenset().union(*TORCH_PRIVATE_ATTRIBUTES.values())
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute):
            on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if node.attr in names and not (on_self and node.attr in OWN_ATTRIBUTES):
                found.append(f"{node.lineno}: .{node.attr}")
            elif (
                isinstance(node.value, ast.Name)
                and node.value.id == "torch"
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{node.lineno}: torch.{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            named = node.args[1] if node.func.id in _ACCESSORS and len(node.args) > 1 else None
            if isinstance(named, ast.Constant) and named.value in names:
                found.append(f"{node.lineno}: {node.func.id}(..., {named.value!r})")
        elif isinstance(node, ast.Import):
            found += [
                f"{node.lineno}: import {alias.name}"
                for alias in node.names
                if _private_torch_module(alias.name)
            ]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            private_names = [
                a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")
            ]
            if _private_torch_module(node.module) or (
                node.module.split(".")[0] == "torch" and private_names
            ):
                found.append(f"{node.lineno}: from {node.module} import")
    return found


def test_torch_privates_are_read_only_in_their_shims() -> None:
    paths = [path for name in SHIPPED for path in _modules(ROOT / name)]
    offences = {
        relative: reads
        for path in paths
        if (relative := str(path.relative_to(ROOT))) not in TORCH_PRIVATE_SHIMS
        and (reads := _torch_private_reads(path))
    }
    assert offences == {}, (
        "read torch's privates through the shim of their concern (tests/test_architecture.py "
        f"TORCH_PRIVATE_SHIMS), or use a public API: {offences}"
    )


@pytest.mark.parametrize("shim", sorted(TORCH_PRIVATE_SHIMS))
def test_each_torch_shim_lists_its_reads_and_the_torch_it_was_verified_on(shim: str) -> None:
    """A shim names what it reads and the releases verified (read, not imported: the values are
    tested on the installed torch by each shim's own tests), and reads its concern."""
    tree = ast.parse((ROOT / shim).read_text(encoding="utf-8"))
    assigned = {
        target.id
        for node in tree.body
        if isinstance(node, ast.AnnAssign | ast.Assign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name)
    }
    assert {"PRIVATE_READS", "VERIFIED_TORCH"} <= assigned, shim
    concern = TORCH_PRIVATE_ATTRIBUTES[TORCH_PRIVATE_SHIMS[shim]]
    source = (ROOT / shim).read_text(encoding="utf-8")
    assert any(name in source for name in concern), f"{shim} reads nothing of its concern"


def test_the_torch_privates_rule_catches_a_read(tmp_path: Path) -> None:
    """Negative control: every way the modules read torch's privates before their shims is
    seen, and the project's own ``self._world`` is not."""
    module = tmp_path / "bad.py"
    module.write_text(
        "from torch.utils._python_dispatch import TorchDispatchMode\n"
        "import torch.utils._python_dispatch\n"
        "from torch.distributed.distributed_c10d import _world\n"
        "task = getattr(torch._C, '_current_graph_task_id', None)\n"
        "c10d = torch._C._distributed_c10d\n"
        "names = dist.distributed_c10d._world.pg_names\n"
        "params = module._parameters.items()\n"
        "keep = name in module._non_persistent_buffers_set\n"
        "model._apply(fn)\n"
        "version = tensor._version\n"
        "code = nn.Module._call_impl.__code__\n"
        "own = self._world.rank\n"
    )
    reads = _torch_private_reads(module)
    assert {read.split(": ")[1] for read in reads} == {
        "from torch.utils._python_dispatch import",
        "import torch.utils._python_dispatch",
        "from torch.distributed.distributed_c10d import",
        "torch._C",
        "getattr(..., '_current_graph_task_id')",
        "._distributed_c10d",
        "._world",
        "._parameters",
        "._non_persistent_buffers_set",
        "._apply",
        "._version",
        "._call_impl",
    }
    assert not any(read.startswith("12:") for read in reads), reads  # self._world: the project's
    assert len([read for read in reads if read.endswith("torch._C")]) == 2, reads


def _exported(init: Path) -> frozenset[str]:
    """The names of the ``__all__`` list literal in ``init`` (read, not imported)."""
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
            and isinstance(node.value, ast.List | ast.Tuple)
        ):
            return frozenset(
                element.value
                for element in node.value.elts
                if isinstance(element, ast.Constant) and isinstance(element.value, str)
            )
    raise AssertionError(f"{init} has no __all__ list")


def _library_names_used(path: Path) -> list[tuple[int, str]]:
    """``(line, name)`` for every name ``path`` takes from ``fp32keep``: ``from fp32keep[.sub]
    import NAME``, ``import fp32keep.SUB`` and ``fp32keep.NAME`` after ``import fp32keep``."""
    used: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if _within(node.module, "fp32keep"):
                used += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            used += [
                (node.lineno, alias.name.split(".")[1])
                for alias in node.names
                if alias.name.startswith("fp32keep.")
            ]
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "fp32keep"
        ):
            used.append((node.lineno, node.attr))
    return used


def _unexported_uses(paths: list[Path], exported: frozenset[str]) -> list[str]:
    return [
        f"{_module_name(path) if path.is_relative_to(ROOT) else path}:{line} uses fp32keep's {name}"
        for path in paths
        for line, name in _library_names_used(path)
        if name not in exported
    ]


def test_the_plugin_uses_only_what_fp32keep_exports() -> None:
    """The plugin is the library's first client: it may use only the public API, so a name it
    needs is a name adopters can rely on too (``fp32keep.__all__``)."""
    exported = _exported(LIBRARY / "__init__.py")
    assert len(exported) >= 15, exported  # read the real list, not an empty one
    offences = _unexported_uses(_modules(PLUGIN), exported)
    assert offences == [], "export these from fp32keep, or stop using them:\n" + "\n".join(offences)


def test_the_export_rule_catches_a_private_name(tmp_path: Path) -> None:
    """Negative control: every way of reaching a name of ``fp32keep`` is read."""
    module = tmp_path / "bad.py"
    module.write_text(
        "import fp32keep\nimport fp32keep.layout.planning\n"
        "from fp32keep import KeepPlan, tensors\n"
        "from fp32keep.plan.keep_plan import check_plan_fits\n"
        "def f():\n    from fp32keep.layout.planning import WrapSpec\n"
        "    return fp32keep.apply_fsdp2, fp32keep.shard.apply.kept_unit_policy\n"
    )
    exported = frozenset({"KeepPlan", "WrapSpec", "apply_fsdp2"})
    names = {name for _, name in _library_names_used(module)}
    assert names == {"KeepPlan", "tensors", "check_plan_fits", "WrapSpec", "apply_fsdp2"} | {
        "layout",
        "shard",
    }
    offences = _unexported_uses([module], exported)
    assert sorted(offence.rsplit(" ", 1)[1] for offence in offences) == [
        "check_plan_fits",
        "layout",
        "shard",
        "tensors",
    ]
