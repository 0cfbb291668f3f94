"""What ``fp32keep check`` checks: built-in zoo entries, Transformers families or a user's
``package.module:factory``.

A family (``--family NAME``) travels to the ranks as the TARGET ``family/NAME``
(:data:`FAMILY_PREFIX`); the command probes every family before any rank starts
(:func:`family_availability`) and sends only those that build.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from fp32keep import KeepLayoutError
    from pytest_fp32keep.check.zoo import ZooEntry


class TargetError(ValueError):
    """A TARGET cannot be checked: not found, its factory raised, or it built no module."""


@dataclass(frozen=True)
class Target:
    """One model to check.

    Attributes:
        name: how the target is shown (zoo name, or the ``module:factory`` string).
        build: builds the FP32, unsharded model.
        make_batch: builds one batch from the model.
        expect_layout_error: FSDP2 cannot hold this model's kept tensors as units of their
            own (a layout, whatever the dtype).
        refused_under: the dtypes under which ``apply_fsdp2`` must refuse the model with
            ``KeepLayoutError`` in the installed Transformers, from a source independent of
            the plan under test (the zoo's :class:`~pytest_fp32keep.check.zoo.entry.
            KeepExpectation` table); under any other dtype the contract must hold as for any
            model. ``None`` where there is no such source (a user's ``module:factory``, a
            family without a zoo entry of its class): then a refusal is expected under every
            dtype if ``expect_layout_error``, else under none (:meth:`refusal_expected`).
        written: the zoo or family entry whose expectations are the source of
            ``refused_under``; an expected refusal passes only if it is the one written there
            (:meth:`refusal_mismatch`). ``None`` for a user's ``module:factory``.
    """

    name: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[nn.Module], Any]
    expect_layout_error: bool = False
    refused_under: frozenset[torch.dtype] | None = None
    written: ZooEntry | None = None

    def refusal_expected(self, dtype: torch.dtype) -> bool:
        """Whether the check passes only if ``apply_fsdp2`` refuses this model under ``dtype``;
        decided without resolving the plan that is under test."""
        if self.refused_under is None:
            return self.expect_layout_error
        return dtype in self.refused_under

    def refusal_mismatch(self, dtype: torch.dtype, error: KeepLayoutError) -> str | None:
        """How the expected refusal ``error`` differs from the written one (its reason tags,
        the tensors it names), or ``None`` where it is that one or nothing more is written."""
        if self.written is None:
            return None
        return self.written.refusal_mismatch(dtype, error)

    def written_refusal(self, dtype: torch.dtype) -> dict[str, str]:
        """Where the refusal expected under ``dtype`` is written and its one-line why (for the
        report; empty without a written entry)."""
        if self.written is None:
            return {}
        row = self.written.expectation(dtype)
        return {"written_in": self.written.written_in, "why": row.why if row is not None else ""}


def _language_model_batch(model: nn.Module) -> dict[str, torch.Tensor]:
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        raise TargetError(
            f"cannot build a batch for {type(model).__name__}: it has no config.vocab_size; "
            "pass --batch package.module:function (function(model) -> batch)"
        )
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if getattr(config, "is_encoder_decoder", False):
        batch["decoder_input_ids"] = ids.clone()
    return batch


def import_attribute(spec: str, *, what: str) -> object:
    """The attribute ``spec`` (``package.module:NAME``) names, imported as the ranks import it.

    ``what`` is where the spec came from (``TARGET``, ``--batch``, ``--shard`` ...): every
    error is a :class:`TargetError` naming it and the spec.
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        alternative = " (or a zoo name)" if what == "TARGET" else ""
        raise TargetError(
            f"{what} {spec!r} is not of the form package.module:function{alternative}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise TargetError(
            f"{what} {spec!r}: cannot import module {module_name!r}: {error}"
        ) from error
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise TargetError(
            f"{what} {spec!r}: module {module_name!r} has no attribute {attribute!r}"
        ) from None


def import_callable(spec: str, *, what: str) -> Callable[..., Any]:
    """:func:`import_attribute`, refusing anything that cannot be called."""
    found = import_attribute(spec, what=what)
    if not callable(found):
        raise TargetError(
            f"{what} {spec!r} is a {type(found).__name__}, not callable: name a function"
        )
    return found


def user_target(spec: str, batch_spec: str | None = None) -> Target:
    """Resolve ``package.module:factory``; the factory is called once here to validate it."""
    factory = import_attribute(spec, what="TARGET")
    if not callable(factory):
        raise TargetError(f"TARGET {spec!r} is a {type(factory).__name__}, not a callable factory")
    try:
        built = factory()
    except Exception as error:
        raise TargetError(
            f"TARGET {spec!r}: the factory raised {type(error).__name__}: {error}"
        ) from error
    if not isinstance(built, nn.Module):
        raise TargetError(
            f"TARGET {spec!r}: the factory returned a {type(built).__name__}, not a torch.nn.Module"
        )
    make_batch: Callable[[nn.Module], Any] = _language_model_batch
    if batch_spec is not None:
        make_batch = import_callable(batch_spec, what="--batch")
    else:
        try:
            make_batch(built)  # fail now, with the message, rather than in every rank
        except TargetError as error:
            raise TargetError(f"TARGET {spec!r}: {error}") from None
    return Target(spec, factory, make_batch)


def _zoo_batch(entry: ZooEntry, model: nn.Module) -> Any:
    return entry.make_batch(model, 0)


def zoo_targets(names: list[str] | None = None) -> tuple[list[Target], Mapping[str, str]]:
    """The built-in zoo entries available in the installed Transformers, and why others are not."""
    from pytest_fp32keep.check.zoo import ZOO, available_entries

    unknown = [name for name in names or [] if name not in ZOO]
    if unknown:
        raise TargetError(
            f"unknown zoo entries {unknown}; the zoo has {sorted(ZOO)}. A model of your own is "
            "named package.module:factory, with a colon before the zero-argument function that "
            "builds it (e.g. my_models:build_model)"
        )
    availability = available_entries(names)
    targets = [
        Target(
            entry.name,
            entry.build,
            partial(_zoo_batch, entry),
            entry.expect_layout_error,
            entry.refused_under(),
            entry,
        )
        for entry in availability.available.values()
    ]
    return targets, availability.unavailable


#: How a family is named as a TARGET (``family/t5``): no ``:``, so never a ``module:factory``.
FAMILY_PREFIX = "family/"


def family_spec(name: str) -> str:
    """The TARGET string of the family ``name``."""
    return FAMILY_PREFIX + name


def _check_families(names: list[str]) -> None:
    from pytest_fp32keep.check.families import FamilyError, check_family_names

    try:
        check_family_names(names)
    except FamilyError as error:
        raise TargetError(str(error)) from None


def family_availability(names: list[str]) -> tuple[list[str], Mapping[str, str]]:
    """Which of the families ``names`` build here, and ``not buildable (reason)`` (or ``not
    runnable (reason)``: a random forward) for the rest.

    Each is built, fed its batch and run forward and backward once, unsharded
    (:func:`~pytest_fp32keep.check.families.probe`); an unknown name is a :class:`TargetError`.
    """
    from pytest_fp32keep.check.families import probe

    _check_families(names)
    buildable, unavailable = [], {}
    for name in names:
        probed = probe(name)
        if probed.reason is None:
            buildable.append(name)
        else:
            unavailable[family_spec(name)] = f"{probed.kind} ({probed.reason})"
    return buildable, unavailable


def family_targets(names: list[str]) -> list[Target]:
    """The families ``names`` as targets (built lazily; the caller probed them)."""
    from pytest_fp32keep.check.families import family_entry

    _check_families(names)
    targets = []
    for name in names:
        # the curated zoo's written refusals, or the family's own (family_entry)
        entry = family_entry(name)
        targets.append(
            Target(
                family_spec(name),
                entry.build,
                partial(_zoo_batch, entry),
                entry.expect_layout_error,
                entry.refused_under(),
                entry,
            )
        )
    return targets


def resolve_targets(
    specs: list[str], batch_spec: str | None = None
) -> tuple[list[Target], Mapping[str, str]]:
    """Zoo names, ``family/NAME`` and ``module:factory`` specs → targets; no spec means the
    whole zoo."""
    if not specs:
        return zoo_targets()
    families = [spec.removeprefix(FAMILY_PREFIX) for spec in specs if _is_family(spec)]
    zoo_names = [spec for spec in specs if ":" not in spec and not _is_family(spec)]
    targets, unavailable = zoo_targets(zoo_names) if zoo_names else ([], {})
    targets += family_targets(families)
    targets += [user_target(spec, batch_spec) for spec in specs if ":" in spec]
    return targets, unavailable


def _is_family(spec: str) -> bool:
    return spec.startswith(FAMILY_PREFIX) and ":" not in spec
