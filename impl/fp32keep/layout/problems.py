"""What a refusal of :func:`fp32keep.layout.planning.plan_layout` says: the true reason, with the
dtypes and the fix. Pure.

Dtypes are spelled as torch prints them (:func:`fp32keep.tensors.dtype_name`), and the phrases
tools written for verl's keep-FP32 path match (verl PR 7165: "tied across FSDP2 unit
boundaries", "no fp32-keep unit owns it", "already in a lower precision", "all-gathers all of
its parameters at one dtype") appear in the refusals that mean the same.
"""

from __future__ import annotations

import torch
from torch import nn

from fp32keep.errors import LayoutProblem, hidden_in_tracebacks
from fp32keep.tensors import dtype_name
from fp32keep.uses.observe import Stack, format_stack
from fp32keep.uses.source import DirectRead

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks

_KEPT = dtype_name(torch.float32)


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
        f"is kept ({_KEPT}) in module {read.module_fqn!r}, which {read.reader} reads directly "
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
        f"is kept ({_KEPT}) but would be all-gathered with unit {unit_label!r} in the policy's "
        f"param_dtype: {why}. Fix: {remedy}, or freeze it (frozen kept parameters are "
        "replicated).",
    )


def uncovered_problem(fqn: str, unit_label: str, stack: Stack, low: str) -> LayoutProblem:
    """A kept parameter the observed forward used while no module of its unit ran."""
    return LayoutProblem(
        fqn,
        "read-not-called",
        f"is kept ({_KEPT}) in unit {unit_label!r}, but the observed forward used it in "
        f"{format_stack(stack)}, while no module of that unit was called or ran a method: "
        "FSDP2 gathers a unit only around its forward and its registered methods, so there it "
        f"would meet the sharded parameter ('mixed torch.Tensor and DTensor'; the plan is for "
        f"{low}). Fix: call the module that owns it, wrap the module that reads it as this "
        "unit (wrap=...), or freeze it (frozen kept parameters are replicated).",
    )


def outside_use_problem(
    fqn: str, unit_label: str, read: DirectRead, why: str, model: nn.Module, *, called: bool
) -> LayoutProblem:
    """A parameter of a unit fp32keep made (``why``: how it came to be a unit) that code
    outside the unit reads, or reaches by ``called`` a module inside it that is no unit."""
    module = read.module_fqn
    kind = type(model.get_submodule(module)).__name__
    own_unit = unit_label == module
    wrap = f"make {module!r} a unit of its own (name its class, {kind}, in wrap=...)"
    if called and read.expression.endswith(".forward(...)"):
        fix = (
            f"call {module!r} itself, not its .forward (FSDP2 all-gathers in the hooks a call "
            "runs and .forward skips)"
        )
    elif called:
        fix = f"the call gathers nothing, as {module!r} is no unit: {wrap}"
    else:
        fix = f"call {module!r} instead of reading its {fqn.rpartition('.')[2]}"
        fix += "" if own_unit else f", and {wrap}"
    if not own_unit:
        fix += f"; or move the code that uses it into the forward of {unit_label!r}"
    return LayoutProblem(
        fqn,
        "read-not-called",
        f"is in unit {unit_label!r} ({why}), but {read.reader} "
        f"({read.reader_fqn or '<root>'!r}) uses it outside that unit ({read.expression}"
        f"{_evidence(read)}) while no module of the unit runs: FSDP2 all-gathers a unit only "
        "around its own modules' forward and registered methods, so there it would meet the "
        "sharded parameter and the model would be sharded, then fail at its first forward "
        f"('mixed torch.Tensor and DTensor'). Fix: {fix}.",
    )


def root_problem(
    fqn: str,
    model: nn.Module,
    module_fqn: str,
    low: str,
    reader: DirectRead | None,
    obstacle: str | None = None,
) -> LayoutProblem:
    """A kept parameter that falls in the root unit: owned by the root itself, or by a module
    no unit can be (a ``ParameterList`` or ``ParameterDict`` has no forward), named with the
    module that reads it; ``obstacle``: why the root cannot be an FP32 unit of its own."""
    root = type(model).__name__
    if module_fqn:
        owner = model.get_submodule(module_fqn)
        read = (
            f", read by {reader.reader_fqn or '<root>'!r} ({reader.reader}: "
            f"{reader.expression}{_evidence(reader)})"
            if reader is not None
            else ""
        )
        where = (
            f"owned by {module_fqn!r} ({type(owner).__name__}{read}), which has no forward of "
            f"its own, so FSDP2's hooks on it would never run and it falls to the root module "
            f"({root})"
        )
        fix = (
            "move it into a module with a forward that uses it (e.g. a small module that owns "
            f"the {type(owner).__name__} and is called by its reader)"
        )
    else:
        where = f"owned directly by the root module ({root})"
        if obstacle:
            where += f", which cannot be an FP32 unit of its own: {obstacle}"
        fix = "move it into a submodule"
    return LayoutProblem(
        fqn,
        "root-owned",
        f"is kept ({_KEPT}) but no fp32-keep unit owns it: it is {where}. The root is sharded "
        "last with the caller's policy, as the model's own boundary, so its parameters are "
        f"all-gathered in the policy's param_dtype (the plan is for {low}). Fix: {fix}, freeze "
        "it (frozen kept parameters are replicated), or train without a low-precision "
        "param_dtype.",
    )


