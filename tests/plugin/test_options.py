"""Options, ini keys and the marker: help, validation, and what is decided in the pytest process.

No test here starts a rank; the last one proves that by records the bodies would leave and by
the absence of the folder the controller creates on its first launch.
"""

from __future__ import annotations

import json

import pytest

from pytest_fp32keep.runner.devices import nccl_shortfall
from tests.error_bounds import PARENT_BOUND_S, within
from tests.plugin._inner import InnerProject


def test_help_lists_options_with_defaults_and_ini_keys(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--help")
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        [
            "*FSDP2 multi-rank tests (pytest-fp32keep)*",
            "*--fsdp-nproc=N*",
            "*--fsdp-backend={auto,gloo,nccl}*",
            "*--fsdp-timeout=SECONDS*",
            "*--fsdp-max-nproc=N*",
            "*fsdp_nproc (string):*",
            "*fsdp_backend (string):*",
            "*fsdp_timeout (string):*",
            "*fsdp_max_nproc (string):*",
        ]
    )
    text = " ".join(result.stdout.str().split())
    assert "(default: 2; ini key: fsdp_nproc)" in text
    assert "(default: auto; ini key: fsdp_backend)" in text
    assert "(default: 300; ini key: fsdp_timeout)" in text
    assert "(default: no cap; ini key: fsdp_max_nproc; environment: FP32KEEP_MAX_NPROC)" in text


def test_marker_is_registered(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(
        ["@pytest.mark.fsdp2(nproc=None, backend=None, isolated=False, timeout=None):*"]
    )
    text = " ".join(result.stdout.str().split())
    assert "a list such as nproc=[1, 2, 4] runs the test once per world size" in text


NPROC_MESSAGE = "expected a positive integer number of ranks, got"
TIMEOUT_MESSAGE = "expected a positive number of seconds, got"


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        pytest.param("--fsdp-nproc=0", f"--fsdp-nproc=0: {NPROC_MESSAGE} '0'", id="nproc-0"),
        pytest.param("--fsdp-nproc=-1", f"--fsdp-nproc=-1: {NPROC_MESSAGE} '-1'", id="nproc--1"),
        pytest.param(
            "--fsdp-nproc=abc", f"--fsdp-nproc=abc: {NPROC_MESSAGE} 'abc'", id="nproc-abc"
        ),
        pytest.param(
            "--fsdp-backend=mpi",
            "--fsdp-backend=mpi: expected one of auto, gloo, nccl, got 'mpi'",
            id="backend-mpi",
        ),
        pytest.param(
            "--fsdp-timeout=0", f"--fsdp-timeout=0: {TIMEOUT_MESSAGE} '0'", id="timeout-0"
        ),
        pytest.param(
            "--fsdp-timeout=-5", f"--fsdp-timeout=-5: {TIMEOUT_MESSAGE} '-5'", id="timeout--5"
        ),
        pytest.param(
            "--fsdp-timeout=soon",
            f"--fsdp-timeout=soon: {TIMEOUT_MESSAGE} 'soon'",
            id="timeout-soon",
        ),
        pytest.param(
            "--fsdp-timeout=nan", f"--fsdp-timeout=nan: {TIMEOUT_MESSAGE} 'nan'", id="timeout-nan"
        ),
        pytest.param(
            "--fsdp-max-nproc=0", f"--fsdp-max-nproc=0: {NPROC_MESSAGE} '0'", id="max-nproc-0"
        ),
    ],
)
def test_invalid_option_is_a_usage_error_naming_it(
    pytester: pytest.Pytester, arg: str, message: str
) -> None:
    pytester.makepyfile("def test_nothing(): pass")
    with within(PARENT_BOUND_S):
        result = pytester.runpytest(arg)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {message}*"])


