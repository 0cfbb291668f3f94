"""What a refusal of :func:`fp32keep.layout.plan_layout` says: the true reason, with the dtypes
and the fix. Pure."""

from __future__ import annotations

from torch import nn

from fp32keep.errors import LayoutProblem
from fp32keep.observe import Stack, format_stack
from fp32keep.reads import DirectRead


def _evidence(read: DirectRead) -> str:
    return "" if read.evidence == "source" else f"; {read.evidence}"


def read_problem(
    fqn: str,
    read: DirectRead,
    unit_label: str,
    replicate_frozen: bool,
    low: str,
    obstacle: str | None = None,
) -> LayoutProblem:
    remedy = (
        "freeze it (requires_grad_(False): frozen kept modules read this way are replicated "
        "whole on every rank)"
        if replicate_frozen
        else "upgrade torch (fully_shard(ignored_params=...) replicates it when frozen)"
    )
    return LayoutProblem(
        fqn,
        "read-not-called",
        f"is kept (float32) in module {read.module_fqn!r}, which {read.reader} reads directly "
        f"({read.expression}{_evidence(read)}) without calling it: FSDP2 all-gathers a unit in "
        "its forward hook, so as a unit of its own it would never be gathered (the first "
        "forward fails with 'mixed torch.Tensor and DTensor'), and inside "
        f"{unit_label!r} it would be all-gathered in the policy's param_dtype ({low})"
        + (f"; nor can its reader's unit hold it: {obstacle}" if obstacle else "")
        + f". Trainable, it cannot be kept: {remedy}.",
    )


def mixed_problem(
    fqn: str,
    model: nn.Module,
    module_fqn: str,
    unit_label: str,
    not_kept_owned: dict[str, list[str]],
) -> LayoutProblem:
    module = model.get_submodule(module_fqn)
    others = not_kept_owned.get(module_fqn, [])
    if others:
        why = (
            f"its module {module_fqn!r} ({type(module).__name__}) also directly owns "
            f"parameters the plan does not keep: {', '.join(others[:4])}"
            f"{' …' if len(others) > 4 else ''}; FSDP2 puts a module's own parameters in one "
            "unit, so they cannot be split"
        )
        remedy = "declare the whole module kept, move the parameter into a module of its own"
    else:
        why = (
            f"its module {module_fqn!r} ({type(module).__name__}) has no forward of its own, "
            "so FSDP2's hooks on it would never run"
        )
        remedy = "move the parameter into a module that is called"
    return LayoutProblem(
        fqn,
        "mixed-unit",
        f"is kept (float32) but would be all-gathered with unit {unit_label!r} in the policy's "
        f"param_dtype: {why}. Fix: {remedy}, or freeze it (frozen kept parameters are "
        "replicated).",
    )


def uncovered_problem(fqn: str, unit_label: str, stack: Stack, low: str) -> LayoutProblem:
    """A kept parameter the observed forward used while no module of its unit ran."""
    return LayoutProblem(
        fqn,
        "read-not-called",
        f"is kept (float32) in unit {unit_label!r}, but the observed forward used it in "
        f"{format_stack(stack)}, while no module of that unit was called or ran a method: "
        "FSDP2 gathers a unit only around its forward and its registered methods, so there it "
        f"would meet the sharded parameter ('mixed torch.Tensor and DTensor'; the plan is for "
        f"{low}). Fix: call the module that owns it, wrap the module that reads it as this "
        "unit (wrap=...), or freeze it (frozen kept parameters are replicated).",
    )
