"""Text tables of probe records and of boundary mismatches.

It owns every table the probe prints: :meth:`DtypeProbe.summary
<pytest_fp32keep.contract.probe.DtypeProbe.summary>` and :meth:`DtypeProbe.as_table
<pytest_fp32keep.contract.probe.DtypeProbe.as_table>` build their rows here, and
:func:`format_mismatches` renders :func:`~pytest_fp32keep.contract.probe.diff_boundaries`
results. The probe decides which records and in what order; this module only lays them out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pytest_fp32keep.contract.probe.records import (
    BoundaryMismatch,
    BoundaryRecord,
    GradRecord,
    MaterializedParamRecord,
    OpRecord,
    TensorLeaf,
    _display_fqn,
    dtype_name,
)


def _leaves_text(leaves: Sequence[TensorLeaf]) -> str:
    return " ".join(f"{leaf.path}={dtype_name(leaf.dtype, short=True)}" for leaf in leaves) or "-"


def _summary_table(
    boundaries: Sequence[BoundaryRecord],
    params: Sequence[MaterializedParamRecord],
    ops: Sequence[OpRecord],
    uncalled: Sequence[str],
) -> str:
    """One row per call in ``boundaries`` (in that order), then one empty row per ``uncalled``."""
    rows: list[list[str]] = []
    for record in boundaries:
        param_text = " ".join(
            f"{p.name}={dtype_name(p.dtype, short=True)}"
            for p in params
            if p.fqn == record.fqn and p.call == record.call
        )
        op_counts: Counter[str] = Counter()
        for op in ops:
            if op.fqn == record.fqn and op.call == record.call and op.phase == "forward":
                name = op.op.removeprefix("aten.").removesuffix(".default")
                dtypes = ",".join(dtype_name(d, short=True) for d in op.output_dtypes)
                op_counts[f"{name}->{dtypes or '-'}"] += 1
        rows.append(
            [
                _display_fqn(record.fqn),
                str(record.call),
                _leaves_text(record.inputs),
                _leaves_text(record.outputs) if record.completed else "(raised)",
                param_text or "-",
                " ".join(f"{k}x{n}" for k, n in op_counts.items()) or "-",
            ]
        )
    rows += [[_display_fqn(f), "-", "-", "-", "-", "-"] for f in uncalled]
    headers = ["module", "call", "inputs", "outputs", "materialized params", "forward ops"]
    return _format_table(headers, rows)


def _boundary_table(records: Sequence[BoundaryRecord]) -> str:
    headers = ["module", "call", "direction", "path", "dtype", "shape"]
    rows: list[list[str]] = []
    for b in records:
        for direction, leaves in (("input", b.inputs), ("output", b.outputs)):
            rows += [
                [
                    _display_fqn(b.fqn),
                    str(b.call),
                    direction,
                    leaf.path,
                    dtype_name(leaf.dtype),
                    str(list(leaf.shape)),
                ]
                for leaf in leaves
            ]
    return _format_table(headers, rows)


def _params_table(records: Sequence[MaterializedParamRecord]) -> str:
    headers = ["module", "call", "parameter", "dtype", "shape", "sharded"]
    rows = [
        [
            _display_fqn(p.fqn),
            str(p.call),
            p.name,
            dtype_name(p.dtype),
            str(list(p.shape)),
            str(p.sharded),
        ]
        for p in records
    ]
    return _format_table(headers, rows)


def _ops_table(records: Sequence[OpRecord]) -> str:
    headers = ["seq", "module", "call", "phase", "op", "inputs", "outputs"]
    rows = [
        [
            str(o.seq),
            _display_fqn(o.fqn),
            str(o.call),
            o.phase,
            o.op,
            _leaves_text(o.inputs),
            _leaves_text(o.outputs),
        ]
        for o in records
    ]
    return _format_table(headers, rows)


def _grads_table(records: Sequence[GradRecord]) -> str:
    headers = ["seq", "module", "parameter", "dtype", "shape"]
    rows = [
        [str(g.seq), _display_fqn(g.fqn), g.name, dtype_name(g.dtype), str(list(g.shape))]
        for g in records
    ]
    return _format_table(headers, rows)


def format_mismatches(mismatches: Sequence[BoundaryMismatch]) -> str:
    """A readable table of :func:`diff_boundaries` results (``"no mismatches"`` if empty)."""
    if not mismatches:
        return "no mismatches"
    rows = [
        [
            _display_fqn(m.fqn),
            str(m.call),
            m.direction,
            m.path,
            dtype_name(m.expected),
            dtype_name(m.observed),
        ]
        for m in mismatches
    ]
    return _format_table(["module", "call", "direction", "path", "expected", "observed"], rows)


def _format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(cell.ljust(w) for cell, w in zip(cells, widths, strict=True)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])
