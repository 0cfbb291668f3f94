"""What every rank agrees on before :func:`fp32keep.load_full_state_dict` moves a tensor.

Every precondition is either computed from data all ranks share (the gathered reports, the
broadcast verdict) or reported through one of those collectives, so an error found on one rank is
raised on every rank, with the same type and, but for the rank that names itself, the same
message. Nothing here writes to the model or to the caller's mapping.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fp32keep.errors import (
    Fp32KeepError,
    Fp32KeepTypeError,
    Fp32KeepValueError,
    StateDictError,
    hidden_in_tracebacks,
)
from fp32keep.load.move import Box, Target
from fp32keep.reprs import SHOWN, and_more, clipped_repr, first_few, first_lines
from fp32keep.tensors import dtype_name

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks

#: The argument names whose values every rank must pass alike, in the order reports carry them.
AGREED_ARGUMENTS = ("src_rank", "strict", "cpu_offload", "bucket_bytes", "direct_bytes")


@dataclass(frozen=True)
class Report:
    """What one rank tells the others before anything moves (small and picklable).

    Attributes:
        problem: an error found on this rank alone, as ``(exception class, message)``.
        holds: whether this rank passed a state dict.
        arguments: the values of :data:`AGREED_ARGUMENTS` and whether ``init_buffers`` is given.
        fingerprint: the model's names, shapes, dtypes and layout, hashed.
        meta: one byte per target, 1 where this rank's tensor is on the meta device.
        boxes: per target, this rank's block of the full tensor (from its mesh coordinate).
    """

    problem: tuple[type[Fp32KeepError], str] | None
    holds: bool
    arguments: tuple[object, ...]
    fingerprint: str
    meta: bytes
    boxes: tuple[Box, ...] = ()


#: One target as the ranks compare it: names (tied aliases together), full shape, dtype,
#: sharded, persistent.
LayoutRow = tuple[tuple[str, ...], tuple[int, ...], str, bool, bool]


def layout_rows(targets: Sequence[Target]) -> list[LayoutRow]:
    return [(t.names, t.full_shape, str(t.dtype), t.sharded, t.persistent) for t in targets]


def fingerprint(targets: Sequence[Target]) -> str:
    digest = hashlib.sha256()
    for row in layout_rows(targets):
        digest.update(repr(row).encode())
    return digest.hexdigest()


def _others(name: str, names: tuple[str, ...]) -> str:
    others = [other for other in names if other != name]
    return f"tied to {others}" if others else "untied"


def layout_differences(
    a: Sequence[LayoutRow], b: Sequence[LayoutRow], ra: int, rb: int
) -> list[str]:
    """How rank ``rb``'s model differs from rank ``ra``'s, one line per difference, by name."""
    rows_a = {name: row for row in a for name in row[0]}
    rows_b = {name: row for row in b for name in row[0]}
    found: list[str] = []
    told: set[str] = set()
    for name in sorted(rows_a.keys() | rows_b.keys()):
        row_a, row_b = rows_a.get(name), rows_b.get(name)
        if row_a is None or row_b is None:
            found.append(f"{name!r} is on rank {ra if row_b is None else rb} only")
        elif row_a[0] != row_b[0]:
            if name not in told:  # one line per tie, not one per alias
                found.append(
                    f"{name!r} is {_others(name, row_a[0])} on rank {ra}, "
                    f"{_others(name, row_b[0])} on rank {rb}"
                )
                told.update(row_a[0] + row_b[0])
        elif row_a != row_b and name == row_a[0][0]:
            fields = ("shape", "dtype", "sharded", "persistent")
            found += [
                f"{name!r}: {field} {x} on rank {ra}, {y} on rank {rb}"
                for field, x, y in zip(fields, row_a[1:], row_b[1:], strict=True)
                if x != y
            ]
    return found


def _model_difference(targets: Sequence[Target], reports: Sequence[Report]) -> str:
    """What differs between rank 0's model and the first rank's whose fingerprint differs: the
    same text on every rank (one more collective, on this failure path alone)."""
    layouts: list[list[LayoutRow] | None] = [None] * len(reports)
    dist.all_gather_object(layouts, layout_rows(targets))
    other = next(r for r, rep in enumerate(reports) if rep.fingerprint != reports[0].fingerprint)
    first, second = layouts[0], layouts[other]
    assert first is not None and second is not None
    found = layout_differences(first, second, 0, other)
    shown = "; ".join(found[:SHOWN]) + and_more(len(found))
    text = f": {shown}" if shown else ""
    if any(" tied to " in line for line in found):
        text += (
            ". A tied weight is untied on some rank: tie it there before apply_fsdp2 "
            "(model.tie_weights(), as from_pretrained does at its end; Transformers 5.0.0 "
            "leaves a model built under torch.device('meta') untied)"
        )
    return text


def agree(local: Report, src_rank: int, targets: Sequence[Target] = ()) -> list[Report]:
    """Gather every rank's report and raise, on every rank, if the ranks cannot load together.

    ``targets`` are this rank's (:func:`fp32keep.load.move.collect_targets`): when the ranks'
    models differ, the refusal names how.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered: list[Report | None] = [None] * world
    dist.all_gather_object(gathered, local)
    reports = [report for report in gathered if report is not None]
    assert len(reports) == world
    for report in reports:  # the lowest rank's own problem, raised alike on every rank
        if report.problem is not None:
            kind, message = report.problem
            raise kind(message)
    if any(report.arguments != local.arguments for report in reports):
        names = (*AGREED_ARGUMENTS, "init_buffers given")
        differing = []
        for position, name in enumerate(names):
            values: dict[str, list[int]] = {}
            for r, report in enumerate(reports):
                values.setdefault(repr(report.arguments[position]), []).append(r)
            if len(values) > 1:
                where = ", ".join(
                    f"{value} on ranks {first_few(ranks)}" for value, ranks in values.items()
                )
                differing.append(f"{name}: {where}")
        raise Fp32KeepValueError(
            "load_full_state_dict was called with different arguments on different ranks ("
            + "; ".join(differing)
            + "); every rank must pass the same ones"
        )
    holders = [r for r, report in enumerate(reports) if report.holds]
    if holders != [src_rank]:
        where = f"ranks {first_few(holders)}" if holders else "no rank"
        raise Fp32KeepValueError(
            f"load_full_state_dict: the full state dict is held by {where}; it must be held by "
            f"src_rank={src_rank} alone (pass None on every other rank) [raised on rank {rank}]"
        )
    differing_ranks = [r for r, rep in enumerate(reports) if rep.fingerprint != local.fingerprint]
    if differing_ranks:
        # every rank gets here (some rank differs from each), so the extra collective pairs up
        how = _model_difference(targets, reports)
        raise Fp32KeepValueError(
            f"load_full_state_dict: the model on ranks {first_few(differing_ranks)} differs "
            f"from rank {rank}'s (names, shapes or dtypes); every rank must build and shard the "
            f"same model{how}"
        )
    return reports


