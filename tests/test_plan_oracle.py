"""Oracle parity: ``fp32keep.resolve_keep_plan`` against the installed Transformers itself.

For every zoo model the installed Transformers can build and every low-precision dtype D, the
oracle is Transformers' own loader: a freshly built FP32 model is saved with
``save_pretrained`` and loaded back with ``from_pretrained(..., dtype=D)``; the floating tensors
that come back in FP32 are what that version keeps. The plan, resolved on the fresh model for D,
must name exactly those tensors. Nothing here re-implements Transformers' matching: the test only
compares dtypes after a real round trip.

Where the plan and the loader legitimately differ, a test below says so and checks the
difference explicitly instead of hiding it:

* non-persistent buffers (rotary ``inv_freq``) are not in the checkpoint; model code creates
  them in FP32 whatever is declared. Parity is checked on the persistent tensors; the
  non-persistent ones are checked against what the model code gives them
  (:func:`test_non_persistent_buffers_follow_model_code`);
* a kept parameter missing from the checkpoint comes back FP32 in 4.x (the loader upcasts
  matching parameters before loading) but in D in 5.x (it only casts what it reads); the plan
  keeps it either way (:func:`test_kept_param_missing_from_checkpoint`);
* a tied tensor declared only under the alias that ``save_pretrained`` drops is not kept by the
  5.x loader (it matches checkpoint keys only), while the plan keeps every alias of a tensor any
  alias of which matches (:func:`test_tied_alias_declared_on_dropped_name`).

``dtype=`` versus ``torch_dtype=`` for ``from_pretrained`` is decided in
:func:`_from_pretrained_dtype_kwargs`, the one place that knows.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from packaging.version import Version
from torch import nn

from fp32keep import KeepDeclarationError, KeepPlan, resolve_keep_plan
from pytest_fp32keep.check.zoo import ZOO, transformers_version
from tests.zoo_entries import available_or_skip

LOW_PRECISION = (torch.float16, torch.bfloat16)
IS_4X = Version(transformers_version()).major < 5


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _from_pretrained_dtype_kwargs(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The keyword that sets the load dtype of ``from_pretrained`` in the installed version.

    ``dtype=`` exists from 4.56 on (4.56 and 4.57 also accept the older ``torch_dtype=``, which
    5.x deprecates); older releases only know ``torch_dtype=``.
    """
    if Version(transformers_version()) < Version("4.56"):
        return {"torch_dtype": dtype}
    return {"dtype": dtype}


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer under every alias (``remove_duplicate=False``)."""
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    return tensors


@dataclasses.dataclass(frozen=True)
class OracleResult:
    """What one ``save_pretrained`` → ``from_pretrained(dtype=D)`` round trip kept in FP32.

    Attributes:
        floating: names (all aliases) of the floating tensors of the freshly built model.
        persistent: those of ``floating`` that are in the model's state dict (what
            ``save_pretrained`` writes, tied aliases included).
        fp32: those of ``floating`` that are FP32 in the loaded model.
        loaded_dtypes: the loaded dtype of every name in ``floating``.
        missing_keys: what ``from_pretrained`` reported missing from the checkpoint.
        unexpected_keys: what it reported unexpected.
    """

    floating: frozenset[str]
    persistent: frozenset[str]
    fp32: frozenset[str]
    loaded_dtypes: dict[str, torch.dtype]
    missing_keys: frozenset[str]
    unexpected_keys: frozenset[str]

    @property
    def non_persistent(self) -> frozenset[str]:
        """Floating names that are not saved: model code alone decides their dtype."""
        return self.floating - self.persistent

    @property
    def kept(self) -> frozenset[str]:
        """The persistent floating names the loader left in FP32: the oracle's keep set."""
        return self.fp32 & self.persistent


