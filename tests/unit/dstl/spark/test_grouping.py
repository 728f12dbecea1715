"""RowsByKey: the same groups, keys and row order as grouping every row's dict by its key."""

from __future__ import annotations

import random
from typing import Any

import pyarrow as pa
import pytest

from dstl.spark import grouping
from dstl.spark.grouping import RowsByKey


def _plain(batches: list[Any], key: str) -> list[tuple[Any, list[dict[str, Any]]]]:
    out: dict[Any, list[dict[str, Any]]] = {}
    for b in batches:
        for row in b.to_pylist():
            out.setdefault(row[key], []).append(row)
    return list(out.items())


@pytest.mark.parametrize("slice_rows", [7, grouping.SLICE_ROWS])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_groups_equal_the_plain_grouping_across_batches_and_slices(
        seed: int, slice_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    print("seed", seed)
    rng = random.Random(seed)
    # 7: keys that cross slice ends; the default: inputs within one slice, grouped at once
    monkeypatch.setattr(grouping, "SLICE_ROWS", slice_rows)
    keys = [None, *(f"k{i}" for i in range(40))]
    batches = []
    n = 0
    for _ in range(rng.randint(1, 6)):
        size = rng.randint(0, 50)
        batches.append(pa.record_batch({
            "key": [rng.choice(keys) for _ in range(size)],
            "seq": list(range(n, n + size))}))
        n += size
    got = RowsByKey(batches, "key")
    want = _plain(batches, "key")
    assert len(got) == len(want)
    assert list(got.items()) == want


def test_integer_and_binary_keys() -> None:
    ints = pa.record_batch({"key": [3, 1, 3, 2, 1], "v": ["a", "b", "c", "d", "e"]})
    assert list(RowsByKey([ints], "key").items()) == _plain([ints], "key")
    raw = pa.record_batch({"key": [b"\x00", b"", b"\x00"], "v": [1, 2, 3]})
    assert list(RowsByKey([raw], "key").items()) == _plain([raw], "key")


def test_no_rows_and_clear() -> None:
    empty = RowsByKey([pa.record_batch({"key": pa.array([], pa.string())})], "key")
    assert len(empty) == 0 and list(empty.items()) == []
    for n in (1, grouping.SLICE_ROWS):  # within one slice, and beyond it
        rows = RowsByKey([pa.record_batch({"key": ["a", "b"] * n})], "key")
        rows.clear()
        assert len(rows) == 2 and list(rows.items()) == []
