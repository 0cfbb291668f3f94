"""Bad inputs to ``load_full_state_dict`` are errors on every rank within seconds, never hangs.

Each of these was refused on the source rank alone (a peer then waited out the process-group
timeout) or, for a sharded model's own ``state_dict()``, ran DTensor collectives on the source
rank alone: every rank hung. Now every precondition is agreed before the first tensor moves:
every rank raises the same error, naming the key and the fix, and nothing changed on any rank.
Also here: tied aliases that disagree, and views that must load by value.
"""

from __future__ import annotations

import functools
import pathlib
import re
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import fp32keep
from fp32keep import Fp32KeepTypeError, StateDictError
from tests.core.toys import stack_class
from tests.error_bounds import LIBRARY_BOUND_S
from tests.multirank.refusals import refused_on_every_rank as shared_refused_on_every_rank
from tests.untouched import assert_same_parameters, snapshot

pytestmark = pytest.mark.fsdp2  # every test runs in the ranks (2 by default)

BF16, FP32 = torch.bfloat16, torch.float32
SEMANTICS = "5.10.4"  # toy declarations use 5.x glob entries; see tests/core/test_layout.py
BF16_POLICY = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)


def rank() -> int:
    return dist.get_rank()


E = TypeVar("E", bound=BaseException)

#: Every rank raises the same error within the library bound (tests/multirank/refusals.py).
refused_on_every_rank = functools.partial(shared_refused_on_every_rank, bound=LIBRARY_BOUND_S)


def sharded_stack(mesh: DeviceMesh, *, tied: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = stack_class(strict=["wo"])()
    if tied:
        model.head.weight = model.embed.weight
    plan = fp32keep.resolve_keep_plan(model, BF16, transformers_version=SEMANTICS)
    fp32keep.keep_aware_cast(model, BF16, plan=plan)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=BF16_POLICY, plan=plan)
    return model


def fresh_full_state() -> OrderedDict[str, torch.Tensor]:
    torch.manual_seed(123)
    return stack_class(strict=["wo"])().state_dict()


def plain(value: object) -> object:
    """A comparable copy of a value, read without any collective (DTensor: the local shard)."""
    if isinstance(value, DTensor):
        return value.to_local().detach().clone()
    if isinstance(value, torch.Tensor):
        if value.is_quantized:
            return value.dequantize()
        return value.to_dense().clone() if value.layout != torch.strided else value.clone()
    return value


def held(state: Mapping[str, object]) -> dict[str, tuple[int, object]]:
    return {key: (id(value), plain(value)) for key, value in state.items()}


def assert_held(state: Mapping[str, object], before: dict[str, tuple[int, object]]) -> None:
    """The caller's mapping holds the same objects with the same values."""
    now = held(state)
    assert list(now) == list(before)
    for key, (identity, value) in before.items():
        assert now[key][0] == identity, key
        if isinstance(value, torch.Tensor):
            assert value.is_meta or torch.equal(now[key][1], value), key  # type: ignore[arg-type]


def assert_refused_untouched(
    mesh: DeviceMesh,
    source: Mapping[str, object] | object,
    expected: type[E],
    match: str,
    *,
    given: Callable[[object], object] | None = None,
    **kwargs: object,
) -> E:
    """Load ``source`` (on rank 0; ``given(source)`` elsewhere): refused everywhere, no change."""
    model = sharded_stack(mesh)
    before = snapshot(model)
    if isinstance(source, dict):
        kept = held(source)
    theirs = source if rank() == 0 else (given(source) if given else None)
    error = refused_on_every_rank(
        lambda: fp32keep.load_full_state_dict(model, theirs, **kwargs),  # type: ignore[arg-type]
        expected,
        match,
    )
    assert_same_parameters(model, before)
    if isinstance(source, dict):
        assert_held(source, kept)
    return error


# --- the argument itself ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        pytest.param("/ckpt/model.safetensors", id="str"),
        pytest.param(pathlib.Path("/ckpt/model.safetensors"), id="path"),
    ],
)
def test_checkpoint_path_instead_of_a_dict(mesh: DeviceMesh, path: object) -> None:
    error = assert_refused_untouched(
        mesh,
        path,
        TypeError,
        r"state_dict on rank 0 is a \w+, .*model\.safetensors.*, not a mapping of names to "
        r"tensors \(a checkpoint path\? load it first, e\.g\. safetensors\.torch\.load_file",
    )
    assert "None on every other rank" in str(error)


def test_non_mapping_on_a_non_source_rank(mesh: DeviceMesh) -> None:
    assert_refused_untouched(
        mesh,
        fresh_full_state(),
        TypeError,
        r"state_dict on rank 1 is a list, \[\], not a mapping of names to tensors; pass the "
        r"full state dict on the source rank and None on every other rank",
        given=lambda _: [],
    )


