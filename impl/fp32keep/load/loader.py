"""Dtype-aligned full-state-dict loading into an FSDP2 model: agree everywhere, then scatter.

The source rank holds the full dict; every other rank passes ``None``. Every step is a collective
every rank takes part in, so a bad input raises the same error on every rank instead of leaving a
peer waiting for the process-group timeout:

1. agree (:mod:`fp32keep.load.validate`): every rank reports its own problems (a non-mapping
   argument, an unsupported layout), its arguments, whether it holds a dict, a fingerprint of its
   model and which of its tensors are on the meta device;
2. validate: the source rank reads and checks every entry it needs and broadcasts the verdict;
   meta tensors that nothing would initialise are refused from the agreed data;
3. allocate: meta tensors (and only those) get storage (:mod:`fp32keep.load.meta`), installed
   in the model at once only where ``init_buffers`` must run on it; every rank reports how that
   went and which shards it can receive in place;
4. move (:mod:`fp32keep.load.move`): sharded tensors travel as each rank's own block (from the
   boxes gathered in step 1: any mesh FSDP2 builds, any ``Shard`` dim), replicated ones by
   broadcast, into that storage; the storage is installed in the model while the first bytes
   travel, and the ranks agree that it was. The destination dtype always wins.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fp32keep._torch.dispatch import version_counter
from fp32keep.devices import collective_device
from fp32keep.errors import (
    Fp32KeepError,
    Fp32KeepNotImplementedError,
    Fp32KeepRuntimeError,
    Fp32KeepTypeError,
    Fp32KeepValueError,
    StateDictError,
    hidden_in_tracebacks,
)
from fp32keep.load.meta import Fresh, allocate
from fp32keep.load.move import Target, collect_targets, cut_evenly, move, scatters_directly
from fp32keep.load.validate import (
    AGREED_ARGUMENTS,
    Report,
    Verdict,
    agree,
    fingerprint,
    state_dict_problem,
    uninitialized_error,
    validate,
    verdict_error,
)
from fp32keep.reprs import first_few
from fp32keep.tensors import check_module, module_problem

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024
DIRECT_BYTES = 1024 * 1024
"""Shards at least this large (per rank) of tensors cut into equal row runs are scattered alone."""

InitBuffers = Callable[[nn.Module], object]
"""Re-creates non-persistent buffers that no rank can send; called with the model."""


@dataclass(frozen=True)
class LoadResult:
    """What a non-strict load skipped.

    Attributes:
        missing_keys: destination tensors with no entry in the state dict (left untouched).
        unexpected_keys: state-dict entries the model does not have (ignored).
    """

    missing_keys: tuple[str, ...] = ()
    unexpected_keys: tuple[str, ...] = ()


def _local_report(
    model: nn.Module,
    state_dict: object,
    arguments: tuple[object, ...],
    init_buffers: object,
) -> tuple[Report, list[Target]]:
    """This rank's report; a problem found here is raised by every rank after the gather."""
    rank, world = dist.get_rank(), dist.get_world_size()
    src_rank = arguments[0]
    targets: list[Target] = []
    problem = state_dict_problem(state_dict, rank)
    if problem is None and (found := module_problem(model, where="load_full_state_dict")):
        problem = Fp32KeepTypeError, f"{found} [on rank {rank}]"
    if problem is None and not any(isinstance(m, FSDPModule) for m in model.modules()):
        problem = (
            Fp32KeepValueError,
            (
                f"{type(model).__name__} is not sharded: call fp32keep.apply_fsdp2(model, ...) "
                "before load_full_state_dict (for an unsharded model use model.load_state_dict)"
            ),
        )
    if problem is None and not (isinstance(src_rank, int) and 0 <= src_rank < world):
        problem = (
            Fp32KeepValueError,
            (f"src_rank={src_rank} is not a rank of this {world}-rank process group"),
        )
    if problem is None:
        problem = _size_problem(arguments)
    if problem is None and init_buffers is not None and not callable(init_buffers):
        problem = (
            Fp32KeepTypeError,
            (
                "init_buffers must be a callable that takes the model, got "
                f"{type(init_buffers).__name__}"
            ),
        )
    if problem is None:
        try:
            targets = collect_targets(model)
        except NotImplementedError as exc:
            problem = Fp32KeepNotImplementedError, str(exc)
    meta = bytes(int(t.local.is_meta) for t in targets)
    holds = state_dict is not None
    boxes = tuple(t.box for t in targets)
    report = Report(problem, holds, arguments, fingerprint(targets), meta, boxes)
    return report, targets


