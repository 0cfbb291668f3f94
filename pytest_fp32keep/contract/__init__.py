"""The precision contract: does a sharded model keep FP32 where its plan says, exactly?

It owns the end-to-end check :func:`assert_fp32_keep_contract` (the orchestrator in
:mod:`.assertion`, the report types in :mod:`.report`, the implementation under test and the
forward/backward run in :mod:`.steps`, one module per check family under :mod:`.checks`, the
gradient noise policy in :mod:`.parity_policy`, the parity control in :mod:`.control`, torch's
deterministic algorithms around every run in :mod:`.determinism`), the dtype recorder
:class:`DtypeProbe` (:mod:`.probe`), the unsharded reference model (:mod:`.reference`), and the
one module that reads FSDP2's private state (:mod:`.fsdp_state`) and the one that imports torch's
private ``TorchDispatchMode`` (:mod:`.torch_dispatch`).

It runs in whatever process group the caller has set up and may import torch, Transformers and
:mod:`fp32keep`; it never imports :mod:`pytest_fp32keep.runner` or :mod:`pytest_fp32keep.check`,
so it works under any launcher (the plugin's ranks, ``fp32keep check``, a user's own torchrun
script).
"""

from pytest_fp32keep.contract.assertion import assert_fp32_keep_contract
from pytest_fp32keep.contract.master import MASTER_DTYPES
from pytest_fp32keep.contract.parity_policy import CONTROL_ERROR_LIMIT, gradient_bounds
from pytest_fp32keep.contract.report import CHECKS, ContractReport, ContractViolation

__all__ = [
    "CHECKS",
    "CONTROL_ERROR_LIMIT",
    "MASTER_DTYPES",
    "ContractReport",
    "ContractViolation",
    "assert_fp32_keep_contract",
    "gradient_bounds",
]
