"""Reading a probe's records: the raw records, per-module queries and reports.

It owns :class:`_ProbeQueries`, the read-only half of
:class:`~pytest_fp32keep.contract.probe.DtypeProbe`; the probe's hooks (in :mod:`.dtype_probe`)
fill the record lists it reads, and its text tables are laid out by :mod:`.render`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Literal

import torch
from torch import nn

from pytest_fp32keep.contract.probe.records import (
    BoundaryDtypes,
    BoundaryRecord,
    GradRecord,
    MaterializedParamRecord,
    OpDtypes,
    OpRecord,
    Phase,
    _display_fqn,
)
from pytest_fp32keep.contract.probe.render import (
    _boundary_table,
    _grads_table,
    _ops_table,
    _params_table,
    _summary_table,
)


class _ProbeQueries:
    """The queries and reports of :class:`~pytest_fp32keep.contract.probe.DtypeProbe`.

    A mixin: the probe sets every attribute declared here (in ``__init__`` and ``clear``).
    """

    _model_type: str
    _fqn_of: dict[nn.Module, str]
    _position: dict[str, int]
    _boundaries: list[BoundaryRecord]
    _params: list[MaterializedParamRecord]
    _ops: list[OpRecord]
    _grads: list[GradRecord]
    _calls: Counter[str]

    # ---- raw records

    @property
    def modules(self) -> tuple[str, ...]:
        """The probed FQNs, in ``named_modules()`` order."""
        return tuple(self._fqn_of.values())

    @property
    def boundary_records(self) -> tuple[BoundaryRecord, ...]:
        """Observation 1, in the order calls returned."""
        return tuple(self._boundaries)

    @property
    def param_records(self) -> tuple[MaterializedParamRecord, ...]:
        """Observation 2, in the order calls started."""
        return tuple(self._params)

    @property
    def op_records(self) -> tuple[OpRecord, ...]:
        """Observation 3, in execution order."""
        return tuple(self._ops)

    @property
    def grad_records(self) -> tuple[GradRecord, ...]:
        """Observation 4, in the order autograd produced the gradients."""
        return tuple(self._grads)

    def calls(self, fqn: str) -> int:
        """How many forward calls of ``fqn`` were seen."""
        self._check_fqn(fqn)
        return self._calls[fqn]

    # ---- per-module queries

    def _check_fqn(self, fqn: str) -> None:
        if fqn not in self._position:
            raise KeyError(f"DtypeProbe does not probe module {fqn!r}; it probes {self.modules}")

    def _resolve_call(self, fqn: str, call: int) -> int:
        self._check_fqn(fqn)
        count = self._calls[fqn]
        resolved = call + count if call < 0 else call
        if not 0 <= resolved < count:
            raise IndexError(
                f"module {_display_fqn(fqn)} has {count} recorded forward call(s); "
                f"call {call} does not exist"
            )
        return resolved

    def boundary(self, fqn: str, call: int = -1) -> BoundaryRecord:
        """The :class:`BoundaryRecord` of one call (``call=-1``: the latest, as in a list)."""
        resolved = self._resolve_call(fqn, call)
        for record in self._boundaries:
            if record.fqn == fqn and record.call == resolved:
                return record
        raise LookupError(f"call {resolved} of {_display_fqn(fqn)} has not returned yet")

    def boundary_dtypes(self, fqn: str, call: int = -1) -> BoundaryDtypes:
        """Observation 1 for one call: input and output dtype per leaf path."""
        record = self.boundary(fqn, call)
        return BoundaryDtypes(record.input_dtypes, record.output_dtypes)

    def materialized_dtypes(self, fqn: str, call: int = -1) -> dict[str, torch.dtype]:
        """Observation 2 for one call: the dtype of each own parameter as ``forward`` saw it."""
        resolved = self._resolve_call(fqn, call)
        return {r.name: r.dtype for r in self._params if r.fqn == fqn and r.call == resolved}

    def op_records_of(
        self, fqn: str, call: int = -1, *, phase: Phase | None = "forward"
    ) -> list[OpRecord]:
        """Observation 3 for one call, in execution order; ``phase=None`` gives both phases."""
        resolved = self._resolve_call(fqn, call)
        return [
            r
            for r in self._ops
            if r.fqn == fqn and r.call == resolved and (phase is None or r.phase == phase)
        ]

    def op_dtypes(
        self, fqn: str, call: int = -1, *, phase: Phase | None = "forward"
    ) -> list[OpDtypes]:
        """Observation 3 for one call as ``(op, input dtypes, output dtypes)`` tuples.

        By default only the ``"forward"`` phase: what the module's own code ran, not FSDP2's
        unshard and casts around it (``phase="hooks"``).
        """
        return [
            OpDtypes(r.op, r.input_dtypes, r.output_dtypes)
            for r in self.op_records_of(fqn, call, phase=phase)
        ]

    def grad_dtypes(self, fqn: str) -> dict[str, torch.dtype]:
        """Observation 4: the latest gradient dtype seen per own parameter of ``fqn``."""
        self._check_fqn(fqn)
        return {r.name: r.dtype for r in self._grads if r.fqn == fqn}

    # ---- reports

    def to_dict(self) -> dict[str, Any]:
        """Every record in a JSON-able form (``json.dumps`` works on it)."""
        return {
            "model_type": self._model_type,
            "modules": list(self.modules),
            "calls": {fqn: self._calls[fqn] for fqn in self.modules},
            "boundary": [r.to_dict() for r in self._boundaries],
            "materialized_params": [r.to_dict() for r in self._params],
            "ops": [r.to_dict() for r in self._ops],
            "grads": [r.to_dict() for r in self._grads],
        }

    def summary(self, *, only_called: bool = True) -> str:
        """One row per module call with all observations side by side, clearly separated.

        Columns: boundary inputs, boundary outputs, materialised parameters, and the forward
        operators grouped as ``op->result dtypes xcount``.
        """
        boundaries = sorted(self._boundaries, key=lambda r: (self._order(r.fqn), r.call))
        uncalled: list[str] = []
        if not only_called:
            called = {r.fqn for r in self._boundaries}
            uncalled = [f for f in self.modules if f not in called]
        return _summary_table(boundaries, self._params, self._ops, uncalled)

    def as_table(self, kind: Literal["boundary", "params", "ops", "grads"] = "boundary") -> str:
        """A detailed text table of one observation, one row per leaf/parameter/operator."""
        if kind == "boundary":
            return _boundary_table(self._boundaries)
        if kind == "params":
            return _params_table(self._params)
        if kind == "ops":
            return _ops_table(self._ops)
        if kind == "grads":
            return _grads_table(self._grads)
        raise ValueError(f"kind must be boundary, params, ops or grads, not {kind!r}")

    def _order(self, fqn: str) -> int:
        return self._position[fqn]