def _size_problem(arguments: tuple[object, ...]) -> tuple[type[Fp32KeepError], str] | None:
    """``bucket_bytes`` or ``direct_bytes`` that is no int >= 0 (a bool is no size)."""
    for name in ("bucket_bytes", "direct_bytes"):
        value = arguments[AGREED_ARGUMENTS.index(name)]
        if not isinstance(value, int) or isinstance(value, bool):
            return Fp32KeepTypeError, f"{name} must be an int number of bytes, got {value!r}"
        if value < 0:
            return Fp32KeepValueError, f"{name} must be a number of bytes >= 0, got {value}"
    return None


def _written(before: tuple[torch.Tensor, int], after: torch.Tensor) -> bool:
    tensor, version = before
    return not after.is_meta and (after is not tensor or version_counter(after) != version)


MATERIALISED = "; nothing was loaded (the meta tensors were materialised, uninitialised)"
UNCHANGED = "; nothing was loaded (the model is unchanged)"


@dataclass
class _Prepared:
    """How preparing went on this rank; ``outcome`` is what the other ranks are told.

    ``fresh`` holds the storage this rank receives its meta tensors into, installed in the model
    while the first bytes travel (:mod:`fp32keep.load.meta`); empty when they were installed
    before (``init_buffers`` needs a real model) or the rank has no meta tensor.
    """

    targets: list[Target]
    fresh: Fresh = field(default_factory=Fresh)
    problem: str | None = None
    cause: BaseException | None = None
    unwritten: tuple[str, ...] = ()
    direct_mask: bytes = b""

    @property
    def outcome(self) -> tuple[str | None, tuple[str, ...], bytes]:
        return self.problem, self.unwritten, self.direct_mask


