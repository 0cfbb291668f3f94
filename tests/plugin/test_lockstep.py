"""Marked tests run in lock-step in ranks kept alive across tests, with pytest's machinery.

One inner session covers the ordinary behaviours (each assertion names what it checks); it
starts three groups: the shared 2-rank group, a 1-rank group, and one isolated group. Beside
``test_lockstep.py`` it holds a ``-p`` plugin whose fixture the ranks must see, a module the ranks
cannot import, and two packages whose unmarked tests interleave with a marked one.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from tests.inner_outcomes import assert_passed, junit_outcomes
from tests.plugin._inner import InnerProject, failure_section, leftover_processes

INNER_TESTS = """
import os
import random

import pytest
import torch
import torch.distributed as dist

from rankrec import record

pytestmark = pytest.mark.fsdp2

MODULE_SETUPS = []


@pytest.fixture(scope="module")
def module_resource(fsdp2_rank):
    MODULE_SETUPS.append(1)
    yield "resource"


def test_all_reduce(fsdp2_rank, fsdp2_world_size, fsdp2_device, fsdp2_mesh):
    total = torch.tensor([float(fsdp2_rank + 1)])
    dist.all_reduce(total)
    assert total.item() == 3.0
    assert fsdp2_world_size == dist.get_world_size() == 2
    assert fsdp2_rank == dist.get_rank()
    assert fsdp2_device == torch.device("cpu")
    assert fsdp2_mesh.device_type == "cpu" and fsdp2_mesh.size() == 2
    record("shared", test="all_reduce")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_parametrized(n, fsdp2_world_size):
    value = torch.tensor([float(n)])
    dist.all_reduce(value)
    assert value.item() == n * fsdp2_world_size
    record("shared", test=f"parametrized[{n}]")


def test_same_seed_on_every_rank(fsdp2_world_size):
    draws = (random.random(), torch.rand(3).tolist())
    gathered = [None] * fsdp2_world_size
    dist.all_gather_object(gathered, draws)
    assert all(d == gathered[0] for d in gathered), gathered
    record("seed", draws=draws)


def test_same_seed_again_next_test(fsdp2_world_size):
    record("seed_next", draws=(random.random(), torch.rand(3).tolist()))


def test_tmp_path_and_monkeypatch(tmp_path, monkeypatch, fsdp2_rank, fsdp2_world_size):
    monkeypatch.setenv("PLUGIN_TEST_VAR", str(fsdp2_rank))
    (tmp_path / "mine.txt").write_text(os.environ["PLUGIN_TEST_VAR"])
    paths = [None] * fsdp2_world_size
    dist.all_gather_object(paths, str(tmp_path))
    assert len(set(paths)) == fsdp2_world_size
    assert (tmp_path / "mine.txt").read_text() == str(fsdp2_rank)


def test_env_restored_by_monkeypatch():
    assert "PLUGIN_TEST_VAR" not in os.environ


def test_pytest_raises():
    with pytest.raises(ZeroDivisionError):
        1 / 0


def test_module_fixture_first(module_resource):
    assert module_resource == "resource"


def test_module_fixture_second(module_resource):
    assert len(MODULE_SETUPS) == 1


PROBES = []


def test_dtype_probe_and_unsharded_reference(dtype_probe, unsharded_reference, fsdp2_device):
    from pytest_fp32keep.contract.reference import seeded

    def factory():
        return torch.nn.Linear(4, 3)

    reference = unsharded_reference(factory, seed=7)
    with seeded(7):
        model = factory()
    assert next(reference.parameters()).device == fsdp2_device
    assert torch.equal(reference.weight, model.weight)
    probe = dtype_probe(model)
    PROBES.append(probe)
    model(torch.ones(2, 4))
    assert probe.calls("") == 1
    assert probe.materialized_dtypes("") == {"weight": torch.float32, "bias": torch.float32}


def test_dtype_probe_was_detached_at_teardown():
    assert len(PROBES) == 1 and not PROBES[0].attached


@pytest.mark.xfail(reason="known to fail", strict=True)
def test_xfail_strict_fails_as_expected():
    assert False


@pytest.mark.xfail(reason="might pass", strict=False)
def test_xpass_non_strict():
    pass


@pytest.mark.xfail(reason="must fail", strict=True)
def test_xpass_strict():
    pass


def test_skip_on_every_rank():
    pytest.skip("every rank skips")


def test_skip_on_one_rank(fsdp2_rank):
    if fsdp2_rank == 1:
        pytest.skip("only rank 1 skips")


def test_fails_on_rank_1(fsdp2_rank):
    print(f"stdout of rank {fsdp2_rank}")
    assert fsdp2_rank == 0, f"rank {fsdp2_rank} is wrong"


def test_fails_identically_everywhere():
    assert 1 + 1 == 3


