"""The loader's source-side checks as pure functions: no process group, no rank.

``fp32keep.load.validate.validate`` runs on the source rank only; whatever it finds is broadcast
and raised on every rank (tests/multirank/test_load_refusals_fsdp2.py). Here: that it never
raises, reads each needed value once, and tells tied aliases apart bit for bit; and how the
refusal of ranks holding different models names what differs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from fp32keep.load.move import Target
from fp32keep.load.validate import (
    entry_problem,
    layout_differences,
    layout_rows,
    same_values,
    validate,
)


def target(
    *names: str, shape: tuple[int, ...] = (2, 2), dtype: torch.dtype = torch.float32
) -> Target:
    return Target(names, shape, dtype, False, True, torch.empty(shape, dtype=dtype))


def test_nested_tensor_is_refused_with_the_fix() -> None:
    nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(2)])
    assert entry_problem(nested, target("w")) == (
        "is a nested tensor; pass a dense one (e.g. value.to_padded_tensor(0.0))"
    )


def test_tied_aliases_compare_bit_for_bit_in_the_destination_dtype() -> None:
    nan = torch.tensor([[float("nan"), 1.0], [2.0, 3.0]])
    assert same_values(nan, nan.clone(), torch.float32)  # NaN where NaN: the same bits
    assert not same_values(torch.zeros(2, 2), -torch.zeros(2, 2), torch.float32)  # -0.0
    near = torch.tensor([[1.0, 1.0001], [0.0, 0.0]])
    assert same_values(near, near.to(torch.bfloat16), torch.bfloat16)  # equal once cast
    assert not same_values(near, near.to(torch.bfloat16), torch.float32)


class Counting(Mapping[str, object]):
    """Counts reads, so the test can see that each needed value is read once."""

    def __init__(self, inner: dict[str, object]) -> None:
        self.inner, self.reads = inner, 0

    def __getitem__(self, key: str) -> object:
        self.reads += 1
        return self.inner[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)


def test_validate_reads_each_needed_value_once_and_keeps_it() -> None:
    weight = torch.ones(2, 2)
    source = Counting({"a": weight, "tied.a": weight, "extra": torch.zeros(1)})
    verdict, values = validate([target("a", "tied.a")], source)
    assert verdict.mismatched == () and verdict.unexpected == ("extra",)
    assert values == [weight] and values[0] is weight
    assert source.reads == 2  # both aliases, never the unexpected entry


def test_validate_never_raises() -> None:
    class Broken(Mapping[str, object]):
        def __getitem__(self, key: str) -> object:
            raise KeyError(key)  # listed but not there

        def __iter__(self) -> Iterator[str]:
            return iter(["a"])

        def __len__(self) -> int:
            raise RuntimeError("no length either")

    verdict, values = validate([target("a")], Broken())
    assert verdict.mismatched == (("a", "reading it raised KeyError: 'a'"),)
    assert values == [None]


def test_models_that_differ_are_told_apart_by_name() -> None:
    """What the refusal of ranks holding different models says (its collectives are in
    tests/multirank/test_load_meta_fsdp2.py): a tie one rank lacks, once per tie; a tensor one
    rank lacks; each field that differs. Negative control: equal models differ in nothing."""
    tied = [target("embed.weight", "head.weight"), target("norm.weight", shape=(2,))]
    assert layout_differences(layout_rows(tied), layout_rows(tied), 0, 1) == []
    untied = [target("embed.weight"), target("head.weight"), target("norm.weight", shape=(2,))]
    assert layout_differences(layout_rows(tied), layout_rows(untied), 0, 1) == [
        "'embed.weight' is tied to ['head.weight'] on rank 0, untied on rank 1"
    ]
    other = [
        target("embed.weight", "head.weight", dtype=torch.bfloat16),
        target("norm.weight", shape=(3,)),
        target("extra"),
    ]
    assert layout_differences(layout_rows(tied), layout_rows(other), 0, 2) == [
        "'embed.weight': dtype torch.float32 on rank 0, torch.bfloat16 on rank 2",
        "'extra' is on rank 2 only",
        "'norm.weight': shape (2,) on rank 0, (3,) on rank 2",
    ]