def test_nccl_with_more_ranks_than_gpus_is_skipped_naming_the_counts(
    inner: InnerProject, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # 0 GPUs on every machine, CI's GPU runner too
    inner.write(
        test_nccl="""
        import pytest
        from rankrec import record

        @pytest.mark.fsdp2
        def test_needs_two_gpus():
            record("ran")
        """
    )
    with within(PARENT_BOUND_S):
        result = inner.run("-rs", "--fsdp-backend=nccl", "--fsdp-nproc=2")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(
        [
            "SKIPPED [[]1[]] test_nccl.py:*: fsdp2: backend nccl needs 2 CUDA devices "
            "(one per rank), 0 visible here*"
        ]
    )
    # with no GPU, fewer ranks is no way out (it said "ask for at most 0 ranks": issue 36)
    said = " ".join(result.stdout.str().split())
    assert "at most 0" not in said and "run with --fsdp-backend=gloo (or auto)" in said
    assert inner.records("ran") == []
    assert not list(inner.path.glob("runpytest-*/fsdp2")), "a group of ranks was started"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("fsdp_nproc = 0", "ini key 'fsdp_nproc' in *tox.ini: expected a positive integer"),
        ("fsdp_backend = cuda", "ini key 'fsdp_backend' in *tox.ini: expected one of auto, gloo"),
        ("fsdp_timeout = -1", "ini key 'fsdp_timeout' in *tox.ini: expected a positive number"),
        ("fsdp_max_nproc = 1.5", "ini key 'fsdp_max_nproc' in *tox.ini: expected a positive int"),
    ],
)
def test_invalid_ini_value_is_a_usage_error_naming_the_key(
    pytester: pytest.Pytester, line: str, message: str
) -> None:
    pytester.makeini(f"[pytest]\n{line}\n")
    pytester.makepyfile("def test_nothing(): pass")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {message}*"])


def test_command_line_overrides_ini(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nfsdp_backend = gloo\n")
    pytester.makepyfile("def test_nothing(): pass")
    result = pytester.runpytest("--fsdp-backend=bogus")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --fsdp-backend=bogus: expected one of*"])


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("fsdp_nproc=0", "-o fsdp_nproc=0: expected a positive integer"),
        ("fsdp_timeout=never", "-o fsdp_timeout=never: expected a positive number"),
        ("fsdp_launcher=mpi", "-o fsdp_launcher=mpi: expected one of auto, local, external"),
    ],
    ids=["nproc", "timeout", "launcher"],
)
def test_a_bad_override_ini_value_is_named_as_typed_not_blamed_on_the_ini_file(
    pytester: pytest.Pytester, override: str, named: str
) -> None:
    """Issue 36: ``-o fsdp_nproc=0`` was reported as the ini key in pyproject.toml."""
    key, value = override.split("=")
    pytester.makepyprojecttoml(f"[tool.pytest.ini_options]\n{key} = '1'\n")
    pytester.makepyfile("def test_nothing(): pass")
    with within(PARENT_BOUND_S):
        result = pytester.runpytest("-o", override)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {named}*"])
    assert "pyproject.toml" not in result.stderr.str()
    # negative control: the same bad value in the file is still named by its key and file
    pytester.makepyprojecttoml(f"[tool.pytest.ini_options]\n{key} = '{value}'\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: ini key '{key}' in *pyproject.toml: *"])


def test_invalid_marker_arguments_are_errors_of_their_tests(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_bad="""
        import pytest

        @pytest.mark.fsdp2(nproc=0)
        def test_zero(): pass

        @pytest.mark.fsdp2(nproc=True)
        def test_bool(): pass

        @pytest.mark.fsdp2(backend="mpi")
        def test_backend(): pass

        @pytest.mark.fsdp2(isolated="yes")
        def test_isolated(): pass

        @pytest.mark.fsdp2(2, nproc=2)
        def test_twice(): pass

        @pytest.mark.fsdp2(ranks=2)
        def test_unknown(): pass

        @pytest.mark.fsdp2(timeout=0)
        def test_timeout(): pass
        """
    )
    result = pytester.runpytest("--strict-markers", "-v")
    result.assert_outcomes(errors=7)
    prefix = "*@pytest.mark.fsdp2"
    result.stdout.fnmatch_lines_random(
        [
            f"{prefix}(nproc=0) on test_bad.py::test_zero: expected a positive integer*got 0",
            f"{prefix}(nproc=True) on test_bad.py::test_bool: expected a positive integer*",
            f"{prefix}(backend='mpi') on test_bad.py::test_backend: expected one of auto, gloo*",
            f"{prefix}(isolated='yes') on test_bad.py::test_isolated: expected True or False*",
            f"{prefix} on test_bad.py::test_twice: nproc given both positionally and as nproc=*",
            f"{prefix} on test_bad.py::test_unknown: unknown argument(s) ranks;*",
            f"{prefix}(timeout=0) on test_bad.py::test_timeout: expected a positive number of*",
        ]
    )
    assert "fsdp2: started" not in result.stdout.str()


