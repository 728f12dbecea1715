"""The column-wise state read (dstl.reader.columns, what the Spark source reads) gives the same
table as the row path (read_state_split + arrow.batches) and the job's dict model: every state
kind, heap and LMDB (v1 and v2 snapshots), before and after materializations, with a log after
the snapshot that changes, clears and extends snapshot entries, after rescales, key-group slices,
key and state filters; values that need the per-row JSON fallback next to the ints decoded by
byte pattern; the int decoder against pickle itself on canonical and damaged encodings."""

from __future__ import annotations

import math
import os
import pickle
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pa = pytest.importorskip("pyarrow")
np = pytest.importorskip("numpy")

from support.columnar import (  # noqa: E402
    column_table,
    read_state_columns,
    row_table,
    sorted_rows,
)
from support.state_job import MiniJob, _Borrowed, state_of  # noqa: E402

from dstl.checkpoint import CheckpointCoordinator  # noqa: E402
from dstl.errors import ConfigError, CorruptObjectError, UsageError  # noqa: E402
from dstl.keygroups import KeyGroupRange  # noqa: E402
from dstl.reader import (  # noqa: E402
    CheckpointCatalog,
    ReadOnlyBlobStore,
    ValueTypeError,
    plan_state_splits,
    task_states,
)
from dstl.reader.columns import int_values, read_state_batches  # noqa: E402
from dstl.storage import ChangelogStorage  # noqa: E402
from dstl.stores import open_store  # noqa: E402
from dstl.stores.base import BlobStore  # noqa: E402
from materializer.backend import ChangelogKeyedStateBackend  # noqa: E402
from materializer.codecs import PickleCodec  # noqa: E402
from materializer.states import (  # noqa: E402
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[BlobStore]:
    s = open_store(str(tmp_path / "state"))
    yield s
    s.close()


def _catalog(store: BlobStore) -> CheckpointCatalog:
    return CheckpointCatalog(ReadOnlyBlobStore(store), job_id="job")


def _same(catalog: CheckpointCatalog, cid: int | None, **kw: Any) -> list[Any]:
    """Both paths give the same rows (and the LMDB reader table too); the rows."""
    cols = sorted_rows(column_table(catalog, cid, **kw))
    assert cols == sorted_rows(row_table(catalog, cid, **kw)), f"checkpoint {cid} {kw}"
    return cols


@pytest.fixture(params=["pages", "pages in small pieces", "pages of a staged file"])
def listing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
            ) -> tuple[str, list[int]]:
    """How v2 files are listed: by their pages (also cut into runs of a few entries and bytes,
    and batches of a few rows), each decompressed into memory (the default) or, when larger
    than ``_IN_MEMORY_BYTES``, into a staged file; the counts of files read each way (in
    memory, staged)."""
    from dstl.reader import columns

    counts = [0, 0]
    mode = request.param

    def counted(fn: Any, staged: bool) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            assert staged == mode.endswith("staged file"), "decompressed the other way"
            counts[staged] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(columns, "file_snapshot_in_memory",
                        counted(columns.file_snapshot_in_memory, False))
    monkeypatch.setattr(columns, "stage_file_snapshot",
                        counted(columns.stage_file_snapshot, True))
    if mode.endswith("staged file"):
        monkeypatch.setattr(columns, "_IN_MEMORY_BYTES", 0)
    if mode == "pages in small pieces":
        monkeypatch.setattr(columns, "_RUN", 7)
        monkeypatch.setattr(columns, "_RUN_BYTES", 40)
        monkeypatch.setattr(columns, "_CHUNK", 5)
    return mode, counts


def _listed(listing: tuple[str, list[int]]) -> None:
    """Every v2 file was read the way the fixture says."""
    mode, (in_memory, staged) = listing
    assert (in_memory == 0 and staged > 0) if mode.endswith("staged file") \
        else (in_memory > 0 and staged == 0)


# --------------------------------------------------------------------------- the model job


@pytest.mark.parametrize("table", ["heap", "lmdb"])
@pytest.mark.parametrize("seed", [21, 22] if os.environ.get("DSTL_DEEP") == "1" else [21])
def test_columns_equal_rows_and_the_model_across_materializations_and_rescales(
        store: BlobStore, table: str, seed: int, listing: tuple[str, list[int]]) -> None:
    job = MiniJob(store, partitions=2, table=table, seed=seed, retained=8)
    try:
        job.run(150)
        job.checkpoint()                 # log only
        job.materialize()
        job.checkpoint()                 # snapshot only
        job.run(80)
        job.checkpoint()                 # snapshot + a log changing its entries
        job.rescale(3)
        job.run(60)
        job.checkpoint()                 # narrowed snapshots and logs of the old layout
        job.materialize(0)
        job.run(40)
        job.checkpoint()
        job.rescale(1)
        job.run(30)
        job.checkpoint()
        catalog = _catalog(store)
        ids = catalog.ids()
        assert len(ids) == 6
        for c in ids:
            rows = _same(catalog, c)
            assert rows, f"checkpoint {c} read nothing"
            assert state_of(read_state_columns(catalog, c)) == job.checkpoint_models[c]
            _same(catalog, c, max_key_groups=3)
        last = ids[-1]
        keys = sorted({k for (_, k, _) in job.checkpoint_models[last]})[:5]
        _same(catalog, last, keys=keys)
        _same(catalog, last, states=["attrs", "window"])
        _same(catalog, last, keys=keys[:2], states=["events"])
        assert sorted_rows(column_table(catalog, last)) == sorted_rows(
            row_table(catalog, last, table="lmdb"))
        if table == "lmdb":
            _listed(listing)
    finally:
        job.close()


# --------------------------------------------------------------------------- values


