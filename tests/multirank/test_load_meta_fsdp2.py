"""Loading into models built on the meta device, the ways verl and accelerate build them.

Real Transformers rotary models from tiny configs (Llama, Qwen3, and Gemma3, whose
``embed_scale`` is a non-persistent buffer that is not rotary), sharded with
``fp32keep.apply_fsdp2`` and loaded with ``fp32keep.load_full_state_dict``, must give the logits
of the eagerly built unsharded model bit for bit on every rank. Non-persistent buffers (the
rotary ``inv_freq``) are in no state dict: the loader sends them from the source rank when it
holds them, and needs ``init_buffers=`` when no rank can.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import fp32keep
from fp32keep import StateDictError
from fp32keep.load.meta import Fresh
from pytest_fp32keep.check.zoo.building import instantiate, make_config
from tests.core.toys import stack_class
from tests.error_bounds import LIBRARY_BOUND_S
from tests.multirank.refusals import refused_on_every_rank as shared_refused_on_every_rank
from tests.untouched import assert_dict_unchanged, dict_snapshot

pytestmark = pytest.mark.fsdp2  # every test runs in the ranks (2 by default)

FP32_POLICY = MixedPrecisionPolicy()  # no cast: sharded and eager logits can be equal bit for bit


def rank() -> int:
    return dist.get_rank()


#: Every rank raises the same error within the library bound (tests/multirank/refusals.py).
refused_on_every_rank = functools.partial(shared_refused_on_every_rank, bound=LIBRARY_BOUND_S)


# --- the models -------------------------------------------------------------------------------

COMMON: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 1,
}

BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "llama": lambda: instantiate("LlamaForCausalLM", make_config("LlamaConfig", **COMMON)),
    "qwen3": lambda: instantiate(
        "Qwen3ForCausalLM", make_config("Qwen3Config", **COMMON, head_dim=8)
    ),
    # a sliding and a full attention layer: both rotary tables are used; embed_scale too
    "gemma3": lambda: instantiate(
        "Gemma3ForCausalLM",
        make_config(
            "Gemma3TextConfig",
            **COMMON,
            head_dim=8,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
}


@contextlib.contextmanager
def init_empty_weights() -> Iterator[None]:
    """accelerate's ``init_empty_weights()`` (``include_buffers=False``), as verl uses it.

    Parameters are created on the meta device; buffers are computed for real by the model's own
    ``__init__``. A faithful copy, so that the test needs no accelerate install.
    """
    register = nn.Module.register_parameter

    def register_empty_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            made = module._parameters[name]
            assert made is not None
            kwargs = made.__dict__
            kwargs["requires_grad"] = param.requires_grad
            module._parameters[name] = type(made)(made.to(torch.device("meta")), **kwargs)

    nn.Module.register_parameter = register_empty_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def built(name: str, how: str) -> nn.Module:
    """``name`` built on this rank the way ``how`` says."""
    build = BUILDERS[name]
    if how == "real":
        return build()
    if how == "meta":
        with torch.device("meta"):
            model = build()
        # Transformers 5.0.0's init_weights skips tie_weights under the meta device (4.x and
        # 5.1+ tie there), leaving Gemma3's lm_head and embed_tokens two tensors, unlike rank 0's
        # real model: from_pretrained ties them at its end, and so does this (idempotent where
        # they are tied already). Left untied, the load is refused: the test below.
        model.tie_weights()  # type: ignore[operator]
        return model
    assert how == "empty"
    with init_empty_weights():
        model = build()
    # Re-registering a parameter under init_empty_weights makes a new one, which unties tied
    # embeddings (verl therefore avoids meta init for tied models); Transformers' from_pretrained
    # ties them again at the end, and so does this.
    model.tie_weights()  # type: ignore[operator]
    return model


def buffers_from_own_init(name: str) -> Callable[[nn.Module], None]:
    """An ``init_buffers`` that re-creates non-persistent buffers by the model's own ``__init__``.

    The model is built again with its parameters on the meta device (no parameter memory) and
    its buffers computed for real; the buffers the loader asked for are copied from it.
    """

    def init_buffers(model: nn.Module) -> None:
        fresh = dict(built(name, "empty").named_buffers())
        with torch.no_grad():
            for fqn, buffer in model.named_buffers():
                if not buffer.is_meta and fqn in fresh:
                    buffer.copy_(fresh[fqn])

    return init_buffers


def non_persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    persistent = set(model.state_dict())
    return {name: b for name, b in model.named_buffers() if name not in persistent}


IDS = torch.randint(2, 64, (2, 8), generator=torch.Generator().manual_seed(3))

MODES = {
    # verl: rank 0 builds the model for real, every other rank under init_empty_weights
    "rank0-real+init_empty_weights": ("real", "empty"),
    # rank 0 real (or from_pretrained), every other rank on torch.device("meta")
    "rank0-real+meta": ("real", "meta"),
    # accelerate's cpu_ram_efficient_loading moves every rank to meta before sharding; the
    # checkpoint is read on rank 0
    "every-rank-meta": ("meta", "meta"),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(BUILDERS))
def test_meta_init_gives_the_eager_logits_on_every_rank(
    mesh: DeviceMesh, name: str, mode: str
) -> None:
    reference = built(name, "real")  # eager, unsharded, the same seed
    assert non_persistent_buffers(reference), "the model must have a non-persistent buffer"
    on_source, elsewhere = MODES[mode]
    model = built(name, on_source if rank() == 0 else elsewhere)
    if on_source == "real":
        checkpoint = model.state_dict() if rank() == 0 else None  # verl: the model's own dict
    else:
        checkpoint = built(name, "real").state_dict() if rank() == 0 else None
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=FP32_POLICY)
    init = buffers_from_own_init(name) if mode == "every-rank-meta" else None
    fp32keep.load_full_state_dict(model, checkpoint, init_buffers=init)

    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    for fqn, expected in non_persistent_buffers(reference).items():
        got = model.get_buffer(fqn)
        assert got.dtype == expected.dtype, fqn
        assert torch.equal(got, expected), f"{fqn} on rank {rank()}: {got} != {expected}"
    with torch.no_grad():
        logits = model(input_ids=IDS).logits
        expected_logits = reference(input_ids=IDS).logits
    assert torch.equal(logits, expected_logits), f"rank {rank()}"


def test_a_tie_missing_on_one_rank_is_refused_naming_it(mesh: DeviceMesh) -> None:
    """Rank 1 builds Gemma3 on the meta device untied (what Transformers 5.0.0 builds there
    without ``tie_weights()``; made so here on every release): the ranks hold different
    models, and each names the tie and its fix, before any tensor moves."""
    model = built("gemma3", "real" if rank() == 0 else "meta")
    if rank() == 1:  # untie: lm_head gets a tensor of its own
        head = model.get_submodule("lm_head")
        assert isinstance(head, nn.Linear)
        head.weight = nn.Parameter(torch.empty_like(head.weight))
    checkpoint = model.state_dict() if rank() == 0 else None
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=FP32_POLICY)
    error = refused_on_every_rank(
        lambda: fp32keep.load_full_state_dict(model, checkpoint),
        ValueError,
        re.escape(
            "every rank must build and shard the same model: 'lm_head.weight' is tied to "
            "['model.embed_tokens.weight'] on rank 0, untied on rank 1. A tied weight is "
            "untied on some rank: tie it there before apply_fsdp2 (model.tie_weights()"
        ),
        same_message=False,  # each rank names the others as the ones that differ
    )
    assert f"the model on ranks [{1 - rank()}] differs from rank {rank()}'s" in str(error)
    assert all(t.is_meta for t in model.parameters()) == (rank() == 1)  # nothing loaded


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3"])  # literal ids: docs/errors.md
def test_every_rank_meta_without_init_buffers_is_refused_naming_the_buffers(
    mesh: DeviceMesh, name: str
) -> None:
    model = built(name, "meta")
    checkpoint = built(name, "real").state_dict() if rank() == 0 else None
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=FP32_POLICY)
    held = dict_snapshot(checkpoint) if checkpoint is not None else None
    error = refused_on_every_rank(
        lambda: fp32keep.load_full_state_dict(model, checkpoint),
        StateDictError,
        "non-persistent buffers on the meta device on the source rank",
    )
    text = str(error)
    for fqn in non_persistent_buffers(built(name, "empty")):
        assert fqn in text and fqn in error.uninitialized, fqn
    assert "init_buffers=" in text and "init_empty_weights" in text  # the fixes
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])  # nothing changed
    if checkpoint is not None and held is not None:
        assert_dict_unchanged(checkpoint, held)


def test_init_buffers_that_leaves_a_buffer_unwritten_is_refused(mesh: DeviceMesh) -> None:
    model = built("gemma3", "meta")
    checkpoint = built("gemma3", "real").state_dict() if rank() == 0 else None
    # Which non-persistent buffers exist depends on the version (4.x keeps Llama's
    # original_inv_freq as a plain attribute, 5.x registers it): Gemma3 has several in each.
    wanted = sorted(non_persistent_buffers(built("gemma3", "real")))
    assert len(wanted) >= 2, wanted
    forgotten = wanted[-1]
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=FP32_POLICY)

    def all_but_one(model: nn.Module) -> None:
        with torch.no_grad():
            for name in wanted[:-1]:
                model.get_buffer(name).fill_(1.0)

    error = refused_on_every_rank(
        lambda: fp32keep.load_full_state_dict(model, checkpoint, init_buffers=all_but_one),
        StateDictError,
        rf"init_buffers left these buffers unwritten on rank 0: \[{re.escape(repr(forgotten))}\]",
    )
    assert error.uninitialized == (forgotten,)


def test_init_buffers_raising_on_one_rank_is_an_error_on_every_rank(mesh: DeviceMesh) -> None:
    model = built("llama", "meta")
    checkpoint = built("llama", "real").state_dict() if rank() == 0 else None
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=FP32_POLICY)

    def fails_on_rank_1(model: nn.Module) -> None:
        buffers_from_own_init("llama")(model)
        if rank() == 1:
            raise RuntimeError("no rope tables here")

    refused_on_every_rank(
        lambda: fp32keep.load_full_state_dict(model, checkpoint, init_buffers=fails_on_rank_1),
        StateDictError,
        r"init_buffers raised on rank 1: RuntimeError: no rope tables here; nothing was loaded",
    )


# --- strict=False into a partly meta model ----------------------------------------------------


def partly_meta_stack(mesh: DeviceMesh) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Real on every rank but for ``layers.1``, which rank 1 holds on the meta device."""
    torch.manual_seed(0)
    model = stack_class(strict=["wo"])()
    if rank() == 1:
        model.layers[1].to_empty(device="meta")  # type: ignore[arg-type]
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=FP32_POLICY)
    torch.manual_seed(9)
    return model, stack_class(strict=["wo"])().state_dict()


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, torch.distributed.tensor.DTensor) else tensor


