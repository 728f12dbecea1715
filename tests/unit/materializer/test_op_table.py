"""The op table (materializer.changes.apply_op, op_rows): one meaning per op. Applied to heap
objects, to stored bytes (what an LMDB table and the state reader hold) and folded from the
change feed's rows, every sequence of changes ends at the same state."""

from __future__ import annotations

import random
from typing import Any

import pytest

from dstl.errors import CorruptObjectError
from materializer.changes import (
    ADD,
    ADD_ELEMENT,
    ADD_OR_UPDATE_ELEMENT,
    CLEAR,
    OPS_BY_KIND,
    READS_CURRENT,
    REMOVE_ELEMENT,
    SET,
    SET_INTERNAL,
    apply_op,
    encode_map_entry,
    frame,
    op_rows,
)
from materializer.codecs import SafeCodec
from materializer.states import StateShape

CODEC = SafeCodec()
enc = CODEC.encode


def _random_change(kind: str, rng: random.Random) -> tuple[int, bytes]:
    op = rng.choice(sorted(OPS_BY_KIND[kind]))
    if op == CLEAR:
        return op, b""
    if kind == "list":
        if op == ADD_ELEMENT:
            return op, enc(rng.randrange(100))
        items = [enc(rng.randrange(100)) for _ in range(rng.randrange(1, 4))]
        return op, frame(items)            # ADD, SET, SET_INTERNAL: framed elements
    if kind == "map":
        k = rng.choice("abcd")
        if op == ADD_OR_UPDATE_ELEMENT:
            return op, encode_map_entry(enc(k), enc(rng.randrange(100)))
        if op == REMOVE_ELEMENT:
            return op, enc(k)
        pairs: list[bytes] = []
        for key in rng.sample("abcd", rng.randrange(1, 3)):
            pairs += [enc(key), enc(rng.randrange(100))]
        return op, frame(pairs)           # ADD, SET, SET_INTERNAL: framed keys and values
    return op, enc(rng.randrange(100))


def _fold_rows(state: Any, kind: str, rows: list[tuple[str, Any, Any]]) -> Any:
    """The change feed's rows applied to a state, as a reader of the feed would."""
    for change, key, value in rows:
        if change == "clear":
            state = None
        elif change == "set":
            state = value
        elif change == "add":
            state = [*(state or []), value]
        elif change == "put":
            state = {**(state or {}), key: value}
        else:
            state = {k: v for k, v in (state or {}).items() if k != key} or None
    if kind in ("list", "map") and not state:
        return None
    return state


@pytest.mark.parametrize("kind", sorted(OPS_BY_KIND))
@pytest.mark.parametrize("seed", range(20))
def test_objects_bytes_and_feed_rows_agree(kind: str, seed: int) -> None:
    rng = random.Random(seed)
    print(f"seed {seed}")
    shape = StateShape(kind, CODEC, CODEC if kind == "map" else None)
    obj: Any = None
    stored: Any = None
    fed: Any = None
    for _ in range(30):
        op, payload = _random_change(kind, rng)
        obj = apply_op(op, shape, obj if op in READS_CURRENT else None, payload, objects=True)
        stored = apply_op(op, shape, stored if op in READS_CURRENT else None, payload,
                          objects=False)
        fed = _fold_rows(fed, kind, list(op_rows(op, shape, payload)))
        assert (stored is None) == (obj is None)
        assert obj is None or shape.from_bytes(stored) == obj
        if kind in ("list", "map") and obj is not None and not obj:
            obj = stored = None  # an emptied list stays stored in the table: compare contents
        assert fed == obj or (not fed and not obj), (op, fed, obj)


def test_ops_outside_the_table_and_payloads_that_do_not_decode_are_corruption() -> None:
    shape = StateShape("map", CODEC, CODEC)
    with pytest.raises(CorruptObjectError, match="unknown op code 4"):
        apply_op(4, shape, None, b"", objects=False)
    with pytest.raises(CorruptObjectError, match="unknown op code 9"):
        list(op_rows(9, shape, b""))
    with pytest.raises(CorruptObjectError):          # a map key that is not hashable
        apply_op(ADD_OR_UPDATE_ELEMENT, shape, None, encode_map_entry(enc([1]), enc(1)),
                 objects=False)
    lst = StateShape("list", CODEC)
    with pytest.raises(CorruptObjectError):          # a list element that does not decode
        apply_op(ADD_ELEMENT, lst, frame([enc(1)]), b"\x80\x05junk", objects=False)
    assert apply_op(SET, lst, None, frame([enc(1)]), objects=True) == [1]
    assert apply_op(SET_INTERNAL, lst, None, b"raw", objects=False) == b"raw"
    assert apply_op(ADD, lst, None, frame([enc(2), enc(3)]), objects=True) == [2, 3]
