"""``fp32keep check --cast/--shard/--load/--policy``: a framework's own steps under the contract.

Bad values are refused in the command, before any rank starts (in-process, ``_launch`` made to
fail the test if it is reached). Four real two-rank runs of one zoo model (t5 at fp16, which
keeps its four ``wo`` weights) through the installed console script: the correct plug-ins pass;
a blanket ``fully_shard`` (the negative control) fails ``materialized`` where the same run with
fp32keep's wrapping plugged in passes; a blanket ``model.to(dtype)`` fails ``stored``;
``--load none`` reports the round trip as not judged.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_fp32keep.check import cli
from pytest_fp32keep.check.plugins import Plugins, policy_takes_dtype, resolve_plugins
from pytest_fp32keep.check.render import legend_text, render_markdown, render_text
from tests.cli.plugins import POLICY_LOG, fixed_policy, keep_load, logged_policy
from tests.cli.test_cli import _environment, run_cli
from tests.error_bounds import PARENT_BOUND_S, within

P = "tests.cli.plugins"
T5_FP16 = ("t5", "--dtype", "fp16")


@pytest.fixture
def no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the command gets as far as starting ranks."""

    def launch(*args: object) -> dict[str, Any]:
        raise AssertionError("ranks were started for a value that should have been refused")

    monkeypatch.setattr(cli, "_launch", launch)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        pytest.param(
            "--shard",
            "no_such_package.frameworks:shard",
            "--shard 'no_such_package.frameworks:shard': cannot import module "
            "'no_such_package.frameworks'",
            id="shard-missing-module",
        ),
        pytest.param(
            "--load",
            f"{P}:missing",
            f"--load '{P}:missing': module '{P}' has no attribute 'missing'",
            id="load-missing-attribute",
        ),
        pytest.param(
            "--cast",
            f"{P}:NOT_CALLABLE",
            f"--cast '{P}:NOT_CALLABLE' is a int, not callable: name a function",
            id="cast-not-callable",
        ),
        pytest.param(
            "--policy",
            P,
            f"--policy '{P}' is not of the form package.module:function",
            id="policy-no-colon",
        ),
        pytest.param(
            "--shard",
            f"{P}:shard_without_keywords",
            f"--shard '{P}:shard_without_keywords': shard_without_keywords(model, mesh) cannot "
            "be called as shard(model, *, mesh, mp_policy, plan, wrap) (got an unexpected "
            "keyword argument 'mp_policy'); define it as def shard_without_keywords(model, *, "
            "mesh, mp_policy, plan, wrap): ...",
            id="shard-signature",
        ),
        pytest.param(
            "--cast",
            f"{P}:cast_of_two",
            f"--cast '{P}:cast_of_two': cast_of_two(model, dtype) cannot be called as "
            "cast(model, dtype, plan) (too many positional arguments); define it as def "
            "cast_of_two(model, dtype, plan): ...",
            id="cast-signature",
        ),
        pytest.param(
            "--load",
            f"{P}:keep_cast",
            f"--load '{P}:keep_cast': keep_cast(model, dtype, plan) cannot be called as "
            "load(model, state_dict) (missing a required argument: 'plan'); define it as def "
            "keep_cast(model, state_dict): ...",
            id="load-signature",
        ),
        pytest.param(
            "--policy",
            f"{P}:policy_of_two",
            f"--policy '{P}:policy_of_two': policy_of_two(dtype, world) cannot be called as "
            "policy_of_two(dtype) or policy_of_two() (missing a required argument: 'world'); "
            "define it as def policy_of_two(dtype): ..., returning a MixedPrecisionPolicy",
            id="policy-signature",
        ),
        pytest.param(
            "--policy",
            f"{P}:policy_returning_a_dict",
            f"--policy '{P}:policy_returning_a_dict': policy_returning_a_dict(torch.float16) "
            "returned a dict, not a torch.distributed.fsdp.MixedPrecisionPolicy: return the "
            "policy to shard with",
            id="policy-returns-a-dict",
        ),
    ],
)
def test_a_bad_plug_in_is_an_error_naming_option_value_and_fix_before_any_rank(
    option: str,
    value: str,
    message: str,
    no_ranks: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with within(PARENT_BOUND_S):
        assert cli.main(["check", *T5_FP16, option, value]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("fp32keep check: error: "), err
    assert message in err, err


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        pytest.param(
            ["--load-on-every-rank"],
            "--load-on-every-rank with --load (not given): it says where your own loader takes "
            "the full state dict; pass --load MODULE:FUNCTION too",
            id="every-rank-without-load",
        ),
        pytest.param(
            ["--load", "none", "--load-on-every-rank"],
            "--load-on-every-rank with --load none:",
            id="every-rank-with-load-none",
        ),
        pytest.param(
            ["--gradient-divide-factor", "0"],
            "--gradient-divide-factor must be above 0 and finite, got 0",
            id="factor-zero",
        ),
        pytest.param(
            ["--gradient-divide-factor", "mean"],
            "--gradient-divide-factor must be a number, got 'mean'",
            id="factor-not-a-number",
        ),
    ],
)
def test_a_bad_convention_is_an_error_before_any_rank(
    arguments: list[str], message: str, no_ranks: None, capsys: pytest.CaptureFixture[str]
) -> None:
    with within(PARENT_BOUND_S):
        try:
            status = cli.main(["check", *T5_FP16, *arguments])
        except SystemExit as exited:  # argparse's own errors exit from the parser
            status = exited.code
    assert status == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("fp32keep check: error: "), err
    assert message in err, err