def test_non_strict_missing_key_left_untouched_where_real(mesh: DeviceMesh) -> None:
    model, source = partly_meta_stack(mesh)
    before = local(model.norm.weight).detach().clone()
    partial = {k: v for k, v in source.items() if k != "norm.weight"}  # real on every rank
    result = fp32keep.load_full_state_dict(model, partial if rank() == 0 else None, strict=False)
    assert result.missing_keys == ("norm.weight",)
    assert torch.equal(local(model.norm.weight), before), "a real missing tensor was changed"
    full = fp32keep.gather_full_state_dict(model)
    for key, value in partial.items():  # layers.1 included: it was meta on rank 1
        assert torch.equal(full[key], value), key


def test_non_strict_missing_key_that_is_meta_somewhere_is_refused(mesh: DeviceMesh) -> None:
    model, source = partly_meta_stack(mesh)
    before = {k: local(v).detach().clone() for k, v in model.state_dict().items()}
    partial = {k: v for k, v in source.items() if k != "layers.1.wo.weight"}
    held = dict_snapshot(partial)
    error = refused_on_every_rank(
        lambda: fp32keep.load_full_state_dict(
            model, partial if rank() == 0 else None, strict=False
        ),
        StateDictError,
        r"layers\.1\.wo\.weight: missing from the state dict and on the meta device on "
        r"ranks \[1\]",
    )
    assert error.uninitialized == ("layers.1.wo.weight",)
    assert "put it in the state dict" in str(error)
    for key, value in model.state_dict().items():  # nothing materialised, nothing loaded
        assert local(value).is_meta == before[key].is_meta, key
        assert before[key].is_meta or torch.equal(local(value), before[key]), key
    assert_dict_unchanged(partial, held)


