"""Negative controls: known-wrong implementations must make the contract suite FAIL, saying why.

One inner pytest session (real plugin, real torchrun ranks, 2 gloo ranks) runs the contract on
a small decoder with kept norms and ``wo`` projections against eight implementations:
``fp32keep`` (must pass: not fail, not error, not skip) and seven wrong ones, each of which must
fail with the contract item that catches it, naming a kept tensor (or the output it spoils):

* four wrong fixes seen in the wild (FP32 ``param_dtype`` on kept units, a blanket cast, the
  caller's bf16 policy on kept units, a dtype-blind loader);
* three that only ``parity`` can see, since every dtype stays right: kept gradients scaled by
  ``1 + 2**-10`` after backward, kept units reducing their FP32 gradients in bf16, and one kept
  module's output nudged by ``2**-10`` of itself (logits and loss off).

The ``operators`` row's negative control (a kept matmul computed in bf16) lives in
``tests/contract/test_operators_row.py``.
"""

from __future__ import annotations

import re

import pytest

from pytest_fp32keep.contract import CHECKS
from tests.inner_outcomes import InnerOutcome, assert_passed, run_inner_session

INNER = """
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor

import fp32keep
from pytest_fp32keep import assert_fp32_keep_contract

FP32 = torch.float32


class Norm(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width) + 0.1 * torch.randn(width))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (self.weight * h.to(self.weight.dtype)).to(x.dtype)


class Block(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.norm = Norm(width)
        self.up = nn.Linear(width, width)
        self.wo = nn.Linear(width, width, bias=False)

    def forward(self, x):
        h = torch.relu(self.up(self.norm(x)))
        return x + self.wo(h.to(self.wo.weight.dtype)).to(h.dtype)


class Decoder(nn.Module):
    _no_split_modules = ["Block"]
    _keep_in_fp32_modules_strict = ["wo", "norm"]

    def __init__(self, width=8, vocab=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def batch(model):
    return torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(0))


def kept_modules(model):
    return [m for layer in model.layers for m in (layer.norm, layer.wo)]


def shard_kept_with(policy_for_kept):
    def shard(model, *, mesh, mp_policy, plan, wrap):
        for layer in model.layers:
            for module in (layer.norm, layer.wo):
                fully_shard(module, mesh=mesh, mp_policy=policy_for_kept(mp_policy))
            fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return shard


def scaled_kept_gradients(model, *, mesh, mp_policy, plan, wrap):
    # fp32keep's layout and policies; then each kept parameter's gradient scaled by 1 + 2^-10
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=mp_policy, plan=plan, wrap=wrap)

    def scale(module, args):
        # runs after FSDP2's own pre-forward (prepended): these are the unsharded parameters
        # whose .grad FSDP2 reduce-scatters after backward
        for param in module.parameters(recurse=False):
            param.register_hook(lambda grad: grad * (1 + 2**-10))

    for module in kept_modules(model):
        module.register_forward_pre_hook(scale)


def nudged_kept_output(model, *, mesh, mp_policy, plan, wrap):
    # fp32keep's sharding; then the last kept wo hands back 2^-6 of its output too much (its
    # output is bf16 under autocast: a nudge of 2^-10 would round away, 2^-6 cannot)
    fp32keep.apply_fsdp2(model, mesh=mesh, mp_policy=mp_policy, plan=plan, wrap=wrap)
    model.layers[1].wo.register_forward_hook(lambda module, args, out: out + out * 2**-6)


def blanket_cast(model, dtype, plan):
    model.to(dtype)  # what verl did before the fix


def dtype_blind_load(model, state_dict):
    # accelerate-style: broadcast every tensor, then assign it: the checkpoint dtype wins
    box = [state_dict]
    dist.broadcast_object_list(box, src=0)
    params = dict(model.named_parameters())
    sharded = {
        name: distribute_tensor(tensor, params[name].device_mesh, params[name].placements)
        for name, tensor in box[0].items()
    }
    model.load_state_dict(sharded, assign=True)


def check(mesh, **implementation):
    assert_fp32_keep_contract(
        Decoder, batch, mesh=mesh, dtype=torch.bfloat16, autocast=True, **implementation
    )


@pytest.mark.fsdp2
def test_fp32keep(fsdp2_mesh):
    check(fsdp2_mesh)


@pytest.mark.fsdp2
def test_kept_units_with_fp32_param_dtype(fsdp2_mesh):
    check(fsdp2_mesh, shard=shard_kept_with(lambda p: MixedPrecisionPolicy(param_dtype=FP32)))


@pytest.mark.fsdp2
def test_blanket_cast_before_wrapping(fsdp2_mesh):
    check(fsdp2_mesh, cast=blanket_cast, shard=shard_kept_with(lambda p: p))


@pytest.mark.fsdp2
def test_kept_units_with_the_callers_bf16_policy(fsdp2_mesh):
    check(fsdp2_mesh, shard=shard_kept_with(lambda p: p))


@pytest.mark.fsdp2
def test_dtype_blind_loader(fsdp2_mesh):
    check(fsdp2_mesh, load=dtype_blind_load)


@pytest.mark.fsdp2
def test_kept_gradients_scaled_after_backward(fsdp2_mesh):
    check(fsdp2_mesh, shard=scaled_kept_gradients)


@pytest.mark.fsdp2
def test_kept_units_reducing_in_bf16(fsdp2_mesh):
    # all-gathered in FP32 like fp32keep's kept units, but the FP32 gradients averaged in bf16
    check(
        fsdp2_mesh,
        shard=shard_kept_with(lambda p: MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)),
    )


@pytest.mark.fsdp2
def test_kept_output_nudged(fsdp2_mesh):
    check(fsdp2_mesh, shard=nudged_kept_output)
"""