_INTS = [0, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, -1, -255, -256, -2**31, -2**31 - 1,
         2**40 + 7, -2**40, 2**63 - 1, -2**63, 2**63, -2**63 - 1, 2**64, 10**30]
_OTHERS: list[Any] = [True, False, 1.5, -0.0, math.inf, math.nan, "", "text", "caf\u00e9 \"q\"",
                      "x" * 300, b"\x00\xff", [1, "a", None], (1, 2), {"a": 1}, {1: "x"},
                      {"$b64": "tag"}, [[1, [2]]], 12.0,
                      "y" * 9000]  # an LMDB overflow value in a v2 file


def _one_backend(store: BlobStore, table: str) -> tuple[ChangelogStorage,
                                                        ChangelogKeyedStateBackend]:
    storage = ChangelogStorage(store=_Borrowed(store))
    backend = ChangelogKeyedStateBackend(storage, "job/p0", KeyGroupRange(0, 15), 16,
                                         table=table, auto_materialize=False)
    return storage, backend


def _commit(store: BlobStore, backend: ChangelogKeyedStateBackend, cid: int) -> None:
    coordinator = CheckpointCoordinator(store, job_id="job", retained=10)
    coordinator.trigger(["p0"], checkpoint_id=cid)
    h = backend.snapshot(cid).result(timeout=30)
    coordinator.acknowledge(cid, "p0", h.to_json_obj(), h.referenced_keys(), h.full_size,
                            h.incremental_size)
    coordinator.close()


def _fill(backend: ChangelogKeyedStateBackend, st: dict[str, Any], rng: random.Random,
          keys: list[str | bytes], model: dict[Any, Any]) -> None:
    values = _INTS + _OTHERS
    for i, k in enumerate(keys):
        backend.set_current_key(k)
        backend.set_current_namespace(None)
        v = values[i % len(values)]
        st["v"].update(v)
        model[("v", k, None)] = v
        st["total"].add(rng.choice(_INTS))
        st["events"].add(rng.choice(values))
        st["attrs"].put(rng.choice([1, "u", (2, "t"), b"b"]), rng.choice(values))
        ns = ("w", i % 3)
        backend.set_current_namespace(ns)
        st["v"].update(rng.choice(_INTS))
        backend.set_current_namespace(None)


def _states(backend: ChangelogKeyedStateBackend) -> dict[str, Any]:
    return {"v": backend.get_state(ValueStateDescriptor("v")),
            "total": backend.get_state(ReducingStateDescriptor("total", lambda a, b: a + b)),
            "events": backend.get_state(ListStateDescriptor("events")),
            "attrs": backend.get_state(MapStateDescriptor("attrs")),
            "p": backend.get_state(ValueStateDescriptor("p", serializer=PickleCodec()))}


def _change_snapshot_entries(backend: ChangelogKeyedStateBackend, st: dict[str, Any],
                             keys: list[str | bytes]) -> None:
    """A log after the snapshot: updates, clears, list appends and map changes on entries the
    snapshot holds, and new keys."""
    for i, k in enumerate(keys):
        backend.set_current_key(k)
        if i % 5 == 0:
            st["v"].clear()
        elif i % 5 == 1:
            st["v"].update(-7 - i)
        st["events"].add(i)
        if i % 4 == 0:
            st["attrs"].remove(1)
            st["attrs"].remove("u")
            st["attrs"].remove((2, "t"))
            st["attrs"].remove(b"b")
        else:
            st["attrs"].put("late", 2**70)
        st["p"].update(frozenset({i}))
    for j in range(5):
        backend.set_current_key(f"new{j}")
        st["v"].update(2**33 + j)
        st["events"].add("n")


@pytest.mark.parametrize("table", ["heap", "lmdb"])
def test_every_value_shape_and_the_json_fallback_through_a_snapshot_and_its_log(
        store: BlobStore, table: str, listing: tuple[str, list[int]]) -> None:
    storage, backend = _one_backend(store, table)
    rng = random.Random(3)
    keys: list[str | bytes] = [f"k{i}" for i in range(60)] + [b"\xff\xfe", b"\x00bin", "\u00e9"]
    model: dict[Any, Any] = {}
    try:
        st = _states(backend)
        _fill(backend, st, rng, keys, model)
        _commit(store, backend, 0)                       # log only
        assert backend.materialize_now(timeout_s=30) is not None
        _commit(store, backend, 1)                       # snapshot only
        _change_snapshot_entries(backend, st, keys[::3])
        _commit(store, backend, 2)                       # snapshot + log
    finally:
        backend.close()
        storage.close()
    catalog = _catalog(store)
    with pytest.raises(UsageError, match="pickle"):
        list(column_table(catalog, 2))
    for cid in (0, 1, 2):
        rows = _same(catalog, cid, allow_pickle=True)
        by_key = {(r[5], r[4], r[7], r[8]): r for r in rows}  # state, key bytes, ns, user key
        assert len(by_key) == len(rows)
        for (state, k, ns), v in model.items():
            if cid == 2 and k in keys[::3]:
                continue
            kb = k.encode() if isinstance(k, str) else k
            got = read_value(by_key[(state, kb, ns, None)][9])
            assert got == v or (isinstance(v, float) and math.isnan(v) and math.isnan(got))
        text_of = {r[4]: r[3] for r in rows}
        assert text_of[b"\xff\xfe"] is None and text_of["\u00e9".encode()] == "\u00e9"
    _same(catalog, 2, allow_pickle=True, keys=[b"\xff\xfe", "k3", "new1"])
    _same(catalog, 2, allow_pickle=True, states=["v"])
    # only some columns, in any order: the same values as those of the whole rows
    full = column_table(catalog, 2, allow_pickle=True)
    for columns in (["value", "key"], ["user_key", "namespace", "kind", "state"],
                    ["key_bytes", "key_group", "partition", "checkpoint", "value"]):
        got = column_table(catalog, 2, allow_pickle=True, columns=columns)
        assert got.column_names == columns
        assert sorted_rows(got) == sorted_rows(full.select(columns)), columns
    if table == "lmdb":
        _listed(listing)


