"""Deterministic change sets for format tests and the golden segment."""

from __future__ import annotations

from dstl.segment import CHANGE_LEN, ChangeSet, build_change_set


def make_change_set(log_id: str, sqn: int, changes: list[tuple[int, bytes]]) -> ChangeSet:
    blocks: dict[int, bytearray] = {}
    for kg, payload in changes:
        buf = blocks.setdefault(kg, bytearray())
        buf += CHANGE_LEN.pack(len(payload))
        buf += payload
    return build_change_set(log_id, sqn, blocks, len(changes), sum(len(p) for _, p in changes))


def golden_change_sets() -> list[ChangeSet]:
    """Two writers, metadata first, three key groups; the content of golden segment v1."""
    return [
        make_change_set("op-a/0", 0, [(-1, b"meta:count"), (3, b"k1=1"), (7, b"k2=1"),
                                      (3, b"k1=2")]),
        make_change_set("op-b/1", 5, [(64, b"x" * 20), (65, b"")]),
        make_change_set("op-a/0", 1, [(7, b"k2=2")]),
    ]


GOLDEN_EXPECTED = {
    ("op-a/0", 0): [(-1, b"meta:count"), (3, b"k1=1"), (3, b"k1=2"), (7, b"k2=1")],
    ("op-b/1", 5): [(64, b"x" * 20), (65, b"")],
    ("op-a/0", 1): [(7, b"k2=2")],
}
