"""Tensors a Transformers model's code builds in FP32 whatever the load dtype: observed, not read.

``from_pretrained(dtype=D)`` constructs the model under the default dtype ``D`` (4.56–4.57:
``_set_default_dtype``; 5.x: ``local_torch_dtype`` in ``get_init_context``) on the meta device,
then loads every checkpoint tensor into the dtype the constructed tensor already has. A tensor the
model code builds with an explicit ``dtype=torch.float32`` (EsmFold2's
``nn.Parameter(torch.empty(..., dtype=torch.float32))``) therefore stays FP32 though no keep list
names it. Measured with a toy model (save_pretrained, then from_pretrained at fp16 and bf16) on
4.56.2, 5.0.0, 5.10.4 and 5.24.0: parameters and persistent buffers built in FP32 load FP32 in
every one (``KeepSemantics.keeps_constructed_fp32``).

Rather than read model source, :func:`constructed_fp32` rebuilds the model's class from its config
the way the installed ``from_pretrained`` does (its own ``get_init_context``, under the default
dtype ``D``, on the meta device: no memory, no weights) and reports the floating parameters and
persistent buffers that come out FP32. Non-persistent buffers are left out: they are not loaded,
model code alone decides their dtype (rotary ``inv_freq``).

Pure with respect to the model in hand: it is only read (its class and config). Results are
cached per (class, config content, dtype): the content is a snapshot of the config's attributes,
nested, compared by value (its JSON where something in it cannot be compared that way), so a
config changed in place is a new key, never a stale answer; serialising every call cost more
than the rest of a cached answer.

A rebuild that fails for the process's own environment (:data:`LOCAL_ERRORS`: a file, memory,
an import) can fail on one rank only, and that rank's plan then misses what the others keep.
Such a failure is not cached (the next plan tries again), and where ranks already exchange
something before sharding (``apply_fsdp2(observed=...)``, the contract's build step) they
compare their plans' digests: :func:`plan_divergence` is the error every rank raises.
"""

from __future__ import annotations

import copy
import inspect
import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from fp32keep.errors import hidden_in_tracebacks
from fp32keep.reprs import SHOWN, and_more, first_few
from fp32keep.tensors import TensorSlot, is_castable_float, tensor_slots

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks

#: How many (class, config, dtype) observations are remembered.
CACHE_SIZE = 64
#: Rebuild errors that come from this process's environment, not from the class and config:
#: they may differ between ranks and between calls, so they are not cached.
LOCAL_ERRORS: tuple[type[BaseException], ...] = (OSError, MemoryError, ImportError)


@dataclass(frozen=True)
class Construction:
    """What rebuilding one Transformers model's class at a low-precision dtype showed.

    Attributes:
        fp32: relative FQN (every alias) -> class name of the module that owns it, for every
            floating parameter and persistent buffer the rebuild left in FP32.
        note: ``""`` when the rebuild was observed; otherwise why nothing was observed (no
            config, or the rebuild raised), for the plan to say.
    """

    fp32: Mapping[str, str]
    note: str = ""


_CACHE: OrderedDict[tuple[Any, ...], Construction] = OrderedDict()
_CACHE_LOCK = threading.RLock()
"""Held while the cache is read or a model is rebuilt (the rebuild sets the default dtype)."""


