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
            "tests.multirank.harness",
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


def scenario_names(module: object) -> list[str]:
    """The ``scenario_*`` functions of a scenario module, sorted."""
    return sorted(name for name in vars(module) if name.startswith("scenario_"))


def assert_scenario_passed(
    outcomes: dict[str, list[RankOutcome]], name: str, nproc: int = 2
) -> None:
    """Fail with every failing rank's traceback unless ``name`` passed on all ``nproc`` ranks."""
    ranks = outcomes.get(name)
    assert ranks is not None, f"{name} did not run (an earlier scenario may have hung the ranks)"
    assert len(ranks) == nproc, f"{name} ran on ranks {[r.rank for r in ranks]} only"
    failed = [r for r in ranks if not r.ok]
    assert not failed, "\n".join(f"--- rank {r.rank} ---\n{r.error}" for r in failed)


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
    names = scenario_names(scenarios)
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