@pytest.mark.fsdp2(nproc=1)
def test_single_rank(fsdp2_world_size):
    assert fsdp2_world_size == 1
    record("single")


@pytest.mark.fsdp2(isolated=True)
def test_isolated(fsdp2_world_size):
    assert fsdp2_world_size == 2
    record("isolated")


def test_after_isolated():
    record("shared", test="after_isolated")
"""


#: A plugin given with ``-p``: the ranks inherit it, so its fixture works in a marked test.
EXTRA_FIXTURES = """
import pytest

@pytest.fixture
def greeting():
    return "hello from a -p plugin"
"""

USES_PLUGIN = """
import pytest

@pytest.mark.fsdp2
def test_fixture_from_plugin(greeting):
    assert greeting == "hello from a -p plugin"
"""

#: The parent collects this module; the ranks cannot import it.
RANK_ONLY_IMPORT_ERROR = """
import os
import pytest

if "RANK" in os.environ:
    raise RuntimeError("this module cannot be imported in the ranks")

@pytest.mark.fsdp2
def test_not_collected_in_ranks():
    pass
"""

#: Marked and unmarked tests interleaved across packages: the pytest process's own setup stack
#: stays in step, so package fixtures of unmarked tests are finalised when the run leaves them.
PACKAGES = {
    "a/__init__.py": "",
    "a/conftest.py": """
import pytest

@pytest.fixture(scope="package")
def package_resource(tmp_path_factory):
    yield "a"
    (tmp_path_factory.getbasetemp() / "a-finalised").write_text("1")
""",
    "a/test_a.py": """
import pytest

def test_unmarked(package_resource):
    assert package_resource == "a"

@pytest.mark.fsdp2
def test_marked(fsdp2_world_size):
    assert fsdp2_world_size == 2
""",
    "b/__init__.py": "",
    "b/test_b.py": """
def test_unmarked_in_b(tmp_path_factory):
    assert (tmp_path_factory.getbasetemp() / "a-finalised").exists()
