"""Forged deltas (snapshot format v3): the forged-object suite's job with incremental
materialization, so the target object is a delta in a chain (a v2 full snapshot, then the
delta), and the named forgeries of a delta — objects whose checksums are valid (an attacker who
can write the store, or a buggy writer, produces exactly this).

* :func:`build_delta_store` runs the job of :mod:`forged_lmdb` (two LMDB partitions, a
  coordinator), materializes (full), changes about a third of the entries (puts, list clears, map
  removals: the delta holds values and tombstones), checkpoints and materializes again (the
  delta), and checkpoints once more: the newest manifest names ``[full, delta]`` for each
  partition; :attr:`forged_lmdb.Built.target` is partition 1's delta.
* :data:`DELTA_FORGERIES` are the named cases; :func:`flip_positions` draws byte flips anywhere in
  the object (every one is caught by a checksum: the oracle asks for typed errors).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange, key_group_for
from dstl.checkpoint import CheckpointCoordinator
from dstl.stores import LocalBlobStore
from materializer.backend import ChangelogKeyedStateBackend
from materializer.delta_format import DELTA_VERSION, DeltaEntry, decode_delta
from materializer.options import BackendOptions
from materializer.snapshot_format import SnapshotEncoder
from support import forged_lmdb as F

#: Deltas whatever their size (the job is small: the default ratio would make them full).
OPTIONS = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None,
                         incremental_snapshots=True, max_delta_ratio=50.0)


def build_delta_store(root: Path, keys: int = 300) -> F.Built:
    """Run the job into ``root/store`` and return what it wrote (about 0.5 s)."""
    store = LocalBlobStore(str(root / "store"))
    storage = ChangelogStorage(store=store, options=DstlOptions(persist_delay_s=0.0))
    coordinator = CheckpointCoordinator(store, job_id=F.JOB, retained=3)
    backends = [ChangelogKeyedStateBackend(storage, F.operator(p), F.key_groups_of(p), F.MP,
                                           table="lmdb", options=OPTIONS,
                                           local_directory=str(root / "writer"),
                                           auto_materialize=False)
                for p in range(F.PARTITIONS)]
    # key -> (key group, {(state, namespace): (kind, value)})
    model: dict[str, tuple[int, dict[tuple[str, Any], tuple[str, Any]]]] = {}
    try:
        states = [{n: b.get_state(d) for n, d in F.descriptors().items()} for b in backends]

        def at(i: int, ns: Any = None) -> tuple[Any, Any, str, int]:
            key = F._key(i)
            kg = key_group_for(key.encode("utf-8"), F.MP)
            p = kg * F.PARTITIONS // F.MP
            backends[p].set_current_key(key)
            backends[p].set_current_namespace(ns)
            model.setdefault(key, (kg, {}))
            return backends[p], states[p], key, kg

        for i in range(keys):
            value, items, entries = F._values(i)
            _b, st, key, _kg = at(i)
            st["v"].update(value)
            st["l"].add_all(items)
            st["m"].put_all(entries)
            model[key][1].update({("v", None): ("value", value), ("l", None): ("list", items),
                                  ("m", None): ("map", entries)})
            if i % 3 == 0:
                _b, st, key, _kg = at(i, ("w", i % 2))
                st["v"].update(i * 2)
                model[key][1][("v", ("w", i % 2))] = ("value", i * 2)
        first = F._checkpoint(coordinator, backends, 1)
        for b, h in zip(backends, first, strict=True):
            b.write_table_marker(h)
            assert b.materialize_now(timeout_s=30) is not None
        for i in range(0, keys, 3):   # the delta: puts, list clears, map removals, namespaces
            _b, st, key, _kg = at(i)
            st["v"].update(-i)
            model[key][1][("v", None)] = ("value", -i)
            if i % 2 == 0:
                st["l"].clear()
                model[key][1].pop(("l", None))
            st["m"].remove("a1")
            st["m"].put("new", i)
            m = dict(model[key][1][("m", None)][1])
            m.pop("a1", None)
            m["new"] = i
            model[key][1][("m", None)] = ("map", m)
            if i % 9 == 0:
                _b, st, key, _kg = at(i, ("w", i % 2))
                st["v"].clear()
                model[key][1].pop(("v", ("w", i % 2)))
        second = F._checkpoint(coordinator, backends, 2)
        for b, h in zip(backends, second, strict=True):
            b.write_table_marker(h)
            assert b.materialize_now(timeout_s=30) is not None
        handles = F._checkpoint(coordinator, backends, 3)
    finally:
        for b in backends:
            b.close()
        coordinator.close()
        storage.close()
    chain = handles[F.TARGET_PARTITION].materialized
    assert [r.delta for r in chain] == [False, True], chain
    rows: list[F.Row] = []
    for key, (kg, slots) in model.items():
        for (state, ns), (kind, value) in slots.items():
            rows += F.rows_of(kg, state, kind, key, ns, value)
    manifest = sorted(p.relative_to(root / "store").as_posix()
                      for p in (root / "store" / "checkpoints").iterdir())[-1]
    built = F.Built(root, chain[-1].key, manifest, F.sorted_rows(rows))
    (root / "info.json").write_text(json.dumps({"target": built.target, "manifest": manifest,
                                                "rows": built.rows}))
    shutil.rmtree(root / "writer", ignore_errors=True)
    return built


# --------------------------------------------------------------------------- forgeries

#: An object valid on its own that is not the piece the checkpoint names (another place in the
#: chain, another materialization, another max parallelism, a full snapshot): every path that
#: reads the checkpoint fails typed naming it; ``dstl inspect``, which reads the object alone,
#: may describe it.
CHAIN = "chain"
#: Damage inside the delta's checksummed blocks (a byte flip): every path that reads the whole
#: delta fails typed naming it; a path that reads only some key groups (restore onto a sub-range)
#: reads only their blocks, so it fails typed or, the damage lying in a block it did not read,
#: reads the model's state of its key groups.
DAMAGED = "damaged"


def _forge(obj: bytes, *, meta: dict[str, Any] | None = None,
           edit: Any = None, key_groups: KeyGroupRange | None = None) -> bytes:
    """The delta re-encoded with valid checksums after changing its metadata fields and/or its
    blocks (``edit(blocks) -> blocks``), the encoder's own order checks bypassed."""
    decoded, blocks = decode_delta(obj, key="forged")
    fields = json.loads(decoded.to_bytes())
    fields.update(meta or {})
    raw: list[tuple[int, list[DeltaEntry]]] = sorted(
        (kg, list(es)) for kg, es in blocks.items())
    if edit is not None:
        raw = edit(raw)
    enc = SnapshotEncoder(key_groups or decoded.key_groups,
                          json.dumps(fields, sort_keys=True).encode(), version=DELTA_VERSION)
    out = [enc.start()]
    out.extend(enc.add_key_group(kg, es) for kg, es in raw)
    out.append(enc.finish())
    return b"".join(out)


