"""Whether pytest itself runs inside a world another launcher started (torchrun, srun).

Under ``torchrun --nproc-per-node=N -m pytest`` or ``srun -n N pytest`` every process runs the
same pytest session. Starting the plugin's own ranks from each of them would make N unrelated
groups, each printing its verdict, and leave the launched world unused; instead, marked tests
run in place in the launched processes (:mod:`pytest_fp32keep.runner.spmd`).

The rule, by ``--fsdp-launcher``:

- ``local``: never; the plugin starts its own ranks, whatever the environment says;
- ``auto``: under torchrun (``TORCHELASTIC_RUN_ID`` with ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), unless those are the plugin's own ranks'
  (they carry its token); an ``srun`` step of several tasks is
  refused, asking for a choice (a batch script's own shell also carries ``SLURM_*`` variables,
  so SLURM's environment alone does not say that every task runs pytest);
- ``external``: required; torchrun's variables (or any ``env://`` launcher's), else SLURM's
  (``SLURM_PROCID``, ``SLURM_NTASKS``/``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``) with
  ``MASTER_ADDR`` and ``MASTER_PORT``, which the user's job script sets.

Standard library only: it runs in ``pytest_configure`` of every session.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Final

import pytest

from pytest_fp32keep.runner.processes import ENV_TOKEN

#: What torchrun (and any ``env://`` launcher) gives every process.
TORCHRUN_VARIABLES: Final = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
#: Set by torchrun's agent alone: tells torchrun from a hand-made ``env://`` environment.
TORCHRUN_MARK: Final = "TORCHELASTIC_RUN_ID"
#: What srun gives every task of a step (``SLURM_NTASKS`` also exists in a batch script).
SLURM_VARIABLES: Final = ("SLURM_PROCID", "SLURM_LOCALID")
SLURM_STEP_TASKS: Final = "SLURM_STEP_NUM_TASKS"
SLURM_TASKS: Final = "SLURM_NTASKS"
RENDEZVOUS_VARIABLES: Final = ("MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class LaunchedWorld:
    """This process's place in a world started by an external launcher.

    Attributes:
        launcher: ``"torchrun"`` (or another ``env://`` launcher) or ``"slurm"``.
        rank: global rank.
        local_rank: rank on this node (the CUDA device index under NCCL).
        world_size: number of processes in the world.
        master: ``"host:port"`` of the rendezvous the process group is initialised from.
    """

    launcher: str
    rank: int
    local_rank: int
    world_size: int
    master: str

    def init_environment(self) -> dict[str, str]:
        """The ``env://`` variables ``dist.init_process_group`` reads, for the launcher's world
        (SLURM names them differently; torchrun's are returned as they are)."""
        host, _, port = self.master.rpartition(":")
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": host,
            "MASTER_PORT": port,
        }


def detect(launcher: str, environ: Mapping[str, str]) -> LaunchedWorld | None:
    """The launched world this pytest process belongs to, or ``None`` to start local ranks.

    ``launcher`` is the validated ``--fsdp-launcher``. Raises ``pytest.UsageError`` where the
    environment cannot give what was asked for, or is ambiguous under ``auto``; the message
    names the variables and the option.
    """
    if launcher == "local":
        return None
    if launcher == "auto" and ENV_TOKEN in environ:
        # A pytest started from inside one of the plugin's own ranks (torchrun's variables are
        # the plugin's): a session of its own, not one rank of a launched world.
        return None
    torchrun = all(name in environ for name in TORCHRUN_VARIABLES)
    if torchrun and (launcher == "external" or TORCHRUN_MARK in environ):
        return _world("torchrun", environ, "RANK", "LOCAL_RANK", "WORLD_SIZE")
    slurm_tasks = SLURM_STEP_TASKS if SLURM_STEP_TASKS in environ else SLURM_TASKS
    slurm = all(name in environ for name in (*SLURM_VARIABLES, slurm_tasks))
    if launcher == "external":
        if not slurm:
            raise pytest.UsageError(
                "--fsdp-launcher=external: this process was not started by a launcher: "
                f"expected torchrun's {', '.join(TORCHRUN_VARIABLES)}, or SLURM's "
                f"{', '.join(SLURM_VARIABLES)}, {SLURM_TASKS} with "
                f"{' and '.join(RENDEZVOUS_VARIABLES)}. Run it under torchrun or srun, or use "
                "--fsdp-launcher=local (ranks of its own, started on this machine)"
            )
        missing = [name for name in RENDEZVOUS_VARIABLES if name not in environ]
        if missing:
            raise pytest.UsageError(
                f"--fsdp-launcher=external under srun: {' and '.join(missing)} not set; export "
                "the address and a free port of the first task's node in the job script, e.g. "
                'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1) '
                "MASTER_PORT=29500"
            )
        return _world("slurm", environ, "SLURM_PROCID", "SLURM_LOCALID", slurm_tasks)
    tasks = environ.get(SLURM_STEP_TASKS, "1").strip()
    if slurm and tasks.isdigit() and int(tasks) > 1:
        raise pytest.UsageError(
            f"pytest runs in an srun step of {tasks} tasks ({SLURM_STEP_TASKS}): say how marked "
            "tests run: --fsdp-launcher=external (every task is one rank of one world, SPMD; "
            "set MASTER_ADDR and MASTER_PORT) or --fsdp-launcher=local (every task starts its "
            "own ranks); or the ini key fsdp_launcher"
        )
    return None


def _world(
    launcher: str, environ: Mapping[str, str], rank: str, local_rank: str, world_size: str
) -> LaunchedWorld:
    """The world from the launcher's variables, each one checked and named when wrong."""
    values = {name: _integer(environ, name) for name in (rank, local_rank, world_size)}
    if values[world_size] < 1:
        raise pytest.UsageError(f"{world_size}={values[world_size]}: expected at least 1")
    if not 0 <= values[rank] < values[world_size]:
        raise pytest.UsageError(
            f"{rank}={values[rank]} is outside the world of {world_size}={values[world_size]}"
        )
    master = f"{environ.get('MASTER_ADDR', '')}:{environ.get('MASTER_PORT', '')}"
    return LaunchedWorld(
        launcher, values[rank], values[local_rank], values[world_size], master.strip()
    )


def _integer(environ: Mapping[str, str], name: str) -> int:
    raw = environ[name]
    if not raw.strip().isdigit():
        raise pytest.UsageError(
            f"{name}={raw!r}: expected a non-negative integer (set by the launcher)"
        )
    return int(raw)