def _load(model_cls: Any, path: Path, dtype: torch.dtype) -> tuple[Any, dict[str, Any]]:
    """``from_pretrained(path, dtype=D)`` without hub kernels (``use_kernels=False``).

    Every supported release takes ``use_kernels`` (4.56 through 5.24 default it to False). 5.25
    defaults it to True unless ``USE_HUB_KERNELS`` says no, and then raises ``ValueError: Kernels
    are not available`` after loading wherever ``kernels`` 0.19.x is not installed (5.25 requires
    it, and the index this project installs from has nothing newer than 0.17.2); with it, the
    model's forwards are swapped for hub kernels, which reach the network. Neither changes a
    dtype: loading, and the dtype plan it applies, finish before ``set_use_kernels``
    (``PreTrainedModel.from_pretrained``), which only replaces forward implementations.
    """
    loaded, info = model_cls.from_pretrained(
        path, output_loading_info=True, use_kernels=False, **_from_pretrained_dtype_kwargs(dtype)
    )
    return loaded, info


def _oracle(
    fresh: Any, dtype: torch.dtype, path: Path, *, drop_keys: tuple[str, ...] = ()
) -> tuple[OracleResult, Any]:
    """Round-trip ``fresh`` through the installed Transformers' own save and load at ``dtype``.

    ``drop_keys`` are deleted from the saved checkpoint before loading (to study missing keys).
    """
    floating = frozenset(name for name, t in _named_tensors(fresh).items() if t.is_floating_point())
    persistent = frozenset(fresh.state_dict()) & floating
    fresh.save_pretrained(path)
    if drop_keys:
        _drop_from_checkpoint(path, drop_keys)
    loaded, info = _load(type(fresh), path, dtype)
    loaded_tensors = _named_tensors(loaded)
    assert floating <= set(loaded_tensors), sorted(floating - set(loaded_tensors))
    loaded_dtypes = {name: loaded_tensors[name].dtype for name in floating}
    stray = {name: dt for name, dt in loaded_dtypes.items() if dt not in (torch.float32, dtype)}
    assert not stray, f"loaded tensors neither FP32 nor {dtype}: {stray}"
    result = OracleResult(
        floating=floating,
        persistent=persistent,
        fp32=frozenset(name for name, dt in loaded_dtypes.items() if dt == torch.float32),
        loaded_dtypes=loaded_dtypes,
        missing_keys=frozenset(info.get("missing_keys", ())),
        unexpected_keys=frozenset(info.get("unexpected_keys", ())),
    )
    return result, loaded


def _drop_from_checkpoint(path: Path, keys: tuple[str, ...]) -> None:
    """Delete ``keys`` from the single-file safetensors checkpoint under ``path``."""
    from safetensors.torch import load_file, save_file

    [weights] = sorted(path.glob("*.safetensors"))
    state = load_file(weights)
    for key in keys:
        assert key in state, f"{key} is not in the checkpoint: {sorted(state)}"
        del state[key]
    save_file(state, weights, metadata={"format": "pt"})


def _parity_message(plan: KeepPlan, oracle: OracleResult, entry_name: str) -> str:
    only_plan = sorted((plan.names & oracle.persistent) - oracle.kept)
    only_loader = sorted(oracle.kept - plan.names)
    lines = [
        f"{entry_name} at {_dtype_id(plan.dtype)} under transformers {transformers_version()}:",
        "  kept by the plan but loaded in low precision by from_pretrained:",
    ]
    for name in only_plan:
        match = plan.match_for(name)
        lines.append(f"    {name}  (plan: {match})")
    lines.append("  loaded FP32 by from_pretrained but not in the plan:")
    lines.extend(f"    {name}" for name in only_loader)
    lines.append(plan.describe())
    return "\n".join(lines)


def _zoo_cases() -> Iterator[Any]:
    for name in ZOO:
        for dtype in LOW_PRECISION:
            yield pytest.param(name, dtype, id=f"{name}-{_dtype_id(dtype)}")


