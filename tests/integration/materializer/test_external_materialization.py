"""Materializing an LMDB table from another process (the executor agent's materializer) while its
writer keeps writing: the table marker commits with the state, the snapshot is taken from one
read transaction, and a backend installs it only when its own log reaches the snapshot's boundary.
Restores from the resulting checkpoints equal a dict model."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.errors import CorruptObjectError, UsageError
from materializer import (
    BackendOptions,
    ChangelogKeyedStateBackend,
    LmdbStateTable,
    SnapshotRef,
    TableMarker,
    ValueStateDescriptor,
)
from materializer.handles import ChangelogStateBackendHandle
from restore import restore_backend

MP = 16
KGS = KeyGroupRange(0, MP - 1)
OP = "op/p0"
NO_TIMER = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)

# What the agent runs, in a process of its own (py-lmdb opens an environment once per process).
_MATERIALIZE = r"""
import json, sys
from dstl.keygroups import KeyGroupRange
from dstl.stores import open_store
from materializer.external import materialize_table_directory
directory, store_uri, start, end, skip = sys.argv[1:6]
skip_b = tuple(json.loads(skip)) if skip != "null" else None
m = materialize_table_directory(directory, KeyGroupRange(int(start), int(end)),
                                open_store(store_uri), skip_boundary=skip_b)
print(json.dumps(None if m is None else {"ref": m.ref.to_json_obj(),
                                         "boundary": list(m.boundary), "entries": m.entries,
                                         "checkpoint": m.marker.checkpoint_id}))
"""


def _materialize(env_dir: str, store_uri: str, skip: Any = None) -> dict[str, Any] | None:
    out = subprocess.run([sys.executable, "-c", _MATERIALIZE, env_dir, store_uri, "0",
                          str(MP - 1), json.dumps(skip)], capture_output=True, text=True,
                         timeout=60, check=True)
    result: dict[str, Any] | None = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[ChangelogStorage]:
    s = ChangelogStorage(str(tmp_path / "store"), options=DstlOptions(persist_delay_s=0.0))
    yield s
    s.close()


def _backend(storage: ChangelogStorage, local: Path) -> ChangelogKeyedStateBackend:
    return ChangelogKeyedStateBackend(storage, OP, KGS, MP, table="lmdb", options=NO_TIMER,
                                      local_directory=str(local))


def _batch(backend: ChangelogKeyedStateBackend, updates: dict[str, int], cp: int,
           model: dict[str, int]) -> ChangelogStateBackendHandle:
    """One task's batch: the writes, the checkpoint and its marker in one LMDB transaction."""
    state = backend.get_state(ValueStateDescriptor("v"))
    with backend.write_batch():
        for k, v in updates.items():
            backend.set_current_key(k)
            state.update(v)
        h = backend.snapshot(cp).result(10)
        backend.write_table_marker(h)
    backend.notify_checkpoint_complete(cp)
    model.update(updates)
    return h


def _restored(storage: ChangelogStorage, h: ChangelogStateBackendHandle, local: Path
              ) -> dict[str, int]:
    b = restore_backend([h], storage, KGS, table="lmdb", local_directory=str(local),
                        operator_id=f"check-{local.name}")
    try:
        state = b.get_state(ValueStateDescriptor("v"))
        out = {}
        for i in range(40):
            b.set_current_key(f"k{i}")
            if (v := state.value()) is not None:
                out[f"k{i}"] = v
        return out
    finally:
        b.close()


def _ref(m: dict[str, Any]) -> tuple[SnapshotRef, tuple[str, int]]:
    return SnapshotRef.from_json_obj(m["ref"]), (m["boundary"][0], m["boundary"][1])


