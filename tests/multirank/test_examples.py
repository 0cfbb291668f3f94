"""The README's runnable example runs, and the README quotes it verbatim, so the docs cannot rot."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "quickstart.py"


def test_readme_quotes_the_quickstart_verbatim() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    example = EXAMPLE.read_text()
    quoted = [
        block for block in blocks if "fp32keep.load_full_state_dict(model, checkpoint)" in block
    ]
    assert quoted, "README no longer quotes examples/quickstart.py"
    for line in quoted[0].splitlines():
        assert line in example, f"README line not in examples/quickstart.py: {line!r}"


@pytest.mark.slow  # its own torchrun; the features it shows run in tests/multirank by default
def test_quickstart_runs_in_two_ranks_and_keeps_wo_fp32() -> None:
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(EXAMPLE),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-6000:]
    assert "stored wo shard: torch.float32; other weights: torch.float16" in completed.stdout
    assert "encoder.block.0.layer.1.DenseReluDense.wo.weight" in completed.stdout
