"""``@pytest.mark.fsdp2(nproc=[1, 2, 4])``: one case per world size, and the cap on ranks.

The first test starts real ranks (world sizes 1 and 2, on gloo); the others are decided in the
pytest process and prove, by the folder the controller creates on its first launch, that no
rank started.
"""

from __future__ import annotations

import shutil

import pytest

from tests.error_bounds import PARENT_BOUND_S, within
from tests.plugin._inner import InnerProject

ENV_CAP = "FP32KEEP_MAX_NPROC"

SIZES_TEST = """
import pytest
import torch.distributed as dist
from rankrec import record

@pytest.mark.fsdp2(nproc=[1, 2, 3])
def test_sizes(fsdp2_world_size):
    record("sizes", world=dist.get_world_size(), param=fsdp2_world_size)

@pytest.mark.fsdp2(nproc=[2, 1])
def test_plain():
    record("plain", world=dist.get_world_size())

@pytest.mark.fsdp2
def test_scalar():
    record("scalar", world=dist.get_world_size())
"""


def _worlds(inner: InnerProject, name: str) -> list[tuple[int, ...]]:
    """(world size, *param) of every record ``name``, sorted."""
    return sorted(
        (record["world"], *([record["param"]] if "param" in record else []))
        for record in inner.records(name)
    )


def test_listed_world_sizes_run_each_in_its_own_ranks_and_k_selects_them(
    inner: InnerProject, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_CAP, raising=False)
    inner.write(test_sizes=SIZES_TEST)
    # --fsdp-nproc=1 is the default of unlisted tests only: a marker's list wins over it
    result = inner.run("-v", "-rs", "--fsdp-nproc=1", "--fsdp-max-nproc=2")
    result.assert_outcomes(passed=5, skipped=1)
    result.stdout.fnmatch_lines_random(
        [
            "*test_sizes.py::test_sizes[[]nproc1[]] PASSED*",
            "*test_sizes.py::test_sizes[[]nproc2[]] PASSED*",
            "*test_sizes.py::test_sizes[[]nproc3[]] SKIPPED*",
            "*test_sizes.py::test_plain[[]nproc2[]] PASSED*",
            "*test_sizes.py::test_plain[[]nproc1[]] PASSED*",
            "*test_sizes.py::test_scalar PASSED*",  # no list: one test, no case id
            "SKIPPED [[]1[]] test_sizes.py:*: fsdp2: needs 3 ranks, more than the cap of 2 set "
            "by --fsdp-max-nproc=2; raise the cap to run it",
        ]
    )
    # every rank of each case ran in a world of the case's size, and the parameter says so
    assert _worlds(inner, "sizes") == [(1, 1), (2, 2), (2, 2)]
    assert _worlds(inner, "plain") == [(1,), (2,), (2,)]
    # negative control: the unlisted test took --fsdp-nproc=1, as before
    assert _worlds(inner, "scalar") == [(1,)]

    shutil.rmtree(inner.path / "records")
    selected = inner.run("-v", "-k", "nproc2")
    selected.assert_outcomes(passed=2, deselected=4)
    assert _worlds(inner, "sizes") == [(2, 2), (2, 2)]
    assert _worlds(inner, "plain") == [(2,), (2,)]
    assert inner.records("scalar") == []


CAP_TEST = """
import pytest
from rankrec import record

@pytest.mark.fsdp2(nproc=[1, 3], backend="nccl")
def test_listed():
    record("ran")

@pytest.mark.fsdp2(nproc=4, backend="nccl")
def test_scalar():
    record("ran")
"""
#: What a case that the cap lets through meets instead: no GPU here, so no rank starts either.
NCCL_SKIP = "fsdp2: backend nccl needs {n} CUDA devices (one per rank), 0 visible here*"
CAP_SKIP = "fsdp2: needs {n} ranks, more than the cap of {cap} set by {source}; raise the cap*"
OPTION, ENV, INI = "--fsdp-max-nproc={}", f"environment variable {ENV_CAP}={{}}", "ini key*"