def _split_of_keys(store: BlobStore, n: int) -> Any:
    storage, backend = _one_backend(store, "heap")
    try:
        for i in range(n):
            backend.set_current_key(f"k{i}")
            backend.get_state(ValueStateDescriptor("v")).update(i)
        _commit(store, backend, 0)
    finally:
        backend.close()
        storage.close()
    return plan_state_splits(0, task_states(_catalog(store).manifest(0)))[0]


@pytest.mark.parametrize("columns", [[], ["key", "key"], ["owner"], "key", ("key", 1)])
def test_columns_not_of_the_state_schema_are_a_config_error(store: BlobStore,
                                                            columns: Any) -> None:
    split = _split_of_keys(store, 1)
    with pytest.raises(ConfigError, match=r"read_state_batches\.columns=.*distinct columns of "
                                          r"the state schema \(checkpoint, partition"):
        read_state_batches(store, split, columns=columns)


def test_typed_values_equal_the_row_paths_and_a_value_that_does_not_convert_is_named(store: BlobStore) -> None:
    storage, backend = _one_backend(store, "heap")
    small = [0, 1, 255, 256, -1, -256, 2**31, -2**40, 2**63 - 1, -2**63]
    try:
        st = {"n": backend.get_state(ValueStateDescriptor("n")),
              "sum": backend.get_state(ReducingStateDescriptor("sum", lambda a, b: a + b)),
              "m": backend.get_state(MapStateDescriptor("m")),
              "l": backend.get_state(ListStateDescriptor("l"))}
        for i in range(300):
            backend.set_current_key(f"k{i}")
            st["n"].update(small[i % len(small)])
            st["sum"].add(i)
            st["m"].put(f"u{i % 4}", i * 1000)
            st["l"].add(i)
        _commit(store, backend, 0)
        assert backend.materialize_now(timeout_s=30) is not None
        for i in range(0, 300, 7):  # a log after the snapshot
            backend.set_current_key(f"k{i}")
            st["n"].update(-i)
            st["sum"].add(10)
            st["m"].put("new", i)
        backend.set_current_key("fresh")
        st["n"].update(2**62)
        _commit(store, backend, 1)
    finally:
        backend.close()
        storage.close()
    catalog = _catalog(store)
    for states, kind in ((["n", "sum"], pa.int64()), (["sum"], pa.float64()),
                         (["sum"], pa.int32()), (["m"], pa.int64()),
                         (["l"], pa.list_(pa.int64())), (["n", "sum", "m"], pa.decimal128(38, 0))):
        typed = ("typed_value", kind)
        cols = column_table(catalog, 1, states=states, typed=typed)
        assert cols.schema.field("typed_value").type == kind
        assert sorted_rows(cols) == sorted_rows(row_table(catalog, 1, states=states,
                                                          typed=typed)), (states, kind)
        assert cols.num_rows >= 300
    # a value that does not convert: one typed error in both paths, naming the state, a key
    # and the value (an int that does not fit included)
    for states, kind, value in ((["n"], pa.int32(), r"-?\d{10,}"), (["n"], pa.string(), r"-?\d+"),
                                (["sum"], pa.int8(), r"\d{3,}"), (["m"], pa.bool_(), r"\d+"),
                                (["n"], pa.uint64(), r"-\d+")):
        typed = ("typed_value", kind)
        shown = (rf"state '{states[0]}', key '(k\d+|fresh)': value {value} \(int\) does not "
                 rf"convert to typed_value {kind} \(.+\); ask for a type every value")
        with pytest.raises(ValueTypeError, match=shown) as rows_err:
            row_table(catalog, 1, states=states, typed=typed)
        with pytest.raises(ValueTypeError, match=shown) as cols_err:
            column_table(catalog, 1, states=states, typed=typed)
        for err in (rows_err.value, cols_err.value):
            assert (err.state, err.type) == (states[0], kind)
            assert isinstance(err.value, int) and isinstance(err.key, str)
    # only the typed column, or it between others
    only = column_table(catalog, 1, states=["n"], typed=("typed_value", pa.int64()),
                        columns=["typed_value", "key"])
    assert only.column_names == ["typed_value", "key"]
    split = plan_state_splits(1, task_states(catalog.manifest(1)))[0]
    for bad in (("value", pa.int64()), ("t", "bigint"), "t"):
        with pytest.raises(ConfigError, match=r"read_state_batches\.typed="):
            read_state_batches(store, split, typed=bad)  # type: ignore[arg-type]


def test_batches_have_at_most_batch_rows_rows(store: BlobStore) -> None:
    split = _split_of_keys(store, 20)
    whole = list(read_state_batches(store, split, columns=["key", "value"]))
    assert [b.num_rows for b in whole] == [20]
    small = list(read_state_batches(store, split, columns=["key", "value"], batch_rows=7))
    assert [b.num_rows for b in small] == [7, 7, 6]
    assert pa.Table.from_batches(small).equals(pa.Table.from_batches(whole))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match=r"read_state_batches\.batch_rows"):
            read_state_batches(store, split, batch_rows=bad)


def read_value(text: str | None) -> Any:
    from dstl.reader import from_json

    return from_json(text)


# --------------------------------------------------------------------------- the int decoder


def _check_ints(blobs: list[bytes]) -> int:
    """int_values agrees with pickle on every blob it accepts; how many it accepted."""
    ok, values = int_values(pa.array(blobs, type=pa.binary()))
    for blob, accepted, value in zip(blobs, ok.tolist(), values.tolist(), strict=True):
        if accepted:
            assert pickle.loads(blob) == value and type(pickle.loads(blob)) is int, blob.hex()
    return int(ok.sum())