def test_snapshot_while_writing_then_install_in_own_log(storage: ChangelogStorage,
                                                        tmp_path: Path) -> None:
    model: dict[str, int] = {}
    b = _backend(storage, tmp_path / "local")
    env = b.tables.path
    store_uri = str(tmp_path / "store")
    assert _materialize(env, store_uri) is None  # no checkpoint yet: no marker
    _batch(b, {f"k{i}": i for i in range(20)}, 1, model)
    state = b.get_state(ValueStateDescriptor("v"))
    # the writer holds a write batch open while the other process materializes: LMDB's MVCC
    # gives the materializer checkpoint 1 exactly, and it never waits for the writer
    with b.write_batch():
        for i in range(10, 30):
            b.set_current_key(f"k{i}")
            state.update(1000 + i)
        m = _materialize(env, store_uri)
        assert m is not None and m["checkpoint"] == 1 and m["entries"] == 20
        h2 = b.snapshot(2).result(10)
        b.write_table_marker(h2)
    b.notify_checkpoint_complete(2)
    model.update({f"k{i}": 1000 + i for i in range(10, 30)})
    ref, boundary = _ref(m)
    assert b.install_materialization(ref, boundary)
    assert not b.install_materialization(ref, boundary)  # once
    h3 = _batch(b, {"k0": -1}, 3, model)
    assert h3.materialized == (SnapshotRef(ref.key, ref.size, KGS, ref.materialization_id),)
    # the log after the snapshot is only what followed its boundary (checkpoints 2 and 3)
    logged = [r for h in h3.non_materialized for r in h.change_sets]
    assert (logged[0].key, logged[0].offset) != boundary and len(logged) == 2
    assert _restored(storage, h3, tmp_path / "r1") == model
    # nothing new since: the next materialization is skipped
    m2 = _materialize(env, store_uri, skip=json.loads(json.dumps(list(
        (h3.non_materialized[-1].change_sets[-1].key,
         h3.non_materialized[-1].change_sets[-1].offset)))))
    assert m2 is None
    b.close()


def test_install_in_restored_handles_and_refusals(storage: ChangelogStorage,
                                                  tmp_path: Path) -> None:
    model: dict[str, int] = {}
    b = _backend(storage, tmp_path / "local")
    env = b.tables.path
    for cp in range(1, 4):
        _batch(b, {f"k{i}": cp * 100 + i for i in range(cp, cp + 15)}, cp, model)
    m = _materialize(env, str(tmp_path / "store"))
    assert m is not None and m["checkpoint"] == 3
    ref, boundary = _ref(m)
    h4 = _batch(b, {"k1": 7}, 4, model)
    b.close()
    # another worker restores checkpoint 4 elsewhere: the boundary lies inside its restored log
    r = restore_backend([h4], storage, KGS, table="lmdb", local_directory=str(tmp_path / "w2"))
    assert not r.install_materialization(ref, ("dstl/no-such-segment", 0))
    assert r.install_materialization(ref, boundary)
    state = r.get_state(ValueStateDescriptor("v"))
    with r.write_batch():
        r.set_current_key("k2")
        state.update(-2)
        h5 = r.snapshot(5).result(10)
        r.write_table_marker(h5)
    model["k2"] = -2
    assert h5.materialized[0].key == ref.key
    assert h5.materialization_id > h4.materialization_id
    assert _restored(storage, h5, tmp_path / "r2") == model
    # another snapshot at a boundary the installed one already covers is refused: the boundary
    # is no longer in the log
    assert r.install_materialization(SnapshotRef("snapshots/other", 1, KGS, 9), boundary) is None
    r.close()


def test_marker_and_readonly_table_reject_bad_input(tmp_path: Path) -> None:
    t = LmdbStateTable(str(tmp_path / "env"), KGS)
    with t.write_batch():
        t.put(0, 1, b"k", b"", b"v")
        t.write_marker(b"{}")
        assert t.read_marker() == b"{}"  # the batch sees its own marker
    t.close()
    ro = LmdbStateTable(str(tmp_path / "env"), KGS, readonly=True)
    with pytest.raises(UsageError, match="read-only"):
        ro.put(0, 1, b"k", b"", b"w")
    with pytest.raises(UsageError, match="read-only"), ro.write_batch():
        pass
    assert ro.read_marker() == b"{}"
    ro.close()
    with pytest.raises(UsageError, match="does not exist"):
        LmdbStateTable(str(tmp_path / "none"), KGS, readonly=True)
    good = TableMarker(OP, KGS, MP, 3, 1, ("dstl/seg", 12), 10, 20, {"0": {"name": "v", "kind": "value"}})
    assert TableMarker.from_bytes(good.to_bytes()) == good
    for bad in (b"not json", b"[]", b'{"v": 9}',
                good.to_bytes().replace(b'"boundary":["dstl/seg",12]', b'"boundary":["x"]'),
                good.to_bytes().replace(b'"states":{"0"', b'"states":{"a"')):
        with pytest.raises(CorruptObjectError, match="marker"):
            TableMarker.from_bytes(bad, where="env/marker")
