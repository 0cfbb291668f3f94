"""Time to error of every bad input of ``fp32keep.load_full_state_dict``, on every rank.

    python bench/load_refusal_times.py [--json OUT]

One ``torchrun`` of 2 gloo ranks (CPU) runs each bad input of docs/errors.md's loader rows
(C5, C9-C29) in turn, the bad part on the source rank only where the input is a dict's (every
other rank passes ``None``). Models and inputs are built by the loader tests' own helpers
(``tests/multirank/test_load_refusals_fsdp2.py``, ``test_load_meta_fsdp2.py``), outside the timed
region; each rank times its own call from a barrier to the raise. The table shows the error class,
its first line, and the seconds on each rank: a refusal must come within seconds on every rank,
never after the process-group timeout. It checks nothing else (the tests do).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from _common import OUT_DIR, python_env, read_json, run_timed, torchrun_command

SCRIPT = Path(__file__).resolve()
NPROC = 2
FIRST_LINE = 200  # characters of each error's first line(s) shown in the table

Case = tuple[str, str, Callable[[], Callable[[], object]]]
"""(bad input, docs/errors.md row, set-up that returns the timed call)."""


def cases(mesh: Any) -> Iterator[Case]:
    """Every bad input, as the tests build it (imported lazily: the parent needs no torch)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.tensor import DTensor, Partial

    import fp32keep
    from tests.core.toys import stack_class
    from tests.multirank import test_load_meta_fsdp2 as meta
    from tests.multirank.test_load_refusals_fsdp2 import (
        Failing,
        Subclass,
        dtensor_state,
        fresh_full_state,
        sharded_stack,
    )

    source_rank = dist.get_rank() == 0
    load = fp32keep.load_full_state_dict

    def on_source(edit: Callable[[dict[Any, Any]], object] | None = None, **kw: Any) -> Any:
        """The toy stack, loaded from a fresh dict that ``edit`` spoils on the source rank."""

        def setup() -> Callable[[], object]:
            model = sharded_stack(mesh)
            given: Any = None
            if source_rank:
                given = dict(fresh_full_state())
                if edit is not None:
                    edit(given)
            return lambda: load(model, given, **kw)

        return setup

    def given_on_source(value: Callable[[], object]) -> Any:
        def setup() -> Callable[[], object]:
            model = sharded_stack(mesh)
            given = value() if source_rank else None
            return lambda: load(model, given)  # type: ignore[arg-type]

        return setup

    def replaced(key: str, make: Callable[[], object]) -> Callable[[dict[Any, Any]], None]:
        return lambda sd: sd.__setitem__(key, make())

    def unsharded() -> Callable[[], object]:
        model = stack_class(strict=["wo"])()
        given = fresh_full_state() if source_rank else None
        return lambda: load(model, given)

    def on_every_rank() -> Callable[[], object]:
        model = sharded_stack(mesh)
        given = fresh_full_state()
        return lambda: load(model, given)

    def other_rank_list() -> Callable[[], object]:
        model = sharded_stack(mesh)
        given: Any = fresh_full_state() if source_rank else []
        return lambda: load(model, given)

    def different_arguments() -> Callable[[], object]:
        model = sharded_stack(mesh)
        given = fresh_full_state() if source_rank else None
        return lambda: load(model, given, strict=source_rank)

    def dtensors() -> Callable[[], object]:
        state = dtensor_state(mesh)  # a collective: built on every rank
        model = sharded_stack(mesh)
        return lambda: load(model, state if source_rank else None)

    def tied_disagree() -> Callable[[], object]:
        model = sharded_stack(mesh, tied=True)
        given = None
        if source_rank:
            given = fresh_full_state()
            given["head.weight"] = given["embed.weight"] + 1
        return lambda: load(model, given)

    def partial_placement() -> Callable[[], object]:
        model = sharded_stack(mesh)
        tp = DTensor.from_local(torch.zeros(8), mesh, [Partial()], run_check=False)
        model.get_submodule("norm").register_parameter(
            "tp_scale", nn.Parameter(tp, requires_grad=False)
        )
        given = None
        if source_rank:
            given = {**fresh_full_state(), "norm.tp_scale": torch.zeros(8)}
        return lambda: load(model, given)

    def meta_llama(**kw: Any) -> Callable[[], Callable[[], object]]:
        def setup() -> Callable[[], object]:
            model = meta.built("llama", "meta")
            given = meta.built("llama", "real").state_dict() if source_rank else None
            fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=meta.FP32_POLICY)
            return lambda: load(model, given, **kw)

        return setup

    def leaves_unwritten(model: nn.Module) -> None:
        pass  # writes none of the buffers it is asked for

    def raises_on_rank_1(model: nn.Module) -> None:
        meta.buffers_from_own_init("llama")(model)
        if dist.get_rank() == 1:
            raise RuntimeError("no rope tables here")

    def partly_meta_missing() -> Callable[[], object]:
        model, source = meta.partly_meta_stack(mesh)
        given = {k: v for k, v in source.items() if k != "layers.1.wo.weight"}
        return lambda: load(model, given if source_rank else None, strict=False)

    def install_fails() -> Callable[[], object]:
        model = meta.uneven_model(mesh, (1,))
        given = meta.uneven_checkpoint(5) if source_rank else None
        original = DTensor.__dict__["from_local"]

        def broken(*args: object, **kwargs: object) -> None:
            raise RuntimeError("no DTensor today")

        def call() -> object:
            if dist.get_rank() == 1:
                DTensor.from_local = broken  # type: ignore[method-assign,assignment]
            try:
                return load(model, given)
            finally:
                DTensor.from_local = original  # type: ignore[method-assign]

        return call

    yield "load before apply_fsdp2", "C9", unsharded
    yield "missing key (strict)", "C10", on_source(lambda sd: sd.pop("layers.1.wo.weight"))
    yield "unexpected key", "C11", on_source(replaced("layers.9.wo.weight", lambda: torch.zeros(2)))
    yield "wrong shape", "C12", on_source(replaced("layers.0.wo.weight", lambda: torch.zeros(3, 8)))
    integer = replaced("layers.0.attn.bias", lambda: torch.zeros(8, dtype=torch.int64))
    yield "integer for a float", "C13", on_source(integer)
    meta_entry = replaced("layers.0.attn.weight", lambda: torch.empty(8, 8, device="meta"))
    yield "meta entry", "C14", on_source(meta_entry)
    yield "non-tensor entry", "C14", on_source(replaced("layers.0.wo.weight", lambda: [0.0]))
    yield "dict on every rank", "C15", on_every_rank
    yield "checkpoint path (str)", "C16", given_on_source(lambda: "/ckpt/model.safetensors")
    yield "a list on rank 1", "C17", other_rank_list
    yield "different arguments (strict)", "C18", different_arguments
    yield "init_buffers not callable", "C19", on_source(init_buffers="rope")
    yield (
        "__getitem__ raises",
        "C20",
        given_on_source(lambda: Failing(fresh_full_state(), fail_on="layers.0.attn.weight")),
    )
    yield (
        "__iter__ raises",
        "C20",
        given_on_source(lambda: Failing(fresh_full_state(), fail_on="__iter__")),
    )
    sparse = replaced("layers.0.attn.weight", lambda: torch.eye(8).to_sparse())
    yield "sparse tensor", "C21", on_source(sparse)
    quantized = replaced(
        "layers.0.attn.bias", lambda: torch.quantize_per_tensor(torch.zeros(8), 0.1, 0, torch.qint8)
    )
    yield "quantized tensor", "C21", on_source(quantized)
    subclass = replaced("layers.0.attn.bias", lambda: torch.zeros(8).as_subclass(Subclass))
    yield "tensor subclass", "C21", on_source(subclass)
    yield "DTensor values", "C22", dtensors
    yield "non-str key", "C23", on_source(lambda sd: sd.__setitem__(3, torch.zeros(1)))
    yield "tied aliases that disagree", "C24", tied_disagree
    yield "Partial placement", "C5", partial_placement
    yield "meta buffers, no init_buffers", "C25", meta_llama()
    yield "init_buffers leaves buffers", "C26", meta_llama(init_buffers=leaves_unwritten)
    yield "init_buffers raises on rank 1", "C27", meta_llama(init_buffers=raises_on_rank_1)
    yield "strict=False, missing meta key", "C28", partly_meta_missing
    yield "installing fails on rank 1", "C29", install_fails