@pytest.mark.parametrize(("name", "dtype"), list(_zoo_cases()))
def test_plan_matches_from_pretrained(name: str, dtype: torch.dtype, tmp_path: Path) -> None:
    """The plan names exactly the persistent floating tensors ``from_pretrained`` keeps FP32."""
    entry = available_or_skip(name)
    fresh: Any = entry.build()
    plan = resolve_keep_plan(fresh, dtype)
    oracle, _ = _oracle(fresh, dtype, tmp_path)

    # The round trip is complete, so no tensor is FP32 merely because it was missing.
    assert not oracle.missing_keys, sorted(oracle.missing_keys)
    assert not oracle.unexpected_keys, sorted(oracle.unexpected_keys)
    # The plan only names floating tensors of the model.
    assert plan.names <= oracle.floating, sorted(plan.names - oracle.floating)
    # Parity on what the checkpoint carries; non-persistent buffers are checked separately.
    assert plan.names & oracle.persistent == oracle.kept, _parity_message(plan, oracle, name)


@pytest.mark.parametrize(("name", "dtype"), list(_zoo_cases()))
def test_non_persistent_buffers_follow_model_code(
    name: str, dtype: torch.dtype, tmp_path: Path
) -> None:
    """Buffers absent from the checkpoint get the dtype the model code gives them, nothing more.

    Legitimate difference: these buffers (rotary ``inv_freq``, ``original_inv_freq``) are not
    saved, so no keep declaration can reach them through ``from_pretrained``; the model's code
    computes them in FP32 on purpose. The parity test therefore leaves them out, and this test
    proves the loader's dtype for them is the model code's: the dtype they get when the same
    class is built with D as the default dtype (on the meta device), which is how
    ``from_pretrained`` builds it. A non-persistent buffer the plan keeps must come back FP32.
    """
    entry = available_or_skip(name)
    fresh: Any = entry.build()
    oracle, _ = _oracle(fresh, dtype, tmp_path)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):  # dtypes only; no weight init in half precision
            built_in_dtype = type(fresh)(copy.deepcopy(fresh.config))
    finally:
        torch.set_default_dtype(previous)
    code_dtypes = {
        fqn: tensor.dtype
        for fqn, tensor in _named_tensors(built_in_dtype).items()
        if fqn in oracle.non_persistent
    }
    loaded = {fqn: oracle.loaded_dtypes[fqn] for fqn in oracle.non_persistent}
    assert loaded == code_dtypes
    # Should the plan name a non-persistent buffer, the loader must not leave it in D:
    # the plan would then promise an FP32 tensor that a from_pretrained model lacks.
    plan = resolve_keep_plan(fresh, dtype)
    in_low_precision = sorted((plan.names & oracle.non_persistent) - oracle.fp32)
    assert not in_low_precision, in_low_precision


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=_dtype_id)
def test_no_declaration_keeps_nothing(dtype: torch.dtype, tmp_path: Path) -> None:
    """Llama declares nothing: the plan is empty; the loader keeps only model-code buffers."""
    entry = available_or_skip("llama")
    fresh: Any = entry.build()
    assert getattr(fresh, "_keep_in_fp32_modules", None) in (None, [], set())
    assert getattr(fresh, "_keep_in_fp32_modules_strict", None) in (None, [], set())
    plan = resolve_keep_plan(fresh, dtype)
    oracle, _ = _oracle(fresh, dtype, tmp_path)

    assert plan.is_empty
    assert plan.names == frozenset()
    assert oracle.kept == frozenset()
    # What does come back FP32 is the non-persistent rotary state, computed by model code.
    assert oracle.fp32 == oracle.fp32 & oracle.non_persistent
    assert oracle.fp32, "expected the rotary inv_freq buffer to stay FP32 by model code"
    assert all(name.endswith("inv_freq") for name in oracle.fp32), sorted(oracle.fp32)