def test_ranks_passing_different_arguments(mesh: DeviceMesh) -> None:
    model = sharded_stack(mesh)
    before = snapshot(model)
    source = fresh_full_state()
    kept = held(source)
    refused_on_every_rank(
        lambda: fp32keep.load_full_state_dict(
            model, source if rank() == 0 else None, strict=rank() == 0, bucket_bytes=64
        ),
        ValueError,
        re.escape(
            "load_full_state_dict was called with different arguments on different ranks "
            "(strict: True on ranks [0], False on ranks [1]); every rank must pass the same ones"
        ),
    )
    assert_same_parameters(model, before)
    assert_held(source, kept)


def test_init_buffers_that_is_not_callable(mesh: DeviceMesh) -> None:
    assert_refused_untouched(
        mesh,
        fresh_full_state(),
        TypeError,
        r"init_buffers must be a callable that takes the model, got str",
        init_buffers="rope",
    )


# --- entries --------------------------------------------------------------------------------------


class Failing(Mapping[str, object]):
    """A lazy checkpoint whose reads fail: ``__getitem__`` or ``__iter__`` raises."""

    def __init__(self, inner: Mapping[str, torch.Tensor], *, fail_on: str) -> None:
        self.inner, self.fail_on = inner, fail_on

    def __getitem__(self, key: str) -> object:
        if self.fail_on == key:
            raise OSError(f"shard file for {key} is gone")
        return self.inner[key]

    def __iter__(self) -> Iterator[str]:
        if self.fail_on == "__iter__":
            raise OSError("index file is gone")
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)


@pytest.mark.parametrize(
    ("fail_on", "match"),
    [
        pytest.param(
            "layers.0.attn.weight",
            r"layers\.0\.attn\.weight: reading it raised OSError: shard file for "
            r"layers\.0\.attn\.weight is gone",
            id="getitem",
        ),
        pytest.param(
            "__iter__",
            r"listing the state dict's keys raised OSError: index file is gone; pass a mapping",
            id="iter",
        ),
    ],
)
def test_mapping_that_raises_when_read(mesh: DeviceMesh, fail_on: str, match: str) -> None:
    inner = fresh_full_state()
    kept = held(inner)
    error = assert_refused_untouched(mesh, Failing(inner, fail_on=fail_on), StateDictError, match)
    assert "nothing was loaded" in str(error)
    assert_held(inner, kept)


def dtensor_state(mesh: DeviceMesh) -> dict[str, object]:
    """A sharded model's own ``state_dict()``: DTensor values, built on every rank."""
    return dict(sharded_stack(mesh).state_dict())


@pytest.mark.parametrize(
    ("key", "make", "match"),
    [
        pytest.param(
            "layers.0.attn.weight",
            lambda: torch.eye(8).to_sparse(),
            r"layers\.0\.attn\.weight: is a torch\.sparse_coo tensor; pass a dense one "
            r"\(value\.to_dense\(\)\)",
            id="sparse",
        ),
        pytest.param(
            "layers.0.attn.weight",
            lambda: torch.empty(8, 8, device="meta"),
            r"layers\.0\.attn\.weight: is on the meta device and holds no data",
            id="meta",
        ),
        pytest.param(
            "layers.0.attn.bias",
            lambda: torch.quantize_per_tensor(torch.zeros(8), 0.1, 0, torch.qint8),
            r"layers\.0\.attn\.bias: is a quantized tensor \(torch\.qint8\); pass "
            r"value\.dequantize\(\)",
            id="quantized",
        ),
        pytest.param(
            "layers.0.attn.bias",
            lambda: torch.zeros(8).as_subclass(Subclass),
            r"layers\.0\.attn\.bias: is a Subclass, a tensor subclass; pass plain torch\.Tensor",
            id="subclass",
        ),
    ],
)
def test_entries_that_are_not_plain_dense_tensors(
    mesh: DeviceMesh, key: str, make: Callable[[], torch.Tensor], match: str
) -> None:
    source: dict[str, object] = dict(fresh_full_state())
    source[key] = make()
    error = assert_refused_untouched(mesh, source, StateDictError, match)
    assert [k for k, _ in error.mismatched] == [key]


class Subclass(torch.Tensor):
    """A tensor subclass the loader does not know."""


def test_sharded_models_own_state_dict_of_dtensors(mesh: DeviceMesh) -> None:
    source = dtensor_state(mesh)  # a collective: every rank builds it
    error = assert_refused_untouched(
        mesh,
        source,
        StateDictError,
        r"embed\.weight: is a DTensor sharded as \(Shard\(dim=0\),\), not a full tensor: this "
        r"looks like a sharded model's own state_dict\(\); gather it first, e\.g\. "
        r"fp32keep\.gather_full_state_dict\(model\)",
    )
    assert {key for key, _ in error.mismatched} == set(source)  # every entry named


def test_non_string_keys(mesh: DeviceMesh) -> None:
    source: dict[object, object] = dict(fresh_full_state())
    source[3] = torch.zeros(1)
    assert_refused_untouched(
        mesh,
        source,
        StateDictError,
        r"  3: is a int key; state-dict keys are tensor names \(str\)",
    )


