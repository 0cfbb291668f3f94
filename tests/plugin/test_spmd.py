"""Marked tests under an external launcher: two torchruns on loopback as two nodes, SPMD.

One inner session, ``torchrun --nnodes=2 --nproc-per-node=2 --node-rank={0,1}`` with a c10d
rendezvous on 127.0.0.1, runs marked tests at world size 4 in place: a toy FSDP2 step, an HSDP
step on a 2 x 2 mesh, T5's FP32-keep contract under fp16, a test that fails on rank 3 only (the
negative control: it must fail, naming rank 3), a marker that asks for another world size, and
an unmarked test. Another session, whose ranks collect different tests, must run none.
"""

from __future__ import annotations

import re
import time

import pytest

from tests.error_bounds import RANK_FAULT_BOUND_S, note_elapsed
from tests.plugin._inner import InnerProject, failure_section, leftover_processes, new_tag
from tests.plugin._launched import LaunchedRun, run_launched

WORLD_TESTS = """
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from rankrec import record

pytestmark = pytest.mark.fsdp2


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def step(sharded, reference, rank, world):
    batch = torch.randn(2 * world, 8, generator=torch.Generator().manual_seed(1))
    sharded(batch[2 * rank : 2 * rank + 2]).sum().backward()
    reference(batch).sum().backward()
    for (name, param), ref in zip(sharded.named_parameters(), reference.parameters()):
        # FSDP2 averages the ranks' gradients: 1/world of the whole batch's.
        torch.testing.assert_close(param.grad.full_tensor(), ref.grad / world, msg=name)


def test_toy_fsdp2(fsdp2_mesh, fsdp2_rank, fsdp2_world_size, fsdp2_device):
    record("toy", world=fsdp2_world_size, seen=dist.get_world_size(), device=str(fsdp2_device))
    reference = model()
    sharded = copy.deepcopy(reference)
    for layer in (sharded[0], sharded[2]):
        fully_shard(layer, mesh=fsdp2_mesh)
    fully_shard(sharded, mesh=fsdp2_mesh)
    assert sharded[0].weight.to_local().shape == (16 // fsdp2_world_size, 8)
    step(sharded, reference, fsdp2_rank, fsdp2_world_size)


def test_hsdp_2x2(fsdp2_rank, fsdp2_world_size):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    reference = model()
    sharded = copy.deepcopy(reference)
    fully_shard(sharded, mesh=mesh)
    placements = [repr(p) for p in sharded[0].weight.placements]
    record("hsdp", placements=placements, shard=list(sharded[0].weight.to_local().shape))
    assert sharded[0].weight.to_local().shape == (8, 8)  # 16 rows over the 2 shard ranks
    step(sharded, reference, fsdp2_rank, fsdp2_world_size)


def test_t5_fp16_contract(fsdp2_mesh):
    from pytest_fp32keep import assert_fp32_keep_contract
    from pytest_fp32keep.check.zoo import ZOO

    entry = ZOO["t5"]
    report = assert_fp32_keep_contract(
        entry.build, lambda m: entry.make_batch(m, 0), mesh=fsdp2_mesh, dtype=torch.float16
    )
    record("t5", ok=report.ok, kept=len(report.kept))
    assert report.ok
    assert report.kept


def test_fails_on_rank_three_only(fsdp2_rank):
    print(f"rank {fsdp2_rank} was here")
    assert fsdp2_rank != 3, "rank three disagrees"


@pytest.mark.fsdp2(nproc=2)
def test_asks_for_two_ranks():
    raise AssertionError("must not run in a world of 4")
"""

UNMARKED = """
from rankrec import record


def test_plain():
    record("plain")
"""


@pytest.fixture(scope="module")
def world(module_inner: InnerProject) -> tuple[InnerProject, LaunchedRun]:
    """The two-node session, run once for the checks below."""
    module_inner.write(test_world=WORLD_TESTS, test_unmarked=UNMARKED)
    files = ["test_world.py", "test_unmarked.py"]
    return module_inner, run_launched(module_inner.path, module_inner.tag, ["-rA", *files])


