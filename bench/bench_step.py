"""What kept units cost per training step: plain FSDP2 against two keep-aware layouts.

    python bench/bench_step.py [--quick] [--json OUT]

A tiny Qwen3-MoE (``transformers.Qwen3MoeForCausalLM``: RMSNorms, q/k norms and a top-k router
per layer) declares every norm and every router kept (``_keep_in_fp32_modules_strict =
["norm", "gate.weight"]``, the router entry as Ernie 4.5 MoE spells it). Three copies from one
seed, 2 ranks, gloo, CPU, the same ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``, the same bf16 autocast, the same AdamW:

* (a) ``plain``: ``model.to(bf16)`` and ``fully_shard`` per decoder layer plus the root: nothing
  kept (the fast, wrong baseline);
* (b) ``per-module``: ``fp32keep.apply_fsdp2(..., group_kept=False)``: one FSDP unit per kept
  module (verl PR 7165's layout);
* (c) ``model-wide``: ``fp32keep.apply_fsdp2(..., group_kept="model")``: every kept module of the
  model in one unit (``fully_shard`` on a list of modules) that is all-gathered once per step and
  not resharded after forward: the layout this benchmark recommends for small kept modules;
* (c') ``grouped``: ``fp32keep.apply_fsdp2(..., group_kept="block")``: a block's kept modules
  share one unit, resharded after forward like the block;
* ``local-plain`` / ``local-kept``: the same model unsharded on each rank, bf16 and keep-aware
  cast: their difference is the FP32 arithmetic any correct layout pays, without FSDP;

One step = forward, backward, ``optimizer.step()``, ``zero_grad()``. The arms run interleaved in
one process pair, round by round, with the order rotated every round, so a burst of load from
elsewhere hits every arm alike; a step's time is the slowest rank's, from a barrier to the end
of ``zero_grad``.

Collectives are counted in one extra, untimed step per arm by a ``TorchDispatchMode`` that sees
every op of the ``c10d`` / ``_c10d_functional`` namespaces: FSDP2's all-gathers and
reduce-scatters are dispatcher ops, so the count does not depend on how FSDP2 calls them.
(``torch.distributed.tensor.debug.CommDebugMode`` would do the same but its module tracker fails
inside FSDP2's hooks on torch 2.13.)
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from _common import (
    OUT_DIR,
    BenchResult,
    Table,
    Target,
    finish,
    fmt,
    load_average,
    median,
    python_env,
    read_json,
    run_timed,
    spread,
    torchrun_command,
)

SCRIPT = Path(__file__).resolve()
NPROC = 2
ARMS = ("plain", "per-module", "model-wide", "grouped", "local-plain", "local-kept")
SHARDED = ("plain", "per-module", "model-wide", "grouped")
MASTER_ARMS = ("plain-master", "units-master", "policy-master")
"""Over FP32 master weights (every trainable parameter stored in FP32), where torch 2.15's
``param_dtype_override_fn`` can keep FP32 inside the caller's units: run where the torch has it."""
GROUP_KEPT = {"per-module": False, "model-wide": "model", "grouped": "block"}
"""``apply_fsdp2(group_kept=...)`` of each keep-aware sharded arm."""
ARM_TITLES = {
    "plain": "(a) plain FSDP2, bf16, nothing kept",
    "per-module": "(b) one unit per kept module (verl PR; group_kept=False)",
    "model-wide": "(c) fp32keep group_kept='model'",
    "grouped": "(c') fp32keep group_kept='block'",
    "local-plain": "unsharded, bf16, nothing kept",
    "local-kept": "unsharded, keep-aware cast",
    "plain-master": "(m) plain FSDP2 over FP32 masters, nothing kept",
    "units-master": "(m-units) FP32 masters, kept units (keep_by='units')",
    "policy-master": "(m-policy) FP32 masters, the policy's override (keep_by='policy')",
}
KEPT_ENTRIES = ["norm", "gate.weight"]

FULL_MODEL: dict[str, int] = {
    "vocab_size": 2048,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
}
"""Tiny on purpose: CPU bf16 matmuls without AVX-512 are far slower than FP32 ones here, and a
larger model would measure that rather than what the FSDP layout costs."""
FULL_BATCH = (2, 64)