def test_the_good_plug_ins_pass_the_same_validation(no_ranks: None) -> None:
    """Negative control of the errors above: the plug-ins of the real runs are accepted, and
    a policy of one argument is told from one of none by its signature alone."""
    plugins = Plugins(f"{P}:keep_cast", f"{P}:keep_shard", f"{P}:keep_load", f"{P}:fixed_policy")
    resolved = resolve_plugins(plugins, [torch.bfloat16, torch.float16])
    assert set(resolved.contract_kwargs(torch.float16)) == {"cast", "shard", "load", "mp_policy"}
    assert resolve_plugins(Plugins(load="none")).contract_kwargs(torch.float16) == {
        "check_state_dict": False
    }
    conventions = Plugins(load=f"{P}:keep_load", load_on_every_rank=True, gradient_divide_factor=1)
    assert resolve_plugins(conventions).contract_kwargs(torch.float16) == {
        "load": keep_load,
        "load_on_every_rank": True,
        "gradient_divide_factor": 1,
    }
    assert policy_takes_dtype(logged_policy) and not policy_takes_dtype(fixed_policy)
    takes: dict[str, Callable[..., Any]] = {
        "optional": lambda dtype=torch.bfloat16: None,
        "varargs": lambda *args: None,
    }
    assert all(policy_takes_dtype(function) for function in takes.values())
    assert not policy_takes_dtype(lambda *, dtype: None)  # keyword-only: called with none


# --- four real runs ------------------------------------------------------------------------------


SUMMED = ("t5", "--dtype", "fp16", "--shard", f"{P}:summing_shard", "--load", "none")


def _runs(folder: Path) -> dict[str, list[str]]:
    """Each run's arguments. Rwkv at fp16 is a layout apply_fsdp2 must refuse (the zoo's written
    expectation): the delegating shard refuses it, the blanket one is judged by the rows."""
    # with a package.module:factory TARGET beside the zoo entry: the plug-ins apply to both
    stack = ("t5", "tests.cli.targets:kept_stack", "--batch", "tests.cli.targets:toy_batch")
    master = (*stack, "--dtype", "fp16", "--master-dtype", "fp32", "--load", "none")
    return {
        "correct": [
            *("t5", "rwkv", "--dtype", "fp16", "--cast", f"{P}:keep_cast"),
            *("--shard", f"{P}:keep_shard", "--load", f"{P}:keep_load"),
            *("--policy", f"{P}:logged_policy", "--report", str(folder / "correct.md")),
        ],
        # the same FP32-master run twice, differing only in the shard: the negative control
        "master": [*master, "--policy", f"{P}:fixed_policy", "--shard", f"{P}:keep_shard"],
        "blanket shard": [
            *master,
            "--policy",
            f"{P}:fixed_policy",
            "--shard",
            f"{P}:blanket_shard",
        ],
        "blanket cast": [
            *("t5", "rwkv", "--dtype", "fp16", "--cast", f"{P}:blanket_cast"),
            *("--shard", f"{P}:blanket_shard"),
        ],
        # summed gradients: right when declared, and the undeclared run is the negative control
        "summed": [*SUMMED, "--gradient-divide-factor", "1"],
        "summed, undeclared": SUMMED,
    }