# test name -> (contract items that must fail, whether no other may, a failure-table row: regex);
# docs/contract.md ("Negative controls") lists them. A wrong store, gather or load also spoils
# the rows downstream of it; the last three break no dtype: only parity can see them, so every
# other item must pass.
EXPECTED_FAILURES = {
    "test_kept_units_with_fp32_param_dtype": (
        {"boundary"},
        False,
        r"boundary\s+layers\.0\.norm call 0 input args\[0\]\s+bfloat16\s+float32\s+FAIL",
    ),
    "test_blanket_cast_before_wrapping": (
        {"stored"},
        False,
        r"stored\s+layers\.0\.wo\.weight\s+float32\s+bfloat16\s+FAIL",
    ),
    "test_kept_units_with_the_callers_bf16_policy": (
        {"materialized"},
        False,
        r"materialized\s+layers\.0\.wo\.weight \(call 0\)\s+float32\s+bfloat16\s+FAIL",
    ),
    "test_dtype_blind_loader": (
        {"round trip"},
        False,
        r"round trip\s+layers\.0\.norm\.weight\s+float32\s+bfloat16\s+FAIL",
    ),
    "test_kept_gradients_scaled_after_backward": (
        {"parity"},
        True,
        r"parity\s+grad layers\.0\.wo\.weight\s+bit-identical \(control\)\s+\S+ relative\s+FAIL",
    ),
    "test_kept_units_reducing_in_bf16": (
        {"parity"},
        True,
        r"parity\s+grad layers\.0\.norm\.weight\s+bit-identical \(control\)\s+\S+ relative\s+FAIL",
    ),
    "test_kept_output_nudged": (
        {"parity"},
        True,
        r"parity\s+logits\s+bfloat16 bit-identical\s+max \|diff\| \S+\s+FAIL\s*\n"
        r"\S*\s*parity\s+loss\s+\S+\s+\S+\s+FAIL",
    ),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, InnerOutcome]:
    """Run the inner session once; per test, its outcome and failure text."""
    project = tmp_path_factory.mktemp("controls")
    session = run_inner_session(project, {"test_controls.py": INNER}, "-q", timeout=900)
    assert len(session.outcomes) == 1 + len(EXPECTED_FAILURES), session.output[-4000:]
    return session.outcomes


def test_fp32keep_passes_the_contract(outcomes: dict[str, InnerOutcome]) -> None:
    assert_passed(outcomes["test_fp32keep"])  # passed: not failed, not errored, not skipped


def failed_items(text: str) -> set[str]:
    """The contract items the violation's headline names (``...: stored, parity``); the
    headline wraps onto indented lines to fit 100 columns, up to the table's header."""
    lines = [line.removeprefix("E").strip() for line in text.splitlines()]
    start = next(i for i, line in enumerate(lines) if "FP32-keep contract broken" in line)
    end = next(i for i in range(start, len(lines)) if re.match(r"check\s+subject", lines[i]))
    headline = " ".join(lines[start:end])
    return {item.strip() for item in headline.rsplit("): ", 1)[-1].split(",")}


def first_table_row(text: str) -> str:
    """The check of the first row of the violation's table (the cause, in the contract's order)."""
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if re.match(r"E?\s*check\s+subject", line))
    return lines[header + 1].removeprefix("E").split()[0]


@pytest.mark.parametrize("name", sorted(EXPECTED_FAILURES))
def test_wrong_implementation_fails_with_the_right_message(
    name: str, outcomes: dict[str, InnerOutcome]
) -> None:
    outcome = outcomes[name]
    assert outcome.outcome != "passed", f"{name} passed the contract, but it is a known-wrong fix"
    # failed by the contract's assertion, not errored on the way (a fixture, a crash)
    assert outcome.outcome == "failed", outcome.text[-3000:]
    text = outcome.text
    checks, only, detail = EXPECTED_FAILURES[name]
    assert "FP32-keep contract broken for Decoder at bfloat16" in text
    failed = failed_items(text)
    assert failed == checks if only else checks <= failed, text[-3000:]
    assert re.search(detail, text), text[-3000:]
    # the first failing check in the contract's order leads the table (issue 22)
    assert first_table_row(text) == min(failed, key=CHECKS.index), text[-3000:]
    message = text[text.index("FP32-keep contract broken") :]
    widest = max(len(line) for line in message.splitlines())
    assert widest <= 100, f"{widest} columns:\n{message}"


def test_a_blanket_cast_folds_the_operators_rows_its_stored_failure_explains(
    outcomes: dict[str, InnerOutcome],
) -> None:
    """Issue 36: one blanket cast printed 103 lines, every operator of every kept module a row
    of its own; they follow from the kept weights stored in bf16, and fold into one line."""
    text = outcomes["test_blanket_cast_before_wrapping"].text
    message = text[text.rindex("FP32-keep contract broken") :]  # the full text, not the summary
    assert not re.search(r"^E?\s*operators\s+layers\.", message, flags=re.M), message
    joined = " ".join(message.split())
    assert re.search(r"\d+ operators rows follow from the stored failure above \(4 kept", joined)
    assert len(message.splitlines()) <= 50, message
    # negative control: a wrong fix that stores and gathers right keeps its rows: the parity-only
    # controls show every failing row of theirs
    nudged = outcomes["test_kept_output_nudged"].text
    assert "follow from" not in nudged
