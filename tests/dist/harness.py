"""Interim multi-rank harness: one real ``torchrun`` runs many scenario functions in lock-step.

Until the plugin's ``@pytest.mark.fsdp2`` marker carries these tests, each scenario is a plain
function ``scenario(mesh) -> None`` in a module; ``run_scenarios`` launches ``torchrun`` once for
the whole module and returns every rank's outcome per scenario. A scenario that fails on one rank
while its peer waits in a collective is bounded by the short process-group timeout set here.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class RankOutcome:
    """What one rank saw for one scenario."""

    rank: int
    ok: bool
    error: str


def run_scenarios(
    module: str, *, nproc: int = 2, timeout: float = 600
) -> dict[str, list[RankOutcome]]:
    """Run every ``scenario_*`` function of ``module`` in ``nproc`` torchrun ranks."""
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "tests.dist.harness",
            module,
            out,
        ]
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        completed = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
        results: dict[str, list[RankOutcome]] = {}
        for rank in range(nproc):
            path = Path(out) / f"rank{rank}.json"
            if not path.exists():
                raise RuntimeError(
                    f"rank {rank} wrote no results (torchrun exit {completed.returncode}):\n"
                    f"{completed.stdout[-4000:]}\n{completed.stderr[-8000:]}"
                )
            for name, outcome in json.loads(path.read_text()).items():
                results.setdefault(name, []).append(
                    RankOutcome(rank, outcome["ok"], outcome["error"])
                )
        return results


def _main() -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    parser = argparse.ArgumentParser()
    parser.add_argument("module")
    parser.add_argument("out")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    scenarios = importlib.import_module(args.module)
    names = sorted(name for name in vars(scenarios) if name.startswith("scenario_"))
    results: dict[str, dict[str, object]] = {}
    for name in names:
        torch.manual_seed(0)
        try:
            getattr(scenarios, name)(mesh)
            results[name] = {"ok": True, "error": ""}
        except BaseException:
            results[name] = {"ok": False, "error": traceback.format_exc()}
        Path(args.out, f"rank{rank}.json").write_text(json.dumps(results))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _main()
