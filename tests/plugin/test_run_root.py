"""Without pytest's ``tmpdir`` plugin (``-p no:tmpdir``) the ranks' folder is private, fresh and
removed at the end, never a fixed ``<tmp>/fsdp2`` that every session of every user shares."""

from __future__ import annotations

import shutil
import stat
import tempfile
from pathlib import Path

from tests.plugin._inner import InnerProject, leftover_processes, new_tag

TESTS = """
import os

import pytest
import torch.distributed as dist

from rankrec import record


@pytest.mark.fsdp2
def test_where():
    run_dir = os.environ["FP32KEEP_RUN_DIR"]
    record("where", run_dir=run_dir, root_mode=os.stat(os.path.dirname(run_dir)).st_mode)
    dist.barrier()
"""


def test_without_tmpdir_each_session_gets_a_private_folder_removed_at_the_end(
    tmp_path: Path,
) -> None:
    project = InnerProject(tmp_path, new_tag())
    project.write(test_where=TESTS)
    roots = []
    try:
        for _ in range(2):
            project.run("-p", "no:tmpdir").assert_outcomes(passed=1)
            records = project.records("where")
            shutil.rmtree(tmp_path / "records")  # the next session's records alone
            (root_mode,) = {r["root_mode"] for r in records}
            (root,) = {Path(r["run_dir"]).parent for r in records}
            assert root != Path(tempfile.gettempdir()) / "fsdp2", "a fixed shared path"
            assert stat.S_IMODE(root_mode) == 0o700, oct(root_mode)
            assert not root.exists(), f"{root} was left behind"
            roots.append(root)
        assert roots[0] != roots[1]  # fresh for each session
        assert leftover_processes(project.tag) == []
    finally:
        project.kill_leftovers()


def test_with_tmpdir_the_folder_is_kept_in_the_basetemp(tmp_path: Path) -> None:
    # The control: with a basetemp the logs stay beside the tmp_path folders, for reading.
    project = InnerProject(tmp_path, new_tag())
    project.write(test_where=TESTS)
    try:
        project.run().assert_outcomes(passed=1)
        root = Path(project.records("where")[0]["run_dir"]).parent
        assert root == tmp_path / "runpytest-1" / "fsdp2" and root.is_dir()
    finally:
        project.kill_leftovers()