@pytest.fixture(scope="module")
def plugged_runs(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, subprocess.CompletedProcess[str] | Path]:
    folder = tmp_path_factory.mktemp("plugged")
    policy_log = folder / "policy.log"
    env = _environment(**{POLICY_LOG: str(policy_log)})
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            name: pool.submit(run_cli, *argv, env=env) for name, argv in _runs(folder).items()
        }
        done: dict[str, subprocess.CompletedProcess[str] | Path] = {
            name: future.result() for name, future in futures.items()
        }
    done["folder"] = folder
    return done


def _run(runs: dict[str, Any], name: str) -> subprocess.CompletedProcess[str]:
    completed: subprocess.CompletedProcess[str] = runs[name]
    return completed


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_the_correct_plug_ins_pass_and_the_reports_name_them(plugged_runs: dict[str, Any]) -> None:
    completed = _run(plugged_runs, "correct")
    out = completed.stdout
    assert completed.returncode == 0, out[-3000:] + completed.stderr[-3000:]
    assert "2 passed, 0 failed" in out
    assert f"under test: cast: {P}:keep_cast\n" in out
    # rwkv: the delegating shard refuses, as apply_fsdp2 must; the legend names the shard
    assert "rwkv   fp16   autocast  pass (refused)" in out, out
    assert f"pass (refused) = --shard {P}:keep_shard refused a layout" in _flat(out)
    for step in (f"shard: {P}:keep_shard", f"load: {P}:keep_load", f"policy: {P}:logged_policy"):
        assert f"\n            {step}\n" in out, out
    folder: Path = plugged_runs["folder"]
    report = json.loads((folder / "correct.json").read_text())
    assert report["plugins"] == {
        "cast": f"{P}:keep_cast",
        "shard": f"{P}:keep_shard",
        "load": f"{P}:keep_load",
        "policy": f"{P}:logged_policy",
        "load_on_every_rank": False,
        "gradient_divide_factor": None,
    }
    t5 = next(case for case in report["cases"] if case["target"] == "t5")
    assert t5["status"]["round trip"] is True  # the plugged-in loader ran
    assert f"`shard: {P}:keep_shard`" in (folder / "correct.md").read_text()
    # the policy function ran in the command (validation) and in each rank for each case
    calls = sorted((folder / "policy.log").read_text().splitlines())
    assert calls == ["0 torch.float16"] * 2 + ["1 torch.float16"] * 2 + ["command torch.float16"]


def test_a_blanket_fully_shard_fails_materialized_where_fp32keeps_wrapping_passes(
    plugged_runs: dict[str, Any],
) -> None:
    passing, failing = _run(plugged_runs, "master"), _run(plugged_runs, "blanket shard")
    assert passing.returncode == 0, passing.stdout[-3000:] + passing.stderr[-3000:]
    assert "2 passed, 0 failed" in passing.stdout
    assert failing.returncode == 1, failing.stdout[-3000:] + failing.stderr[-3000:]
    out = _flat(failing.stdout)
    assert "0 passed, 2 failed" in out
    assert f"shard: {P}:blanket_shard" in out
    kept = ["layers.0.wo.weight", "layers.1.wo.weight"]  # the TARGET's, then t5's
    kept += [f"{block}.DenseReluDense.wo.weight" for block in ("encoder.block.0.layer.1",)]
    kept += [f"{block}.DenseReluDense.wo.weight" for block in ("decoder.block.1.layer.2",)]
    for name in kept:
        row = f"- `materialized` {name} (call 0): expected float32, observed float16"
        assert row in out, out[-3000:]
    assert "`materialized`" not in passing.stdout