def state_dict_problem(state_dict: object, rank: int) -> tuple[type[Fp32KeepError], str] | None:
    """A ``state_dict`` argument that is neither ``None`` nor a mapping, as a local problem."""
    if state_dict is None or isinstance(state_dict, Mapping):
        return None
    shown = clipped_repr(state_dict, 80)
    hint = (
        " (a checkpoint path? load it first, e.g. safetensors.torch.load_file(path) or "
        "torch.load(path, weights_only=True))"
        if isinstance(state_dict, str | bytes) or hasattr(state_dict, "__fspath__")
        else ""
    )
    return Fp32KeepTypeError, (
        f"load_full_state_dict: state_dict on rank {rank} is a {type(state_dict).__name__}, "
        f"{shown}, not a mapping of names to tensors{hint}; pass the full state dict on the "
        "source rank and None on every other rank"
    )


@dataclass(frozen=True)
class Verdict:
    """The source rank's findings, broadcast to every rank (no tensors in it)."""

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[tuple[str, str], ...] = ()
    # for every target, the state-dict key that feeds it (None when missing or non-persistent)
    sources: tuple[str | None, ...] = ()
    failure: str | None = None  # reading the mapping itself failed


def family(dtype: torch.dtype) -> str:
    if dtype.is_floating_point:
        return "floating"
    if dtype.is_complex:
        return "complex"
    return "bool" if dtype == torch.bool else "integer"


