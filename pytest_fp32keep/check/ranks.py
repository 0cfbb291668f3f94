"""The rank side of ``fp32keep check``: run every case of the contract, rank 0 writes results.

Launched by :mod:`pytest_fp32keep.check.cli` through :mod:`pytest_fp32keep.runner.processes` as
``torchrun ... --nproc-per-node=N -m pytest_fp32keep.check.ranks SPEC OUT``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from fp32keep import KeepLayoutError, resolve_keep_plan
from pytest_fp32keep.check.targets import Target, resolve_targets
from pytest_fp32keep.contract import CHECKS, ContractViolation, assert_fp32_keep_contract
from pytest_fp32keep.runner.processes import init_process_group_kwargs

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _init() -> str:
    world = int(os.environ["WORLD_SIZE"])
    use_nccl = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if use_nccl:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # A short timeout bounds a case that fails on one rank while its peers wait.
    dist.init_process_group(
        "nccl" if use_nccl else "gloo",
        timeout=timedelta(seconds=120),
        **init_process_group_kwargs(),  # the launch's private FileStore: no TCP listener
    )
    return "cuda" if use_nccl else "cpu"


def _run_case(
    target: Target, dtype_name: str, autocast: bool, prefetch: bool, device: str
) -> dict[str, Any]:
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    case: dict[str, Any] = {
        "target": target.name,
        "dtype": dtype_name,
        "context": f"{'autocast' if autocast else 'direct'}{', prefetch' if prefetch else ''}",
        "expect_layout_error": target.expect_layout_error
        and not resolve_keep_plan(target.build(), DTYPES[dtype_name]).is_empty,
        "status": {},
        "kept": [],
        "failures": [],
        "message": "",
    }
    try:
        report = assert_fp32_keep_contract(
            target.build,
            target.make_batch,
            mesh=mesh,
            dtype=DTYPES[dtype_name],
            autocast=autocast,
            forward_prefetch=prefetch,
        )
    except KeepLayoutError as error:
        case["outcome"] = "refused"
        case["message"] = str(error)
        case["refused"] = list(error.fqns)
        case["ok"] = case["expect_layout_error"]
        return case
    except ContractViolation as violation:
        report = violation.report
        case["outcome"] = "fail"
    except Exception:
        case["outcome"] = "error"
        case["message"] = traceback.format_exc()
        case["ok"] = False
        return case
    else:
        case["outcome"] = "pass"
    case["ok"] = case["outcome"] == "pass" and not case["expect_layout_error"]
    case["status"] = {check: report.status()[check] for check in CHECKS}
    case["kept"] = [row.to_dict() for row in report.kept]
    case["failures"] = [finding.to_dict() for finding in report.failures]
    case["notes"] = list(report.notes)
    if case["expect_layout_error"]:
        case["message"] = "expected apply_fsdp2 to refuse this layout with KeepLayoutError"
    return case


def main(argv: list[str] | None = None) -> int:
    """Run the cases in ``SPEC`` (JSON) and write the results to ``OUT`` (JSON, rank 0)."""
    spec_path, out_path = (argv if argv is not None else sys.argv[1:])[:2]
    spec = json.loads(Path(spec_path).read_text())
    device = _init()
    targets, _ = resolve_targets(spec["targets"], spec.get("batch"))
    cases = []
    for target in targets:
        for dtype_name in spec["dtypes"]:
            for autocast in spec["autocast"]:
                for prefetch in spec["prefetch"]:
                    cases.append(_run_case(target, dtype_name, autocast, prefetch, device))
                    dist.barrier()
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps({"device": device, "cases": cases}, indent=2))
    gc.collect()  # FSDP2 modules sit in cycles: free them before the group (see rank_session)
    dist.barrier()  # every rank done with its last collective before the group goes away
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
