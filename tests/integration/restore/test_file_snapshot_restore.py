"""Restores from file-level snapshots (format v2): every state kind equals a dict model
into LMDB (install by rename, or range copy) and the heap; rescaling 1->2, 2->1, 4->3, 8->2 with
v2, v1 and mixed snapshots; the v1 golden checkpoint still restores; a corrupt or truncated object
is a typed error naming it and nothing half-installed remains; a restore killed midway (SIGKILL in
a child process) leaves no table that a later task could take for a checkpoint's."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange, key_group_for
from dstl.errors import CorruptObjectError
from dstl.layout import operator_dir
from dstl.stores import LocalBlobStore, MemoryBlobStore
from materializer.backend import ChangelogKeyedStateBackend
from materializer.handles import ChangelogStateBackendHandle
from materializer.lmdb_table import LmdbStateTable
from materializer.options import BackendOptions
from materializer.states import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)
from restore.cache import LocalFileCache
from restore.file_restore import STAGE_PREFIX
from restore.restore import RestoreStats, restore_backend

MP = 64
ALL = KeyGroupRange(0, MP - 1)
WAIT = 10.0
FILE = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)
ENTRIES = FILE.replace(lmdb_snapshot_format="entries")
KEYS = [f"user-{i}" for i in range(300)]
GOLDEN = Path(__file__).resolve().parents[2] / "data" / "format" / "v1" / "checkpoint"
GOLDEN_V2_LAYOUT1 = GOLDEN.parents[1] / "v2_layout1" / "checkpoint"

Model = dict[tuple[str, str, Any], Any]


class Avg:
    def create_accumulator(self) -> list[int]:
        return [0, 0]

    def add(self, v: int, acc: list[int]) -> list[int]:
        return [acc[0] + v, acc[1] + 1]

    def get_result(self, acc: list[int]) -> float:
        return acc[0] / acc[1]

    def merge(self, a: list[int], b: list[int]) -> list[int]:
        return [a[0] + b[0], a[1] + b[1]]


def _descs() -> dict[str, Any]:
    return {"v": ValueStateDescriptor("v"), "l": ListStateDescriptor("l"),
            "m": MapStateDescriptor("m"), "r": ReducingStateDescriptor("r", lambda a, b: a + b),
            "a": AggregatingStateDescriptor("a", Avg())}


def _workload(b: ChangelogKeyedStateBackend, rng: random.Random, steps: int, keys: list[str],
              model: Model) -> None:
    """Random mutations of every state kind, mirrored into ``model``."""
    st = {n: b.get_state(d) for n, d in _descs().items()}
    for _ in range(steps):
        k, ns = rng.choice(keys), rng.choice([None, "w1"])
        b.set_current_key(k)
        b.set_current_namespace(ns)
        op = rng.randrange(7)
        if op == 0:
            st["v"].update(rng.randrange(100))
            model[("v", k, ns)] = st["v"].value()
        elif op == 1:
            st["l"].add(rng.randrange(5))
            model.setdefault(("l", k, ns), []).append(st["l"].get()[-1])
        elif op == 2:
            st["m"].put(f"f{rng.randrange(3)}", [rng.randrange(5)])
            model[("m", k, ns)] = st["m"].items()
        elif op == 3:
            x = rng.randrange(10)
            st["r"].add(x)
            model[("r", k, ns)] = model.get(("r", k, ns), 0) + x
        elif op == 4:
            st["a"].add(rng.randrange(10))
            model[("a", k, ns)] = st["a"].get()
        elif op == 5:
            st["v"].clear()
            model.pop(("v", k, ns), None)
        else:
            st["m"].remove("f0")
            items = st["m"].items()
            model.pop(("m", k, ns), None)
            if items:
                model[("m", k, ns)] = items
    b.set_current_namespace(None)


def _read_all(b: ChangelogKeyedStateBackend) -> Model:
    st = {n: b.get_state(d) for n, d in _descs().items()}
    out: Model = {}
    for k in KEYS:
        if key_group_for(k.encode(), MP) not in b.key_groups:
            continue
        b.set_current_key(k)
        for ns in (None, "w1"):
            b.set_current_namespace(ns)
            for name, s in st.items():
                v = (s.value() if name == "v" else (s.get() or None) if name == "l"
                     else (s.items() or None) if name == "m" else s.get())
                if v is not None:
                    out[(name, k, ns)] = v
    b.set_current_namespace(None)
    return out


def _in(model: Model, kgs: KeyGroupRange) -> Model:
    return {k: v for k, v in model.items() if key_group_for(k[1].encode(), MP) in kgs}


def _checkpoint(b: ChangelogKeyedStateBackend, cp: int) -> ChangelogStateBackendHandle:
    h = b.snapshot(cp).result(WAIT)
    b.notify_checkpoint_complete(cp)
    return h


def _version(storage: ChangelogStorage, key: str) -> int:
    return storage.store.get_range(key, 5, 1)[0]


@pytest.fixture
def storage() -> Iterator[ChangelogStorage]:
    s = ChangelogStorage(store=MemoryBlobStore(), options=DstlOptions(persist_delay_s=0.0))
    yield s
    s.close()


def _build(storage: ChangelogStorage, op: str, kgs: KeyGroupRange, table: str, seed: int,
           model: Model, options: BackendOptions = FILE, tail: bool = True,
           local: str | None = None, marker: bool = False) -> ChangelogStateBackendHandle:
    """A backend with a snapshot (and a log tail after it unless ``tail=False``); ``marker``:
    the table holds a table marker when the snapshot is taken (as under Spark)."""
    b = ChangelogKeyedStateBackend(storage, op, kgs, MP, table=table, options=options,
                                   local_directory=local)
    rng = random.Random(seed)
    mine = [k for k in KEYS if key_group_for(k.encode(), MP) in kgs]
    if seed % 2:   # another registration order: other state ids, restore maps them by name
        b.get_state(_descs()["m"])
    _workload(b, rng, 500, mine, model)
    h1 = _checkpoint(b, 1)
    if marker:
        b.write_table_marker(h1)
    assert b.materialize_now(WAIT) is not None
    if tail:
        _workload(b, rng, 200, mine, model)
    h = _checkpoint(b, 2)
    assert _read_all(b) == _in(model, kgs)
    b.close()
    return h


@pytest.mark.parametrize("dst", ["lmdb", "heap"])
@pytest.mark.parametrize("cached", [False, True])
def test_every_state_kind_from_a_file_snapshot(storage: ChangelogStorage, tmp_path: Path,
                                               dst: str, cached: bool) -> None:
    model: Model = {}
    h = _build(storage, "op", ALL, "lmdb", 3, model, marker=True)
    assert _version(storage, h.materialized[0].key) == 2
    cache = LocalFileCache(str(tmp_path / "cache")) if cached else None
    st = RestoreStats()
    r = restore_backend([h.to_json()], storage, ALL, table=dst, cache=cache, stats=st,
                        local_directory=str(tmp_path / "local"))
    try:
        assert _read_all(r) == model
        assert st["file_snapshots"] == 1 and st["entries"] > 0 and st["changes"] > 0
        if dst == "lmdb":
            assert r.tables.read_marker() is None
        # the restored backend goes on, materializes (v2 again) and restores once more
        _workload(r, random.Random(9), 100, KEYS, model)
        _checkpoint(r, 3)
        assert r.materialize_now(WAIT) is not None
        h2 = _checkpoint(r, 4)
    finally:
        r.close()
        if cache is not None:
            cache.close()
    again = restore_backend([h2], storage, ALL, table="lmdb")
    assert _read_all(again) == model
    again.close()
    assert not list((tmp_path / "local").glob(f"{STAGE_PREFIX}*"))


def test_snapshot_without_log_installs_the_file_as_the_table(storage: ChangelogStorage,
                                                              tmp_path: Path) -> None:
    model: Model = {}
    h = _build(storage, "op", ALL, "lmdb", 4, model, tail=False)
    st = RestoreStats()
    r = restore_backend([h], storage, ALL, table="lmdb", stats=st,
                        local_directory=str(tmp_path))
    assert _read_all(r) == model and st["changes"] == 0
    assert st["entries"] == len(model)   # one table entry per (state, key, namespace)
    r.close()


@pytest.mark.parametrize("old,new", [(1, 2), (2, 1), (4, 3)])
def test_rescale_copies_each_tables_dictionary(storage: ChangelogStorage, tmp_path: Path,
                                               old: int, new: int) -> None:
    """Tables whose values took a dictionary (a write batch of >= 1,000 values of 200 bytes)
    rescale into tables holding every source's dictionary under its own number, and every
    state kind equals the model, read from LMDB and the heap."""
    model: Model = {}
    big: dict[str, str] = {}
    handles = []
    ranges = [KeyGroupRange.of_operator(MP, old, i) for i in range(old)]
    per = [[k for k in (f"big-{n}" for n in range(6000))
            if key_group_for(k.encode(), MP) in kgs][:1100] for kgs in ranges]
    for i, kgs in enumerate(ranges):
        b = ChangelogKeyedStateBackend(storage, f"big/{i}", kgs, MP, table="lmdb", options=FILE,
                                       local_directory=str(tmp_path / "src"))
        v = b.get_state(ValueStateDescriptor("v"))
        with b.write_batch():
            for k in per[i]:
                b.set_current_key(k)
                big[k] = f"{k}:" + hashlib.sha256(k.encode()).hexdigest() * 3 + "x" * 64
                v.update(big[k])
        assert b.tables.dictionaries == [0]
        _workload(b, random.Random(i), 300,
                  [k for k in KEYS if key_group_for(k.encode(), MP) in kgs], model)
        _checkpoint(b, 1)
        assert b.materialize_now(WAIT) is not None
        _workload(b, random.Random(i + 50), 100,
                  [k for k in KEYS if key_group_for(k.encode(), MP) in kgs], model)
        handles.append(_checkpoint(b, 2))
        b.close()
    for j in range(new):
        kgs = KeyGroupRange.of_operator(MP, new, j)
        sources = [i for i, r in enumerate(ranges) if len(r.intersection(kgs))]
        for table in ("lmdb", "heap"):
            r = restore_backend(handles, storage, kgs, table=table, operator_id=f"new/{j}",
                                local_directory=str(tmp_path / table))
            try:
                assert _read_all(r) == _in(model, kgs), f"{table} backend {j} of {new}"
                v = r.get_state(ValueStateDescriptor("v"))
                for k, text in big.items():
                    if key_group_for(k.encode(), MP) in kgs:
                        r.set_current_key(k)
                        assert v.value() == text
                if table == "lmdb":
                    assert r.tables.layout == b"2"
                    assert r.tables.dictionaries == list(range(len(sources)))
            finally:
                r.close()


@pytest.mark.parametrize("old,new", [(1, 2), (2, 1), (4, 3), (8, 2)])
@pytest.mark.parametrize("sources", ["lmdb", "mixed"])
def test_rescale_from_file_snapshots(storage: ChangelogStorage, tmp_path: Path, old: int,
                                     new: int, sources: str) -> None:
    """lmdb: every old backend wrote v2; mixed: heap (v1) and LMDB with v2 and v1 (entries)."""
    model: Model = {}
    handles = []
    for i in range(old):
        table = "heap" if sources == "mixed" and i % 3 == 1 else "lmdb"
        opts = ENTRIES if sources == "mixed" and i % 3 == 2 else FILE
        handles.append(_build(storage, f"op/{i}", KeyGroupRange.of_operator(MP, old, i), table,
                              old * 10 + new + i, model, opts))
    for j in range(new):
        kgs = KeyGroupRange.of_operator(MP, new, j)
        for table in ("lmdb", "heap"):
            st = RestoreStats()
            r = restore_backend(handles, storage, kgs, table=table, operator_id=f"new/{j}",
                                stats=st, local_directory=str(tmp_path / table))
            try:
                assert _read_all(r) == _in(model, kgs), f"{table} backend {j} of {new}"
                v2 = [m for h in handles for m in h.materialized
                      if len(m.key_groups.intersection(kgs)) and _version(storage, m.key) == 2]
                assert st["file_snapshots"] == len(v2) and (sources == "mixed" or v2)
            finally:
                r.close()


def test_v1_golden_checkpoint_still_restores(tmp_path: Path) -> None:
    """Objects written by the v1 writer (LMDB and heap backends) restore into both tables."""
    _golden_restores(GOLDEN, ("lmdb", "heap"), 1, tmp_path)


def test_v2_layout1_golden_checkpoint_still_restores(tmp_path: Path) -> None:
    """File-level snapshots (v2) of a table of key layout "1" restore into both tables."""
    _golden_restores(GOLDEN_V2_LAYOUT1, ("lmdb",), 2, tmp_path)


def _golden_restores(golden: Path, sources: tuple[str, ...], version: int, tmp_path: Path
                     ) -> None:
    store = LocalBlobStore(golden / "store")
    storage = ChangelogStorage(store=store, options=DstlOptions(persist_delay_s=0.0))
    handles = json.loads((golden / "handles.json").read_text())
    model = json.loads((golden / "model.json").read_text())
    try:
        for src in sources:
            h = ChangelogStateBackendHandle.from_json(handles[src])
            assert all(store.get_range(m.key, 5, 1)[0] == version for m in h.materialized)
            for dst in ("lmdb", "heap"):
                r = restore_backend([h], storage, KeyGroupRange(0, 15), table=dst,
                                    operator_id=f"again-{src}-{dst}",
                                    local_directory=str(tmp_path))
                v = r.get_state(ValueStateDescriptor("v"))
                li = r.get_state(ListStateDescriptor("l"))
                m = r.get_state(MapStateDescriptor("m"))
                rows = []
                for k in sorted({f"key-{i}" for i in range(25)}):
                    r.set_current_key(k)
                    for ns in (None, "w"):
                        r.set_current_namespace(ns)
                        if v.value() is not None:
                            rows.append([k, ns, v.value(), li.get(), sorted(map(list, m.items()))])
                if dst == "lmdb" and version == 2:   # installed by rename: it stays layout 1
                    assert r.tables.layout == b"1"
                r.close()
                expected = [[k, ns, val, lst, [list(x) for x in mp]]
                            for k, ns, val, lst, mp in model[src]]
                assert rows == expected, f"{src} -> {dst}"
    finally:
        storage.close()


# --------------------------------------------------------------------------- damage


def _damaged(storage: ChangelogStorage, key: str, how: str) -> None:
    data = bytearray(storage.store.get(key))
    if how == "flip":
        data[len(data) // 2] ^= 0x08
    elif how == "truncate":
        data = data[:len(data) - 100]
    else:   # empty
        data = bytearray()
    storage.store.delete([key])
    storage.store.put(key, bytes(data))


@pytest.mark.parametrize("how", ["flip", "truncate", "empty"])
@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("dst", ["lmdb", "heap"])
def test_damaged_file_snapshot_is_a_typed_error_and_nothing_is_installed(
        storage: ChangelogStorage, tmp_path: Path, how: str, cached: bool, dst: str) -> None:
    model: Model = {}
    h = _build(storage, "op", ALL, "lmdb", 5, model)
    key = h.materialized[0].key
    _damaged(storage, key, how)
    local = tmp_path / "local"
    cache = LocalFileCache(str(tmp_path / "cache")) if cached else None
    try:
        with pytest.raises(CorruptObjectError, match=r"checkpoint 2") as info:
            restore_backend([h], storage, ALL, table=dst, cache=cache,
                            local_directory=str(local))
    finally:
        if cache is not None:
            cache.close()
    assert info.value.key == key
    _assert_nothing_valid(local, "op")


def test_a_restore_failing_after_the_install_removes_its_table(
        storage: ChangelogStorage, tmp_path: Path) -> None:
    # the snapshot is valid and installed by rename; the log after it is damaged, so the
    # restore fails in its replay: the installed table goes with it, nothing stays to open
    model: Model = {}
    h = _build(storage, "op", ALL, "lmdb", 7, model)
    segment = h.non_materialized[0].change_sets[0].key
    _damaged(storage, segment, "flip")
    local = tmp_path / "local"
    with pytest.raises(CorruptObjectError) as info:
        restore_backend([h], storage, ALL, table="lmdb", local_directory=str(local))
    assert info.value.key == segment
    assert not (local / operator_dir("op")).exists()


def _assert_nothing_valid(local: Path, op: str) -> None:
    """No staging debris of this process, and the table (if any) is empty and has no marker."""
    if not local.exists():
        return
    assert not [p for p in os.listdir(local) if p.startswith(f"{STAGE_PREFIX}{os.getpid()}-")]
    env = local / operator_dir(op)
    if (env / "data.mdb").exists():
        with LmdbStateTable(str(env), ALL, readonly=True) as t:
            assert t.read_marker() is None
            snap = t.snapshot()
            try:
                assert snap.entry_count() <= 1   # the layout record at most
            finally:
                snap.release()


def test_file_data_outside_its_key_groups_is_refused(storage: ChangelogStorage,
                                                     tmp_path: Path) -> None:
    """A forged object whose metadata claims fewer key groups than the file holds."""
    from materializer.file_snapshot import (
        FileSnapshotMeta,
        decompress_file_snapshot,
        verify_file_snapshot,
        write_file_snapshot,
    )
    model: Model = {}
    h = _build(storage, "op", ALL, "lmdb", 6, model, tail=False)
    key = h.materialized[0].key
    data = storage.store.get(key)
    layout = verify_file_snapshot(lambda o, n: data[o:o + n], len(data), key=key)
    raw = tmp_path / "raw.mdb"
    decompress_file_snapshot(lambda o, n: data[o:o + n], layout, str(raw), key=key)
    m = layout.meta
    lie = FileSnapshotMeta(KeyGroupRange(0, 3), m.max_parallelism, m.states, m.operator_id,
                           m.materialization_id)
    import io
    out = io.BytesIO()

    def copy(fd: int) -> None:
        os.write(fd, raw.read_bytes())
    write_file_snapshot(copy, lie, out, tmp_dir=str(tmp_path))
    storage.store.delete([key])
    storage.store.put(key, out.getvalue())
    for kgs in (KeyGroupRange(0, 3), ALL):
        # a sub-range: the entry outside the metadata's key groups; all: the reference too wide
        with pytest.raises(CorruptObjectError,
                           match=r"outside key groups|the snapshot holds") as info:
            restore_backend([h], storage, kgs, table="lmdb", local_directory=str(tmp_path / "l"))
        assert info.value.key == key


# --------------------------------------------------------------------------- killed midway

_CHILD = r"""
import json, os, signal, sys
from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.stores import LocalBlobStore
import materializer.backend as backend_mod
from restore.restore import restore_backend
store_dir, handle, local, env_path, mode = sys.argv[1:6]
real_rename = os.rename
def rename(src, dst):
    installing = os.path.abspath(dst) == os.path.abspath(env_path)
    if installing and mode == "before-rename":
        os.kill(os.getpid(), signal.SIGKILL)
    real_rename(src, dst)
    if installing and mode == "after-rename":
        os.kill(os.getpid(), signal.SIGKILL)