def entry_problem(value: object, target: Target) -> str | None:
    """Why ``value`` cannot be loaded into ``target``, or None. Reads no tensor data."""
    if not isinstance(value, torch.Tensor):
        return f"is a {type(value).__name__}, not a tensor"
    if isinstance(value, DTensor):
        # the pack would run DTensor collectives on the source rank alone: every rank hangs
        return (
            f"is a DTensor sharded as {tuple(value.placements)}, not a full tensor: this looks "
            "like a sharded model's own state_dict(); gather it first, e.g. "
            "fp32keep.gather_full_state_dict(model) or torch.distributed.checkpoint.state_dict."
            "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))"
        )
    if type(value) not in (torch.Tensor, nn.Parameter):
        return (
            f"is a {type(value).__name__}, a tensor subclass; pass plain torch.Tensor values "
            "(the loader moves raw bytes, and a subclass may run collectives of its own)"
        )
    if value.is_meta:
        return "is on the meta device and holds no data"
    if value.is_nested:
        return "is a nested tensor; pass a dense one (e.g. value.to_padded_tensor(0.0))"
    if value.layout != torch.strided:
        return f"is a {value.layout} tensor; pass a dense one (value.to_dense())"
    if value.is_quantized:
        return f"is a quantized tensor ({dtype_name(value.dtype)}); pass value.dequantize()"
    if tuple(value.shape) != target.full_shape:
        return f"has shape {tuple(value.shape)}, the model expects {target.full_shape}"
    if family(value.dtype) != family(target.dtype):
        return (
            f"is {dtype_name(value.dtype)} ({family(value.dtype)}) but the model's tensor is "
            f"{dtype_name(target.dtype)} ({family(target.dtype)})"
        )
    return None


def same_values(first: torch.Tensor, other: torch.Tensor, dtype: torch.dtype) -> bool:
    """Bit-for-bit equal once both are in the destination dtype (NaNs compare equal)."""
    if first is other or (
        first.dtype == other.dtype
        and first.stride() == other.stride()
        and first.storage_offset() == other.storage_offset()
        and first.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()
    ):
        return True
    a = first.detach().to(dtype).contiguous().reshape(-1).view(torch.uint8)
    b = other.detach().to(dtype).contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(a, b)


def validate(
    targets: Sequence[Target], state_dict: Mapping[Any, object]
) -> tuple[Verdict, list[torch.Tensor | None]]:
    """Check ``state_dict`` against the model on the source rank; never raises.

    Every value the load needs is read here, once, and returned: the move phase uses these very
    tensors, so a mapping that fails (or changes) on a second read cannot fail mid-load. Tied
    aliases present under several keys must hold the same values: refused otherwise (see
    :func:`fp32keep.load_full_state_dict`).
    """
    values: list[torch.Tensor | None] = [None] * len(targets)
    try:
        keys = list(iter(state_dict))  # not list(mapping): that also calls a __len__ that may fail
    except Exception as exc:
        failure = f"listing the state dict's keys raised {type(exc).__name__}: {exc}"
        return Verdict(failure=failure), values
    try:
        return _validate_entries(targets, state_dict, keys, values), values
    except Exception as exc:  # a mapping that breaks in a way not foreseen above
        failure = f"validating the state dict raised {type(exc).__name__}: {exc}"
        return Verdict(failure=failure), [None] * len(targets)


