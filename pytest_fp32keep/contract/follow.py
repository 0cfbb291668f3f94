"""What the reference follows of the implementation's choices, where the contract allows either.

Two things are the implementation's to decide, not the contract's, and the unsharded reference
and the parity control make the same decisions, so that every row compares like with like:

* **which parameters train**: ``requires_grad`` of every parameter and the train/eval mode of
  every module, as the implementation's ``cast`` and ``shard`` leave them (read after ``shard``,
  before the round trip and the first forward). A model frozen there (trl freezes its teacher
  in its own preparation) is judged as the frozen model it is: forward only when nothing
  trains. Freezing in ``load`` or later is not followed.
* **under FP32 master weights, the storage of what is not a master weight**: a floating buffer
  or frozen parameter the plan does not keep may be stored in ``dtype`` (what accelerate's
  upcast of the trainable parameters leaves) or in FP32 (verl's ``module.to(torch.float32)``).
  Read after ``cast``, before ``shard``: where the implementation stores one in FP32, the
  reference and the control hold it in FP32 too, with its value as built (and loaded), never
  rounded through ``dtype``. Any other dtype (fp16 where ``dtype`` is bf16) is not followed:
  ``stored`` still expects ``dtype`` there.

Kept tensors, and trainable parameters under FP32 master weights, are never followed: their
storage is the contract's (:mod:`.master`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch
from torch import nn

from fp32keep import KeepPlan
from pytest_fp32keep.contract.steps import local

__all__ = ["Choices", "cast_following", "follow", "read_choices", "stored_fp32", "values_of"]


def _floating(model: nn.Module) -> dict[str, tuple[torch.Tensor, bool]]:
    """Every floating parameter and buffer of ``model`` by name (every alias), and whether it
    is a buffer."""
    found: dict[str, tuple[torch.Tensor, bool]] = {
        name: (param, False)
        for name, param in model.named_parameters(remove_duplicate=False)
        if param.is_floating_point()
    }
    found.update(
        (name, (buffer, True))
        for name, buffer in model.named_buffers(remove_duplicate=False)
        if buffer.is_floating_point()
    )
    return found


def stored_fp32(
    model: nn.Module, reference: nn.Module, plan: KeepPlan, dtype: torch.dtype
) -> frozenset[str]:
    """The names of the floating tensors the plan does not keep that ``model`` (cast, not yet
    sharded) stores in FP32 where ``reference`` holds them in ``dtype``: the candidates for
    FP32 storage under master weights (:func:`read_choices` keeps the buffers and frozen
    parameters among them)."""
    held = _floating(reference)
    return frozenset(
        name
        for name, (tensor, _) in _floating(model).items()
        if name not in plan
        and name in held
        and local(tensor).dtype == torch.float32
        and held[name][0].dtype == dtype != torch.float32
    )


@dataclasses.dataclass(frozen=True)
class Choices:
    """What the implementation decided where the contract allows either (module docstring)."""

    requires_grad: Mapping[str, bool]  # every floating parameter's name (every alias)
    training: Mapping[str, bool]  # every module's fully qualified name
    fp32: frozenset[str]  # buffers and frozen parameters not kept, stored FP32 (master weights)

    def notes(self, reference: nn.Module) -> list[str]:
        """What ``reference`` (before :func:`follow`) does differently, for the report."""
        notes: list[str] = []
        built = {name: p.requires_grad for name, p in reference.named_parameters()}
        now = {name: self.requires_grad.get(name, trains) for name, trains in built.items()}
        frozen = sorted(name for name, trains in built.items() if trains and not now[name])
        thawed = sorted(name for name, trains in built.items() if not trains and now[name])
        modes = dict(reference.named_modules(remove_duplicate=False))
        moved = sorted(f or "<root>" for f, on in self.training.items() if modes[f].training != on)
        for names, what in (
            (frozen, "frozen that the model factory builds trainable"),
            (thawed, "trainable that the model factory builds frozen"),
            (moved, "module(s) in another train/eval mode than the model factory builds"),
        ):
            if names:
                notes.append(
                    f"the implementation's cast and shard leave {len(names)} "
                    f"{'' if names is moved else 'parameter(s) '}{what} "
                    f"({_shown(names)}): the reference and the control follow"
                )
        if self.fp32:
            shown = _shown(sorted(self.fp32))
            notes.append(
                f"under FP32 master weights the implementation stores {len(self.fp32)} buffer(s) "
                f"or frozen parameter(s) the plan does not keep in FP32 ({shown})"
                ", a convention the contract accepts beside `dtype`: the reference and the "
                "control hold them in FP32 too, as built or loaded"
            )
        return notes


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (" …" if len(names) > 3 else "")


def read_choices(
    model: nn.Module, reference: nn.Module, candidates: frozenset[str], master: bool
) -> Choices:
    """The implementation's choices, read off ``model`` after ``shard``; ``candidates``
    (:func:`stored_fp32`, read after ``cast``) count only under master weights (``master``),
    and only for the buffers and the parameters ``model`` leaves frozen. Only the names
    ``reference`` has too are read."""
    params = dict(reference.named_parameters(remove_duplicate=False))
    modules = dict(reference.named_modules(remove_duplicate=False))
    requires_grad = {
        name: param.requires_grad
        for name, param in model.named_parameters(remove_duplicate=False)
        if name in params
    }
    training = {
        fqn: module.training
        for fqn, module in model.named_modules(remove_duplicate=False)
        if fqn in modules
    }
    fp32 = frozenset(n for n in candidates if not requires_grad.get(n, False) and master)
    return Choices(requires_grad, training, fp32)


def values_of(model: nn.Module, names: frozenset[str]) -> dict[str, torch.Tensor]:
    """Copies of ``model``'s tensors ``names``, in FP32: the values a correct FP32 storage of
    them holds, read before any cast to a lower dtype."""
    found = _floating(model)
    return {
        name: found[name][0].detach().to(torch.float32, copy=True)
        for name in names
        if name in found
    }


def follow(model: nn.Module, choices: Choices, values: Mapping[str, torch.Tensor]) -> None:
    """Make ``model`` (the reference, or the control before its cast) follow ``choices``:
    ``requires_grad`` and train/eval modes as the implementation left them, and the tensors
    ``values`` holds (:func:`values_of`) set to them, in place (identity and aliases kept)."""
    for name, param in model.named_parameters(remove_duplicate=False):
        trains = choices.requires_grad.get(name)
        if trains is not None and param.requires_grad != trains:
            param.requires_grad_(trains)
    for fqn, module in model.named_modules(remove_duplicate=False):
        mode = choices.training.get(fqn)
        if mode is not None:
            module.training = mode
    found = _floating(model)
    with torch.no_grad():
        for name, value in values.items():
            if name in found:
                found[name][0].data = value.to(found[name][0].device)


def cast_following(model: nn.Module, choices: Choices, cast: Callable[[nn.Module], object]) -> None:
    """``cast`` ``model`` (freshly built, uncast) as the implementation's choices say: which
    parameters train and each module's mode set first, then the cast, then the tensors the
    implementation stores in FP32 put back to their values from before the cast."""
    follow(model, choices, {})
    kept_fp32 = values_of(model, choices.fp32)
    cast(model)
    follow(model, choices, kept_fp32)
