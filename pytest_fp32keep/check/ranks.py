"""The rank side of ``fp32keep check``: run every case of the contract, rank 0 writes results.

Every rank judges every case; after each case, each rank's account is gathered to rank 0
(``gather_object``, bounded by the process group's timeout like every collective here) and
merged there (:func:`pytest_fp32keep.check.rank_verdicts.merge_case`): a case passes only if it
passed on every rank, and a row the ranks disagree on names the ranks that failed.

Launched by :mod:`pytest_fp32keep.check.cli` through :mod:`pytest_fp32keep.runner.processes` as
``torchrun ... --nproc-per-node=N -m pytest_fp32keep.check.ranks SPEC OUT``.

The ranks' stdout and stderr are the command's own: whatever a rank prints reaches the user as
it happens. Two things are handled here instead:

* progress: with ``spec["progress"]`` (the command's stdout is a terminal), rank 0 prints
  ``[3/18] t5 fp16 autocast ... pass`` as each case ends;
* known noise: torch warns, in every rank and about once per FSDP2 unit class, that an
  FSDP2-wrapped module returned a view tensor (``_fsdp_state.py``). T5, Blip2 and
  InstructBlip trigger it; it is harmless unless code modifies such an output in place (then
  backward would raise or its gradients would differ, which this check reports as an error or a
  parity failure), and printed per rank it buried the table.
  :class:`ViewWarnings` records exactly that warning instead of printing it, and the command
  prints one summarised note. It hooks ``warnings.showwarning``, which Python calls only for a
  warning the filters let through, so the count is what would have been printed; every other
  warning, and every other line a rank writes, is printed as before. Recording in the rank
  rather than filtering the text in the parent keeps the match exact (category and message,
  not a line of text that a rank's other output could interleave with) and the output live.
* known noise on stdout: torch 2.9's gloo prints "[Gloo] Rank 0 is connected to 1 peer ranks.
  ..." from C++ for every process group it connects; each rank drops exactly that line from
  its own stdout, the rest passing through live (:mod:`pytest_fp32keep.check.rank_output`).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import random
import sys
import traceback
import warnings
from collections import Counter
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from fp32keep import KeepLayoutError
from pytest_fp32keep.check.plugins import Plugins, ResolvedPlugins, resolve_plugins
from pytest_fp32keep.check.rank_output import GlooConnectedLines
from pytest_fp32keep.check.rank_verdicts import merge_case
from pytest_fp32keep.check.render import progress_line
from pytest_fp32keep.check.targets import Target, resolve_targets
from pytest_fp32keep.contract import CHECKS, ContractViolation, assert_fp32_keep_contract
from pytest_fp32keep.contract.determinism import CUBLAS_DETERMINISTIC_CONFIGS
from pytest_fp32keep.contract.own_warnings import VIEW_TENSOR_WARNING
from pytest_fp32keep.runner.processes import init_process_group_kwargs

TORCH_OVERRIDES_PARAM_DTYPE = "param_dtype_override_fn" in {
    field.name for field in dataclasses.fields(MixedPrecisionPolicy)
}
"""Whether this torch has ``param_dtype_override_fn`` (2.15+), read from torch itself: over FP32
master weights ``apply_fsdp2`` then keeps kept parameters inside the caller's own units, so no
layout is refused for mixing kept parameters with others (the zoo's written refusals are those
of kept units over low-precision storage)."""

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: ``--master-dtype``: absent (None) or ``fp32`` (FP32 master weights).
MASTER_DTYPES = {None: None, "fp32": torch.float32}
#: Python's and torch's global seed before each case.
CASE_SEED = 0


class ViewWarnings:
    """Records torch's FSDP2 view-tensor warning instead of printing it; passes the rest on.

    Use as a context manager around the cases: ``counts`` maps the unit class names to how many
    times the warning would have been printed.
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._shown: Any = None

    def __enter__(self) -> ViewWarnings:
        self._shown = warnings.showwarning
        warnings.showwarning = self._show
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        warnings.showwarning = self._shown

    def _show(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        match = VIEW_TENSOR_WARNING.search(str(message))
        if match is not None and issubclass(category, UserWarning):
            self.counts[match["modules"] or "?"] += 1
            return
        self._shown(message, category, filename, lineno, file, line)


def _init() -> str:
    # One device per rank of this node (torchrun's LOCAL_WORLD_SIZE; one node: the world).
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    use_nccl = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    if use_nccl:
        # cuBLAS reads it when it starts (the first matmul): before that, in every rank, so
        # that the contract's deterministic runs are deterministic in cuBLAS too. A value the
        # user set is kept (the contract then reports cuBLAS as not deterministic).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_CONFIGS[0])
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # A short timeout bounds a case that fails on one rank while its peers wait.
    dist.init_process_group(
        "nccl" if use_nccl else "gloo",
        timeout=timedelta(seconds=120),
        **init_process_group_kwargs(),  # the launch's private FileStore: no TCP listener
    )
    return "cuda" if use_nccl else "cpu"


def _run_case(
    target: Target,
    dtype_name: str,
    autocast: bool,
    prefetch: bool,
    device: str,
    master_dtype: str | None = None,
    measure_spread: bool = False,
    expect_kept: int | None = None,
    plugins: ResolvedPlugins | None = None,
) -> dict[str, Any]:
    # The same seed before every case on every rank: a --batch function that draws from the
    # global generators builds the same batch in every rank and every run (the model itself is
    # built under assert_fp32_keep_contract's own seed).
    random.seed(CASE_SEED)
    torch.manual_seed(CASE_SEED)
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    plugins = plugins or ResolvedPlugins()
    # The zoo's written refusals are apply_fsdp2's: a --shard of the user's is judged by the
    # contract's rows instead, never failed for not refusing (a refusal it raises is judged
    # against what is written, as apply_fsdp2's is: judge_refusal).
    written_refusal = target.refusal_expected(DTYPES[dtype_name]) and not (
        master_dtype == "fp32" and TORCH_OVERRIDES_PARAM_DTYPE
    )
    case: dict[str, Any] = {
        "target": target.name,
        "dtype": dtype_name,
        "context": f"{'autocast' if autocast else 'direct'}{', prefetch' if prefetch else ''}",
        # from the zoo's written expectations, never from the plan under test
        "expect_layout_error": written_refusal and plugins.shard is None,
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
            master_dtype=MASTER_DTYPES[master_dtype],
            measure_spread=measure_spread,
            expect_kept=expect_kept,
            **plugins.contract_kwargs(DTYPES[dtype_name]),
        )
    except KeepLayoutError as error:
        case["expect_layout_error"] = written_refusal
        judge_refusal(case, target, DTYPES[dtype_name], error)
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
    case["status"] = {check: report.checked()[check] for check in CHECKS}  # None: not run
    case["kept"] = [row.to_dict() for row in report.kept]
    case["failures"] = [finding.to_dict() for finding in report.failures]
    case["notes"] = list(report.notes)
    if case["expect_layout_error"]:
        case["message"] = "expected apply_fsdp2 to refuse this layout with KeepLayoutError"
    return case


def judge_refusal(
    case: dict[str, Any], target: Target, dtype: torch.dtype, error: KeepLayoutError
) -> None:
    """Record ``apply_fsdp2``'s refusal in ``case``: it passes only where a refusal is expected
    (``case["expect_layout_error"]``) and it is the one written (reason tags and refused
    tensors, :meth:`Target.refusal_mismatch`); any other is the case's failure, and says how it
    differs from what is written, and where."""
    case["outcome"] = "refused"
    case["message"] = str(error)
    case["refused"] = list(error.fqns)
    case["ok"] = case["expect_layout_error"]
    if not case["expect_layout_error"]:
        return
    case["written"] = target.written_refusal(dtype)
    mismatch = target.refusal_mismatch(dtype, error)
    if mismatch is not None:
        case["ok"] = False
        case["refusal_mismatch"] = mismatch
        case["message"] = f"{error}\n{mismatch}"  # last: the report keeps a message's end


def _gather_case(case: dict[str, Any]) -> dict[str, Any] | None:
    """Every rank's ``case`` gathered to rank 0 and merged there (a collective: every rank calls
    it after each case, which also keeps the ranks in step); ``None`` on the other ranks."""
    rank = dist.get_rank()
    gathered: list[Any] = [None] * dist.get_world_size() if rank == 0 else []
    dist.gather_object(case, gathered if rank == 0 else None, dst=0)
    dist.barrier()  # no rank starts the next case before rank 0 has the accounts of this one
    return merge_case(gathered) if rank == 0 else None


def _view_warnings(counts: Counter[str]) -> dict[str, Any]:
    """Every rank's recorded view-tensor warnings, summed on rank 0 (a collective)."""
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(dict(counts), gathered if dist.get_rank() == 0 else None, dst=0)
    total: Counter[str] = Counter()
    for rank_counts in gathered:
        total.update(rank_counts or {})
    return {"count": sum(total.values()), "modules": sorted(total)}


def main(argv: list[str] | None = None) -> int:
    """Run the cases in ``SPEC`` (JSON) and write the results to ``OUT`` (JSON, rank 0)."""
    spec_path, out_path = (argv if argv is not None else sys.argv[1:])[:2]
    spec = json.loads(Path(spec_path).read_text())
    with GlooConnectedLines():  # every process group gloo connects, the contract's included
        _run(spec, out_path)
    return 0


def _run(spec: dict[str, Any], out_path: str) -> None:
    device = _init()
    targets, _ = resolve_targets(spec["targets"], spec.get("batch"))
    plugins = resolve_plugins(Plugins.from_dict(spec.get("plugins") or {}))
    runs = [
        (target, dtype_name, autocast, prefetch)
        for target in targets
        for dtype_name in spec["dtypes"]
        for autocast in spec["autocast"]
        for prefetch in spec["prefetch"]
    ]
    cases = []
    with ViewWarnings() as recorded:
        for index, run in enumerate(runs, start=1):
            merged = _gather_case(
                _run_case(
                    *run,
                    device,
                    spec.get("master_dtype"),
                    bool(spec.get("measure_spread")),
                    spec.get("expect_kept"),
                    plugins,
                )
            )
            if merged is None:
                continue  # not rank 0: rank 0 holds every rank's account
            cases.append(merged)
            if spec.get("progress"):
                line = progress_line(index, len(runs), cases[-1], int(spec.get("width", 100)))
                print(line, flush=True)
    view_warnings = _view_warnings(recorded.counts)
    if dist.get_rank() == 0:
        result = {
            "device": device,
            "backend": dist.get_backend(),
            "cases": cases,
            "view_warnings": view_warnings,
        }
        Path(out_path).write_text(json.dumps(result, indent=2))
    gc.collect()  # FSDP2 modules sit in cycles: free them before the group (see rank_session)
    dist.barrier()  # every rank done with its last collective before the group goes away
    dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
