"""The probe itself: :class:`DtypeProbe`'s lifecycle and the hooks that take each observation.

It owns attaching and detaching the forward hooks, the global hooks and the gradient hooks,
the per-thread call stack, and turning each hook call or dispatched operator into a record;
reading the records back is :class:`~.queries._ProbeQueries`, which it inherits.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from pytest_fp32keep.contract.probe.leaves import _call_leaves, _floating_leaves, _is_dtensor
from pytest_fp32keep.contract.probe.queries import _ProbeQueries
from pytest_fp32keep.contract.probe.recorder import (
    ModuleSelector,
    _activate,
    _deactivate,
    _Frame,
    _select_modules,
)
from pytest_fp32keep.contract.probe.records import (
    BoundaryRecord,
    GradRecord,
    MaterializedParamRecord,
    OpRecord,
)


class DtypeProbe(_ProbeQueries):
    """Record boundary, materialised-parameter, operator and gradient dtypes of a model.

    Attach it to a plain ``nn.Module`` or a Hugging Face model, before or after
    ``fully_shard``, run forward (and backward), then read the records::

        with DtypeProbe(model, modules=["layers.0.mlp"]) as probe:
            loss = model(batch).sum()
            loss.backward()
        probe.boundary_dtypes("layers.0.mlp").inputs   # {"args[0]": torch.bfloat16}
        probe.materialized_dtypes("layers.0.mlp")      # {"weight": torch.float32, ...}
        probe.op_dtypes("layers.0.mlp")                # [OpDtypes("aten.mm.default", ...)]
        print(probe.summary())

    The package docstring (:mod:`pytest_fp32keep.contract.probe`) explains where each
    observation is taken and why they must not be conflated. Records survive :meth:`detach`;
    :meth:`clear` drops them.

    Args:
        model: the model to observe.
        modules: which modules to probe: ``None`` for every module (the root is ``""``), a
            predicate ``(fqn, module) -> bool``, or an iterable of FQNs (a single string is one
            FQN). An unknown FQN or an empty selection raises ``ValueError``.
        record_ops: record operators (observation 3) through a ``TorchDispatchMode``.
        record_grads: record gradient dtypes (observation 4) through tensor hooks.
    """

    def __init__(
        self,
        model: nn.Module,
        modules: ModuleSelector = None,
        *,
        record_ops: bool = True,
        record_grads: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"DtypeProbe needs an nn.Module, got {type(model).__name__}")
        self._model_type = type(model).__name__
        self._fqn_of = _select_modules(model, modules)
        self._position = {fqn: index for index, fqn in enumerate(self._fqn_of.values())}
        self._record_ops = record_ops
        self._record_grads = record_grads
        self._pre_handles: dict[nn.Module, RemovableHandle] = {}
        self._post_handles: dict[nn.Module, RemovableHandle] = {}
        self._global_handles: list[RemovableHandle] = []
        self._grad_hooks: dict[tuple[str, str], tuple[weakref.ref[torch.Tensor], RemovableHandle]]
        self._grad_hooks = {}
        self._local = threading.local()
        self._lock = threading.Lock()
        self._attached = False
        self.clear()

    # ---- lifecycle

    def attach(self) -> DtypeProbe:
        """Register the hooks; returns ``self``. Attaching twice raises ``RuntimeError``."""
        if self._attached:
            raise RuntimeError("DtypeProbe is already attached")
        for module in self._fqn_of:
            self._pre_handles[module] = module.register_forward_pre_hook(
                self._on_pre_forward, with_kwargs=True
            )
            self._post_handles[module] = module.register_forward_hook(
                self._on_post_forward, always_call=True
            )
        self._global_handles = [
            nn.modules.module.register_module_forward_pre_hook(self._on_global_pre_forward),
            nn.modules.module.register_module_forward_hook(
                self._on_global_post_forward, always_call=True
            ),
        ]
        self._attached = True
        return self

    def detach(self) -> None:
        """Remove every hook the probe registered; the records stay. Idempotent."""
        handles = [
            *self._pre_handles.values(),
            *self._post_handles.values(),
            *self._global_handles,
            *(handle for _, handle in self._grad_hooks.values()),
        ]
        for handle in handles:
            handle.remove()
        self._pre_handles.clear()
        self._post_handles.clear()
        self._global_handles.clear()
        self._grad_hooks.clear()
        # A forward interrupted by a BaseException (Ctrl-C) skips the always-call hooks; do not
        # leave this thread's dispatch mode entered on its behalf.
        self._stack().clear()
        _deactivate(self)
        self._attached = False

    @property
    def attached(self) -> bool:
        """Whether the hooks are registered."""
        return self._attached

    def __enter__(self) -> DtypeProbe:
        return self.attach()

    def __exit__(self, *exc_info: object) -> None:
        self.detach()

    def __deepcopy__(self, memo: dict[int, Any]) -> DtypeProbe:
        # ``copy.deepcopy(model)`` copies the model's hook dicts, and with them the bound methods
        # of this probe. Sharing the probe makes those copied hooks inert (they ignore modules
        # the probe did not select) instead of feeding a silent copy of the probe.
        return self

    def clear(self) -> None:
        """Drop every record and restart call indices at 0."""
        self._boundaries = []
        self._params = []
        self._ops = []
        self._grads = []
        self._calls = Counter()
        self._seq = 0

    # ---- hooks (each returns None: the probe never changes what the model computes)

    def _stack(self) -> list[_Frame]:
        stack: list[_Frame] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = []
            self._local.stack = stack
        return stack

    def _next_seq(self) -> int:
        with self._lock:
            self._seq += 1
            return self._seq - 1

    def _on_global_pre_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        fqn = self._fqn_of.get(module)
        if fqn is None:
            return
        with self._lock:
            call = self._calls[fqn]
            self._calls[fqn] += 1
        stack = self._stack()
        stack.append(_Frame(module, fqn, call))
        if self._record_ops:
            _activate(self)  # idempotent: only the outermost probed call enters the mode

    def _frame_of(self, module: nn.Module) -> _Frame | None:
        for frame in reversed(self._stack()):
            if frame.module is module:
                return frame
        return None

    def _on_pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        frame = self._frame_of(module)
        if frame is None:
            return
        frame.inputs = _call_leaves(args, kwargs)
        frame.phase = "forward"
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            self._params.append(
                MaterializedParamRecord(
                    fqn=frame.fqn,
                    call=frame.call,
                    name=name,
                    dtype=param.dtype,
                    shape=tuple(param.shape),
                    sharded=_is_dtensor(param),
                )
            )
            if self._record_grads and param.requires_grad:
                self._watch_grad(frame.fqn, name, param)
        # Move the output hook behind any forward hook registered since the last call (FSDP2's
        # post-forward hook when fully_shard ran after attach), so outputs are read after
        # FSDP2's output_dtype cast. Hooks for this call are collected only after forward.
        post = self._post_handles.get(module)
        if post is not None:
            post.remove()
            self._post_handles[module] = module.register_forward_hook(
                self._on_post_forward, always_call=True
            )

    def _on_global_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        frame = self._frame_of(module)
        if frame is not None:
            frame.phase = "hooks"

    def _on_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        stack = self._stack()
        frame = self._frame_of(module)
        if frame is None:
            return
        # Called from torch's exception path (always_call) when forward raised.
        raised = output is None and sys.exc_info()[1] is not None
        self._boundaries.append(
            BoundaryRecord(
                fqn=frame.fqn,
                call=frame.call,
                module_type=type(module).__name__,
                inputs=frame.inputs,
                outputs=() if raised else tuple(_floating_leaves(output, "output")),
                completed=not raised,
            )
        )
        # Frames above this one belong to calls that never reached their post-hook.
        del stack[stack.index(frame) :]
        if not stack:
            _deactivate(self)

    def _record_op(self, func: Any, args: Any, kwargs: Any, result: Any) -> None:
        stack = self._stack()
        # record_function markers (FSDP2 wraps its casts in them) carry no tensor data.
        if not stack or getattr(func, "namespace", None) == "profiler":
            return
        frame = stack[-1]
        self._ops.append(
            OpRecord(
                fqn=frame.fqn,
                call=frame.call,
                seq=self._next_seq(),
                op=str(func),
                phase=frame.phase,
                inputs=_call_leaves(args, kwargs),
                outputs=tuple(_floating_leaves(result, "result")),
            )
        )

    def _watch_grad(self, fqn: str, name: str, param: torch.Tensor) -> None:
        # One hook per parameter object: FSDP2 reuses its unsharded parameter across calls, and
        # a leaf's hook fires once per backward however many calls used it.
        watched = self._grad_hooks.get((fqn, name))
        if watched is not None:
            ref, handle = watched
            if ref() is param:
                return
            handle.remove()

        def on_grad(grad: torch.Tensor) -> None:
            self._grads.append(
                GradRecord(fqn, name, self._next_seq(), grad.dtype, tuple(grad.shape))
            )

        self._grad_hooks[(fqn, name)] = (weakref.ref(param), param.register_hook(on_grad))  # type: ignore[no-untyped-call]

    def __repr__(self) -> str:
        state = "attached" if self._attached else "detached"
        return (
            f"<DtypeProbe {self._model_type} {state}: {len(self._fqn_of)} module(s), "
            f"{len(self._boundaries)} call(s), {len(self._ops)} op(s)>"
        )