@pytest.mark.parametrize(
    ("option", "env", "ini", "cap", "source"),
    [
        pytest.param("2", None, None, 2, OPTION.format(2), id="option"),
        pytest.param(None, "2", None, 2, ENV.format(2), id="env"),
        pytest.param(None, None, "2", 2, "ini key 'fsdp_max_nproc' in *tox.ini", id="ini"),
        pytest.param("3", "9", "9", 3, OPTION.format(3), id="option-over-env"),
        pytest.param(None, "3", "9", 3, ENV.format(3), id="env-over-ini"),
        # negative controls: the stronger source allows what the weaker one would skip
        pytest.param("9", "2", None, None, None, id="option-allows"),
        pytest.param(None, "9", "2", None, None, id="env-allows"),
        pytest.param(None, None, None, None, None, id="no-cap"),
    ],
)
def test_cap_skips_what_needs_more_ranks_naming_where_it_was_set(
    inner: InnerProject,
    monkeypatch: pytest.MonkeyPatch,
    option: str | None,
    env: str | None,
    ini: str | None,
    cap: int | None,
    source: str | None,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # 0 GPUs: what passes the cap skips on nccl
    if env is None:
        monkeypatch.delenv(ENV_CAP, raising=False)
    else:
        monkeypatch.setenv(ENV_CAP, env)
    if ini is not None:
        inner.path.joinpath("tox.ini").write_text(f"[pytest]\nfsdp_max_nproc = {ini}\n")
    inner.write(test_cap=CAP_TEST)
    args = ["-rs", "-k", "nproc3 or scalar", *([f"--fsdp-max-nproc={option}"] if option else [])]
    with within(PARENT_BOUND_S):
        result = inner.run(*args)
    result.assert_outcomes(skipped=2, deselected=1)
    reasons = [
        CAP_SKIP.format(n=n, cap=cap, source=source)
        if cap is not None and n > cap
        else NCCL_SKIP.format(n=n)
        for n in (3, 4)
    ]
    result.stdout.fnmatch_lines_random([f"SKIPPED [[]1[]] test_cap.py:*: {r}" for r in reasons])
    assert inner.records("ran") == []
    assert not list(inner.path.glob("runpytest-*/fsdp2")), "a group of ranks was started"


def test_invalid_cap_in_the_environment_is_a_usage_error_naming_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_CAP, "many")
    pytester.makepyfile("def test_nothing(): pass")
    with within(PARENT_BOUND_S):
        result = pytester.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            f"ERROR: environment variable {ENV_CAP}=many: expected a positive integer number "
            "of ranks, got 'many'"
        ]
    )
    # negative control: the command line wins over the variable, so its valid cap is used
    assert pytester.runpytest_subprocess("--fsdp-max-nproc=2").ret == pytest.ExitCode.OK


def test_invalid_world_size_lists_are_errors_of_their_tests(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
        import pytest

        def pytest_collection_modifyitems(items):
            for item in items:
                if item.name == "test_late":
                    item.add_marker(pytest.mark.fsdp2(nproc=[1, 2]))
        """
    )
    pytester.makepyfile(
        test_bad="""
        import pytest

        @pytest.mark.fsdp2(nproc=[])
        def test_empty(): pass

        @pytest.mark.fsdp2(nproc=[1, "2"])
        def test_text(): pass

        @pytest.mark.fsdp2(nproc=[2, 1.5])
        def test_float(): pass

        @pytest.mark.fsdp2(nproc=[True])
        def test_bool(): pass

        @pytest.mark.fsdp2(nproc=(1, 0))
        def test_zero(): pass

        @pytest.mark.fsdp2([1, 2, 1, 2])
        def test_repeated(): pass

        def test_late(): pass

        @pytest.mark.fsdp2(nproc=[1, 2])
        @pytest.mark.skip(reason="valid list")
        def test_valid(): pass
        """
    )
    with within(PARENT_BOUND_S):
        result = pytester.runpytest_subprocess("--strict-markers", "-v")
    result.assert_outcomes(errors=7, skipped=2)
    expected = [
        "(nproc=[]) on test_bad.py::test_empty: expected at least one number of ranks, got an "
        "empty list",
        "(nproc=[1, '2']) on test_bad.py::test_text: expected positive integer numbers of "
        "ranks, got '2' at index 1",
        "(nproc=[2, 1.5]) on test_bad.py::test_float: expected positive integer numbers of "
        "ranks, got 1.5 at index 1",
        "(nproc=[True]) on test_bad.py::test_bool: expected positive integer numbers of "
        "ranks, got True at index 0",
        "(nproc=(1, 0)) on test_bad.py::test_zero: expected positive integer numbers of "
        "ranks, got 0 at index 1",
        "(nproc=[1, 2, 1, 2]) on test_bad.py::test_repeated: lists 1, 2 more than once; name "
        "each number of ranks once",
        "(nproc=[1, 2]) on test_bad.py::test_late: a list of world sizes must be on the test "
        "when it is collected",
    ]
    text = result.stdout.str()
    missing = [line for line in expected if f"\n@pytest.mark.fsdp2{line}" not in text]
    assert missing == []
    assert text.count("ERROR at setup of test_") == 7
    # negative control: a valid list is expanded into one case per world size
    result.stdout.fnmatch_lines_random(
        ["*test_valid[[]nproc1[]] SKIPPED*", "*test_valid[[]nproc2[]] SKIPPED*"]
    )
    assert "fsdp2: started" not in text
