"""Negative controls: known-wrong implementations must make the contract suite FAIL, saying why.

One inner pytest session (real plugin, real torchrun ranks) runs the contract on a small
decoder with kept norms and ``wo`` projections against five implementations: ``fp32keep`` (must
pass) and four wrong fixes seen in the wild (each must fail with the contract item that catches
it, naming a kept tensor).
"""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

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
"""

# test name -> (contract item that must be reported, a row of the failure table: regex)
EXPECTED_FAILURES = {
    "test_kept_units_with_fp32_param_dtype": (
        "boundary",
        r"boundary\s+layers\.0\.norm call 0 input args\[0\]\s+bfloat16\s+float32\s+FAIL",
    ),
    "test_blanket_cast_before_wrapping": (
        "stored",
        r"stored\s+layers\.0\.wo\.weight\s+float32\s+bfloat16\s+FAIL",
    ),
    "test_kept_units_with_the_callers_bf16_policy": (
        "materialized",
        r"materialized\s+layers\.0\.wo\.weight \(call 0\)\s+float32\s+bfloat16\s+FAIL",
    ),
    "test_dtype_blind_loader": (
        "round trip",
        r"round trip\s+layers\.0\.norm\.weight\s+float32\s+bfloat16\s+FAIL",
    ),
}


@pytest.fixture(scope="module")
def failures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str | None]:
    """Run the inner session once; per test, its failure text (None when it passed)."""
    project = tmp_path_factory.mktemp("controls")
    (project / "test_controls.py").write_text(INNER)
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml=report.xml"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    report = ET.parse(project / "report.xml")
    outcome: dict[str, str | None] = {}
    for case in report.iter("testcase"):
        failure = case.find("failure")
        outcome[case.attrib["name"]] = None if failure is None else (failure.text or "")
    assert len(outcome) == 5, completed.stdout[-4000:]
    return outcome


def test_fp32keep_passes_the_contract(failures: dict[str, str | None]) -> None:
    assert failures["test_fp32keep"] is None, failures["test_fp32keep"]


@pytest.mark.parametrize("name", sorted(EXPECTED_FAILURES))
def test_wrong_implementation_fails_with_the_right_message(
    name: str, failures: dict[str, str | None]
) -> None:
    text = failures[name]
    assert text is not None, f"{name} passed the contract, but it is a known-wrong fix"
    check, detail = EXPECTED_FAILURES[name]
    assert "FP32-keep contract broken for Decoder at bfloat16 (autocast" in text
    headline = next(line for line in text.splitlines() if "FP32-keep contract broken" in line)
    assert check in headline.split(":")[-1], headline
    assert re.search(detail, text), text[-3000:]