def _prepare(
    model: nn.Module,
    targets: list[Target],
    reports: Sequence[Report],
    init_buffers: InitBuffers | None,
    device: torch.device,
    direct_bytes: int,
    src_rank: int,
) -> _Prepared:
    """Allocate storage for meta tensors, run ``init_buffers`` where needed; never raises (the
    ranks agree next)."""
    rank = dist.get_rank()
    needed = [
        i
        for i, t in enumerate(targets)
        if not t.persistent and reports[src_rank].meta[i] and reports[rank].meta[i]
    ]
    suffix = UNCHANGED
    fresh = Fresh()
    try:
        if any(reports[rank].meta):
            targets, fresh = allocate(targets, device)
        if needed and init_buffers is not None:
            # init_buffers writes the model's own buffers: install the storage first (nothing
            # has been received into it yet, so nothing is left for Fresh.finish to copy).
            suffix = MATERIALISED
            fresh.install(model)
            if fresh.error is not None:
                raise fresh.error
            fresh = Fresh()
            targets = collect_targets(model)
            before = {i: (targets[i].local, version_counter(targets[i].local)) for i in needed}
            layout = fingerprint(targets)
            try:
                init_buffers(model)
            except Exception as exc:
                problem = f"init_buffers raised on rank {rank}: {_describe(exc)}{suffix}"
                return _Prepared(targets, problem=problem, cause=exc)
            targets = collect_targets(model)
            if fingerprint(targets) != layout:
                problem = (
                    f"init_buffers changed the model on rank {rank} (names, shapes or dtypes); "
                    f"it must only write the buffers' values{suffix}"
                )
                return _Prepared(targets, problem=problem)
            unwritten = tuple(
                targets[i].key for i in needed if not _written(before[i], targets[i].local)
            )
            if unwritten:
                problem = (
                    f"init_buffers left these buffers unwritten on rank {rank}: "
                    f"{first_few(unwritten)}; it must fill (or re-register) every one of "
                    f"them{suffix}"
                )
                return _Prepared(targets, problem=problem, unwritten=unwritten)
        mask = bytes(int(scatters_directly(t, device, direct_bytes)) for t in targets)
    except Exception as exc:  # out of memory while allocating, for one
        problem = f"preparing the model raised on rank {rank}: {_describe(exc)}{suffix}"
        return _Prepared(targets, problem=problem, cause=exc)
    return _Prepared(targets, fresh, direct_mask=mask)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def load_full_state_dict(
    model: nn.Module,
    state_dict: Mapping[str, object] | None,
    *,
    src_rank: int = 0,
    cpu_offload: bool = False,
    strict: bool = True,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    direct_bytes: int = DIRECT_BYTES,
    init_buffers: InitBuffers | None = None,
) -> LoadResult:
    """Load a full (unsharded) state dict held by ``src_rank`` into an FSDP2-sharded model.

    Call it on every rank, with the same arguments, after :func:`fp32keep.apply_fsdp2`;
    ``src_rank`` passes the dict, every other rank passes ``None``.

    * The destination dtype wins for parameters and persistent buffers, for every alias
      (``remove_duplicate=False``); tied tensors stay tied.
    * The caller's mapping is only read, each needed value once: never mutated, its
      ``_metadata`` untouched. Values may be strided or expanded views; they load by value.
    * Every bad input is found before any tensor moves and raised on every rank within seconds,
      with the key and the fix, and nothing is changed (:class:`fp32keep.StateDictError` for the
      dict; ``TypeError``/``ValueError`` for the call): missing, unexpected, shape-mismatched,
      non-tensor, meta, wrong-kind (integer for float), DTensor (a sharded model's own
      ``state_dict()``), sparse, quantized or subclass values; a mapping that fails to list or
      read; a non-mapping argument (a checkpoint path); a dict on the wrong rank; ranks passing
      different arguments or holding different models. ``strict=False`` loads what fits and
      returns the missing and unexpected keys.
    * Tied aliases (one tensor, several keys) present under several keys must hold the same
      values in the destination dtype, else ``StateDictError`` names both keys.
      ``nn.Module.load_state_dict`` keeps the last one silently; refusing is safer because two
      different values for one tensor mean the checkpoint was saved untied (or is corrupt), and
      either choice would discard trained weights without a word.

    Meta-device models (any rank, any mix: ``torch.device("meta")``, accelerate's
    ``init_empty_weights``) are supported. Only meta tensors are materialised (on the CPU when
    ``cpu_offload``, else on the collective's device); real tensors are never replaced. Their
    storage is allocated before anything moves (a failure there is refused on every rank, the
    model unchanged), receives the bytes directly, and is installed in the model while the
    transfer runs (:mod:`fp32keep.load.meta`).

    * A persistent meta tensor is filled from the dict; one missing from it under
      ``strict=False`` would stay uninitialised, so it is refused on every rank (naming it and
      the ranks where it is meta). A missing tensor that is real on every rank is left untouched.
    * A non-persistent buffer (rotary ``inv_freq``; in no state dict) that is meta on some rank
      is sent from the source rank's model when it is real there, in the same buckets as the
      other buffers; ranks where it is real keep their own.
    * When it is meta on the source rank too, nothing can send it. Then ``init_buffers`` is
      required: it is called with the model, on each rank where such a buffer is meta, after
      materialisation and before any tensor moves; it must write every such buffer (in place or
      by re-registering it) and change no name, shape or dtype. Without it the load is refused,
      naming the buffers. The loader checks that each one was written (version counters) and
      turns an exception on any rank into a ``StateDictError`` on every rank; the model's meta
      tensors are then materialised but nothing was loaded. A version-neutral ``init_buffers``
      is the model's own ``__init__``: build the model again with parameters on the meta device
      and buffers real (accelerate's ``init_empty_weights()``) and copy its buffers::

          def init_buffers(model):
              with init_empty_weights():
                  fresh = dict(build_model().named_buffers())
              with torch.no_grad():
                  for name, buffer in model.named_buffers():
                      if not buffer.is_meta and name in fresh:  # materialised, not yet written
                          buffer.copy_(fresh[name])

      (Transformers' own ``_init_weights`` re-creates rotary buffers from 5.0 on but not in 4.x,
      and re-initialises parameters of the modules it visits, so the loader does not call it.)

    Any mesh FSDP2 shards over is served: a 1-D mesh over the process group, HSDP's 2-D
    replicate x shard mesh, a sub-mesh of a larger world (``mesh["dp"]`` of a DP x TP mesh), and
    ``Shard(d)`` placements on any dim from a ``shard_placement_fn``. Each rank reports the
    block of every tensor its own mesh coordinate gives it, and receives exactly that block
    (every replica of a shard gets it) from ``src_rank`` over the default process group, so
    every rank of the world takes part. Tensor-parallel placements (``Partial``, strided shards)
    raise ``NotImplementedError`` on every rank before anything moves.

    A block of at least ``direct_bytes`` that is a run of whole dim-0 rows, of one size on
    every rank, is scattered straight into place (asynchronously, no packing on either side;
    the inputs are views of the caller's tensors, and at most ``bucket_bytes`` of converted
    copies are alive when the dtype differs); the rest are coalesced into buckets of at most
    ``bucket_bytes`` summed over every destination. The source rank's extra memory is therefore
    about one bucket plus one tensor, whatever the world size; a non-source rank never holds
    more than its shards plus one bucket. Every collective is bounded by the process group's
    timeout.

    Returns:
        The missing and unexpected keys (empty after a strict load).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise Fp32KeepRuntimeError(
            "load_full_state_dict needs an initialised process group (launch with torchrun and "
            "call torch.distributed.init_process_group first)"
        )
    rank = dist.get_rank()
    given = init_buffers is not None
    arguments = (src_rank, strict, cpu_offload, bucket_bytes, direct_bytes, given)
    local, targets = _local_report(model, state_dict, arguments, init_buffers)
    reports = agree(local, src_rank, targets)

    shared: list[object] = [None]
    values: list[torch.Tensor | None] = []
    if rank == src_rank:
        assert isinstance(state_dict, Mapping)  # agree() checked it
        shared[0], values = validate(targets, state_dict)
    dist.broadcast_object_list(shared, src=src_rank)
    verdict = shared[0]
    assert isinstance(verdict, Verdict)
    error = verdict_error(verdict, strict, src_rank)
    if error is None:
        error = uninitialized_error(targets, verdict, reports, src_rank, given)
    if error is not None:
        raise error

    device = torch.device("cpu") if cpu_offload else collective_device()
    prepared = _prepare(model, targets, reports, init_buffers, device, direct_bytes, src_rank)
    targets = prepared.targets
    gathered: list[tuple[str | None, tuple[str, ...], bytes] | None] = [None] * len(reports)
    dist.all_gather_object(gathered, prepared.outcome)
    outcomes = [outcome for outcome in gathered if outcome is not None]
    for problem, unwritten, _ in outcomes:  # the lowest rank's problem, raised on every rank
        if problem is not None:
            raise StateDictError(problem, uninitialized=unwritten) from prepared.cause

    # Non-persistent buffers travel from the source to the ranks that hold them on meta.
    src_meta, own_meta = reports[src_rank].meta, reports[rank].meta
    sent = [
        i
        for i, t in enumerate(targets)
        if not t.persistent and not src_meta[i] and any(r.meta[i] for r in reports)
    ]
    present = [i for i, key in enumerate(verdict.sources) if key is not None] + sent
    keep = frozenset(i for i in sent if not own_meta[i])  # real here: never overwritten
    boxes = [report.boxes for report in reports]
    direct = [  # agreed: every rank can receive in place, every block is one size
        i
        for i in present
        if all(mask[i] for _, _, mask in outcomes)
        and cut_evenly(targets[i], [blocks[i] for blocks in boxes])
    ]

    def source(index: int) -> torch.Tensor:
        value = values[index] if targets[index].persistent else targets[index].local
        assert value is not None  # validate() read every present entry
        return value

    move(
        targets,
        present,
        direct,
        source,
        keep,
        boxes,
        rank=rank,
        src_rank=src_rank,
        device=device,
        bucket_bytes=bucket_bytes,
        in_flight_work=functools.partial(prepared.fresh.install, model),
    )
    if any(any(report.meta) for report in reports):
        _agree_installed(prepared.fresh, len(reports))
    prepared.fresh.finish()
    return LoadResult(verdict.missing, verdict.unexpected)


def _agree_installed(fresh: Fresh, world: int) -> None:
    """Raise on every rank if installing the received tensors failed on any (one small
    all-reduce: the lowest failing rank; its own exception is chained there)."""
    rank = dist.get_rank()
    failed = torch.tensor([world if fresh.error is None else rank], device=collective_device())
    dist.all_reduce(failed, op=dist.ReduceOp.MIN)
    first = int(failed.item())
    if first < world:
        raise StateDictError(
            f"installing the received tensors in the model raised on rank {first} (its "
            "exception is chained there); the load is incomplete and the model's meta tensors "
            "may be partly materialised: build the model again before retrying"
        ) from fresh.error


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of an FSDP2 model on every rank (all-gathers every shard).

    Every alias of a tied tensor appears under each of its names, like ``state_dict()``; values
    are unsharded CPU tensors in the model's storage dtypes. Meant for tests and round trips on
    models that fit in one rank's memory.
    """
    check_module(model, where="gather_full_state_dict")
    full: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict(keep_vars=False).items():
        tensor = value.full_tensor() if isinstance(value, DTensor) else value
        full[name] = tensor.detach().cpu().clone()
    return full