def test_kept_param_missing_from_checkpoint(tmp_path: Path) -> None:
    """4.x upcasts a kept parameter missing from the checkpoint; 5.x leaves it in D.

    Legitimate difference, explicit here: 4.56/4.57 cast every parameter whose name matches the
    keep regex to FP32 *before* loading, so a matching parameter the checkpoint lacks (freshly
    initialised) ends FP32 too. 5.x applies its dtype plan to the checkpoint keys it reads, so
    the same parameter is initialised in the load dtype. The plan describes what must be kept,
    independent of the checkpoint's completeness: it keeps the parameter in both.
    """
    entry = available_or_skip("t5")
    dtype = torch.float16  # T5's regular ["wo"] applies under fp16 in every version
    fresh: Any = entry.build()
    dropped = "encoder.block.0.layer.1.DenseReluDense.wo.weight"
    plan = resolve_keep_plan(fresh, dtype)
    assert dropped in plan.param_names
    oracle, _ = _oracle(fresh, dtype, tmp_path, drop_keys=(dropped,))

    assert dropped in oracle.missing_keys
    if IS_4X:
        assert oracle.loaded_dtypes[dropped] == torch.float32, "4.x upcasts missing kept params"
    else:
        assert oracle.loaded_dtypes[dropped] == dtype, "5.x leaves missing params in D"
    # Every other kept tensor is unaffected.
    others = plan.names - {dropped}
    assert others & oracle.persistent == oracle.kept - {dropped}


def _tied_llama(**declarations: list[str]) -> Any:
    """The zoo's Llama with tied embeddings and ``declarations`` as class attributes."""
    transformers = importlib.import_module("transformers")
    base = transformers.LlamaForCausalLM
    subclass = type("TiedKeepLlama", (base,), dict(declarations))
    llama: Any = ZOO["llama"].build()
    config = llama.config
    config.tie_word_embeddings = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return subclass(config)


_TIED_ALIASES = frozenset({"model.embed_tokens.weight", "lm_head.weight"})


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=_dtype_id)
def test_tied_alias_declared_on_saved_name(dtype: torch.dtype, tmp_path: Path) -> None:
    """Declared under the saved alias, a tied tensor is kept under every name by both."""
    available_or_skip("llama")
    fresh = _tied_llama(_keep_in_fp32_modules_strict=["embed_tokens"])
    assert fresh.get_input_embeddings().weight is fresh.get_output_embeddings().weight
    plan = resolve_keep_plan(fresh, dtype)
    oracle, loaded = _oracle(fresh, dtype, tmp_path)

    assert loaded.get_input_embeddings().weight is loaded.get_output_embeddings().weight
    assert plan.param_names >= _TIED_ALIASES
    assert plan.names & oracle.persistent == oracle.kept, _parity_message(plan, oracle, "tied")


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=_dtype_id)
def test_tied_alias_declared_on_dropped_name(dtype: torch.dtype, tmp_path: Path) -> None:
    """Declared only under the alias ``save_pretrained`` drops: refused by 4.x, differs in 5.x.

    4.56/4.57 validate entries against ``named_parameters()``, which reports a tied tensor once,
    under its first name (``model.embed_tokens.weight``), so ``lm_head`` is refused when the
    model is built, and the resolver refuses it the same way.

    5.x accepts it. Legitimate difference, explicit here: the loader matches checkpoint keys
    only, and the checkpoint holds the tensor as ``model.embed_tokens.weight``, so it loads in
    D; the plan keeps every alias of a tensor any alias of which matches (a conservative choice:
    an FP32 contract never silently lost because of which alias a checkpoint happens to carry).
    """
    available_or_skip("llama")
    if IS_4X:
        with pytest.raises(ValueError, match="lm_head"):
            _tied_llama(_keep_in_fp32_modules_strict=["lm_head"])
        model = _tied_llama()
        model._keep_in_fp32_modules_strict = ["lm_head"]
        with pytest.raises(KeepDeclarationError, match="lm_head"):
            resolve_keep_plan(model, dtype)
        return

    fresh = _tied_llama(_keep_in_fp32_modules_strict=["lm_head"])
    plan = resolve_keep_plan(fresh, dtype)
    oracle, loaded = _oracle(fresh, dtype, tmp_path)

    assert loaded.get_input_embeddings().weight is loaded.get_output_embeddings().weight
    assert plan.names == _TIED_ALIASES
    assert oracle.kept == frozenset(), "the loader only matched the saved key"
    # Apart from the tied pair, plan and loader agree.
    assert (plan.names - _TIED_ALIASES) & oracle.persistent == oracle.kept