def test_parent_decides_skips_and_refuses_fixtures_without_importing_torch(
    inner: InnerProject,
) -> None:
    inner.write(
        conftest="""
        import json, sys
        from pathlib import Path

        def pytest_unconfigure(config):
            torch_modules = sorted(m for m in sys.modules if m.split(".")[0] == "torch")
            (Path(__file__).parent / "torch_modules.json").write_text(json.dumps(torch_modules))
        """
    )
    inner.write(
        test_decide="""
        import sys
        import pytest
        from rankrec import record

        def test_unmarked_first():
            assert "torch" not in sys.modules

        @pytest.mark.fsdp2
        @pytest.mark.skip(reason="not today")
        def test_skip_mark():
            record("ran")

        @pytest.mark.fsdp2
        @pytest.mark.skipif("sys.platform != 'nowhere'", reason="condition holds")
        def test_skipif_mark():
            record("ran")

        @pytest.mark.fsdp2
        @pytest.mark.xfail(run=False, reason="never run")
        def test_xfail_not_run():
            record("ran")

        @pytest.mark.fsdp2(nproc=64, backend="nccl")
        def test_needs_gpus():
            record("ran")

        def test_rank_fixture_outside_ranks(fsdp2_rank):
            pass

        def test_mesh_fixture_outside_ranks(fsdp2_mesh):
            pass

        def test_probe_fixture_outside_ranks(dtype_probe):
            pass

        def test_unmarked_last():
            assert "torch" not in sys.modules
        """
    )
    result = inner.run("--strict-markers", "-v", "-rA")
    result.assert_outcomes(passed=2, skipped=3, xfailed=1, errors=3)
    result.stdout.fnmatch_lines_random(
        [
            "SKIPPED [[]1[]] test_decide.py:*: not today",
            "SKIPPED [[]1[]] test_decide.py:*: condition holds",
            "SKIPPED [[]1[]] test_decide.py:*: fsdp2: backend nccl needs 64 CUDA devices "
            "(one per rank), * visible here*",
            "XFAIL*test_decide.py::test_xfail_not_run - *never run",
            "*the fixture 'fsdp2_rank' is available only inside tests marked @pytest.mark.fsdp2*",
            "*the fixture 'fsdp2_mesh' is available only inside tests marked @pytest.mark.fsdp2*",
            "*the fixture 'dtype_probe' is available only inside tests marked @pytest.mark.fsdp2*",
        ]
    )
    assert inner.records("ran") == []
    assert json.loads((inner.path / "torch_modules.json").read_text()) == []
    assert not list(inner.path.glob("runpytest-*/fsdp2")), "a group of ranks was started"


@pytest.mark.parametrize(
    ("devices", "way_out"),
    [
        (0, "or run on a machine with 4 GPUs"),
        (1, "or ask for at most 1 rank"),
        (3, "at most 3 ranks"),
    ],
)
def test_the_nccl_skip_offers_fewer_ranks_only_where_a_gpu_is_visible(
    devices: int, way_out: str
) -> None:
    said = nccl_shortfall(4, devices)
    assert said.startswith(f"fsdp2: backend nccl needs 4 CUDA devices (one per rank), {devices}")
    assert way_out in said
    assert ("at most" in said) is (devices > 0)  # negative control: never "at most 0 ranks"