def test_one_report_for_the_whole_world(world: tuple[InnerProject, LaunchedRun]) -> None:
    _, run = world
    assert run.combined.count("test session starts") == 1
    summaries = re.findall(r"=+ (.*) in [\d.]+s", run.combined)
    assert len(summaries) == 1, summaries
    assert summaries[0].startswith("1 failed, 4 passed, 1 skipped"), summaries
    assert "launched world of 4 processes (torchrun)" in run.combined
    # Every rank ends with the same verdict: each torchrun says its workers failed (exit 1).
    assert run.returncodes == [1, 1]


def test_every_rank_ran_the_marked_tests_at_world_size_four(
    world: tuple[InnerProject, LaunchedRun],
) -> None:
    project, run = world
    toy = project.records("toy")
    assert sorted(r["rank"] for r in toy) == ["0", "1", "2", "3"]
    assert {(r["world"], r["seen"], r["device"]) for r in toy} == {(4, 4, "cpu")}
    hsdp = project.records("hsdp")
    assert len(hsdp) == 4
    assert {tuple(r["placements"]) for r in hsdp} == {("Replicate()", "Shard(dim=0)")}
    t5 = project.records("t5")
    assert len(t5) == 4 and all(r["ok"] and r["kept"] for r in t5)
    assert sorted(r["rank"] for r in project.records("plain")) == ["0", "1", "2", "3"]
    for name in ("test_toy_fsdp2", "test_hsdp_2x2", "test_t5_fp16_contract", "test_plain"):
        assert re.search(rf"PASSED \S+::{name}\b", run.combined), name


def test_a_failure_on_one_rank_fails_the_test_naming_that_rank(
    world: tuple[InnerProject, LaunchedRun],
) -> None:
    _, run = world
    section = failure_section(run.combined, "test_fails_on_rank_three_only")
    assert "fsdp2: call failed on rank 3 of 4 (ranks 0,1,2 passed)" in section
    assert "AssertionError: rank three disagrees" in section
    assert "rank 3 was here" in section and "rank 0 was here" in section
    assert "FAILED test_world.py::test_fails_on_rank_three_only - [rank 3]" in run.combined


def test_a_marker_for_another_world_size_is_skipped_saying_why(
    world: tuple[InnerProject, LaunchedRun],
) -> None:
    _, run = world
    assert "the marker asks for nproc=2; the world torchrun launched has 4 processes" in (
        run.combined
    )
    assert "must not run" not in run.combined
    assert "SKIPPED [1] test_world.py:" in run.combined  # at the test, not in the plugin


def test_nothing_of_the_world_is_left(world: tuple[InnerProject, LaunchedRun]) -> None:
    project, _ = world
    assert leftover_processes(project.tag) == []


DIFFERING = """
import os

import pytest

from rankrec import record


@pytest.mark.fsdp2
def test_everywhere():
    record("ran")


if os.environ["RANK"] == "1":

    def test_only_on_rank_one():
        record("ran")
"""

DYING = """
import os

import pytest
import torch
import torch.distributed as dist

from rankrec import record

pytestmark = pytest.mark.fsdp2


def test_dies_on_rank_one(fsdp2_rank):
    if fsdp2_rank == 1:
        os._exit(7)
    dist.all_reduce(torch.ones(1))


def test_after():
    record("after")
"""

HANGING = """
import pytest
import torch
import torch.distributed as dist

from rankrec import record


@pytest.mark.fsdp2(timeout=5)
def test_hangs_on_rank_zero(fsdp2_rank):
    if fsdp2_rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins


@pytest.mark.fsdp2
def test_after():
    record("after")
"""


