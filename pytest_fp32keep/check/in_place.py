"""``fp32keep check`` run by an external launcher: every process is one rank, SPMD.

``torchrun --nnodes=2 --nproc-per-node=8 ... -m pytest_fp32keep.check check t5`` (or ``srun
fp32keep check --launcher external``) starts the command in every process of the launched world.
Instead of starting ranks of its own (:mod:`pytest_fp32keep.runner.processes`), each process
validates the same options and targets, then runs the rank program
(:func:`pytest_fp32keep.check.ranks.main`) in place, at the launched world size; rank 0 gets every
rank's verdict of every case, as in the local mode, and alone prints the table and writes the
reports. The launcher owns the processes and their restarts; ``--timeout`` does not apply.

Whether a launcher started the command is :mod:`pytest_fp32keep.runner.launched`'s rule, the
plugin's own (``--launcher`` here, ``--fsdp-launcher`` there).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from pytest_fp32keep.runner.launched import LaunchedWorld, detect

LAUNCHERS = ("auto", "local", "external")


def launched_world(launcher: str) -> LaunchedWorld | None:
    """The world a launcher started this command in, else ``None`` (start local ranks).

    Raises ``ValueError`` with the plugin's message where the environment cannot give what
    ``launcher`` asks for (the option is named ``--launcher`` here).
    """
    try:
        return detect(launcher, os.environ)
    except pytest.UsageError as error:
        raise ValueError(str(error).replace("--fsdp-launcher", "--launcher")) from None


def run_in_place(spec: dict[str, Any], world: LaunchedWorld) -> dict[str, Any] | None:
    """Run every case of ``spec`` in this process, one rank of ``world``; rank 0's result
    (every rank's verdicts merged), ``None`` on the other ranks."""
    from pytest_fp32keep.check import ranks

    os.environ.update(world.init_environment())  # SLURM's names -> env://'s
    # Every process keeps its spec and result private: nodes may share no file system.
    with tempfile.TemporaryDirectory(prefix="fp32keep-check-") as work:
        spec_path, out_path = Path(work, "spec.json"), Path(work, "out.json")
        spec_path.write_text(json.dumps(spec))
        ranks.main([str(spec_path), str(out_path)])
        if world.rank != 0:
            return None
        result: dict[str, Any] = json.loads(out_path.read_text())
    return result
