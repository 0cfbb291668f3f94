"""``fp32keep check`` under an external launcher: torchrun starts the command in every process.

Two torchruns on loopback as two nodes of two processes: the command runs its cases in place at
world size 4, rank 0 alone prints the table; a model whose build differs on rank 1 (the negative
control, ``tests/cli/rank_targets.py``) fails there alone, naming rank 1.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pytest_fp32keep.check.in_place import launched_world
from tests.plugin._inner import leftover_processes, new_tag
from tests.plugin._launched import run_launched

ROOT = Path(__file__).resolve().parents[2]
CHECK = ("-m", "pytest_fp32keep.check", "check")


def test_check_runs_in_place_in_a_launched_world_and_rank_0_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The targets are this repository's test modules: the command imports them from its cwd.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    tag = new_tag()
    targets = ["tests.cli.targets:kept_stack", "tests.cli.rank_targets:differs_on_rank_1"]
    args = [*targets, "--batch", "tests.cli.targets:toy_batch", "--dtype", "fp16"]
    args += ["--report-json", str(tmp_path / "report.json")]
    run = run_launched(tmp_path, tag, args, program=CHECK)
    assert leftover_processes(tag) == []
    assert run.combined.count("fp32keep check: 4 ranks on gloo (cpu)") == 1
    assert run.combined.count("1 passed, 1 failed") == 1
    assert "differs_on_rank_1 fp16 autocast: FAIL (rank 1)" in run.combined
    assert "- ranks disagree: rank 1: fail (round trip); ranks 0,2,3: pass" in run.combined
    report = (tmp_path / "report.json").read_text()
    assert '"nproc": 4' in report
    assert sorted(run.returncodes) == [0, 1]  # rank 0's node fails; the other's ranks are quiet


def test_check_external_without_a_launcher_is_a_usage_error_naming_the_option(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("RANK", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="--launcher=external: this process was not started"):
        launched_world("external")
    assert launched_world("local") is None
