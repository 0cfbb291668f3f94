"""The warnings the contract's own sharding causes, kept from becoming errors under ``-W error``.

torch warns, from FSDP2's post-forward hook (``torch/distributed/fsdp/_fully_shard/
_fsdp_state.py``), whenever a module sharded with ``fully_shard`` returns a view tensor:
``UserWarning: FSDP2-wrapped module (FSDPT5Block) returned a view tensor. An in-place op on this
view ...``. Inside :func:`~pytest_fp32keep.contract.assert_fp32_keep_contract` every such unit is
one the contract had sharded (the implementation's ``shard`` step, the parity control): the
warning comes from the check itself, not from the user's code. It is also harmless there: an
in-place op on such a view would skip an all-gather, and then backward raises or the gradients
differ, which the contract reports (``crashed`` or ``parity``). Under ``-W error`` or
``filterwarnings = error`` (how mature projects run their tests) it raised instead, inside the
``forward`` step, and every model whose blocks return views (T5, BLIP-2) was ``crashed
(forward)``.

:func:`own_sharding_warnings` wraps the contract: for exactly that warning (its message, its
category, raised from torch's FSDP code) the action is ``default`` (shown once per place, as
without any filter) whatever the caller's filters say. Every other warning, the user's own
included (raised in the model factory, the batch factory or the forward, even one with the same
text), meets the caller's filters unchanged, and under ``-W error`` still fails the test.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable
from typing import Final, ParamSpec, TypeVar

__all__ = ["VIEW_TENSOR_WARNING", "VIEW_TENSOR_WARNING_MODULE", "own_sharding_warnings"]

#: torch's message, matched from its start (as a warnings filter matches); the group is the
#: unit's class names (absent where a torch release does not name them).
VIEW_TENSOR_WARNING: Final = re.compile(
    r"FSDP2-wrapped module (\((?P<modules>[^)]*)\) )?returned a view tensor"
)
#: Where torch raises it: FSDP's own modules. A filter's ``module`` is matched from the start of
#: the module the warning is attributed to: a dotted name when torch warns, the file's path
#: without ``.py`` when :mod:`.determinism` re-issues it after a run (``warn_explicit``).
VIEW_TENSOR_WARNING_MODULE: Final = r"(.*[\\/])?torch[.\\/]distributed[.\\/]fsdp[.\\/]"

_P = ParamSpec("_P")
_R = TypeVar("_R")


def own_sharding_warnings(function: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorate ``function`` so that, while it runs, torch's FSDP2 view-tensor warning is shown
    (``default`` action) rather than raised, whatever the caller's filters; the caller's filters
    are restored after, and every other warning meets them unchanged."""

    @functools.wraps(function)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "default",
                message=VIEW_TENSOR_WARNING.pattern,
                category=UserWarning,
                module=VIEW_TENSOR_WARNING_MODULE,
            )
            return function(*args, **kwargs)

    return wrapper