QUICK_MODEL: dict[str, int] = {**FULL_MODEL, "num_hidden_layers": 2, "num_experts": 4}
QUICK_BATCH = (2, 32)


# ----------------------------------------------------------------------------------------------
# rank side


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model_config = QUICK_MODEL if args.quick else FULL_MODEL
    batch, seq = QUICK_BATCH if args.quick else FULL_BATCH
    from fp32keep.shard.keep_policy import OVERRIDE_SUPPORTED

    arms = ARMS + (MASTER_ARMS if OVERRIDE_SUPPORTED else ())
    steppers = {arm: _build_arm(arm, model_config, mesh) for arm in arms}
    generator = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, model_config["vocab_size"], (batch, seq), generator=generator)
        for _ in range(4)
    ]

    counts: dict[str, dict[str, int]] = {}
    losses: dict[str, list[float]] = {arm: [] for arm in arms}
    for arm in (arm for arm in arms if arm in SHARDED + MASTER_ARMS):
        step = steppers[arm]
        with CollectiveCounter() as counter:
            losses[arm].append(step(batches[0]))
        counts[arm] = dict(counter.counts)

    seconds: dict[str, list[float]] = {arm: [] for arm in arms}
    for round_index in range(args.warmup + args.steps):
        shift = round_index % len(arms)
        for arm in arms[shift:] + arms[:shift]:
            data = batches[round_index % len(batches)]
            dist.barrier()
            start = time.perf_counter()
            loss = steppers[arm](data)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if round_index >= args.warmup:
                seconds[arm].append(float(elapsed.item()))
                losses[arm].append(loss)
    if rank == 0:
        units = {arm: steppers[arm].fsdp_units() for arm in arms if arm in SHARDED + MASTER_ARMS}
        payload = {
            "arms": arms,
            "seconds": seconds,
            "counts": counts,
            "losses": losses,
            "units": units,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(payload))
    gc.collect()  # free FSDP2's reference cycles while the group lives (see rank_session)
    dist.barrier()
    dist.destroy_process_group()


class CollectiveCounter:
    """Counts every ``c10d`` / ``_c10d_functional`` op dispatched while active, by op name."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counts: Counter[str] = Counter()
        self.counts = counts

        class _Mode(TorchDispatchMode):  # type: ignore[no-untyped-call]
            def __torch_dispatch__(
                self,
                func: Any,
                types: Any,
                args: Sequence[Any] = (),
                kwargs: Mapping[str, Any] | None = None,
            ) -> Any:
                if func.namespace in ("c10d", "_c10d_functional"):
                    counts[func.overloadpacket.__name__] += 1
                return func(*args, **(kwargs or {}))

        self._mode: Any = _Mode()  # type: ignore[no-untyped-call]

    def __enter__(self) -> CollectiveCounter:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)


def _kept_model_class() -> Any:
    from transformers import Qwen3MoeForCausalLM

    class KeptQwen3Moe(Qwen3MoeForCausalLM):  # type: ignore[misc]
        """Qwen3-MoE whose norms and routers are declared kept in FP32."""

        _keep_in_fp32_modules_strict = KEPT_ENTRIES

    return KeptQwen3Moe


class Stepper:
    """One arm's model and optimizer; calling it runs one training step and returns the loss."""

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.model = model
        self.optimizer = optimizer

    def __call__(self, input_ids: Any) -> float:
        import torch

        # Kept norms return FP32 activations; autocast feeds the bf16 linears as a bf16 run does.
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = self.model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach().float().item())

    def fsdp_units(self) -> int:
        """FSDP2 units (one per ``fully_shard`` call: a grouped unit's modules count once)."""
        from pytest_fp32keep.contract.fsdp_state import fsdp_units

        return len(fsdp_units(self.model))