def test_int_decoder_takes_every_canonical_int_of_64_bits() -> None:
    rng = random.Random(9)
    ints = _INTS + [rng.randrange(-2**63, 2**63) for _ in range(2000)] + [
        rng.randrange(-2**17, 2**17) for _ in range(2000)] + list(range(-300, 70000, 97))
    blobs = [pickle.dumps(v, protocol=5) for v in ints]
    ok, values = int_values(pa.array(blobs, type=pa.binary()))
    for v, accepted, got in zip(ints, ok.tolist(), values.tolist(), strict=True):
        assert accepted == (-2**63 <= v < 2**63), v
        if accepted:
            assert got == v
    # sliced arrays (batches are slices of larger arrays)
    arr = pa.array(blobs, type=pa.binary()).slice(len(_INTS), 500)
    ok2, values2 = int_values(arr)
    assert ok2.all() and values2.tolist() == ints[len(_INTS):len(_INTS) + 500]


def test_int_decoder_refuses_what_is_not_exactly_an_int_pickle() -> None:
    rng = random.Random(10)
    good = [pickle.dumps(v, protocol=5) for v in _INTS]
    others = [pickle.dumps(v, protocol=p) for v in _OTHERS for p in (2, 4, 5)]
    others += [b"", b"\x80", b"\x80\x05K\x01", b"\x80\x05K\x01.x", pickle.dumps(7, protocol=2),
               b"\x80\x04K\x01.", b"\x80\x05J\x01\x00\x00\x00.", b"\x80\x05\x8a\x01\x05."]
    assert _check_ints(others) == 0
    damaged = []
    for blob in good * 40:
        b = bytearray(blob)
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
        damaged.append(bytes(b))
        damaged.append(blob[:rng.randrange(len(blob))])
        damaged.append(blob + bytes([rng.randrange(256)]))
    accepted = []
    for blob in damaged:  # anything accepted must decode to exactly that int (pickle decides)
        try:
            pickle.loads(blob)
        except Exception:
            assert _check_ints([blob]) == 0, blob.hex()
            continue
        accepted.append(blob)
    _check_ints(accepted)


def test_int_decoder_on_values_of_one_length_some_of_which_are_not_ints() -> None:
    # values of one length take the one-shape path (BININT1 from one word): every byte of the
    # head and the STOP still decides, position by position, also in a sliced array
    rng = random.Random(12)
    for v in (0, 7, 255, 256, 65535, 65536, -1, 2**31, -2**63):  # 5, 15, 17, 14+w bytes
        blob = pickle.dumps(v, protocol=5)
        for trial in range(60):
            blobs = [blob] * rng.randrange(1, 40)
            for _ in range(rng.randrange(0, 4)):  # damaged values of the same length
                b = bytearray(blob)
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
                blobs.insert(rng.randrange(len(blobs) + 1), bytes(b))
            first = rng.randrange(0, 3)
            arr = pa.array([b"\x80\x05K\x01."] * first + blobs, type=pa.binary()).slice(first)
            ok, values = int_values(arr)
            for b, accepted, got in zip(blobs, ok.tolist(), values.tolist(), strict=True):
                try:
                    want = pickle.loads(b)
                except Exception:
                    want = None
                if accepted:
                    assert type(want) is int and got == want, b.hex()
                else:
                    assert got == 0 and (b != blob), (v, trial, b.hex())
            assert ok.sum() >= blobs.count(blob)
    assert [len(a) for a in int_values(pa.array([], type=pa.binary()))] == [0, 0]
    ok, values = int_values(pa.array([b"\x80\x05K\x01x"] * 3, type=pa.binary()))
    assert not ok.any() and not values.any()


def test_int_decoder_on_values_of_one_length_of_several_shapes_and_ints() -> None:
    # values of one length are read as one matrix of bytes: every int of each shape of that
    # length, and two shapes of one length in one array (17 bytes: BININT and a LONG1 of 3
    # bytes, which pickle writes for no int but decodes), each row decoded as pickle does
    rng = random.Random(13)

    def long1(v: int, width: int) -> bytes:  # a framed LONG1 of ``width`` bytes
        body = b"\x8a" + bytes([width]) + v.to_bytes(width, "little", signed=True) + b"."
        return b"\x80\x05\x95" + (len(body)).to_bytes(8, "little") + body

    groups = [[pickle.dumps(rng.randrange(0, 256), protocol=5) for _ in range(300)],
              [pickle.dumps(rng.randrange(256, 65536), protocol=5) for _ in range(300)],
              [pickle.dumps(rng.randrange(-2**31, 2**31), protocol=5) for _ in range(300)]
              + [long1(rng.randrange(-2**23, 2**23), 3) for _ in range(300)],
              [pickle.dumps(rng.randrange(2**55, 2**63), protocol=5) for _ in range(300)]]
    for blobs in groups:
        rng.shuffle(blobs)
        assert len({len(b) for b in blobs}) == 1
        for arr in (pa.array(blobs, type=pa.binary()),
                    pa.array([b"x", *blobs], type=pa.binary()).slice(1)):
            ok, values = int_values(arr)
            assert ok.all(), [b.hex() for b, a in zip(blobs, ok.tolist(), strict=True) if not a]
            assert values.tolist() == [pickle.loads(b) for b in blobs]


def test_int_text_is_the_decimal_text_of_every_int() -> None:
    from dstl.reader.columns import _int_text

    rng = random.Random(13)
    cases = [[], [0], [255], [256], [-1], list(range(256)), [0, 255, 256], [-2**63, 2**63 - 1],
             [rng.randrange(256) for _ in range(3000)], [rng.randrange(-300, 300) for _ in
                                                         range(3000)]]
    for ints in cases:
        got = _int_text(np.array(ints, dtype=np.int64))
        assert got.type == pa.string() and got.to_pylist() == [str(v) for v in ints], ints[:5]