backend_mod.os.rename = rename
real_open_tables = backend_mod.ChangelogKeyedStateBackend._open_tables
def open_tables(self, *args):
    # "restoring" once the restore has replaced the previous table by an empty one: a kill
    # before that point would find the previous table as it was, which no restore can help
    tables = real_open_tables(self, *args)
    print("restoring", flush=True)
    return tables
backend_mod.ChangelogKeyedStateBackend._open_tables = open_tables
storage = ChangelogStorage(store=LocalBlobStore(store_dir), options=DstlOptions(persist_delay_s=0))
r = restore_backend([handle], storage, KeyGroupRange(0, 63), table="lmdb", local_directory=local)
print("done", flush=True)
r.close()
storage.close()
"""


def _child(store: Path, handle: str, local: Path, mode: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(store), handle, str(local),
                             str(local / operator_dir("op")), mode],
                            stdout=subprocess.PIPE, text=True, env=env)


@pytest.mark.parametrize("mode", ["before-rename", "after-rename", "random"])
def test_restore_killed_midway_leaves_no_valid_looking_table(tmp_path: Path, mode: str) -> None:
    store_dir = tmp_path / "store"
    storage = ChangelogStorage(store=LocalBlobStore(store_dir),
                               options=DstlOptions(persist_delay_s=0.0))
    model: Model = {}
    try:
        h = _build(storage, "op", ALL, "lmdb", 7, model, local=str(tmp_path / "writer"),
                   marker=True)
        local = tmp_path / "local"
        # a previous table with a marker is in place: a killed restore must not leave it (or
        # anything else) looking like a checkpoint's table
        prev = ChangelogKeyedStateBackend(storage, "op", ALL, MP, table="lmdb", options=FILE,
                                          local_directory=str(local))
        prev.tables.write_marker(_STALE)
        prev.close()
        delays = [0.0, 0.05, 0.1, 0.2, 0.3, 0.5] if mode == "random" else [None]
        for delay in delays:
            p = _child(store_dir, h.to_json(), local, mode if delay is None else "none")
            assert p.stdout is not None and p.stdout.readline().strip() == "restoring"
            if delay is not None:
                time.sleep(delay)
                p.send_signal(signal.SIGKILL)
            p.wait(60)
            if delay is None:
                assert p.returncode == -signal.SIGKILL
            _assert_no_marker(local, "op")
        # a later restore in the same directory works and removes the dead child's debris
        r = restore_backend([h], storage, ALL, table="lmdb", local_directory=str(local))
        assert _read_all(r) == model
        r.close()
        assert not [p for p in os.listdir(local) if p.startswith(STAGE_PREFIX)]
    finally:
        storage.close()


_STALE = b'{"stale": true}'


def _assert_no_marker(local: Path, op: str) -> None:
    """No table with a marker — except the previous table itself, untouched (a kill before the
    restore began: it holds the layout record and its marker and nothing else)."""
    env = local / operator_dir(op)
    if (env / "data.mdb").exists():
        with LmdbStateTable(str(env), ALL, readonly=True) as t:
            marker = t.read_marker()
            snap = t.snapshot()
            try:
                count = snap.entry_count()
            finally:
                snap.release()
            assert marker is None or (marker == _STALE and count == 2), \
                "a killed restore left a table with a marker"


# --------------------------------------------------------------------------- the option


def test_the_snapshot_format_option_is_checked_and_reaches_spark_conf() -> None:
    from dstl.errors import ConfigError, ConfigTypeError
    from dstl.spark.session_conf import backend_options_from as _backend_options_from

    assert BackendOptions().lmdb_snapshot_format == "file"
    conf = {"spark.dstl.backend.lmdb_snapshot_format": "entries"}
    assert _backend_options_from(conf).lmdb_snapshot_format == "entries"
    with pytest.raises(ConfigError, match="lmdb_snapshot_format"):
        _backend_options_from({"spark.dstl.backend.lmdb_snapshot_format": "files"})
    with pytest.raises(ConfigError, match="lmdb_snapshot_format"):
        BackendOptions(lmdb_snapshot_format="v2")
    with pytest.raises(ConfigTypeError, match="lmdb_snapshot_format"):
        BackendOptions(lmdb_snapshot_format=2)  # type: ignore[arg-type]


def test_entries_option_writes_v1_from_lmdb(storage: ChangelogStorage) -> None:
    model: Model = {}
    h = _build(storage, "op", ALL, "lmdb", 8, model, ENTRIES)
    assert _version(storage, h.materialized[0].key) == 1
    st = RestoreStats()
    r = restore_backend([h], storage, ALL, table="lmdb", stats=st)
    assert _read_all(r) == model and st["file_snapshots"] == 0
    r.close()


# --------------------------------------------------------------------------- chained rescaling


@pytest.mark.parametrize("chain", [(1, 2, 1), (2, 1, 2), (1, 2, 3, 1), (4, 3, 2, 4)])
@pytest.mark.parametrize("fmt", ["file", "entries"])
def test_chained_rescales_without_materialization(storage: ChangelogStorage, chain: tuple[int, ...],
                                                  fmt: str) -> None:
    """After a rescaling restore a backend's handle still names the snapshots and logs it was
    restored from, which cover more key groups than it owns; every later restore must read them
    only for the key groups of the handle that names them (a log replayed twice for the same
    key group doubles list appends)."""
    opts = FILE if fmt == "file" else ENTRIES
    model: Model = {}
    first = chain[0]
    handles = [_build(storage, f"s0/{i}", KeyGroupRange.of_operator(MP, first, i),
                      "lmdb" if i % 2 == 0 else "heap", 20 + i, model, opts)
               for i in range(first)]
    for step, n in enumerate(chain[1:], start=1):
        new_handles = []
        for j in range(n):
            kgs = KeyGroupRange.of_operator(MP, n, j)
            table = "heap" if (j + step) % 2 else "lmdb"
            r = restore_backend([h.to_json() for h in handles], storage, kgs, table=table,
                                operator_id=f"s{step}/{j}", options=opts)
            try:
                assert _read_all(r) == _in(model, kgs), f"step {step}: {table} {j} of {n}"
                mine = [k for k in KEYS if key_group_for(k.encode(), MP) in kgs]
                _workload(r, random.Random(step * 10 + j), 80, mine, model)
                new_handles.append(_checkpoint(r, 10 + step))
            finally:
                r.close()
        handles = [ChangelogStateBackendHandle.from_json(h.to_json()) for h in new_handles]
    last = restore_backend(handles, storage, ALL, table="lmdb", operator_id="end", options=opts)
    assert _read_all(last) == model
    last.close()


@pytest.mark.parametrize("dst", ["lmdb", "heap"])
def test_a_table_emptied_before_its_snapshot_restores_empty(storage: ChangelogStorage,
                                                           dst: str) -> None:
    b = ChangelogKeyedStateBackend(storage, "op", ALL, MP, table="lmdb", options=FILE)
    v = b.get_state(ValueStateDescriptor("v"))
    for k in KEYS[:20]:
        b.set_current_key(k)
        v.update(1)
    _checkpoint(b, 1)
    for k in KEYS[:20]:
        b.set_current_key(k)
        v.clear()
    _checkpoint(b, 2)
    assert b.materialize_now(WAIT) is not None
    h = _checkpoint(b, 3)
    b.close()
    assert _version(storage, h.materialized[0].key) == 2
    st = RestoreStats()
    r = restore_backend([h], storage, ALL, table=dst, stats=st)
    assert st["entries"] == 0 and st["file_snapshots"] == 1
    vr = r.get_state(ValueStateDescriptor("v"))
    for k in KEYS[:20]:
        r.set_current_key(k)
        assert vr.value() is None
    r.close()


_FSIZE_CHILD = r"""
import json, os, resource, signal, sys
from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.errors import LocalDiskFullError
from dstl.stores import LocalBlobStore
from restore.restore import restore_backend
store_dir, handle, local = sys.argv[1:4]
storage = ChangelogStorage(store=LocalBlobStore(store_dir), options=DstlOptions(persist_delay_s=0))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))
try:
    restore_backend([handle], storage, KeyGroupRange(0, 63), table="lmdb", local_directory=local)
except LocalDiskFullError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
else:
    print(json.dumps({"error": None}))
"""


def test_a_full_local_disk_while_staging_is_a_typed_error_and_leaves_nothing(
        tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    storage = ChangelogStorage(store=LocalBlobStore(store_dir),
                               options=DstlOptions(persist_delay_s=0.0))
    try:
        b = ChangelogKeyedStateBackend(storage, "op", ALL, MP, table="lmdb", options=FILE)
        v = b.get_state(ValueStateDescriptor("v"))
        with b.write_batch():
            for i in range(20_000):   # a data file of a few MB, above the child's 256 KiB limit
                b.set_current_key(f"key-{i}")
                v.update("x" * 64)
        _checkpoint(b, 1)
        assert b.materialize_now(WAIT) is not None
        h = _checkpoint(b, 2)
        b.close()
    finally:
        storage.close()
    local = tmp_path / "local"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", _FSIZE_CHILD, str(store_dir), h.to_json(),
                           str(local)], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["error"] == "LocalDiskFullError", result
    assert h.materialized[0].key in result["message"]
    assert not [p for p in os.listdir(local) if p.startswith(STAGE_PREFIX)]
    _assert_no_marker(local, "op")
