"""``DtypeProbe`` on real 2-rank FSDP2 (gloo, CPU), launched with torchrun.

One torchrun runs every scenario of ``fsdp_probe_worker.py`` (see its docstring) once per module;
each test below checks one claim on every rank. Until the plugin's ``fsdp2`` marker lands, the
launch is a plain subprocess with a timeout that kills the whole process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).with_name("fsdp_probe_worker.py")
NPROC = 2
# A run takes about 10 s on 2 CPU cores; the margin covers a loaded CI machine.
TIMEOUT_S = 240
ORDERS = ("attach_before_shard", "attach_after_shard")

pytestmark = pytest.mark.skipif(
    sys.platform == "win32", reason="torchrun with gloo on CPU is exercised on POSIX only"
)


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every rank's results, from one torchrun of the worker."""
    out_dir = tmp_path_factory.mktemp("fsdp_probe")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={NPROC}",
        str(WORKER),
        str(out_dir),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # A new session so that a timeout kills torchrun and its ranks, not torchrun alone.
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"torchrun did not finish in {TIMEOUT_S} s; output:\n{_tail(output)}")
    if process.returncode != 0:
        pytest.fail(f"torchrun exited with {process.returncode}; output:\n{_tail(output)}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(NPROC)]


def _scenario(ranks: list[dict[str, Any]], name: str) -> list[tuple[str, dict[str, Any]]]:
    """(label, result) for every rank and attach order of a scenario."""
    return [
        (f"rank {rank} {order}", result[name][order])
        for rank, result in enumerate(ranks)
        for order in ORDERS
    ]


def _boundary(result: dict[str, Any], fqn: str) -> tuple[dict[str, str], dict[str, str]]:
    (record,) = [b for b in result["probe"]["boundary"] if b["fqn"] == fqn]
    return (
        {leaf["path"]: leaf["dtype"] for leaf in record["inputs"]},
        {leaf["path"]: leaf["dtype"] for leaf in record["outputs"]},
    )


def _params(result: dict[str, Any], fqn: str) -> list[dict[str, Any]]:
    return [p for p in result["probe"]["materialized_params"] if p["fqn"] == fqn]


def _ops(result: dict[str, Any], fqn: str, phase: str) -> list[tuple[str, list[str], list[str]]]:
    return [
        (op["op"], [i["dtype"] for i in op["inputs"]], [o["dtype"] for o in op["outputs"]])
        for op in result["probe"]["ops"]
        if op["fqn"] == fqn and op["phase"] == phase
    ]


def _grads(result: dict[str, Any], fqn: str) -> dict[str, str]:
    return {g["name"]: g["dtype"] for g in result["probe"]["grads"] if g["fqn"] == fqn}


def _casts_to(ops: list[tuple[str, list[str], list[str]]], dtype: str) -> list[list[str]]:
    """The input dtypes of every ``_to_copy`` that produced ``dtype``."""
    return [
        inputs
        for op, inputs, outputs in ops
        if op == "aten._to_copy.default" and outputs == [dtype]
    ]


CONV = "block.conv"


def test_bf16_policy_all_gathers_the_child_in_bf16(ranks: list[dict[str, Any]]) -> None:
    for label, result in _scenario(ranks, "bf16_child"):
        summary = result["summary"]
        # Unsharded (full 8x8, not the 4x8 shard), in the policy's bf16.
        assert _params(result, CONV) == [
            {
                "fqn": CONV,
                "call": 0,
                "name": "weight",
                "dtype": "bfloat16",
                "shape": [8, 8],
                "sharded": False,
            }
        ], f"{label}\n{summary}"
        assert _boundary(result, CONV) == ({"args[0]": "bfloat16"}, {"output": "bfloat16"}), label
        # The weight arrived in bf16 but the module's matmul still ran in FP32: the weight
        # dtype is not the operator dtype.
        forward_ops = _ops(result, CONV, "forward")
        assert ("aten.mm.default", ["float32", "float32"], ["float32"]) in forward_ops, label
        assert _grads(result, CONV) == {"weight": "bfloat16"}, label


def test_param_dtype_none_keeps_fp32_params_and_the_bf16_boundary(
    ranks: list[dict[str, Any]],
) -> None:
    for label, result in _scenario(ranks, "keep_none"):
        summary = result["summary"]
        assert [(p["dtype"], p["shape"], p["sharded"]) for p in _params(result, CONV)] == [
            ("float32", [8, 8], False)
        ], f"{label}\n{summary}"
        # The root cast the input to bf16; the child unit leaves it alone.
        assert _boundary(result, CONV) == ({"args[0]": "bfloat16"}, {"output": "bfloat16"}), (
            f"{label}\n{summary}"
        )
        assert _casts_to(_ops(result, CONV, "hooks"), "float32") == [], label
        assert result["diff_vs_reference"] == [], f"{label}\n{summary}"
        assert _grads(result, CONV) == {"weight": "float32"}, label
        # The other parameters are still all-gathered with the caller's bf16 policy.
        assert {p["dtype"] for p in _params(result, "block.proj")} == {"bfloat16"}, label


def test_param_dtype_none_matches_the_reference_without_autocast(
    ranks: list[dict[str, Any]],
) -> None:
    for rank, result in enumerate(ranks):
        direct = result["keep_none_direct"]
        assert direct["diff_vs_reference"] == [], f"rank {rank}\n{direct['summary']}"
        assert _boundary(direct, CONV) == ({"args[0]": "bfloat16"}, {"output": "bfloat16"})


def test_param_dtype_fp32_turns_the_child_boundary_fp32(ranks: list[dict[str, Any]]) -> None:
    # The known-wrong fix: the probe must show FSDP2 casting the child's input to FP32.
    for label, result in _scenario(ranks, "keep_fp32"):
        summary = result["summary"]
        assert _boundary(result, CONV) == ({"args[0]": "float32"}, {"output": "float32"}), (
            f"{label}\n{summary}"
        )
        assert [p["dtype"] for p in _params(result, CONV)] == ["float32"], label
        # The cast happened in the child's FSDP2 pre-forward hook, not in its forward.
        assert _casts_to(_ops(result, CONV, "hooks"), "float32") == [["bfloat16"]], label
        # So the module's own upcast has nothing left to do.
        assert _casts_to(_ops(result, CONV, "forward"), "float32") == [], label
        mismatches = {
            (m["fqn"], m["direction"], m["path"], m["expected"], m["observed"])
            for m in result["diff_vs_reference"]
        }
        assert (CONV, "input", "args[0]", "bfloat16", "float32") in mismatches, summary
        assert (CONV, "output", "output", "bfloat16", "float32") in mismatches, summary


def test_outputs_are_seen_after_the_fsdp2_output_cast(ranks: list[dict[str, Any]]) -> None:
    # FSDP2's post-forward hook is appended after the probe's when the probe attached first;
    # the probe must still report what the caller receives in both orders.
    for label, result in _scenario(ranks, "output_cast"):
        assert _boundary(result, CONV) == ({"args[0]": "bfloat16"}, {"output": "float32"}), (
            f"{label}\n{result['summary']}"
        )
        last_forward_op = _ops(result, CONV, "forward")[-1]
        assert last_forward_op == ("aten._to_copy.default", ["float32"], ["bfloat16"]), label
        assert _casts_to(_ops(result, CONV, "hooks"), "float32") == [["bfloat16"]], label


def test_root_inputs_are_seen_after_the_fsdp2_input_cast(ranks: list[dict[str, Any]]) -> None:
    # The worker feeds FP32; the root unit's bf16 policy casts it before forward sees it.
    for label, result in _scenario(ranks, "keep_none"):
        assert _boundary(result, "")[0] == {"args[0]": "bfloat16"}, label
        assert _casts_to(_ops(result, "", "hooks"), "bfloat16") == [["float32"]], label


def test_attach_order_does_not_change_any_record(ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(ranks):
        for name in ("bf16_child", "keep_none", "keep_fp32", "output_cast"):
            before, after = (result[name][order]["probe"] for order in ORDERS)
            for key in ("boundary", "materialized_params", "ops", "grads", "calls"):
                assert before[key] == after[key], f"rank {rank} {name}: {key} differs"


def test_probe_does_not_change_sharded_numerics(ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(ranks):
        assert result["numerics_unchanged"] == {"logits": True, "grads": True}, f"rank {rank}"


def test_reference_is_refused_for_a_sharded_module(ranks: list[dict[str, Any]]) -> None:
    for result in ranks:
        message = result["reference_of_sharded_error"]
        assert "already sharded by FSDP2" in message
        assert "(root), block.conv" in message
        assert "before apply_fsdp2/fully_shard" in message
        assert "factory" in message


def test_reference_built_before_sharding_matches_the_full_shards(
    ranks: list[dict[str, Any]],
) -> None:
    assert [result["reference_matches_full_shards"] for result in ranks] == [True] * NPROC


def test_fsdp2_machinery_stays_out_of_the_forward_phase(ranks: list[dict[str, Any]]) -> None:
    # All-gathers, copies and casts run in FSDP2's hooks; what each module's forward ran is
    # operator for operator what the unsharded reference ran.
    for rank, result in enumerate(ranks):
        reference = {"probe": result["reference"]}
        for order in ORDERS:
            observed = result["keep_none"][order]
            for fqn in result["reference"]["modules"]:
                assert _ops(observed, fqn, "forward") == _ops(reference, fqn, "forward"), (
                    f"rank {rank} {order} {fqn!r}"
                )
            hook_ops = {op for op, _, _ in _ops(observed, CONV, "hooks")}
            assert "c10d._allgather_base_.default" in hook_ops, f"rank {rank} {order}"