def _validate_entries(
    targets: Sequence[Target],
    state_dict: Mapping[Any, object],
    keys: Sequence[object],
    values: list[torch.Tensor | None],
) -> Verdict:
    named = {key for key in keys if isinstance(key, str)}
    mismatched = [
        (
            clipped_repr(key),
            f"is a {type(key).__name__} key; state-dict keys are tensor names (str)",
        )
        for key in keys
        if not isinstance(key, str)
    ]
    claimed: set[str] = set()
    missing: list[str] = []
    sources: list[str | None] = []
    for index, target in enumerate(targets):
        present = [name for name in target.names if name in named] if target.persistent else []
        claimed.update(present)
        sources.append(present[0] if present else None)
        if target.persistent and not present:
            missing.append(target.key)
        read: list[tuple[str, torch.Tensor]] = []
        for name in present:
            try:
                value = state_dict[name]
            except Exception as exc:
                mismatched.append((name, f"reading it raised {type(exc).__name__}: {exc}"))
                continue
            reason = entry_problem(value, target)
            if reason is not None:
                mismatched.append((name, reason))
            elif isinstance(value, torch.Tensor):
                read.append((name, value))
        if read and len(read) == len(present):
            values[index] = read[0][1]
            first_name, first = read[0]
            for name, value in read[1:]:
                if not same_values(first, value, target.dtype):
                    mismatched.append(
                        (
                            name,
                            f"holds other values than {first_name!r}, its tied alias (one "
                            "tensor in the model); load_state_dict would silently keep the "
                            "last one. Drop the key you do not want, or untie the model's "
                            "weights (e.g. tie_word_embeddings=False) to keep both",
                        )
                    )
    unexpected = [key for key in keys if isinstance(key, str) and key not in claimed]
    return Verdict(tuple(missing), tuple(unexpected), tuple(mismatched), tuple(sources))


def verdict_error(verdict: Verdict, strict: bool, src_rank: int) -> StateDictError | None:
    """The error every rank raises for ``verdict``, or None when the dict can be loaded."""
    headline = f"the full state dict on rank {src_rank} does not fit the model; nothing was loaded."
    if verdict.failure is not None:
        return StateDictError(
            f"{headline}\n{verdict.failure}; pass a mapping whose keys and values can be read "
            "(e.g. a dict from safetensors.torch.load_file)"
        )
    problems: list[str] = []
    if verdict.mismatched:
        problems.append(
            f"entries that cannot be loaded ({len(verdict.mismatched)}):\n"
            + "\n".join(first_lines([f"  {key}: {why}" for key, why in verdict.mismatched]))
        )
    if strict and verdict.missing:
        problems.append(f"missing keys ({len(verdict.missing)}): {first_few(verdict.missing)}")
    if strict and verdict.unexpected:
        count = len(verdict.unexpected)
        problems.append(f"unexpected keys ({count}): {first_few(verdict.unexpected)}")
    if not problems:
        return None
    hint = (
        " Pass strict=False to skip missing and unexpected keys." if not verdict.mismatched else ""
    )
    return StateDictError(
        headline + "\n" + "\n".join(problems) + hint,
        missing=verdict.missing,
        unexpected=verdict.unexpected,
        mismatched=verdict.mismatched,
    )


def uninitialized_error(
    targets: Sequence[Target],
    verdict: Verdict,
    reports: Sequence[Report],
    src_rank: int,
    has_init_buffers: bool,
) -> StateDictError | None:
    """Meta tensors that nothing would initialise, or None (decided from agreed data alone)."""
    lines: list[str] = []
    names: list[str] = []
    buffers: list[str] = []
    for index, target in enumerate(targets):
        meta_on = [r for r, report in enumerate(reports) if report.meta[index]]
        if not meta_on:
            continue
        if target.persistent and verdict.sources[index] is None:
            names.append(target.key)
            lines.append(
                f"  {target.key}: missing from the state dict and on the meta device on ranks "
                f"{first_few(meta_on)}, so it would hold garbage there; put it in the state dict, "
                "or build it for real on those ranks"
            )
        elif not target.persistent and src_rank in meta_on and not has_init_buffers:
            buffers.extend(target.names)
    lines = first_lines(lines)  # the buffers' line below is never cut
    if buffers:
        names.extend(buffers)
        lines.append(
            f"  non-persistent buffers on the meta device on the source rank (rank {src_rank}), "
            f"so no rank can send them, and in no state dict: {first_few(buffers)}. Build the "
            "model on the source rank with real buffers (a real build, or accelerate's "
            "init_empty_weights(), which puts only parameters on the meta device), or pass "
            "init_buffers=, a callable that re-creates them once the model is materialised"
        )
    if not lines:
        return None
    return StateDictError(
        "load_full_state_dict would leave tensors on the meta device uninitialised; nothing was "
        "loaded.\n" + "\n".join(lines),
        missing=verdict.missing,
        unexpected=verdict.unexpected,
        uninitialized=names,
    )