def test_a_damaged_value_fails_as_in_the_row_path() -> None:
    from dstl.reader.columns import Run, run_batches
    from dstl.reader.image import state_info

    info = state_info({"name": "v", "kind": "value"}, False, "snap")
    for bad in (b"\x80\x05K\x01", b"\x80\x05\x95\x04\x00\x00\x00\x00\x00\x00\x00M\x01",
                b"\x80\x05c__builtin__\neval\n."):
        run = Run(info, pa.array([1, 1], type=pa.int32()), pa.array([b"a", b"b"]),
                  pa.array([b"", b""]), pa.array([pickle.dumps(3, protocol=5), bad]))
        with pytest.raises(CorruptObjectError) as exc:
            list(run_batches([run], 0, "p0", None, None))
        with pytest.raises(CorruptObjectError) as row_exc:
            info.shape.from_bytes(bad)
        assert str(exc.value) == str(row_exc.value)


def _counts(job: MiniJob, keys: list[str]) -> None:
    """The job's count operation (set, sometimes clear) on each of ``keys``."""
    for key in keys:
        p = job.partition_of(key)
        b, st = job.backends[p], job.states[p]
        b.set_current_key(key)
        b.set_current_namespace(None)
        job._op_count(key, b, st)


def test_a_file_of_one_key_and_value_size_is_read_in_one_gather(
        store: BlobStore, monkeypatch: pytest.MonkeyPatch) -> None:
    # a counter's v2 snapshot: raw keys of one size (fixed-width keys, no namespace), values
    # of one size (small ints); its entries are gathered as one item each, and read as the
    # row path reads them, with a log after the snapshot that updates and clears some
    from dstl.reader import columns

    used: list[bool] = []
    fixed = columns._fixed_runs

    def spy(*args: Any) -> Any:
        got = fixed(*args)
        used.append(got is not None)
        return got

    monkeypatch.setattr(columns, "_fixed_runs", spy)
    job = MiniJob(store, partitions=2, table="lmdb", seed=31, retained=4)
    try:
        keys = [f"u{i:04d}" for i in range(600)]
        _counts(job, keys + keys[::3])
        job.checkpoint()
        job.materialize()
        _counts(job, keys[::7] + [f"u{i:04d}" for i in range(600, 700)])
        cid = job.checkpoint()
    finally:
        job.close()
    _same(_catalog(store), cid)
    assert state_of(read_state_columns(_catalog(store), cid)) == job.checkpoint_models[cid]
    assert used and all(used)


def test_one_gather_of_entries_gives_what_cutting_each_entry_gives() -> None:
    # entries laid out as LMDB nodes hold them (raw key, then the value): the one-gather cut
    # equals the entry-by-entry cut, and declines (None) raw keys of one size whose key and
    # namespace lengths differ
    import struct

    from dstl.reader.columns import _fixed_runs, _prefixed_runs, _slices, _words
    from dstl.reader.image import state_info

    states = {1: state_info({"name": "v", "kind": "value"}, False, "snap"),
              2: state_info({"name": "w", "kind": "value"}, False, "snap")}
    rng = random.Random(5)

    def layout(entries: list[tuple[int, int, bytes, bytes, bytes]]) -> tuple[np.ndarray, Any]:
        data, starts = bytearray(b"\xee" * 3), []
        for kg, sid, k, ns, v in entries:
            data += b"\xee" * rng.randrange(3)  # nodes are apart in a file
            starts.append(len(data))
            data += struct.pack(">HHI", kg, sid, len(k)) + k + ns + v
        return np.frombuffer(bytes(data + b"\xee" * 2), dtype=np.uint8), np.array(starts)

    def heads(data: np.ndarray, starts: np.ndarray) -> np.ndarray:  # EntrySpans.key_head
        return _words(data, ">u8")[starts]

    def cut(runs: Any) -> list[tuple[Any, ...]]:
        return [(r.info.name, r.kg.to_pylist(), r.kb.to_pylist(), r.nb.to_pylist(),
                 r.vb.to_pylist()) for r in runs]

    for trial in range(40):
        n = rng.randrange(1, 50)
        kl, vl = rng.randrange(0, 12), rng.randrange(0, 9)
        entries = [(rng.randrange(128), rng.choice([1, 2]), bytes(rng.getrandbits(8)
                    for _ in range(kl)), b"", bytes(rng.getrandbits(8) for _ in range(vl)))
                   for _ in range(n)]
        data, starts = layout(entries)
        size = np.full(n, 8 + kl, dtype=np.int64)
        want = cut(_prefixed_runs(states, data, starts, size,
                                  _slices(data, starts + 8 + kl, np.full(n, vl)), "snap"))
        got = _fixed_runs(states, data, starts, 8 + kl, vl, "snap", heads(data, starts))
        assert got is not None and cut(got) == want, trial
    # one raw-key size, two splits of it into key and namespace: declined
    data, starts = layout([(1, 1, b"ab", b"cde", b"v"), (1, 1, b"abc", b"de", b"v")])
    assert _fixed_runs(states, data, starts, 13, 1, "snap", heads(data, starts)) is None
    with pytest.raises(CorruptObjectError, match="shorter than its prefix"):
        _fixed_runs(states, data, starts, 7, 1, "snap", heads(data, starts))


# --------------------------------------------------------------------------- the log overlay