class _Registered(nn.Module):
    """A linear layer plus two buffers, registered in the order given."""

    def __init__(self, order: list[str]) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        for name in order:  # beta, non-persistent, is computed here as a rotary table would be
            value = torch.zeros(4) if name == "alpha" else torch.arange(4.0) + 10
            self.register_buffer(name, value, persistent=name == "alpha")


def test_ranks_that_register_tensors_in_different_orders_load_alike(mesh: DeviceMesh) -> None:
    """Gemma3's rotary module registers its buffers while iterating a set, so their module order
    follows each process's PYTHONHASHSEED: ranks must not pair tensors by module order."""
    model = _Registered(["alpha", "beta"] if rank() == 0 else ["beta", "alpha"])
    checkpoint = None
    if rank() == 0:
        checkpoint = {**model.state_dict(), "alpha": torch.arange(4.0)}
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=FP32_POLICY)
    fp32keep.load_full_state_dict(model, checkpoint)
    assert torch.equal(model.alpha, torch.arange(4.0)), model.alpha
    assert torch.equal(model.beta, torch.arange(4.0) + 10), model.beta


# --- storage received into first, installed while the bytes travel ----------------------------


class _Uneven(nn.Module):
    """Rows 2 ranks cannot split evenly (rank 1 holds 2 of 5, which FSDP2 pads to 3) and rows
    they can (4 + 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.odd = nn.Linear(4, 5)
        self.even = nn.Linear(4, 8)


#: odd.weight and odd.bias on rank 1: FSDP2's ``_apply`` re-pads them into new storage, so the
#: loader must copy what it received there; every other shard keeps the storage received into.
PADDED_ON_RANK_1 = 2


def uneven_model(mesh: DeviceMesh, meta_ranks: tuple[int, ...]) -> nn.Module:
    torch.manual_seed(0)
    where = torch.device("meta") if rank() in meta_ranks else contextlib.nullcontext()
    with where:
        model = _Uneven()
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=FP32_POLICY)
    return model


def uneven_checkpoint(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return dict(_Uneven().state_dict())


def assert_loaded(model: nn.Module, checkpoint: dict[str, torch.Tensor]) -> None:
    full = fp32keep.gather_full_state_dict(model)
    assert set(full) == set(checkpoint)
    for key, value in checkpoint.items():
        assert torch.equal(full[key], value), f"{key}: {full[key]} != {value}"


def spy_on_copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many received tensors each load had to copy into storage ``_apply`` re-allocated."""
    copied: list[int] = []
    finish = Fresh.finish

    def counting(self: Fresh) -> None:
        copied.append(len(self.copies))
        finish(self)

    monkeypatch.setattr(Fresh, "finish", counting)
    return copied


