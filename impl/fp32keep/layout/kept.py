"""Which modules become kept units: the selection behind
:func:`fp32keep.layout.planning.plan_layout`. Pure.

Kept units are chosen from the module tree and the plan: the topmost fully kept modules with a
forward, wrap targets nested inside them, owners of only kept parameters that have children
that are not kept, and never a module an ancestor reads without calling it (observed,
:meth:`fp32keep.uses.observe.ParameterUse.direct_read`, or else read from the source,
:func:`fp32keep.uses.source.find_direct_read`). Such a read module goes with its reader
instead where the reader is its parent and owns no parameter that is not kept: the reader
becomes an owner unit (its children that are not kept get units of their own first), so FSDP2
all-gathers the read tensors in FP32 in the reader's own forward hook, just before the reader's
code reads them (the linear-attention ``conv1d`` whose ``weight`` Bailing-Hybrid's attention
hands to a kernel).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeAlias

from torch import nn

from fp32keep.errors import hidden_in_tracebacks
from fp32keep.plan.keep_plan import KeepPlan
from fp32keep.tensors import dtype_name, is_castable_float, iter_owned, join
from fp32keep.uses.source import DirectRead

#: pytest hides this module's frames from a test's traceback when the error is fp32keep's own.
__tracebackhide__ = hidden_in_tracebacks

ReadFinder: TypeAlias = Callable[[nn.Module, str], DirectRead | None]
"""``(model, module_fqn) -> DirectRead | None``: who reads a module's tensors without calling it."""


def has_own_forward(module: nn.Module) -> bool:
    # Containers (ModuleList, ModuleDict, a bare nn.Module) never run forward, so FSDP2's forward
    # hooks on them would never all-gather: their callable descendants must be the units.
    forward = getattr(type(module), "forward", None)
    return forward is not None and forward is not nn.Module.forward


def float_param_names(model: nn.Module) -> dict[str, list[str]]:
    """For every module FQN, the floating parameter names (all aliases) in its subtree."""
    below: dict[str, list[str]] = defaultdict(list)
    for module_fqn, _, attribute, tensor, is_param in iter_owned(model):
        if not is_param or not is_castable_float(tensor.dtype):
            continue
        name = join(module_fqn, attribute)
        parts = module_fqn.split(".") if module_fqn else []
        for cut in range(len(parts) + 1):
            below[".".join(parts[:cut])].append(name)
    return below


@dataclass
class KeptSelection:
    """The kept units ``plan_layout`` found, before grouping.

    Attributes:
        top: topmost fully kept modules with a forward (containers resolved to their callable
            descendants); the only ones ``group_kept`` may group.
        nested: wrap targets inside a fully kept module: kept units of their own, so that a large
            kept subtree (Blip2's ``qformer``) is all-gathered block by block, not at once.
        owners: modules that directly own only kept parameters, some trainable, but have children
            that are not kept (attention ``sinks``, a gate's ``A_log``): kept units sharded after
            their children, which get units of their own with the caller's policy
            (``owner_children``). Frozen ones stay replicated, as before.
        read_directly: kept modules an ancestor reads without calling (:mod:`fp32keep.uses`):
            never units, since FSDP2 would never all-gather them; those with trainable
            parameters whose reader can hold them are not here but in their reader's owner unit
            (see the module docstring).
        reader_obstacles: for each trainable module of ``read_directly``, why its reader cannot
            hold it (for the refusal to say).
        root_obstacle: why a root that directly owns kept, trainable parameters cannot be an
            owner unit (:func:`root_obstacle`), for the ``root-owned`` refusal to say; ``None``
            when it is one, or owns none.
    """

    top: list[str] = field(default_factory=list)
    nested: list[str] = field(default_factory=list)
    owners: list[str] = field(default_factory=list)
    owner_children: list[str] = field(default_factory=list)
    read_directly: list[DirectRead] = field(default_factory=list)
    reader_obstacles: dict[str, str] = field(default_factory=dict)
    root_obstacle: str | None = None


def _direct_float_params(model: nn.Module) -> dict[str, list[str]]:
    """For every module FQN, the floating parameter names (all aliases) it owns directly."""
    owned: dict[str, list[str]] = defaultdict(list)
    for module_fqn, _, attribute, tensor, is_param in iter_owned(model):
        if is_param and is_castable_float(tensor.dtype):
            owned[module_fqn].append(join(module_fqn, attribute))
    return owned


def kept_modules(
    model: nn.Module,
    plan: KeepPlan,
    below: dict[str, list[str]],
    is_target: Callable[[nn.Module], bool],
    find_read: ReadFinder,
) -> KeptSelection:
    """The kept units of ``model`` under ``plan`` (see :class:`KeptSelection`), before grouping.

    ``below`` is :func:`float_param_names`; ``is_target`` says which modules are wrap targets;
    ``find_read`` who reads a module without calling it (observed, or from the source).
    """
    if not plan.param_names:
        return KeptSelection()
    return _KeptSelector(model, plan, below, is_target, find_read).select()