class _Records:
    """A log reader over hand-made records (key group, payload), for the overlay."""

    log_id = "job/p0"

    def __init__(self, records: list[tuple[int, bytes]]) -> None:
        self.records = records

    def read(self, handle: Any, key_groups: Any = None) -> Iterator[tuple[int, bytes]]:
        return iter(self.records)

    def read_blocks(self, handle: Any, key_groups: Any = None) -> Iterator[tuple[Any, bytes,
                                                                                  list[Any]]]:
        """One change set per record, so the records keep their order across key groups."""
        import struct
        from types import SimpleNamespace

        from dstl.segment import body_blocks, build_change_set

        for sqn, (kg, payload) in enumerate(self.records):
            body = build_change_set(self.log_id, sqn, {kg: struct.pack(">I", len(payload))
                                                       + payload}, 1, len(payload)).body
            yield (SimpleNamespace(key="seg", offset=sqn), body,
                   body_blocks(body, key_groups=key_groups))


def _meta(sid: int, name: str, kind: str = "value") -> tuple[int, bytes]:
    from materializer.changes import encode_metadata

    return -1, encode_metadata(sid, {"name": name, "kind": kind, "value_codec": "safe",
                                     "key_codec": "safe" if kind == "map" else None})


def _change(kg: int, op: int, sid: int, key: bytes, value: Any, ns: bytes = b"") -> tuple[int,
                                                                                         bytes]:
    import struct

    payload = pickle.dumps(value, protocol=5) if value is not None else b""
    return kg, (struct.pack(">BHI", op, sid, len(key)) + key + struct.pack(">I", len(ns)) + ns
                + payload)


def _overlay_rows(records: list[tuple[int, bytes]]) -> list[tuple[Any, ...]]:
    from dstl.reader.columns import _Overlay, run_batches

    overlay = _Overlay(False)
    log = _Records(records)
    overlay.replay(log, log, None)  # type: ignore[arg-type]
    t = pa.Table.from_batches(list(run_batches(overlay.rest(), 0, "p0", None, None)))
    return sorted(((r["state"], r["key_bytes"], r["value"]) for r in t.to_pylist()), key=repr)


def _image_rows(records: list[tuple[int, bytes]]) -> list[tuple[Any, ...]]:
    from dstl.reader.image import StateImage
    from dstl.reader.rows import to_json

    image = StateImage(False)
    log = _Records(records)
    image.replay(log, log, range(16))  # type: ignore[arg-type]
    return sorted(((info.name, kb, to_json(info.shape.from_bytes(vb)))
                   for info, _, kb, _, vb in image.rows()), key=repr)


def test_the_overlay_replays_like_the_image_also_a_log_that_redefines_a_state_id() -> None:
    from materializer.changes import ADD_ELEMENT, CLEAR, SET

    plain = [_meta(0, "a"), _change(1, SET, 0, b"k1", 5), _change(2, SET, 0, b"k2", 7),
             _change(1, SET, 0, b"k1", 6), _change(2, CLEAR, 0, b"k2", None),
             _meta(1, "l", "list"), _change(3, ADD_ELEMENT, 1, b"k3", "x"),
             _change(3, ADD_ELEMENT, 1, b"k3", "y")]
    assert _overlay_rows(plain) == _image_rows(plain) == [
        ("a", b"k1", "6"), ("l", b"k3", '["x","y"]')]
    # state id 0 names another state half-way: the columns path hands the log to the rows path
    redefined = [_meta(0, "a"), _change(1, SET, 0, b"k1", 5), _meta(0, "b"),
                 _change(1, SET, 0, b"k1", 9), _change(1, SET, 0, b"k2", 1)]
    assert _overlay_rows(redefined) == _image_rows(redefined) == [
        ("a", b"k1", "5"), ("b", b"k1", "9"), ("b", b"k2", "1")]


def _snapshot_through(snapshot: list[tuple[int, bytes, bytes, int]],
                      records: list[tuple[int, bytes]]) -> tuple[list[Any], list[Any]]:
    """The entries of a value state's snapshot run ``(kg, key, namespace, value)`` with a log
    over it: through the overlay (columns), and through the image (rows: the reference)."""
    from dstl.reader.columns import Run, _Overlay
    from dstl.reader.image import StateImage

    overlay = _Overlay(False)
    log = _Records(records)
    overlay.replay(log, log, None)  # type: ignore[arg-type]
    info = overlay.image.states["a"]
    run = Run(info, pa.array([e[0] for e in snapshot], pa.int32()),
              pa.array([e[1] for e in snapshot], pa.binary()),
              pa.array([e[2] for e in snapshot], pa.binary()),
              pa.array([pickle.dumps(e[3], protocol=5) for e in snapshot], pa.binary()))
    got = [(kg, kb, nb, pickle.loads(vb)) for r in [*overlay.through(run), *overlay.rest()]
           for kg, kb, nb, vb in zip(r.kg.to_pylist(), r.kb.to_pylist(), r.nb.to_pylist(),
                                     r.vb.to_pylist(), strict=True)]
    image = StateImage(False)
    for kg, kb, nb, v in snapshot:
        image.entries[("a", kg, kb, nb)] = pickle.dumps(v, protocol=5)
    image.replay(log, log, range(16))  # type: ignore[arg-type]
    want = [(kg, kb, nb, pickle.loads(vb)) for _, kg, kb, nb, vb in image.rows()]
    return sorted(got), sorted(want)