""",
}


@pytest.fixture(scope="module")
def session(module_inner: InnerProject) -> tuple[InnerProject, pytest.RunResult]:
    """The inner session, run once for every check of this module (it starts real ranks)."""
    module_inner.write(
        test_lockstep=INNER_TESTS,
        extra_fixtures=EXTRA_FIXTURES,
        test_uses_plugin=USES_PLUGIN,
        test_rank_only_import_error=RANK_ONLY_IMPORT_ERROR,
    )
    for name, source in PACKAGES.items():
        (module_inner.path / name).parent.mkdir(exist_ok=True)
        (module_inner.path / name).write_text(source)
    result = module_inner.run(
        "--strict-markers", "-rA", "-v", "--junitxml=out.xml", "-p", "extra_fixtures"
    )
    return module_inner, result


def test_outcomes_of_every_test(session: tuple[InnerProject, pytest.RunResult]) -> None:
    _, result = session
    # test_lockstep.py: 16 passed, 4 failed, 1 skipped, 1 xfailed, 1 xpassed; the plugin's
    # fixture: 1 passed; the rank-only import error: 1 error; the packages: 3 passed
    result.assert_outcomes(passed=20, failed=4, skipped=1, xfailed=1, xpassed=1, errors=1)
    result.stdout.fnmatch_lines_random(
        [
            "PASSED test_uses_plugin.py::test_fixture_from_plugin",
            "PASSED a/test_a.py::test_unmarked",
            "PASSED a/test_a.py::test_marked",
            "PASSED b/test_b.py::test_unmarked_in_b",
            "PASSED test_lockstep.py::test_all_reduce",
            "PASSED test_lockstep.py::test_parametrized[[]1[]]",
            "PASSED test_lockstep.py::test_parametrized[[]3[]]",
            "PASSED test_lockstep.py::test_same_seed_on_every_rank",
            "PASSED test_lockstep.py::test_tmp_path_and_monkeypatch",
            "PASSED test_lockstep.py::test_env_restored_by_monkeypatch",
            "PASSED test_lockstep.py::test_pytest_raises",
            "PASSED test_lockstep.py::test_module_fixture_second",
            "PASSED test_lockstep.py::test_dtype_probe_and_unsharded_reference",
            "PASSED test_lockstep.py::test_dtype_probe_was_detached_at_teardown",
            "PASSED test_lockstep.py::test_single_rank",
            "PASSED test_lockstep.py::test_isolated",
            "PASSED test_lockstep.py::test_after_isolated",
            "XFAIL test_lockstep.py::test_xfail_strict_fails_as_expected - known to fail",
            "XPASS test_lockstep.py::test_xpass_non_strict - might pass",
            "FAILED test_lockstep.py::test_xpass_strict*",
            "SKIPPED [[]1[]] test_lockstep.py:*: every rank skips",
            "FAILED test_lockstep.py::test_skip_on_one_rank*",
            "FAILED test_lockstep.py::test_fails_on_rank_1 - [[]rank 1[]] AssertionError: rank*",
            "FAILED test_lockstep.py::test_fails_identically_everywhere*",
        ]
    )


def test_ranks_are_reused_across_tests(session: tuple[InnerProject, pytest.RunResult]) -> None:
    project, _ = session
    shared = project.records("shared")
    assert len(shared) == 2 * 5, shared  # 5 recording tests x 2 ranks
    pids = {(r["rank"], r["pid"]) for r in shared}
    assert len(pids) == 2, f"the shared group must keep the same 2 processes: {pids}"
    assert {rank for rank, _ in pids} == {"0", "1"}


def test_isolated_and_other_sizes_get_their_own_ranks(
    session: tuple[InnerProject, pytest.RunResult],
) -> None:
    project, _ = session
    shared_pids = {r["pid"] for r in project.records("shared")}
    isolated = project.records("isolated")
    single = project.records("single")
    assert [r["rank"] for r in isolated] == ["0", "1"]
    assert [r["rank"] for r in single] == ["0"]
    assert not {r["pid"] for r in isolated} & shared_pids
    assert not {r["pid"] for r in single} & shared_pids


def test_every_rank_starts_each_test_with_the_same_seed(
    session: tuple[InnerProject, pytest.RunResult],
) -> None:
    project, _ = session
    seeds = project.records("seed")
    again = project.records("seed_next")
    assert len(seeds) == 2 and seeds[0]["draws"] == seeds[1]["draws"]
    assert len(again) == 2 and again[0]["draws"] == again[1]["draws"]
    assert seeds[0]["draws"] != again[0]["draws"], "each test gets its own seed"


def test_failure_names_the_root_cause_rank_and_shows_every_rank(
    session: tuple[InnerProject, pytest.RunResult],
) -> None:
    _, result = session
    text = failure_section(result.stdout.str(), "test_fails_on_rank_1")
    assert "fsdp2: call failed on rank 1 of 2 (rank 0 passed); root cause: rank 1" in text
    assert "rank 1 (root cause: first to fail)" in text
    assert "AssertionError: rank 1 is wrong" in text
    assert "Captured stdout call [rank 0]" in text and "stdout of rank 0" in text
    assert "Captured stdout call [rank 1]" in text and "stdout of rank 1" in text


def test_identical_tracebacks_are_merged(session: tuple[InnerProject, pytest.RunResult]) -> None:
    _, result = session
    text = failure_section(result.stdout.str(), "test_fails_identically_everywhere")
    assert "call failed on ranks 0,1 of 2" in text
    assert "ranks 0,1 (root cause: first to fail)" in text
    assert text.count("assert (1 + 1) == 3") == 1, text


def test_skip_counts_only_when_every_rank_skips(
    session: tuple[InnerProject, pytest.RunResult],
) -> None:
    _, result = session
    text = failure_section(result.stdout.str(), "test_skip_on_one_rank")
    assert "rank 1 skipped in call while rank 0 ran it" in text
    assert "only rank 1 skips" in text


def test_strict_xpass_fails(session: tuple[InnerProject, pytest.RunResult]) -> None:
    _, result = session
    assert "[XPASS(strict)] must fail" in failure_section(result.stdout.str(), "test_xpass_strict")


def test_junitxml_holds_one_testcase_per_test(
    session: tuple[InnerProject, pytest.RunResult],
) -> None:
    project, _ = session
    root = ET.parse(next(project.path.glob("out.xml"))).getroot()
    cases = {case.get("name"): case for case in root.iter("testcase")}
    assert len(cases) == 28
    failure = cases["test_fails_on_rank_1"].find("failure")
    assert failure is not None
    assert failure.get("message", "").startswith("[rank 1] AssertionError: rank 1 is wrong")
    assert "root cause: rank 1" in (failure.text or "")
    assert cases["test_skip_on_every_rank"].find("skipped") is not None
    outcomes = junit_outcomes(next(project.path.glob("out.xml")))
    assert outcomes["test_skip_on_every_rank"].outcome == "skipped"
    assert_passed(outcomes["test_all_reduce"])  # passed: not failed, not errored, not skipped


def test_ranks_report_tests_they_cannot_collect(
    session: tuple[InnerProject, pytest.RunResult],
) -> None:
    _, result = session
    text = failure_section(result.stdout.str(), "test_not_collected_in_ranks")
    assert (
        "collected no test with id 'test_rank_only_import_error.py::test_not_collected_in_ranks'"
        in text
    )
    assert "RuntimeError: this module cannot be imported in the ranks" in text


def test_no_process_left(session: tuple[InnerProject, pytest.RunResult]) -> None:
    project, _ = session
    assert leftover_processes(project.tag) == []