def constructed_fp32(module: nn.Module, dtype: torch.dtype) -> Construction:
    """The tensors ``type(module)`` builds in FP32 when ``from_pretrained(dtype=dtype)`` builds it.

    ``module`` must be a Transformers ``PreTrainedModel`` (the caller checks); its device does not
    matter (the rebuild is on the meta device) and it is not modified.

    Fail-open: a module without a config, or whose class cannot be rebuilt from its config alone
    (a constructor that needs more arguments, model code that needs real tensors), contributes
    nothing and the returned ``note`` says why (a ``RuntimeWarning`` too, once per class and
    dtype). Failing closed would refuse a plan whose declared keeps are perfectly known, for
    every model fp32keep planned before this observation existed; the declarations stay the
    contract, and the note makes the unobserved part visible in ``KeepPlan.describe()``.
    """
    config = getattr(module, "config", None)
    cls = type(module)
    if config is None or not hasattr(cls, "get_init_context"):
        return Construction(MappingProxyType({}), f"{cls.__name__}: no config to rebuild from")
    key = _cache_key(cls, config, dtype)
    with _CACHE_LOCK:  # one rebuild at a time: it sets process-wide state (the default dtype)
        if key is not None and key in _CACHE:
            _CACHE.move_to_end(key)
            return _CACHE[key]
        note = None
        local = False
        try:
            observed = Construction(MappingProxyType(_observe(cls, config, dtype)))
        except Exception as error:  # fail-open, said in the note (see the docstring)
            note = (
                f"{cls.__name__}: rebuild from its config failed ({type(error).__name__}: {error})"
            )
            observed = Construction(MappingProxyType({}), note)
            local = isinstance(error, LOCAL_ERRORS)  # may succeed next time, or on another rank
        if key is not None and not local:  # cached before warning: under -W error it raises
            _CACHE[key] = observed
            while len(_CACHE) > CACHE_SIZE:
                _CACHE.popitem(last=False)
    if note is not None:
        warnings.warn(
            f"fp32keep: {note}; tensors its code builds in FP32 are not in the keep plan",
            RuntimeWarning,
            stacklevel=3,
        )
    return observed


def _cache_key(cls: type, config: Any, dtype: torch.dtype) -> tuple[Any, ...] | None:
    """(class, config type, the config's content, dtype), or ``None`` when the content cannot be
    taken (then observed every time, never cached). The content is a snapshot of the config's
    attributes (:func:`_state`): cheap, and a config changed in place gives a new key; where the
    snapshot cannot be taken, its JSON (``to_json_string(use_diff=False)``) instead."""
    state = _state(config, _STATE_DEPTH)
    if state is not None:
        return (cls, type(config), state, dtype)
    try:
        content: str = config.to_json_string(use_diff=False)
    except Exception:
        return None
    return (cls, type(config), content, dtype)


#: How deep :func:`_state` follows nested configs, dicts and lists before it gives up.
_STATE_DEPTH = 8


class _Uncomparable(Exception):
    """Something in a config that :func:`_state` does not snapshot."""


#: Values :func:`_state` takes as they are (immutable, compared by value).
_SCALARS = (str, int, float, bool, type(None), torch.dtype)


def _state(value: Any, depth: int) -> Any:
    """A hashable snapshot of ``value``: its attributes (a config: its ``__dict__``), dict
    items and list entries, nested; ``None`` when something in it cannot be compared that way
    (too deep, or an object of another kind: the JSON is then taken every time)."""
    try:
        return _snapshot(value, depth)
    except _Uncomparable:
        return None


def _snapshot(value: Any, depth: int) -> Any:
    if isinstance(value, _SCALARS):
        return value
    if depth == 0:
        raise _Uncomparable
    if isinstance(value, dict):
        return (dict, tuple((key, _snapshot(item, depth - 1)) for key, item in value.items()))
    if isinstance(value, list | tuple):
        return (type(value), tuple(_snapshot(item, depth - 1) for item in value))
    if hasattr(value, "to_json_string") and hasattr(value, "__dict__"):  # a (sub-)config
        items = vars(value).items()
        return (type(value), tuple((key, _snapshot(item, depth - 1)) for key, item in items))
    raise _Uncomparable


def _observe(cls: Any, config: Any, dtype: torch.dtype) -> dict[str, str]:
    config = copy.deepcopy(config)  # from_pretrained too builds from a copy it may change
    _set_config_dtype(config, dtype)
    with _init_contexts(cls, dtype):
        rebuilt = cls(config)
    modules = rebuilt.named_modules(remove_duplicate=False)
    owners = {name: type(sub).__name__ for name, sub in modules}
    fp32: dict[str, str] = {}
    for slot in tensor_slots(rebuilt):
        if slot.tensor.dtype != torch.float32 or not slot.persistent:
            continue
        for name in slot.names:
            fp32[name] = owners[name.rpartition(".")[0]]
    return fp32