def _embedding_weights(model: nn.Module) -> tuple[str, str] | None:
    """The names of the input and the output embedding's weights of a Hugging Face model
    (``get_input_embeddings``/``get_output_embeddings``), or ``None`` where it has none."""
    fqn_of = {id(module): fqn for fqn, module in model.named_modules(remove_duplicate=False)}
    found = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(model, getter)()
        except (AttributeError, NotImplementedError):
            return None
        if not isinstance(module, nn.Module) or id(module) not in fqn_of:
            return None
        found.append(f"{fqn_of[id(module)]}.weight".lstrip("."))
    return found[0], found[1]


def tied_problem(
    model: nn.Module, names: list[str], labels: list[str], dtype: torch.dtype, kept: bool
) -> LayoutProblem:
    """One tensor under several names that fall in different units."""
    embeddings = _embedding_weights(model)
    if embeddings is not None and set(embeddings) <= set(names):
        fix = (
            f"these are the input and output embeddings ({embeddings[0]!r} and "
            f"{embeddings[1]!r}): set tie_word_embeddings=False in the model's config (e.g. "
            "from_pretrained(..., tie_word_embeddings=False)), so the output embedding gets a "
            "weight of its own, or wrap a common ancestor of both as one unit (wrap=...)."
        )
    else:
        fix = (
            "Wrap a common ancestor of all its owners as one unit (wrap=...), or untie the "
            "weights (give each module a parameter of its own)."
        )
    return LayoutProblem(
        names[0],
        "tied-across-units",
        f"is tied across FSDP2 unit boundaries: one {dtype_name(dtype)} tensor"
        f"{' the plan keeps' if kept else ''}, named {names}, falls in units {labels}, and "
        f"FSDP2 manages a parameter in one unit only. Fix: {fix}",
    )


def adapter_base(model: nn.Module, module_fqn: str) -> tuple[str, torch.Tensor] | None:
    """``(name, tensor)`` of the base weight when ``module_fqn`` is (inside) an adapter of a PEFT
    tuner layer (a module with a ``base_layer``, like LoRA's ``lora_A``/``lora_B``) whose base
    weight is stored in FP32; else ``None``."""
    parts = module_fqn.split(".") if module_fqn else []
    for cut in range(len(parts) - 1, -1, -1):
        layer_fqn = ".".join(parts[:cut])
        base = getattr(model.get_submodule(layer_fqn), "base_layer", None)
        if not isinstance(base, nn.Module) or parts[cut] == "base_layer":
            continue
        weight = getattr(base, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dtype == torch.float32:
            return f"{layer_fqn}.base_layer.weight".lstrip("."), weight
        return None
    return None


def degraded_problem(
    fqn: str, model: nn.Module, module_fqn: str, dtype: torch.dtype, unit_label: str
) -> LayoutProblem:
    """A kept parameter stored below FP32 before wrapping. An adapter beside its FP32 base
    weight (PEFT's LoRA on a kept Linear, adapters cast down) is tagged a mixed-dtype unit with
    the adapters' own fix: the base weight is right, and is not named as a culprit."""
    found = adapter_base(model, module_fqn)
    if found is None:
        return LayoutProblem(
            fqn,
            "degraded",
            f"is kept by the plan but already in a lower precision: stored as "
            f"{dtype_name(dtype)} before wrapping; cast with fp32keep.keep_aware_cast(model, "
            "dtype) instead of model.to(dtype), or load the checkpoint again.",
        )
    base, weight = found
    crash = (
        "; with the base weight trainable, FSDP2 would fail on the first forward with 'FSDP "
        "expects uniform original parameter dtype' (a unit all-gathers all of its parameters "
        "at one dtype)"
        if weight.requires_grad
        else ""
    )
    return LayoutProblem(
        fqn,
        "mixed-dtype-unit",
        f"is an adapter stored as {dtype_name(dtype)} beside its {_KEPT} base weight "
        f"{base!r} in unit {unit_label!r}: the plan keeps the adapters of a kept module in "
        f"{_KEPT} too, and this one would be all-gathered and trained in {dtype_name(dtype)}"
        f"{crash}. Fix: keep the adapters of a kept module in FP32: PEFT's "
        "get_peft_model(..., autocast_adapter_dtype=True) (its default) or "
        "peft.tuners.tuners_utils.cast_adapter_dtype(model, adapter_name), or cast the "
        f"adapters to {_KEPT}; the base weight is right as it is.",
    )


def mixed_dtype_problem(fqn: str, dtype: torch.dtype, unit_label: str, found: str) -> LayoutProblem:
    """A trainable parameter whose dtype differs from the others' in its unit, nothing kept."""
    return LayoutProblem(
        fqn,
        "mixed-dtype-unit",
        f"is stored as {dtype_name(dtype)} in unit {unit_label!r}, which holds trainable "
        f"parameters of several dtypes ({found}); an FSDP2 unit all-gathers all of its "
        "parameters at one dtype, and FSDP2 would fail on the first forward with 'FSDP expects "
        "uniform original parameter dtype'. Store FP32 master weights with "
        "fp32keep.upcast_to_fp32_master(model), or declare the FP32 modules in "
        "_keep_in_fp32_modules(_strict) so they get units of their own.",
    )