def _build_arm(arm: str, model_config: Mapping[str, int], mesh: Any) -> Stepper:
    """Build, cast and shard one arm's model from the common seed."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import Qwen3MoeConfig

    import fp32keep

    torch.manual_seed(0)
    config = Qwen3MoeConfig(**model_config)
    model = _kept_model_class()(config)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if arm == "local-plain":
        model.to(torch.bfloat16)
    elif arm == "local-kept":
        fp32keep.keep_aware_cast(model, torch.bfloat16)
    elif arm in ("plain", "plain-master"):
        if arm == "plain":
            model.to(torch.bfloat16)  # else the FP32 masters as built
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    elif arm in MASTER_ARMS:
        plan = fp32keep.resolve_keep_plan(model, torch.bfloat16)
        fp32keep.keep_aware_cast(model, torch.bfloat16, plan=plan)
        fp32keep.upcast_to_fp32_master(model)
        keep_by = "policy" if arm == "policy-master" else "units"
        fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=policy, plan=plan, keep_by=keep_by)
    else:
        plan = fp32keep.resolve_keep_plan(model, torch.bfloat16)
        fp32keep.keep_aware_cast(model, torch.bfloat16, plan=plan)
        fp32keep.apply_fsdp2(
            model, mesh=mesh, mp_policy=policy, plan=plan, group_kept=GROUP_KEPT[arm]
        )
    return Stepper(model, torch.optim.AdamW(model.parameters(), lr=1e-4))


# ----------------------------------------------------------------------------------------------
# parent side


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="smaller model, few steps")
    parser.add_argument("--json", type=Path, help="write the result here as JSON")
    parser.add_argument("--steps", type=int, help="timed steps per arm")
    parser.add_argument("--warmup", type=int, help="untimed rounds first")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0

    started = time.perf_counter()
    quick: bool = args.quick
    steps = args.steps or (6 if quick else 30)
    warmup = args.warmup if args.warmup is not None else (1 if quick else 3)
    out = OUT_DIR / "step" / "result.json"
    out.unlink(missing_ok=True)
    worker_args = ["--worker", "--out", str(out), "--steps", str(steps), "--warmup", str(warmup)]
    if quick:
        worker_args.append("--quick")
    result = BenchResult(
        name="step",
        title="Per-step cost of kept units (2 ranks, gloo, CPU, bf16)",
        command="python bench/bench_step.py" + (" --quick" if quick else ""),
        mode="quick" if quick else "full",
        load_before=load_average(),
    )
    run_timed(torchrun_command(NPROC, SCRIPT, *worker_args), timeout=3600, env=python_env())
    data = read_json(out)
    _report(result, data, quick, steps, warmup)
    finish(result, args.json, started)
    return 0


def _paired(data: Mapping[str, Any], arm: str, base: str, *, ratio: bool) -> float:
    # Arms ran in the same rounds, so round i of one arm met the same machine load as round i of
    # another: compare within rounds, then take the median.
    pairs = zip(data["seconds"][arm], data["seconds"][base], strict=True)
    return median([a / b if ratio else a - b for a, b in pairs])


def _report(
    result: BenchResult, data: Mapping[str, Any], quick: bool, steps: int, warmup: int
) -> None:
    model_config = QUICK_MODEL if quick else FULL_MODEL
    batch, seq = QUICK_BATCH if quick else FULL_BATCH
    table = Table(
        f"Qwen3-MoE, {model_config['num_hidden_layers']} layers, hidden "
        f"{model_config['hidden_size']}, {model_config['num_experts']} experts (top-"
        f"{model_config['num_experts_per_tok']}), batch {batch}x{seq}; kept: every norm and "
        f"router ({KEPT_ENTRIES}); {steps} timed steps per arm after {warmup} warm-up rounds, "
        "all arms interleaved round by round. 'x (a)' is the median of per-round ratios.",
        [
            "arm",
            "FSDP units",
            "step ms (median)",
            "min–max ms",
            "x (a)",
            "all-gathers / step",
            "reduce-scatters / step",
            "other collectives",
        ],
    )
    ag: dict[str, int] = {}
    rs: dict[str, int] = {}
    for arm in data["arms"]:
        wall = median(data["seconds"][arm])
        row = [
            ARM_TITLES[arm],
            str(data["units"].get(arm, "none")),
            fmt(wall * 1e3),
            spread([s * 1e3 for s in data["seconds"][arm]]),
            fmt(_paired(data, arm, "plain", ratio=True)),
        ]
        if arm in SHARDED + MASTER_ARMS:
            counts: dict[str, int] = data["counts"][arm]
            ag[arm] = sum(n for op, n in counts.items() if "allgather" in op or "all_gather" in op)
            rs[arm] = sum(n for op, n in counts.items() if "reduce_scatter" in op)
            row += [str(ag[arm]), str(rs[arm]), str(sum(counts.values()) - ag[arm] - rs[arm])]
        else:
            row += ["0", "0", "0"]
        table.rows.append(row)
    result.tables.append(table)
    _master_targets(result, data, ag, rs)

    ours = _paired(data, "model-wide", "plain", ratio=True)
    result.targets.append(
        Target("time: (c) model-wide vs (a) plain", f"{ours:.3f}x", ours <= 1.10, "<= 1.10x")
    )
    mine, theirs = ag["model-wide"] + rs["model-wide"], ag["per-module"] + rs["per-module"]
    result.targets.append(
        Target("collectives per step: (c) fewer than (b)", f"{mine} vs {theirs}", mine < theirs)
    )
    result.targets[-1].limit = "fewer"
    keep_aware = [arm for arm in data["arms"] if arm in SHARDED and arm != "plain"]
    same = all(data["losses"][arm] == data["losses"]["per-module"] for arm in keep_aware)
    result.targets.append(
        Target(
            "sanity: every keep-aware layout gives bit-identical losses every step",
            "identical" if same else "DIFFERENT",
            same,
            "identical",
        )
    )
    extra_units = max(1, data["units"]["per-module"] - data["units"]["plain"])
    per_unit = _paired(data, "per-module", "plain", ratio=False) / extra_units * 1e3
    model_wide_gap = _paired(data, "model-wide", "plain", ratio=False) * 1e3
    arithmetic = _paired(data, "local-kept", "local-plain", ratio=False) * 1e3
    result.notes.append(
        "Where the time goes (medians of per-round differences): (c) - (a) = "
        f"{model_wide_gap:.1f} "
        f"ms per step; without FSDP, the keep-aware cast takes {arithmetic:+.1f} ms against plain "
        "bf16 (the FP32 norm and router arithmetic alone, which any correct layout pays); "
        f"(b) - (a) is {per_unit:.2f} ms per extra FSDP unit (hooks, copies, a small all-gather "
        "in forward and again in backward, a reduce-scatter)."
    )
    result.notes.append(
        "Collectives were counted in one untimed step per arm with a TorchDispatchMode that sees "
        "every c10d op (FSDP2's all-gathers and reduce-scatters are dispatcher ops); every rank "
        "issues the same ones. The unsharded rows run the same model, autocast and optimizer "
        "without FSDP on each rank."
    )


def _master_targets(
    result: BenchResult, data: Mapping[str, Any], ag: Mapping[str, int], rs: Mapping[str, int]
) -> None:
    """Issue 38's targets: keeping by the policy over FP32 masters is no slower than plain FSDP2
    over the same masters, and adds no collective; or a note where the torch cannot."""
    if "policy-master" not in data["arms"]:
        result.notes.append(
            "The FP32-master arms (plain, kept units, the policy's override) need torch >= 2.15 "
            "(param_dtype_override_fn): not run on this torch; nox -s keep-policy has one."
        )
        return
    ratio = _paired(data, "policy-master", "plain-master", ratio=True)
    result.targets.append(
        Target(
            "time: (m-policy) vs (m) plain over masters", f"{ratio:.3f}x", ratio <= 1.05, "<= 1.05x"
        )
    )
    policy = ag["policy-master"] + rs["policy-master"]
    plain = ag["plain-master"] + rs["plain-master"]
    units = ag["units-master"] + rs["units-master"]
    result.targets.append(
        Target(
            "collectives per step: (m-policy) as many as (m) plain",
            f"{policy} vs {plain} (kept units: {units})",
            policy == plain,
            "equal",
        )
    )
    units_gap = _paired(data, "units-master", "plain-master", ratio=False) * 1e3
    policy_gap = _paired(data, "policy-master", "plain-master", ratio=False) * 1e3
    result.notes.append(
        f"Over FP32 masters, (m-units) - (m) = {units_gap:.1f} ms per step and (m-policy) - (m) "
        f"= {policy_gap:.1f} ms (medians of per-round differences)."
    )


if __name__ == "__main__":
    sys.exit(main())