def _worker(out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rows: list[dict[str, Any]] = []
    for label, row, setup in cases(mesh):
        call = setup()
        dist.barrier()
        start = time.perf_counter()
        try:
            call()
        except Exception as exc:  # the refusal being timed
            seconds = time.perf_counter() - start
            kind, first = type(exc).__name__, _first_lines(str(exc))
        else:
            seconds, kind, first = time.perf_counter() - start, "(no error)", ""
        rows.append({"input": label, "row": row, "error": kind, "first": first, "s": seconds})
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def _first_lines(message: str) -> str:
    """The first line, and for a multi-line message the first line that names a key (the
    headline of a ``StateDictError`` is the same for every bad entry)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return ""
    detail = next((line for line in lines[1:] if ":" in line and not line.endswith(":")), "")
    return f"{lines[0]} / {detail}" if detail else lines[0]


def table(per_rank: list[list[dict[str, Any]]]) -> str:
    """The markdown table: one row per bad input, the seconds of every rank."""
    ranks = range(len(per_rank))
    header = ["bad input", "row", "error (rank 0), first line", *(f"rank {r} s" for r in ranks)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for index, entry in enumerate(per_rank[0]):
        first = (
            entry["first"]
            if len(entry["first"]) <= FIRST_LINE
            else entry["first"][: FIRST_LINE - 3] + "..."
        )
        shown = f"`{entry['error']}`: {first}".replace("|", "\\|")
        times = [f"{per_rank[r][index]['s']:.3f}" for r in ranks]
        lines.append("| " + " | ".join([entry["input"], entry["row"], shown, *times]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", type=Path, help="write every rank's rows here as JSON")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker)
        return 0
    out = OUT_DIR / "load_refusals"
    for stale in out.glob("rank*.json"):
        stale.unlink()
    run_timed(torchrun_command(NPROC, SCRIPT, "--worker", str(out)), timeout=900, env=python_env())
    per_rank = [read_json(out / f"rank{r}.json") for r in range(NPROC)]
    print(table(per_rank))
    if args.json:
        args.json.write_text(json.dumps(per_rank, indent=2) + "\n")
    silent = [e["input"] for e in per_rank[0] if e["error"] == "(no error)"]
    return 1 if silent else 0


if __name__ == "__main__":
    sys.exit(main())