def _first_block(f: Any) -> Any:
    def edit(raw: list[tuple[int, list[DeltaEntry]]]) -> list[tuple[int, list[DeltaEntry]]]:
        (kg, es), *rest = raw
        return [*f(kg, es), *rest]
    return edit


def _moved(raw: list[tuple[int, list[DeltaEntry]]]) -> list[tuple[int, list[DeltaEntry]]]:
    """The first block's first entry moved into the second block, in order there (its key
    hashes to another key group than the block's)."""
    (kg0, es0), (kg1, es1), *rest = raw
    moved = sorted([*es1, es0[0]], key=lambda e: (e[0], e[1], e[2]))
    return [(kg0, es0[1:]), (kg1, moved), *rest]


def _value_of_another(kg: int, es: list[DeltaEntry]) -> list[tuple[int, list[DeltaEntry]]]:
    """The first put's value bytes replaced by another put's of the same state (valid bytes,
    another value: the state read is not the model's, and every path must read the same)."""
    puts = [i for i, e in enumerate(es) if e[3] is not None]
    a = puts[0]
    b = next(i for i in puts[1:] if es[i][0] == es[a][0] and es[i][3] != es[a][3])
    out = list(es)
    out[a] = (*es[a][:3], es[b][3])
    return [(kg, out)]