def one_node_session(
    factory: pytest.TempPathFactory, name: str, source: str, args: tuple[str, ...] = ()
) -> tuple[InnerProject, LaunchedRun, list[tuple[int, str]]]:
    """``torchrun --nproc-per-node=2 -m pytest ARGS test_NAME.py``: the project, the run, and
    the processes of it still alive afterwards (before they are killed)."""
    project = InnerProject(factory.mktemp(name), new_tag())
    project.write(**{f"test_{name}": source})
    try:
        run = run_launched(project.path, project.tag, [*args, f"test_{name}.py"], nnodes=1)
        leftovers = leftover_processes(project.tag)
    finally:
        project.kill_leftovers()
    return project, run, leftovers


def test_a_collection_that_differs_between_ranks_runs_nothing(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    project, run, leftovers = one_node_session(tmp_path_factory, "differing", DIFFERING)
    assert "rank 1 collected, rank 0 did not: test_differing.py::test_only_on_rank_one" in (
        run.combined
    )
    assert "so none ran" in run.combined
    assert project.records("ran") == []
    assert run.returncodes != [0]
    assert leftovers == []


def test_a_rank_that_dies_ends_the_run_with_the_cause_on_rank_zero(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    project, run, leftovers = one_node_session(tmp_path_factory, "dying", DYING)
    # Rank 0 learns it from the launcher's SIGTERM, or from the exchange its dead peer left.
    cause = re.search(
        r"fsdp2: rank 0 (was stopped by the launcher \(torchrun, SIGTERM\) during "
        r"test_dying.py::test_dies_on_rank_one|could not exchange the call of "
        r"test_dying.py::test_dies_on_rank_one with the other ranks .*): rank 1 stopped answering "
        r"during the call of test_dying.py::test_dies_on_rank_one",
        run.combined,
    )
    assert cause, "rank 0 did not name the cause"
    assert "exitcode  : 7" in run.combined  # the launcher names the rank that died
    assert project.records("after") == []
    assert run.returncodes != [0]
    assert leftovers == []


@pytest.mark.parametrize(
    ("source", "args", "timeout_from"),
    [
        pytest.param(HANGING, (), "5 s (@pytest.mark.fsdp2(timeout=5))", id="marker"),
        pytest.param(
            HANGING.replace("fsdp2(timeout=5)", "fsdp2"),
            ("--fsdp-timeout=5",),
            "--fsdp-timeout=5 s",
            id="option",
        ),
    ],
)
def test_a_hang_ends_the_run_with_every_ranks_stack_on_rank_zero(
    tmp_path_factory: pytest.TempPathFactory,
    source: str,
    args: tuple[str, ...],
    timeout_from: str,
) -> None:
    project, run, leftovers = one_node_session(tmp_path_factory, "hanging", source, args)
    # Only the hang watch says this (the process group's own timeout is 65 s here, and says
    # something else): the run ended at the test's timeout, named with where it was set, as in
    # the local mode.
    report = run.combined.split(
        f"fsdp2: test_hanging.py::test_hangs_on_rank_zero was still running after {timeout_from} "
        "on the 2 ranks torchrun launched; the run ends here",
        1,
    )
    assert len(report) == 2, "no hang report"
    rank0 = report[1].split("---- rank 0: in call ----", 1)[1]
    assert "dist.all_reduce(torch.ones(1))  # rank 1 never joins" in rank0.split("---- rank 1")[0]
    assert "---- rank 1: done with its call, waiting for the other ranks ----" in report[1]
    assert run.combined.count("was still running after") == 1  # rank 0 alone reports
    assert project.records("after") == []
    assert run.returncodes != [0]
    assert leftovers == []


RANK_TWO_DIES = """
import os
import time

import pytest

from rankrec import record

pytestmark = pytest.mark.fsdp2


def test_passes_first():
    record("first")


def test_dies_on_rank_two(fsdp2_rank):
    if fsdp2_rank == 2:
        record("death", at=time.time())
        os._exit(3)


def test_after():
    record("after")
"""


def test_a_rank_that_dies_is_named_on_rank_zero(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Two nodes of two: rank 2 (node 1) dies in a call; rank 0 (node 0) names it, and only it."""
    project = InnerProject(tmp_path_factory.mktemp("rank_two"), new_tag())
    project.write(test_rank_two=RANK_TWO_DIES)
    try:
        run = run_launched(project.path, project.tag, ["test_rank_two.py"])
        ended = time.time()
        leftovers = leftover_processes(project.tag)
    finally:
        project.kill_leftovers()
    rank0 = re.search(
        r"fsdp2: rank 0 (was stopped by the launcher|could not exchange)[^\n]*", run.combined
    )
    assert rank0, "rank 0 did not name the cause"
    assert (
        "rank 2 stopped answering during the call of test_rank_two.py::test_dies_on_rank_two"
        in rank0[0]
    ), rank0[0]
    assert "exit status or signal is in torchrun's log" in rank0[0]
    # The ranks that did not die ended through the plugin: they are not named.
    assert not re.search(r"rank [013] stopped answering", run.combined)
    assert run.combined.count("stopped answering") == 1  # rank 0 alone reports
    assert sorted(r["rank"] for r in project.records("first")) == ["0", "1", "2", "3"]
    assert project.records("after") == []
    assert run.returncodes != [0, 0]
    assert leftovers == []
    (death,) = project.records("death")
    elapsed = ended - death["at"]
    assert elapsed < RANK_FAULT_BOUND_S, (
        f"took {elapsed:.1f} s; the bound is {RANK_FAULT_BOUND_S} s"
    )
    note_elapsed(elapsed)


STATE = """
import time

import pytest
import torch
import torch.distributed as dist

from rankrec import record

pytestmark = pytest.mark.fsdp2


def test_changes_defaults():
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)


def test_sees_the_usual_defaults():
    record("usual", dtype=str(torch.get_default_dtype()), grad=torch.is_grad_enabled())
    assert torch.get_default_dtype() == torch.float32
    assert torch.is_grad_enabled()


def test_restores_what_it_changes():
    torch.set_default_dtype(torch.float16)
    torch.set_default_dtype(torch.float32)


def test_destroys_the_group(fsdp2_rank):
    if fsdp2_rank in WHO:
        record("destroyed", at=time.time())
        dist.destroy_process_group()


def test_after():
    record("after")
"""


@pytest.mark.parametrize(
    ("who", "named"),
    [
        pytest.param("(0, 1)", "rank 0: ", id="every-rank"),
        pytest.param("(1,)", "rank 1: ", id="rank-one"),
    ],
)
def test_torch_defaults_are_restored_and_a_destroyed_group_ends_the_run(
    tmp_path_factory: pytest.TempPathFactory, who: str, named: str
) -> None:
    source = STATE.replace("WHO", who)
    project, run, leftovers = one_node_session(tmp_path_factory, "state", source, ("-rA",))
    elapsed = time.time() - min(r["at"] for r in project.records("destroyed"))
    assert elapsed < RANK_FAULT_BOUND_S, (
        f"took {elapsed:.1f} s; the bound is {RANK_FAULT_BOUND_S} s"
    )
    note_elapsed(elapsed)
    # torch's defaults: put back after the test that changed them, which a warning names on
    # every rank that changed them (as in the local mode); the next test sees the usual ones.
    assert (
        "RankWarning: [ranks 0,1] test_state.py::test_changes_defaults changed the default dtype "
        "to torch.float64, grad mode to disabled and did not restore it"
    ) in " ".join(run.combined.split())
    assert [(r["dtype"], r["grad"]) for r in project.records("usual")] == [
        ("torch.float32", True)
    ] * 2
    assert re.search(r"PASSED \S+::test_sees_the_usual_defaults", run.combined)
    # negative control: a test that restores what it changed is not named
    assert "test_restores_what_it_changes changed" not in run.combined
    # the destroyed default group: the run ends there, rank 0 naming the test and the rank
    cause = re.search(r"fsdp2: rank 0[^\n]*", run.combined)
    assert cause, "rank 0 did not name the cause"
    assert (
        f"{named}test_state.py::test_destroys_the_group destroyed the default process group in "
        "its call"
    ) in cause[0], cause[0]
    assert project.records("after") == []
    assert run.returncodes != [0]
    assert leftovers == []