def test_a_blanket_cast_fails_stored(plugged_runs: dict[str, Any]) -> None:
    completed = _run(plugged_runs, "blanket cast")
    assert completed.returncode == 1, completed.stdout[-3000:] + completed.stderr[-3000:]
    out = _flat(completed.stdout)
    assert f"under test: cast: {P}:blanket_cast shard: {P}:blanket_shard" in out
    row = "- `stored` encoder.block.0.layer.1.DenseReluDense.wo.weight: expected float32, observed"
    assert f"{row} float16" in out, out[-3000:]
    # rwkv, which apply_fsdp2 must refuse: a shard of the user's that does not refuse is judged
    # by the contract's rows (here stored), not failed for not refusing as apply_fsdp2 would be
    rwkv = next(line for line in completed.stdout.splitlines() if line.startswith("rwkv "))
    # result FAIL (maybe naming the ranks that failed it), then stored FAIL
    assert re.match(r"rwkv +fp16 +autocast +FAIL( \(ranks? [0-9,]+\))? +FAIL ", rwkv), rwkv
    assert "not refused" not in out and "expected apply_fsdp2 to refuse" not in out


def test_load_none_reports_the_round_trip_as_not_judged(plugged_runs: dict[str, Any]) -> None:
    completed = _run(plugged_runs, "master")
    out = _flat(completed.stdout)
    assert "load: none (round trip not judged)" in out
    assert "note: round trip not judged: --load none loaded no state dict" in out
    assert "not run (a step it needs crashed; the round trip with --load none)" in out
    row = next(line for line in completed.stdout.splitlines() if line.startswith("t5 "))
    assert row.split()[-1] == "-", row  # the trip column: not judged, not passed
    # negative control: a run that loads judges the round trip and says nothing of the kind
    judged = _flat(_run(plugged_runs, "correct").stdout)
    assert "round trip not judged" not in judged


def _result(plugins: dict[str, str | None]) -> dict[str, Any]:
    case = {
        "target": "rwkv",
        "dtype": "fp16",
        "context": "autocast",
        "expect_layout_error": True,
        "outcome": "refused",
        "refused": ["head.weight"],
        "ok": True,
        "status": {},
        "kept": [],
        "failures": [],
        "message": "",
    }
    return {
        "cases": [case],
        "nproc": 2,
        "date": "today",
        "plugins": plugins,
        "device": "cpu",
        "backend": "gloo",
    }


def test_the_verdict_names_the_plugged_in_shard_not_apply_fsdp2() -> None:
    plugged = _result({"cast": None, "shard": f"{P}:keep_shard", "load": None, "policy": None})
    text = _flat(legend_text(plugged["cases"], short_headers=True, plugins=plugged["plugins"]))
    assert f"pass (refused) = --shard {P}:keep_shard refused a layout" in text
    assert "apply_fsdp2" not in text
    assert "under test: cast: fp32keep's own" in render_text(plugged, 100)
    assert f"`shard: {P}:keep_shard`" in render_markdown(plugged)
    # negative control: fp32keep's own wrapping is named as such, and no plug-in line shown
    own = _result(dict.fromkeys(("cast", "shard", "load", "policy")))
    assert "pass (refused) = apply_fsdp2 refused" in _flat(render_text(own, 100))
    assert "under test" not in render_text(own, 100)
    assert "Under test" not in render_markdown(own)


def test_a_declared_gradient_sum_passes_and_an_undeclared_one_fails_parity(
    plugged_runs: dict[str, Any],
) -> None:
    declared, undeclared = _run(plugged_runs, "summed"), _run(plugged_runs, "summed, undeclared")
    assert declared.returncode == 0, declared.stdout + declared.stderr
    assert "gradients: divided by 1, not the world size" in _flat(declared.stdout)
    assert undeclared.returncode == 1, undeclared.stdout + undeclared.stderr
    assert "parity" in undeclared.stdout and "grad " in undeclared.stdout, undeclared.stdout