def test_a_snapshot_run_through_a_log_of_updates_drops_exactly_the_entries_it_changed() -> None:
    """Key bytes alone do not name an entry: the namespace and the key group do too. A log of
    counters (each key once, default namespace) is matched by key bytes and then compared; any
    other log with an anti-join. Both give the row path's entries."""
    from materializer.changes import CLEAR, SET

    snapshot = [(1, b"k1", b"", 1), (1, b"k1", b"ns", 2), (2, b"k2", b"", 3), (5, b"k5", b"", 9),
                (3, b"k3", b"", 4), (7, b"k7", b"", 5)]
    logs = {
        # each key bytes once, default namespace: k5 under another key group (a forged log)
        # is another entry, the snapshot's stays
        "counters": [_meta(0, "a"), _change(1, SET, 0, b"k1", 10), _change(2, CLEAR, 0, b"k2", None),
                     _change(4, SET, 0, b"k5", 7), _change(1, SET, 0, b"k1", 11)],
        "namespaced": [_meta(0, "a"), _change(1, SET, 0, b"k1", 20, b"ns"),
                       _change(3, SET, 0, b"k3", 30)],
        "same key bytes twice": [_meta(0, "a"), _change(1, SET, 0, b"k1", 11),
                                 _change(6, SET, 0, b"k1", 12), _change(7, CLEAR, 0, b"k7", None)],
        "new keys only": [_meta(0, "a"), _change(8, SET, 0, b"k8", 1)],
        # each key bytes changed once (every change is its entry's last: no group-by), one of
        # them under another key group than the snapshot's entry
        "each key bytes once": [_meta(0, "a"), _change(1, SET, 0, b"k1", 10),
                                _change(2, CLEAR, 0, b"k2", None), _change(4, SET, 0, b"k5", 7),
                                _change(9, SET, 0, b"k9", 1)],
    }
    for name, records in logs.items():
        got, want = _snapshot_through(snapshot, records)
        assert got == want, name
    got, _ = _snapshot_through(snapshot, logs["counters"])
    assert (1, b"k1", b"", 11) in got and (5, b"k5", b"", 9) in got and (4, b"k5", b"", 7) in got
    assert not [e for e in got if e[1] == b"k2"] and (1, b"k1", b"ns", 2) in got


def test_the_overlay_refuses_what_the_image_refuses() -> None:
    from materializer.changes import ADD_ELEMENT, SET

    cases = [
        [_meta(0, "a"), _change(1, ADD_ELEMENT, 0, b"k", 1)],        # a list op on a value
        [_change(1, SET, 0, b"k", 1), _meta(0, "a")],                # before its metadata
        [_meta(0, "a"), _change(1, SET, 3, b"k", 1)],                # an id never described
        [_meta(0, "a"), (1, b"\x01\x00\x00\x00\x00\x00\x09k")],      # key past the record
        [_meta(0, "a"), (1, b"\x01\x00")],                           # shorter than its header
        [_meta(0, "a"), (1, b"\x01\x00\x00\x00\x00\x00\x01k\x00\x00\x00\x05")],  # namespace
    ]
    for records in cases:
        with pytest.raises(CorruptObjectError) as want:
            _image_rows(records)
        with pytest.raises(CorruptObjectError) as got:
            _overlay_rows(records)
        assert type(got.value) is type(want.value), records
        if "op code" in str(want.value) or "metadata record" in str(want.value):
            assert str(got.value) == str(want.value)


# --------------------------------------------------------------------------- the log's framing


class _Bodies:
    """Change-set bodies as a log reader: ``read`` walks them change by change (the reference,
    :func:`dstl.segment.iter_body_changes`), ``read_blocks`` by block (what the columns use)."""

    def __init__(self, bodies: list[bytes]) -> None:
        self.bodies = bodies

    def read(self, handle: Any, key_groups: Any = None) -> Iterator[tuple[int, bytes]]:
        from dstl.segment import iter_body_changes

        for i, body in enumerate(self.bodies):
            yield from iter_body_changes(body, key=f"seg{i}", offset=i, key_groups=key_groups)

    def read_blocks(self, handle: Any, key_groups: Any = None) -> Iterator[tuple[Any, bytes,
                                                                                  list[Any]]]:
        from types import SimpleNamespace

        from dstl.segment import body_blocks

        for i, body in enumerate(self.bodies):
            yield (SimpleNamespace(key=f"seg{i}", offset=i), body,
                   body_blocks(body, key=f"seg{i}", offset=i, key_groups=key_groups))


def _framed(changes: list[bytes]) -> bytes:
    import struct

    return b"".join(struct.pack(">I", len(c)) + c for c in changes)


def _body(blocks: dict[int, bytes], sqn: int = 0) -> bytes:
    from dstl.segment import build_change_set

    return build_change_set("job/p0", sqn, blocks, 0, 0).body


def _same_as_the_reference(bodies: list[bytes], key_groups: Any = None) -> None:
    from dstl.reader.columns import log_columns

    log = _Bodies(bodies)
    try:
        want: Any = list(log.read(None, key_groups))
    except CorruptObjectError as exc:
        with pytest.raises(CorruptObjectError) as got:
            log_columns(log, None, key_groups)  # type: ignore[arg-type]
        assert (type(got.value), str(got.value)) == (type(exc), str(exc))
        return
    kgs, payloads = log_columns(log, None, key_groups)  # type: ignore[arg-type]
    assert list(zip(kgs.tolist(), payloads.to_pylist(), strict=True)) == want


def test_log_columns_cut_changes_like_the_per_change_walk() -> None:
    from materializer.changes import CLEAR, SET

    def sets(n: int, value: Any = 1, op: int = SET, ns: bytes = b"") -> list[bytes]:
        return [_change(0, op, 0, b"k%04d" % i, value, ns)[1] for i in range(n)]

    uniform = sets(40)
    cases = {
        "uniform": {-1: _framed([_meta(0, "a")[1]]), 3: _framed(uniform), 5: _framed(sets(9))},
        "one CLEAR in a uniform run": {3: _framed(uniform[:20] + sets(1, None, CLEAR)
                                                  + uniform[21:])},
        "a namespace": {3: _framed(uniform[:-1] + sets(1, ns=b"n"))},
        "values of two widths": {3: _framed(uniform + sets(5, 1 << 20))},
        "below the uniform minimum": {3: _framed(sets(7))},
        "empty payloads": {3: _framed([b""] * 12), 4: b""},
        "a uniform head with a short tail": {3: _framed(uniform) + b"\x00\x00\x00"},
        "a uniform run then one cut short": {3: _framed(uniform) + _framed(sets(1))[:-2]},
        "a length past the block": {3: _framed(sets(10))[:-1]},
        "a length field cut": {3: b"\x00\x00"},
    }
    for blocks in cases.values():  # the names say what each case is
        body = _body(blocks)
        _same_as_the_reference([body])
        _same_as_the_reference([body, _body(blocks, 1)], key_groups={3})
        _same_as_the_reference([body], key_groups=set())
    assert _Bodies([]).bodies == []
    _same_as_the_reference([])