class _KeptSelector:
    """One walk of the module tree that fills a :class:`KeptSelection`: the questions it asks of
    a module (fully kept? owns only kept parameters? read without being called?) and what it
    adds for each answer."""

    def __init__(
        self,
        model: nn.Module,
        plan: KeepPlan,
        below: dict[str, list[str]],
        is_target: Callable[[nn.Module], bool],
        find_read: ReadFinder,
    ) -> None:
        self.model = model
        self.plan = plan
        self.below = below
        self.is_target = is_target
        self.find_read = find_read
        self.direct = _direct_float_params(model)
        self.trainable = {
            name
            for name, param in model.named_parameters(remove_duplicate=False)
            if param.requires_grad
        }
        self.found = KeptSelection()

    def select(self) -> KeptSelection:
        self.visit("", self.model)
        return self.found

    def fully_kept(self, fqn: str) -> bool:
        names = self.below.get(fqn, [])
        return bool(names) and all(name in self.plan.param_names for name in names)

    def owns_only_kept(self, fqn: str, module: nn.Module) -> bool:
        # Only trainable ones: frozen kept parameters of such a module (a router's correction
        # bias) stay replicated, whole on every rank, which costs no collective at all. The root
        # too (Blip2's query_tokens): its children then get units, and it is sharded last.
        names = self.direct.get(fqn, [])
        return (
            bool(names)
            and has_own_forward(module)
            and all(name in self.plan.param_names for name in names)
            and any(name in self.trainable for name in names)
            and not self.fully_kept(fqn)
        )

    def callable_descendants(self, fqn: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
        if has_own_forward(module):
            return [(fqn, module)]
        out: list[tuple[str, nn.Module]] = []
        for child_name, child in module.named_children():
            child_fqn = join(fqn, child_name)
            if self.below.get(child_fqn):
                out.extend(self.callable_descendants(child_fqn, child))
        return out

    def owner_children(self, fqn: str, module: nn.Module) -> list[str]:
        out: list[str] = []
        for child_name, child in module.named_children():
            child_fqn = join(fqn, child_name)
            if self.below.get(child_fqn) and not self.fully_kept(child_fqn):
                out.extend(
                    unit_fqn
                    for unit_fqn, unit_module in self.callable_descendants(child_fqn, child)
                    if not self.fully_kept(unit_fqn)
                    and not self.is_target(unit_module)
                    and not self.owns_only_kept(unit_fqn, unit_module)
                )
        return out

    def add_owner_children(self, fqn: str, module: nn.Module) -> None:
        self.found.owner_children.extend(self.owner_children(fqn, module))

    def reader_obstacle(self, read: DirectRead) -> str | None:
        # The reader's own unit can all-gather the read tensors only if it claims nothing else
        # that is not kept: it must be the read module's parent (a module between them would
        # give its own parameters to the reader's unit) and own no parameter the plan does
        # not keep. None: it can.
        reader = read.reader_fqn
        if not reader:
            return f"its reader is the root module ({read.reader}), sharded with your policy"
        where = f"its reader {reader!r} ({read.reader})"
        if read.module_fqn.rpartition(".")[0] != reader:
            return f"{where} is not its parent"
        reader_module = self.model.get_submodule(reader)
        if not has_own_forward(reader_module):
            return f"{where} has no forward of its own"
        others = [name for name in self.direct.get(reader, []) if name not in self.plan.param_names]
        if others:
            params = dict(reader_module.named_parameters(prefix=reader, recurse=False))
            shown = ", ".join(
                f"{name.rpartition('.')[2]} ({dtype_name(params[name].dtype)})"
                for name in others[:4]
            )
            return (
                f"{where} also directly owns parameters the plan does not keep ({shown}), "
                "so its unit cannot all-gather in FP32"
            )
        return None

    def keep(self, fqn: str, module: nn.Module, into: list[str]) -> bool:
        """Add ``fqn`` to ``into`` unless an ancestor reads it without calling it; then its
        reader owns it where it can, else the read is recorded. Whether it was added."""
        read = self.find_read(self.model, fqn)
        if read is None:
            into.append(fqn)
            return True
        names = [name for name, _ in module.named_parameters(prefix=fqn)]
        if not any(name in self.trainable for name in names):
            self.found.read_directly.append(read)  # frozen: replicated, no collective at all
            return False
        obstacle = self.reader_obstacle(read)
        if obstacle is not None:
            self.found.reader_obstacles[fqn] = obstacle
            self.found.read_directly.append(read)
        elif read.reader_fqn not in self.found.owners:
            self.found.owners.append(read.reader_fqn)
            self.add_owner_children(read.reader_fqn, self.model.get_submodule(read.reader_fqn))
        return False

    def add_root_owner(self) -> None:
        # Everything but the root's own (kept) parameters must leave the root's FP32 unit: each
        # child gets a unit, and so does the input embedding the root calls itself
        # (``self.get_input_embeddings()(input_ids)``), which would otherwise be gathered only
        # in its parent's forward, after the root already used it.
        model = self.model
        children = self.owner_children("", model)
        embedding = root_called_embedding(model)
        if (
            embedding is None
            or embedding in children
            or self.is_target(model.get_submodule(embedding))  # a unit already
            or any(self.fully_kept(fqn) for fqn in _self_and_ancestors(embedding))
        ):
            embedding = None
        else:
            children.append(embedding)
        self.found.root_obstacle = root_obstacle(model, children, self.find_read, embedding)
        if self.found.root_obstacle is None:
            self.found.owners.append("")
            self.found.owner_children.extend(children)

    def visit(self, fqn: str, module: nn.Module) -> None:
        if self.fully_kept(fqn):
            for unit_fqn, unit_module in self.callable_descendants(fqn, module):
                if self.keep(unit_fqn, unit_module, self.found.top):
                    self.nest(unit_fqn, unit_module)
            return
        if not fqn:
            if self.owns_only_kept(fqn, module):
                self.add_root_owner()
            else:  # the refusal, where one is due, says which condition failed
                direct = self.direct.get("", [])
                self.found.root_obstacle = _root_not_owner(module, direct, self.plan)
        elif self.owns_only_kept(fqn, module) and self.keep(fqn, module, self.found.owners):
            self.add_owner_children(fqn, module)
        for child_name, child in module.named_children():
            self.visit(join(fqn, child_name), child)

    def nest(self, fqn: str, module: nn.Module) -> None:
        """Wrap targets inside a kept unit: kept units of their own, nested."""
        for name, inner in module.named_modules(prefix=fqn):
            if (
                name != fqn
                and self.below.get(name)
                and self.is_target(inner)
                and has_own_forward(inner)
            ):
                self.keep(name, inner, self.found.nested)


def root_called_embedding(model: nn.Module) -> str | None:
    """The FQN of the input embedding ``model.get_input_embeddings()`` returns, when it lies
    below a child of the root (Blip2's ``language_model.model.decoder.embed_tokens``).

    Transformers' vision-language models embed the text in the root's own forward
    (``self.get_input_embeddings()(input_ids)``), not in the language model's: as part of the
    language model's unit the embedding would be used before that unit is all-gathered.
    ``None`` without such a method (a plain module), when it raises, or for a direct child.
    """
    getter = getattr(model, "get_input_embeddings", None)
    if not callable(getter):
        return None
    try:
        embedding = getter()
    except (NotImplementedError, AttributeError):  # Transformers' default when unset
        return None
    fqn = next((name for name, module in model.named_modules() if module is embedding), None)
    return fqn if fqn is not None and "." in fqn else None


def root_obstacle(
    model: nn.Module, units: list[str], find_read: ReadFinder, called: str | None = None
) -> str | None:
    """Why the root cannot be an FP32 unit holding only its own kept parameters, when its
    ``units`` (children, and ``called``: the embedding it calls) get units of their own;
    ``None`` when it can.

    It cannot when a tensor of one of them is read without a call: FSDP2 would never all-gather
    that unit before the read (the root's parameters the plan does not keep are checked by the
    caller, which names them). The source scan counts ``NAME.TENSOR`` as a read only while no
    ancestor calls ``NAME(...)``, and cannot tie the root's ``get_input_embeddings()(...)`` to
    the embedding's name, so for ``called`` only an observed read counts (T5's
    ``_init_weights`` spells ``module.shared.weight``).
    """
    for fqn in units:
        read = find_read(model, fqn)
        if read is None or (fqn == called and read.evidence == "source"):
            continue
        return (
            f"{read.reader} reads {read.expression} without calling {fqn!r}, which would "
            "then be a unit of its own that FSDP2 never all-gathers before the read"
        )
    return None


def _root_not_owner(root: nn.Module, names: list[str], plan: KeepPlan) -> str | None:
    """Why a root that directly owns kept parameters is not an owner unit (``None``: it owns
    none, or none of its checks failed)."""
    others = [name for name in names if name not in plan.param_names]
    if others and len(others) < len(names):
        params = dict(root.named_parameters(recurse=False))
        shown = ", ".join(f"{name} ({dtype_name(params[name].dtype)})" for name in others[:4])
        return (
            f"it also directly owns parameters the plan does not keep ({shown}"
            f"{' …' if len(others) > 4 else ''}), and FSDP2 puts a module's own parameters in "
            "one unit"
        )
    if names and not others:
        if not has_own_forward(root):
            return "it has no forward of its own, so FSDP2's hooks on it would never run"
        return (
            "its kept parameters are frozen, and this torch's fully_shard cannot leave them out "
            "(ignored_params) to replicate them"
        )
    return None


def _self_and_ancestors(fqn: str) -> list[str]:
    parts = fqn.split(".")
    return [".".join(parts[:cut]) for cut in range(len(parts), 0, -1)]