def test_strided_views_load_by_value(mesh: DeviceMesh) -> None:
    reference = fresh_full_state()
    base = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    views = {
        "layers.0.attn.weight": base[:, ::2],  # every other column: strided
        "layers.0.wo.weight": base[:, :8].t(),  # transposed
        "layers.1.attn.weight": torch.randn(8).expand(8, 8),  # stride 0 rows
        "layers.1.attn.bias": base.reshape(-1)[5:13],  # a storage offset
    }
    source = {**reference, **views}
    assert not any(v.is_contiguous() for v in list(views.values())[:3])
    for direct_bytes in (0, 1 << 30):  # straight into place, and through buckets
        model = sharded_stack(mesh)
        fp32keep.load_full_state_dict(
            model, source if rank() == 0 else None, direct_bytes=direct_bytes
        )
        full = fp32keep.gather_full_state_dict(model)
        for key, value in source.items():
            assert torch.equal(full[key], value.to(full[key].dtype)), (key, direct_bytes)


# --- tied aliases ---------------------------------------------------------------------------------


def test_tied_aliases_that_disagree_are_refused_naming_both(mesh: DeviceMesh) -> None:
    model = sharded_stack(mesh, tied=True)
    before = snapshot(model)
    source = fresh_full_state()
    source["head.weight"] = source["embed.weight"] + 1  # saved untied, loaded into a tied model
    kept = held(source)
    error = refused_on_every_rank(
        lambda: fp32keep.load_full_state_dict(model, source if rank() == 0 else None),
        StateDictError,
        r"head\.weight: holds other values than 'embed\.weight', its tied alias",
    )
    assert error.mismatched[0][0] == "head.weight"
    assert "Drop the key you do not want, or untie" in str(error)
    assert_same_parameters(model, before)
    assert_held(source, kept)


def test_tied_aliases_equal_in_the_destination_dtype_load(mesh: DeviceMesh) -> None:
    model = sharded_stack(mesh, tied=True)
    source = fresh_full_state()
    source["head.weight"] = source["embed.weight"].to(BF16)  # another object and dtype
    fp32keep.load_full_state_dict(model, source if rank() == 0 else None)
    assert model.head.weight is model.embed.weight
    full = fp32keep.gather_full_state_dict(model)
    assert torch.equal(full["head.weight"], source["embed.weight"].to(BF16))


# --- sizes: bounded messages, wrong-typed arguments ----------------------------------------------

UNEXPECTED = 2_000_000
MESSAGE_LIMIT = 4096  # bytes of a refusal naming any number of keys (tests/core: the same)


def test_two_million_unexpected_keys_are_refused_with_a_bounded_message(mesh: DeviceMesh) -> None:
    """The message used to list every key: 45 MB, 16 s on rank 1. Now the first few and a
    count, on every rank; ``error.unexpected`` still holds every key."""
    model = sharded_stack(mesh)
    before = snapshot(model)
    source: dict[str, object] = dict(fresh_full_state())
    empty = torch.zeros(0)  # one 0-element tensor under every extra key: cheap to hold
    source.update(dict.fromkeys((f"extra.{i}.weight" for i in range(UNEXPECTED)), empty))
    error = refused_on_every_rank(
        lambda: fp32keep.load_full_state_dict(model, source if rank() == 0 else None),
        StateDictError,
        re.escape(
            "unexpected keys (2000000): ['extra.0.weight', 'extra.1.weight', 'extra.2.weight', "
            "'extra.3.weight', 'extra.4.weight'] … and 1999995 more"
        ),
    )
    assert len(str(error)) < MESSAGE_LIMIT, len(str(error))
    assert len(error.unexpected) == UNEXPECTED
    assert_same_parameters(model, before)


@pytest.mark.parametrize(
    ("argument", "match"),
    [
        pytest.param(
            "model",
            r"load_full_state_dict: model must be a torch\.nn\.Module, got None of type "
            r"NoneType; pass the model itself \[on rank 1\]",
            id="model-not-a-module-on-rank-1",
        ),
        pytest.param(
            "bucket_bytes",
            r"bucket_bytes must be an int number of bytes, got '256MB'",
            id="bucket-bytes-a-string",
        ),
    ],
)
def test_wrong_typed_arguments_are_refused_on_every_rank(
    mesh: DeviceMesh, argument: str, match: str
) -> None:
    """They used to raise what their first use raised (``'NoneType' object has no attribute
    'modules'`` on rank 1 alone, its peer left waiting); now a ``TypeError`` on every rank."""
    model = sharded_stack(mesh)
    before = snapshot(model)
    source = fresh_full_state()
    theirs = source if rank() == 0 else None
    target = None if argument == "model" and rank() == 1 else model
    kwargs: dict[str, object] = {"bucket_bytes": "256MB"} if argument == "bucket_bytes" else {}
    refused_on_every_rank(
        lambda: fp32keep.load_full_state_dict(target, theirs, **kwargs),  # type: ignore[arg-type]
        Fp32KeepTypeError,
        match,
    )
    assert_same_parameters(model, before)
