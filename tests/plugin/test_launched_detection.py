"""When a session is one process of a launched world, the option, and collections that differ.

Pure functions over a given environment and given node-id lists; the real launched sessions are
in test_spmd.py.
"""

from __future__ import annotations

import pytest

from pytest_fp32keep.runner.collection_agreement import differences
from pytest_fp32keep.runner.launched import LaunchedWorld, detect
from tests.error_bounds import PARENT_BOUND_S, within
from tests.plugin._inner import InnerProject

TORCHRUN = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "abc",
}
SRUN = {
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_NUM_TASKS": "8",
}


def test_torchrun_is_a_launched_world_under_auto() -> None:
    assert detect("auto", TORCHRUN) == LaunchedWorld("torchrun", 3, 1, 4, "10.0.0.1:29500")


def test_local_and_a_plain_environment_start_local_ranks() -> None:
    assert detect("local", TORCHRUN) is None
    assert detect("auto", {}) is None


def test_env_variables_without_torchrun_need_the_explicit_option() -> None:
    hand_made = {k: v for k, v in TORCHRUN.items() if k != "TORCHELASTIC_RUN_ID"}
    assert detect("auto", hand_made) is None
    assert detect("external", hand_made) is not None


def test_the_plugins_own_ranks_are_not_a_launched_world() -> None:
    """A pytest started inside one of the plugin's ranks (its token) runs a session of its own."""
    assert detect("auto", {**TORCHRUN, "FP32KEEP_TOKEN": "x"}) is None


def test_external_without_a_launcher_names_what_it_looked_for() -> None:
    with pytest.raises(pytest.UsageError, match=r"--fsdp-launcher=external: .*RANK.*SLURM_PROCID"):
        detect("external", {})


def test_an_srun_step_under_auto_asks_for_a_choice() -> None:
    with pytest.raises(pytest.UsageError, match="srun step of 8 tasks") as caught:
        detect("auto", SRUN)
    assert "--fsdp-launcher=external" in str(caught.value)
    assert "--fsdp-launcher=local" in str(caught.value)
    # A batch script's shell (no step variables) and a one-task step start local ranks.
    assert detect("auto", {k: v for k, v in SRUN.items() if k != "SLURM_STEP_NUM_TASKS"}) is None
    assert detect("auto", {**SRUN, "SLURM_STEP_NUM_TASKS": "1"}) is None


def test_srun_under_external_needs_the_rendezvous_address() -> None:
    with pytest.raises(pytest.UsageError, match="MASTER_ADDR and MASTER_PORT not set"):
        detect("external", SRUN)
    world = detect("external", {**SRUN, "MASTER_ADDR": "node1", "MASTER_PORT": "29500"})
    assert world == LaunchedWorld("slurm", 5, 1, 8, "node1:29500")
    assert world.init_environment() == {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "MASTER_ADDR": "node1",
        "MASTER_PORT": "29500",
    }


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("RANK", "three", "RANK='three': expected a non-negative integer"),
        ("RANK", "4", "RANK=4 is outside the world of WORLD_SIZE=4"),
        ("WORLD_SIZE", "0", "WORLD_SIZE=0: expected at least 1"),
        ("LOCAL_RANK", "-1", "LOCAL_RANK='-1': expected a non-negative integer"),
    ],
)
def test_a_bad_launcher_variable_is_named(variable: str, value: str, message: str) -> None:
    with pytest.raises(pytest.UsageError, match=message.replace("[", r"\[")):
        detect("auto", {**TORCHRUN, variable: value})


def test_the_same_collection_everywhere_is_no_difference() -> None:
    assert differences([["a", "b"], ["a", "b"], ["a", "b"]]) is None


def test_differences_name_the_tests_and_the_ranks() -> None:
    message = differences([["a", "b", "c"], ["a", "b", "c"], ["a", "c", "x"], ["a", "c", "x"]])
    assert message is not None
    assert "ranks 2,3 collected, rank 0 did not: x" in message
    assert "rank 0 collected, ranks 2,3 did not: b" in message
    assert "rank 1" not in message


def test_the_same_tests_in_another_order_is_a_difference() -> None:
    message = differences([["a", "b"], ["b", "a"]])
    assert message is not None
    assert "rank 1 collected the same tests in another order: at position 1" in message


def test_a_long_difference_is_cut() -> None:
    message = differences([[], [f"t{i}" for i in range(25)]])
    assert message is not None
    assert "t9 and 15 more" in message
    assert "t10" not in message


@pytest.mark.parametrize(
    ("args", "ini", "message"),
    [
        pytest.param(
            ["--fsdp-launcher=slurm"],
            "",
            "--fsdp-launcher=slurm: expected one of auto, local, external, got 'slurm'",
            id="option",
        ),
        pytest.param([], "fsdp_launcher = nodes\n", "ini key 'fsdp_launcher' in", id="ini"),
        pytest.param(
            ["--fsdp-launcher=external"],
            "",
            "--fsdp-launcher=external: this process was not started by a launcher",
            id="external-without-launcher",
        ),
    ],
)
def test_a_bad_launcher_setting_is_a_usage_error(
    inner: InnerProject, monkeypatch: pytest.MonkeyPatch, args: list[str], ini: str, message: str
) -> None:
    assert inner.pytester is not None
    for name in (*TORCHRUN, *SRUN):  # the outer session may itself run under a launcher
        monkeypatch.delenv(name, raising=False)
    inner.pytester.makeini("[pytest]\n" + ini)
    inner.write(test_plain="def test_plain():\n    pass\n")
    with within(PARENT_BOUND_S):
        result = inner.run(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in result.stderr.str()
    result.stdout.no_fnmatch_line("*test_plain*PASSED*")


@pytest.mark.parametrize(
    ("args", "refused"),
    [
        pytest.param(["-n", "2"], True, id="n2"),
        pytest.param(["-n", "0"], False, id="n0-negative-control"),
    ],
)
def test_xdist_in_a_launched_world_is_a_usage_error_naming_the_conflict(
    inner: InnerProject, monkeypatch: pytest.MonkeyPatch, args: list[str], refused: bool
) -> None:
    assert inner.pytester is not None
    for name, value in TORCHRUN.items():  # what torchrun gives a worker; no rank runs here
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    inner.write(test_plain="def test_plain():\n    pass\n")
    with within(PARENT_BOUND_S):
        result = inner.run(*args)
    message = "-n 2 (pytest-xdist) in a world torchrun launched: every launched process"
    if refused:
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        assert message in result.stderr.str()
        result.stdout.no_fnmatch_line("*test_plain*PASSED*")
    else:  # -n 0 starts no worker: the session runs as a rank (no marked test: no group)
        assert result.ret == pytest.ExitCode.OK, result.stderr.str()
        assert "(pytest-xdist)" not in result.stderr.str()
