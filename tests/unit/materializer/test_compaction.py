"""The compaction rule of incremental materialization (materializer.compaction)."""

from __future__ import annotations

import pytest

from materializer.compaction import DELTA, FULL, MERGE, next_piece


@pytest.mark.parametrize(("deltas", "expected"), [
    ([], DELTA),                      # a new chain: its first delta
    ([10, 10], DELTA),                # fewer than max_deltas, small
    ([10, 10, 10], MERGE),            # max_deltas reached: merged into one delta
    ([300, 10, 10], MERGE),           # a merged delta first, then deltas: merged again
    ([490, 10], DELTA),               # exactly the ratio is still a delta
    ([490, 11], FULL),                # beyond the ratio: the base is rewritten
    ([600], FULL),                    # whatever the count
])
def test_next_piece_follows_bytes_then_count(deltas: list[int], expected: str) -> None:
    assert next_piece(1000, deltas, 3, 0.5) == expected


def test_a_small_table_with_many_small_deltas_is_not_rewritten_by_count() -> None:
    """The count alone merges deltas; it never rewrites the full snapshot."""
    assert next_piece(10**9, [1000] * 500, 8, 0.5) == MERGE
    assert next_piece(10**9, [1000] * 7, 8, 0.5) == DELTA
