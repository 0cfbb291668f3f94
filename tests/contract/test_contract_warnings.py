"""The contract with every warning an error (``-W error``, ``filterwarnings = error``).

torch warns, in FSDP2's post-forward hook, when a unit returns a view tensor; inside the contract
every unit is one the contract sharded, so that warning is the contract's own and must not turn
into ``crashed (forward)`` (it did: the README's T5 example failed under ``-W error``). Everything
else stays an error: the user's own warnings in the model factory or the forward, one in torch's
very words raised from the user's module, and torch's view-tensor warning about a model the user
sharded themselves, outside the contract (the negative controls, in the same session).

The default tier runs ``-W error``; the slow tier also runs ``filterwarnings = error`` from an ini
file. The warm-rank counterpart is ``tests/contract/test_zoo_contract.py``, which runs every zoo
model's contract with every warning an error.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.contract.test_readme_example import readme_example
from tests.plugin._inner import InnerProject, failure_section, tagged_project


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Iterator[InnerProject]:
    """An inner project whose processes carry a unique tag (as in tests/plugin)."""
    with tagged_project(pytester, monkeypatch) as project:
        yield project


#: The user's own tests beside the README example: each must still fail under warnings as errors.
OWN_WARNINGS = """
import warnings

import pytest
import torch
from torch.distributed.fsdp import fully_shard
from transformers import T5Config, T5ForConditionalGeneration

from pytest_fp32keep import assert_fp32_keep_contract


def config():
    return T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                    decoder_start_token_id=0, dropout_rate=0.0)


def build_batch(model):
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def build_warning():
    warnings.warn("the user's factory warns", UserWarning)
    return T5ForConditionalGeneration(config())


class LookalikeT5(T5ForConditionalGeneration):
    def forward(self, *args, **kwargs):
        warnings.warn("FSDP2-wrapped module (LookalikeT5) returned a view tensor", UserWarning)
        return super().forward(*args, **kwargs)


@pytest.mark.fsdp2
def test_factory_warning(fsdp2_mesh):
    assert_fp32_keep_contract(build_warning, build_batch, mesh=fsdp2_mesh, dtype=torch.float16)


@pytest.mark.fsdp2
def test_lookalike_forward_warning(fsdp2_mesh):
    assert_fp32_keep_contract(
        lambda: LookalikeT5(config()), build_batch, mesh=fsdp2_mesh, dtype=torch.float16
    )


@pytest.mark.fsdp2
def test_own_sharding(fsdp2_mesh):
    model = T5ForConditionalGeneration(config())
    for block in [*model.encoder.block, *model.decoder.block]:
        fully_shard(block, mesh=fsdp2_mesh)
    fully_shard(model, mesh=fsdp2_mesh)
    model(**build_batch(model)).loss.backward()
"""


@pytest.mark.parametrize(
    ("args", "ini"),
    [
        pytest.param(("-W", "error"), "", id="W-error"),
        pytest.param(
            (),
            "[pytest]\nfilterwarnings =\n    error\n",
            id="filterwarnings-error",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_readme_example_passes_and_user_warnings_still_fail(
    inner: InnerProject, args: tuple[str, ...], ini: str
) -> None:
    if ini:
        (inner.path / "pytest.ini").write_text(ini)
    source, _ = readme_example()
    inner.write(test_my_model_fp32keep=source, test_own_warnings=OWN_WARNINGS)
    result = inner.run("-rA", "--tb=short", *args)
    output = result.stdout.str()
    # the README's four cases pass: torch's warning about the contract's own units is no error
    result.assert_outcomes(passed=4, failed=3)
    # a warning of the user's model factory: the contract's build step crashed on it
    factory = failure_section(output, "test_factory_warning")
    assert "crashed" in factory and "UserWarning: the user's factory warns" in factory
    # torch's words, raised from the user's module: only torch's FSDP code is exempted
    lookalike = failure_section(output, "test_lookalike_forward_warning")
    assert "UserWarning: FSDP2-wrapped module (LookalikeT5) returned a view tensor" in lookalike
    # torch's own warning about units the user sharded outside the contract stays an error
    own = failure_section(output, "test_own_sharding")
    assert "UserWarning: FSDP2-wrapped module (FSDPT5Block) returned a view tensor" in own