def _set_config_dtype(config: Any, dtype: torch.dtype) -> None:
    # from_pretrained records the load dtype on the config and its sub-configs before building
    # (4.56+: ``config.dtype``), and model code may read it while constructing.
    configs = [config] + [getattr(config, key, None) for key in getattr(config, "sub_configs", {})]
    for each in configs:
        if each is not None:
            each.dtype = dtype


@contextmanager
def _init_contexts(cls: Any, dtype: torch.dtype) -> Iterator[None]:
    """The installed ``from_pretrained``'s construction contexts, on the meta device.

    5.x's ``get_init_context(dtype, ...)`` sets the default dtype itself (``local_torch_dtype``);
    4.56–4.57's takes no dtype, ``from_pretrained`` sets it before (``_set_default_dtype``), so it
    is set here. The default dtype is restored whatever happens.
    """
    parameters = inspect.signature(cls.get_init_context).parameters
    arguments: dict[str, Any] = {"is_quantized": False, "_is_ds_init_called": False}
    if "dtype" in parameters:
        arguments["dtype"] = dtype
    if "allow_all_kernels" in parameters:
        arguments["allow_all_kernels"] = None
    original = torch.get_default_dtype()
    try:
        with ExitStack() as stack:
            stack.enter_context(torch.device("meta"))
            torch.set_default_dtype(dtype)
            for context in cls.get_init_context(**arguments):
                stack.enter_context(context)
            yield
    finally:
        torch.set_default_dtype(original)


def plan_divergence(where: str, accounts: Sequence[tuple[int, str, tuple[str, ...]]]) -> str | None:
    """Why the ranks' keep plans differ, or ``None`` when every digest is the first rank's.

    ``accounts``: per rank, its number, its plan's :meth:`~fp32keep.KeepPlan.digest` and its
    ``unobserved`` notes. Computed from gathered data alone: the same text on every rank.
    """
    first, digest, _ = accounts[0]
    differing = [rank for rank, other, _ in accounts if other != digest]
    if not differing:
        return None
    notes = [
        f"rank {rank}: {'; '.join(unobserved[:SHOWN])}{and_more(len(unobserved))}"
        for rank, _, unobserved in accounts
        if unobserved
    ]
    why = f"; construction not observed on {', '.join(notes[:SHOWN])}" if notes else ""
    why += and_more(len(notes)) + (" ranks" if len(notes) > SHOWN else "")
    return (
        f"{where}: the keep plan on ranks {first_few(differing)} differs from rank "
        f"{first}'s{why}. Every rank must resolve the same plan: a rebuild that failed on some "
        "rank only (for a file, memory or an import of its own) left out there what the model "
        "code builds in FP32"
    )


def clear_cache() -> None:
    """Forget every cached observation (tests; a class redefined in place)."""
    _CACHE.clear()


def constructed_entry(owner: str) -> str:
    """The plan entry that says why a constructed tensor is kept."""
    return f"constructed in torch.float32 by {owner}"


def constructed_matches(
    slots: list[TensorSlot], observed: list[tuple[str, Construction]], already: Mapping[str, Any]
) -> dict[str, tuple[str, str | None]]:
    """FQN -> (entry, via_alias) for the model's tensors a rebuild left in FP32.

    ``observed`` pairs each declaring root's prefix with its :class:`Construction`. A tensor a
    keep list already caught (``already``) keeps that reason; only castable floating parameters
    and persistent buffers count; a tied tensor is kept under every alias when any alias was
    observed FP32 (as the plan does for list matches).
    """
    found: dict[str, tuple[str, str | None]] = {}
    for slot in slots:
        if not is_castable_float(slot.tensor.dtype) or not slot.persistent:
            continue
        if any(name in already for name in slot.names):
            continue
        direct = {
            name: constructed_entry(owner)
            for name in slot.names
            for prefix, construction in observed
            if (owner := construction.fp32.get(_relative(prefix, name) or "\0")) is not None
        }
        if not direct:
            continue
        first_name, first_entry = next(iter(direct.items()))
        for name in slot.names:
            found[name] = (direct[name], None) if name in direct else (first_entry, first_name)
    return found


def _relative(prefix: str, name: str) -> str | None:
    if not prefix:
        return name
    return name.removeprefix(prefix + ".") if name.startswith(prefix + ".") else None