@pytest.mark.parametrize("direct_bytes", [0, 1 << 20], ids=["direct", "buckets"])
@pytest.mark.parametrize("meta_ranks", [(1,), (0, 1)], ids=["rank1-meta", "every-rank-meta"])
def test_meta_shards_receive_straight_into_their_storage(
    mesh: DeviceMesh,
    monkeypatch: pytest.MonkeyPatch,
    meta_ranks: tuple[int, ...],
    direct_bytes: int,
) -> None:
    model = uneven_model(mesh, meta_ranks)
    checkpoint = uneven_checkpoint(5)
    copied = spy_on_copies(monkeypatch)
    given = checkpoint if rank() == 0 else None
    fp32keep.load_full_state_dict(model, given, direct_bytes=direct_bytes)
    assert_loaded(model, checkpoint)
    # Even shards end in the very storage they were received into (no copy); only the shards
    # FSDP2 pads are copied, once, after every collective.
    assert copied == [PADDED_ON_RANK_1 if rank() == 1 else 0], copied


def test_negative_control_padded_shards_without_the_final_copy_are_wrong(
    mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loader that trusted the installed tensors to be the received ones fails the check."""
    model = uneven_model(mesh, (1,))
    monkeypatch.setattr(Fresh, "finish", lambda self: None)
    checkpoint = uneven_checkpoint(11) if rank() == 0 else None  # values no rank held before
    fp32keep.load_full_state_dict(model, checkpoint)
    with pytest.raises(AssertionError, match=r"odd\.(weight|bias)"):
        assert_loaded(model, uneven_checkpoint(11))


def test_installing_that_fails_on_one_rank_is_an_error_on_every_rank(
    mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = uneven_model(mesh, (1,))
    checkpoint = uneven_checkpoint(5) if rank() == 0 else None
    if rank() == 1:

        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("no DTensor today")

        monkeypatch.setattr(DTensor, "from_local", broken)
    error = refused_on_every_rank(
        lambda: fp32keep.load_full_state_dict(model, checkpoint),
        StateDictError,
        r"installing the received tensors in the model raised on rank 1 \(its exception is "
        r"chained there\); the load is incomplete",
    )
    if rank() == 1:
        assert isinstance(error.__cause__, RuntimeError), error.__cause__