DELTA_FORGERIES: list[F.Forgery] = [
    F.Forgery("delta-truncated", lambda b, o: o[:len(o) // 2], what="half the object"),
    F.Forgery("delta-follows-nothing", lambda b, o: _forge(o, meta={"follows": 0}), CHAIN,
              what="follows materialization 0"),
    F.Forgery("delta-other-materialization",
              lambda b, o: _forge(o, meta={"materialization_id": 9}), CHAIN,
              what="another materialization id than the checkpoint names"),
    F.Forgery("delta-other-max-parallelism", lambda b, o: _forge(o, meta={"max_parallelism": 32}),
              CHAIN, what="max parallelism 32 (the checkpoint's is 16)"),
    F.Forgery("delta-wider-range", lambda b, o: _forge(
        o, meta={"key_groups": [0, F.MP - 1]}, key_groups=KeyGroupRange(0, F.MP - 1)), F.MODEL,
              what="the whole range with empty blocks beyond the partition's: every reader "
                   "reads only the reference's key groups, so the model's state"),
    F.Forgery("delta-key-in-another-key-group", lambda b, o: _forge(o, edit=_moved),
              what="an entry in the block of another key group"),
    F.Forgery("delta-undescribed-state", lambda b, o: _forge(o, edit=_first_block(
        lambda kg, es: [(kg, [(77, *es[0][1:]), *es[1:]])])),
              what="a state id the metadata does not describe"),
    F.Forgery("delta-out-of-order", lambda b, o: _forge(o, edit=_first_block(
        lambda kg, es: [(kg, [es[1], es[0], *es[2:]])])), what="two entries swapped"),
    F.Forgery("delta-entry-twice", lambda b, o: _forge(o, edit=_first_block(
        lambda kg, es: [(kg, [es[0], *es])])), what="an entry repeated"),
    F.Forgery("delta-full-snapshot-instead", lambda b, o: (
        b.store / _full_key(b)).read_bytes(), CHAIN,
              what="the chain's full snapshot in its place"),
    F.Forgery("delta-another-value", lambda b, o: _forge(o, edit=_first_block(_value_of_another)),
              expect="any", what="a value replaced by another valid one (no promise: same state "
                              "on every path)"),
]


def _full_key(built: F.Built) -> str:
    from dstl.checkpoint.manifest import decode_manifest
    path = built.store / built.manifest
    m = decode_manifest(path.read_bytes(), built.manifest)
    for t in m.tasks:
        keys = [r["key"] for r in dict(t.state).get("materialized", [])]
        if built.target in keys:
            return str(keys[0])
    raise AssertionError("the target is in no task's chain")


def flip_positions(obj: bytes, rng: random.Random, n: int) -> list[tuple[tuple[int, int], ...]]:
    """``n`` distinct sets of one to three ``(offset, xor mask)`` flips anywhere in ``obj``."""
    out: list[tuple[tuple[int, int], ...]] = []
    while len(out) < n:
        chosen: dict[int, int] = {}
        for _ in range(rng.randint(1, 3)):
            chosen.setdefault(rng.randrange(len(obj)), rng.choice([1, 2, 4, 8, 16, 32, 64,
                                                                   128, 0xFF]))
        positions = tuple(sorted(chosen.items()))
        if positions not in out:
            out.append(positions)
    return out


def flipped(obj: bytes, positions: tuple[tuple[int, int], ...]) -> bytes:
    d = bytearray(obj)
    for off, mask in positions:
        d[off] ^= mask
    return bytes(d)


__all__ = ["CHAIN", "DELTA_FORGERIES", "OPTIONS", "build_delta_store", "flip_positions", "flipped"]