def test_log_columns_on_random_and_damaged_blocks() -> None:
    import random

    from materializer.changes import CLEAR, SET

    rnd = random.Random(16)
    for trial in range(300):
        blocks: dict[int, bytes] = {}
        for kg in rnd.sample(range(-1, 12), rnd.randint(0, 5)):
            width = rnd.choice([1, 2, 300])
            changes = [_change(kg, rnd.choice([SET, SET, SET, CLEAR]), rnd.randint(0, 2),
                               b"k%0*d" % (rnd.choice([4, 4, 5]), i),
                               rnd.choice([1, 1, width, -width, "s" * rnd.randint(0, 3)]))[1]
                       for i in range(rnd.choice([0, 3, 8, 9, 30]))]
            raw = bytearray(_framed(changes))
            if raw and trial % 3 == 0:  # a flipped byte, then maybe a cut: framing damage
                raw[rnd.randrange(len(raw))] ^= 1 << rnd.randrange(8)
                if rnd.random() < 0.5:
                    del raw[rnd.randrange(len(raw)):]
            blocks[kg] = bytes(raw)
        _same_as_the_reference([_body(blocks, 0), _body(blocks, 1)],
                               key_groups=None if trial % 2 else set(range(0, 12, 2)))


def test_slices_of_one_width_and_of_many_equal_python_slicing() -> None:
    import numpy as np

    from dstl.reader.columns import _slices

    rnd = np.random.default_rng(16)
    whole = rnd.integers(0, 256, 4096, dtype=np.uint8)
    for data in (whole, whole[3:1000], np.frombuffer(bytes(whole[:64]), dtype=np.uint8)):
        raw = data.tobytes()
        for width in (*range(1, 42), 0):
            for n in (0, 1, 5, 200):
                if width > len(data):
                    continue
                starts = rnd.integers(0, len(data) - width + 1, n).astype(np.int64)
                starts[:min(n, 2)] = [0, len(data) - width][:min(n, 2)]  # both ends
                for lengths in (np.full(n, width, dtype=np.int64),
                                rnd.integers(0, width + 1, n).astype(np.int64)):
                    got = _slices(data, starts, lengths).to_pylist()
                    assert got == [raw[s:s + ln] for s, ln in zip(starts.tolist(),
                                                                  lengths.tolist(),
                                                                  strict=True)]


def test_wide_slices_of_one_width_from_a_mapped_file_up_to_its_last_byte(tmp_path: Path
                                                                      ) -> None:
    import numpy as np

    from dstl.reader.columns import _slices

    rnd = np.random.default_rng(17)
    path = tmp_path / "data"
    raw = rnd.integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    path.write_bytes(raw)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    for width in (1, 7, 8, 9, 4096, 70_000, len(raw)):
        n = 1 if width == len(raw) else 30
        starts = rnd.integers(0, len(raw) - width + 1, n).astype(np.int64)
        starts[-1] = len(raw) - width  # the file's last bytes
        got = _slices(data, starts, np.full(n, width, dtype=np.int64)).to_pylist()
        assert got == [raw[s:s + width] for s in starts.tolist()]


def test_slices_in_runs_of_one_length_equal_python_slicing() -> None:
    import numpy as np

    from dstl.reader.columns import _MAX_RUNS, _slices_in_runs

    rnd = np.random.default_rng(18)
    data = rnd.integers(0, 256, 5000, dtype=np.uint8)
    raw = data.tobytes()
    for runs in (1, 2, 3, _MAX_RUNS, _MAX_RUNS + 1, _MAX_RUNS + 2, 60):
        widths = rnd.choice([0, 1, 5, 9, 25, 300], runs)
        lengths = np.concatenate([np.full(rnd.integers(1, 20), w, dtype=np.int64)
                                  for w in widths])
        starts = np.array([rnd.integers(0, len(raw) - ln + 1) for ln in lengths.tolist()],
                          dtype=np.int64)
        got = _slices_in_runs(data, starts, lengths)
        assert got.type == pa.binary()
        assert got.to_pylist() == [raw[a:a + ln] for a, ln in zip(starts.tolist(),
                                                                   lengths.tolist(),
                                                                   strict=True)]


def test_pieces_of_a_file_keep_every_entry_in_order_within_their_limits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    from dstl.reader import columns

    rnd = np.random.default_rng(7)
    monkeypatch.setattr(columns, "_RUN", 10)
    monkeypatch.setattr(columns, "_RUN_BYTES", 100)
    for n in (0, 1, 9, 10, 11, 300):
        ks = rnd.integers(1, 30, n + 5)
        vs = rnd.choice([0, 5, 60, 150], n + 5)  # 150: one entry over the byte limit
        at = np.sort(rnd.choice(n + 5, n, replace=False))
        pieces = list(columns._pieces(at, ks, vs))
        assert np.concatenate(pieces).tolist() == at.tolist() if pieces else not n
        for p in pieces:
            assert 1 <= len(p) <= 10
            assert len(p) == 1 or (ks[p].sum() <= 100 and vs[p].sum() <= 100)
