"""The state reader at its edges, as a hostile caller or a busy job would meet it: arguments and
Spark options of the wrong type or out of range (typed errors, raised by the call, before anything
is read), empty checkpoints and emptied state, a checkpoint deleted by the running job's
retention or by ``dstl gc`` between planning and reading (heap and LMDB, state and change
splits), damaged and truncated manifests, snapshots and segments, binary keys, and pickle states.

The job is tests/support/state_job.py's MiniJob (no Spark); the Spark sources' option parsing is
tested on SourceOptions directly (the Spark round trip of one refused option is in
tests/integration/spark/test_spark_state_reader.py).
"""

from __future__ import annotations

import io
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.columnar import read_state_columns, read_state_table_rows
from support.state_job import MiniJob, _Borrowed, replay, state_of

from dstl.checkpoint import CheckpointCoordinator
from dstl.cli import main
from dstl.errors import (
    ConfigError,
    ConfigTypeError,
    CorruptObjectError,
    ObjectNotFoundError,
    UsageError,
)
from dstl.keygroups import KeyGroupRange
from dstl.reader import (
    CheckpointCatalog,
    CheckpointDeletedError,
    CheckpointNotFoundError,
    ReadOnlyBlobStore,
    open_read_only,
    plan_change_range,
    plan_state_splits,
    read_change_split,
    read_changes,
    read_state,
    read_state_split,
    task_states,
    verify_checkpoint,
)
from dstl.reader.columns import read_state_batches, read_state_table
from dstl.storage import ChangelogStorage
from dstl.stores import open_store, parse_storage_options
from dstl.stores.base import BlobStore
from materializer.backend import ChangelogKeyedStateBackend
from materializer.codecs import PickleCodec
from materializer.states import ValueStateDescriptor


@pytest.fixture
def store(tmp_path: Path) -> Iterator[BlobStore]:
    s = open_store(str(tmp_path / "state"))
    yield s
    s.close()


def _catalog(store: BlobStore) -> CheckpointCatalog:
    return CheckpointCatalog(ReadOnlyBlobStore(store), job_id="job")


def _small_job(store: BlobStore, table: str = "heap", retained: int = 3) -> MiniJob:
    job = MiniJob(store, partitions=2, seed=31, table=table, retained=retained)
    job.run(80)
    job.checkpoint()
    return job


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(("kwargs", "error", "field"), [
    ({"checkpoint_id": "0"}, ConfigTypeError, "checkpoint_id"),
    ({"checkpoint_id": True}, ConfigTypeError, "checkpoint_id"),
    ({"checkpoint_id": 0.0}, ConfigTypeError, "checkpoint_id"),
    ({"checkpoint_id": -1}, ConfigError, "checkpoint_id"),
    ({"checkpoint_id": 1 << 63}, ConfigError, "checkpoint_id"),
    ({"keys": "k3"}, ConfigTypeError, "keys"),
    ({"keys": [3]}, ConfigTypeError, "keys"),
    ({"states": "attrs"}, ConfigTypeError, "states"),
    ({"states": ["attrs", ""]}, ConfigError, "states"),
    ({"table": "memory"}, ConfigError, "table"),
    ({"table": None}, ConfigTypeError, "table"),
    ({"allow_pickle": "no"}, ConfigTypeError, "allow_pickle"),
    ({"max_key_groups": 0}, ConfigError, "max_key_groups"),
    ({"max_key_groups": 1 << 20}, ConfigError, "max_key_groups"),
    ({"cache": object()}, ConfigTypeError, "cache"),
])
def test_read_state_checks_its_arguments_before_reading(store: BlobStore, kwargs: dict[str, Any],
                                                        error: type[Exception],
                                                        field: str) -> None:
    job = _small_job(store)
    job.close()
    catalog = _catalog(store)
    with pytest.raises(error) as exc:
        read_state(catalog, **kwargs)  # the call raises: no iteration needed
    assert f"read_state.{field}=" in str(exc.value)
    if "table" not in kwargs:  # the column-wise whole read takes the same arguments
        with pytest.raises(error) as exc:
            read_state_table(catalog, **kwargs)
        assert f"read_state_table.{field}=" in str(exc.value)


@pytest.mark.parametrize(("args", "kwargs", "field"), [
    (("1",), {}, "start"),
    ((-2,), {}, "start"),
    ((None, -1), {}, "end"),
    ((None, True), {}, "end"),
    ((3, 1), {}, "start"),
    ((None,), {"on_lost": "skip"}, "on_lost"),
])
def test_the_change_feed_checks_its_arguments(store: BlobStore, args: tuple[Any, ...],
                                              kwargs: dict[str, Any], field: str) -> None:
    job = _small_job(store)
    job.close()
    with pytest.raises(ConfigError, match=rf"plan_change_range\.{field}="):
        read_changes(_catalog(store), *args, **kwargs)


def test_constructors_and_split_readers_check_their_arguments(store: BlobStore,
                                                              tmp_path: Path) -> None:
    job = _small_job(store)
    job.close()
    catalog = _catalog(store)
    with pytest.raises(ConfigTypeError, match=r"CheckpointCatalog\.store="):
        CheckpointCatalog("/tmp/state")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"CheckpointCatalog\.job_id="):
        CheckpointCatalog(store, job_id=" job")
    with pytest.raises(ConfigTypeError, match=r"open_read_only\.state_uri="):
        open_read_only(42)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"open_read_only\.state_uri="):
        open_read_only("s3:/bucket/app")
    with pytest.raises(ConfigError, match="storage_options"):
        open_read_only(str(tmp_path), {"anon": True})  # a local path takes none
    split = plan_state_splits(0, task_states(catalog.manifest()))[0]
    with pytest.raises(ConfigTypeError, match=r"read_state_split\.keys="):
        read_state_split(catalog.store, split, keys=["k1"])  # type: ignore[list-item]
    with pytest.raises(ConfigTypeError, match=r"read_state_split\.split="):
        read_state_split(catalog.store, split.handle)  # type: ignore[arg-type]
    with pytest.raises(ConfigTypeError, match=r"read_change_split\.split="):
        read_change_split(catalog.store, split)  # type: ignore[arg-type]
    with pytest.raises(ConfigTypeError, match=r"verify_checkpoint\.progress="):
        verify_checkpoint(catalog, progress=lambda done: None)  # type: ignore[arg-type, misc]
    with pytest.raises(ConfigError, match=r"CheckpointCatalog\.find\.checkpoint_id="):
        catalog.find(-3)


def test_storage_options_refuse_a_key_given_twice_without_showing_values() -> None:
    with pytest.raises(ConfigError, match="each key once") as exc:
        parse_storage_options(["secret=s3cr3t", "secret=other"])
    assert "s3cr3t" not in str(exc.value)
    with pytest.raises(ConfigError, match="a value for 'client_kwargs' or a group"):
        parse_storage_options(["client_kwargs=1", "client_kwargs.endpoint_url=x"])
    assert parse_storage_options(["client_kwargs.endpoint_url=http://h:1",
                                  "client_kwargs.region_name=r"]) == {
        "client_kwargs": {"endpoint_url": "http://h:1", "region_name": "r"}}


# --------------------------------------------------------------------------- Spark options

def _parse(options: dict[str, str], **kw: Any) -> Any:
    from dstl.spark.datasource import SourceOptions

    return SourceOptions.parse({"path": "/tmp/state", **options}, **kw)


@pytest.mark.parametrize(("options", "kw", "field"), [
    ({"checkpiont": "3"}, {"stream": False}, "checkpiont"),
    ({"checkpoint": "-1"}, {"stream": False}, "checkpoint"),
    ({"checkpoint": "1.0"}, {"stream": False}, "checkpoint"),
    ({"checkpoint": " 3"}, {"stream": False}, "checkpoint"),
    ({"checkpoint": str(1 << 63)}, {"stream": False}, "checkpoint"),
    ({"keyGroupsPerSplit": "0"}, {"stream": False}, "keyGroupsPerSplit"),
    ({"keyGroupsPerSplit": "40000"}, {"stream": False}, "keyGroupsPerSplit"),
    ({"table": "memory"}, {"stream": False}, "table"),
    ({"allowPickle": "yes"}, {"stream": False}, "allowPickle"),
    ({"cache": "maybe"}, {"stream": False}, "cache"),
    ({"state": "count,,attrs"}, {"stream": False}, "state"),
    ({"valueType": "bigint, other string"}, {"stream": False}, "valueType"),
    ({"valueType": "map<string,double"}, {"stream": False}, "valueType"),
    ({"operator": ""}, {"stream": False}, "operator"),
    ({"storageOptions": "[1]"}, {"stream": False}, "storageOptions"),
    ({"storageOptions": "{not json"}, {"stream": False}, "storageOptions"),
    # options the mode would ignore
    ({"startCheckpoint": "3"}, {"stream": False}, "startCheckpoint"),
    ({"startingCheckpoint": "earliest"}, {"stream": False}, "startingCheckpoint"),
    ({"readChangeFeed": "true", "checkpoint": "3"}, {"stream": False}, "checkpoint"),
    ({"readChangeFeed": "true", "startCheckpoint": "5", "endCheckpoint": "3"},
     {"stream": False}, "startCheckpoint"),
    ({"readChangeFeed": "true", "startCheckpoint": "-2"}, {"stream": False}, "startCheckpoint"),
    ({"readChangeFeed": "true", "onLostChanges": "skip"}, {"stream": False}, "onLostChanges"),
    ({"startCheckpoint": "3"}, {"source": "dstl_changes", "stream": True}, "startCheckpoint"),
    ({"startingCheckpoint": "newest"}, {"source": "dstl_changes", "stream": True},
     "startingCheckpoint"),
    ({"maxCheckpointsPerTrigger": "0"}, {"source": "dstl_changes", "stream": True},
     "maxCheckpointsPerTrigger"),
    ({"readChangeFeed": "false"}, {"source": "dstl_changes", "stream": True}, "readChangeFeed"),
])
def test_spark_source_options_are_checked(options: dict[str, str], kw: dict[str, Any],
                                          field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        _parse(options, **kw)
    assert f"source.{field}=" in str(exc.value)


def test_the_spark_source_reads_sparks_placeholder_partition_as_no_rows() -> None:
    # Spark hands a source that planned no split one InputPartition(None); anything else that is
    # not a split of ours is refused, by name
    from pyspark.sql.datasource import InputPartition

    from dstl.errors import UsageError
    from dstl.spark.datasource import _Output, _Pushed, _read

    opts = _parse({}, stream=False)
    assert list(_read(opts, _Pushed(), _Output(None), InputPartition(None))) == []
    with pytest.raises(UsageError, match="not one of the splits it planned"):
        list(_read(opts, _Pushed(), _Output(None), InputPartition(3)))


def test_the_spark_sources_take_a_user_schema_as_their_columns() -> None:
    from pyspark.sql.types import (
        BinaryType,
        CalendarIntervalType,
        IntegerType,
        LongType,
        StringType,
        StructField,
        StructType,
    )

    from dstl.reader.rows import CHANGE_DDL, STATE_DDL
    from dstl.spark.datasource import _Output

    def schema(*fields: tuple[str, Any]) -> StructType:
        return StructType([StructField(n, t) for n, t in fields])

    opts = _parse({}, stream=False)
    types = {"bigint": LongType(), "int": IntegerType(), "binary": BinaryType(),
             "string": StringType()}
    own = schema(*((n, types[t]) for n, t in (p.split(" ") for p in STATE_DDL.split(", "))))
    assert _Output.of(opts, own, STATE_DDL) == _Output(None)  # the source's own: as it is
    out = _Output.of(opts, schema(("Value", StringType()), ("KEY", StringType()),
                                  ("typed_value", LongType())), STATE_DDL)
    assert out.columns == ("value", "key", "typed_value") and out.typed is not None
    assert _Output.of(opts, schema(("seq", LongType())), CHANGE_DDL).columns == ("seq",)
    with pytest.raises(ConfigError, match=r"dstl source\.schema=.*name at least one column"):
        _Output.of(opts, StructType([]), STATE_DDL)
    with pytest.raises(ConfigError, match=r"the source has no column 'seq'"):
        _Output.of(opts, schema(("seq", LongType())), STATE_DDL)
    with pytest.raises(ConfigError, match=r"column 'checkpoint' is bigint in the source, not "
                                          r"string: declare it bigint"):
        _Output.of(opts, schema(("checkpoint", StringType())), STATE_DDL)
    # NOT NULL: refused where a row may hold null (Spark would trust it), kept elsewhere
    for name, kind, ddl in (("key", StringType(), STATE_DDL), ("value", StringType(), CHANGE_DDL),
                            ("typed_value", LongType(), STATE_DDL),
                            ("namespace", StringType(), STATE_DDL)):
        with pytest.raises(ConfigError, match=rf"column '{name}' can be null"):
            _Output.of(opts, StructType([StructField(name, kind, False)]), ddl)
    kept = _Output.of(opts, StructType([StructField("checkpoint", LongType(), False),
                                        StructField("key_bytes", BinaryType(), False)]),
                      STATE_DDL)
    assert kept.columns == ("checkpoint", "key_bytes")
    # a typed_value type Spark cannot take from Arrow (interval) is refused, named
    with pytest.raises(ConfigError, match=r"column 'typed_value' is interval, which Spark does "
                                          r"not convert from Arrow \(.*UNSUPPORTED_DATA_TYPE"):
        _Output.of(opts, schema(("key", StringType()), ("typed_value", CalendarIntervalType())),
                   STATE_DDL)


def test_spark_source_options_accept_what_the_docs_show() -> None:
    o = _parse({"Checkpoint": "7", "keygroupspersplit": "4", "TABLE": "LMDB", "state": "a, b",
                "valueType": "map<string,array<bigint>>", "allowPickle": "TRUE"}, stream=False)
    assert (o.checkpoint, o.key_groups_per_split, o.table, o.states, o.value_type,
            o.allow_pickle) == (7, 4, "lmdb", ("a", "b"), "map<string,array<bigint>>", True)
    f = _parse({"readChangeFeed": "true", "startCheckpoint": "-1", "endCheckpoint": "3",
                "onLostChanges": "resumefromoldest"}, stream=False)
    assert (f.change_feed, f.start, f.end, f.on_lost) == (True, -1, 3, "resumeFromOldest")
    s = _parse({"startingCheckpoint": "12", "maxCheckpointsPerTrigger": "2",
                "onLostChanges": "fail"}, source="dstl_changes", stream=True)
    assert (s.starting, s.max_checkpoints_per_trigger) == ("12", 2)
    # Spark first asks for the schema, before it knows the mode: names are still checked
    assert _parse({"startCheckpoint": "3"}).start == 3
    with pytest.raises(ConfigError, match="checkpiont"):
        _parse({"checkpiont": "3"})


# --------------------------------------------------------------------------- empty state


@pytest.mark.parametrize("table", ["heap", "lmdb"])
def test_empty_checkpoints_and_emptied_state_read_as_nothing(store: BlobStore,
                                                             table: str) -> None:
    job = MiniJob(store, partitions=2, seed=5, table=table, retained=5)
    try:
        job.checkpoint()  # 0: nothing ever written
        job.run(40)
        job.checkpoint()  # 1
        for b, st in zip(job.backends, job.states, strict=True):  # 2: every entry cleared
            for (state, key, ns) in list(job.model):
                if job.partition_of(key) != job.backends.index(b):
                    continue
                b.set_current_key(key)
                b.set_current_namespace(ns)
                st[state].clear()
                del job.model[(state, key, ns)]
        job.checkpoint()
    finally:
        job.close()
    catalog = _catalog(store)
    for table_ in ("heap", "lmdb"):
        assert list(read_state(catalog, 0, table=table_)) == []
        assert list(read_state(catalog, 2, table=table_)) == []
    for cid in (0, 2):
        assert sum(b.num_rows for b in read_state_table(catalog, cid)) == 0
    assert state_of(read_state_table_rows(catalog, 1)) == job.checkpoint_models[1]
    assert list(read_changes(catalog, None, 0)) == []
    cleared = list(read_changes(catalog, 1, 2))
    assert cleared and {r.op for r in cleared} == {"clear"}
    assert replay(cleared, job.checkpoint_models[1]) == {}
    assert replay(read_changes(catalog, None, 2), None) == {}
    assert verify_checkpoint(catalog, 0).ok and verify_checkpoint(catalog, 2).ok


def test_a_store_without_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "state"
    root.mkdir()
    catalog = CheckpointCatalog(open_read_only(str(root)))
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint"):
        list(read_state(catalog))
    assert list(read_changes(catalog, None)) == []
    # nothing to read is a usage error (exit 2): an empty directory holds no DSTL store
    assert main(["checkpoints", "list", str(root)]) == 2
    assert main(["state", "dump", str(root)]) == 2
    assert "NoStoreError: no DSTL store at" in capsys.readouterr().err
    assert main(["state", "dump", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


# --------------------------------------------------------------------------- deleted while read


@pytest.mark.parametrize("table", ["heap", "lmdb"])
def test_a_checkpoint_subsumed_by_the_running_job_while_read(store: BlobStore,
                                                             table: str) -> None:
    job = MiniJob(store, partitions=2, seed=6, table=table, retained=1)
    try:
        job.run(100)
        job.checkpoint()  # 0: log only
        catalog = _catalog(store)
        state_splits = plan_state_splits(0, task_states(catalog.manifest(0)))
        change_splits = plan_change_range(catalog, None, 0).splits
        assert state_splits and change_splits
        # the job goes on: it materializes (truncating the log checkpoint 0 names) and commits
        # checkpoint 1, whose retention deletes checkpoint 0's manifest and then its segments
        job.materialize()
        job.run(20)
        job.checkpoint()
        assert catalog.ids() == [1]
    finally:
        job.close()
    for reader_table in ("heap", "lmdb", "columns"):
        for split in state_splits:
            with pytest.raises(CheckpointDeletedError) as exc:
                if reader_table == "columns":
                    list(read_state_batches(catalog.store, split))
                else:
                    list(read_state_split(catalog.store, split, table=reader_table))
            assert exc.value.checkpoint_id == 0 and "retained=" in str(exc.value)
    for change_split in change_splits:
        with pytest.raises(CheckpointDeletedError):
            list(read_change_split(catalog.store, change_split))
    with pytest.raises(CheckpointNotFoundError):
        verify_checkpoint(catalog, 0)
    # the newest checkpoint reads whole
    assert state_of(read_state(catalog, 1)) == job.checkpoint_models[1]


def test_a_checkpoint_deleted_by_gc_mid_iteration(store: BlobStore) -> None:
    """A reader that has begun streaming a checkpoint's snapshot blocks, when that checkpoint's
    manifest and objects go: the next block it needs is a CheckpointDeletedError."""
    job = MiniJob(store, partitions=1, seed=7, table="heap", retained=3)
    try:
        job.run(400, keys=400)
        job.checkpoint()
        job.materialize()
        job.checkpoint()  # 1: snapshot only (no log after it)
    finally:
        job.close()
    catalog = _catalog(store)
    snapshot = task_states(catalog.manifest(1))[0].handle.materialized[0]
    assert len(snapshot.key_groups) > 1, "the snapshot must have several blocks (key groups)"
    rows = read_state(catalog, 1)
    first = next(rows)
    assert first.checkpoint == 1
    # every checkpoint removed (as a job with a new name would leave them), then gc
    store.delete([c.key for c in catalog.checkpoints()])
    coordinator = CheckpointCoordinator.recover(store, "job", retained=1)
    try:
        assert snapshot.key in coordinator.collect_orphans(0.0)
    finally:
        coordinator.close()
    with pytest.raises(CheckpointDeletedError) as exc:
        list(rows)
    assert snapshot.key in str(exc.value)


@pytest.mark.parametrize("table", ["heap", "lmdb"])
def test_a_checkpoint_deleted_between_the_splits_of_a_column_wise_read(store: BlobStore,
                                                                      table: str) -> None:
    """``read_state_table`` (``dstl state dump --format parquet``) has read the first split when
    the checkpoint goes: the next split is a CheckpointDeletedError, not fewer rows."""
    job = MiniJob(store, partitions=2, seed=9, table=table, retained=3)
    try:
        job.run(300, keys=200)
        job.checkpoint()
        job.materialize()
        job.run(60)
        job.checkpoint()  # 1: snapshots + a log tail in both partitions
    finally:
        job.close()
    catalog = _catalog(store)
    p0 = sum(r.partition == "p0" for r in read_state(catalog, 1))
    assert p0 and p0 < len(list(read_state(catalog, 1)))
    batches = read_state_table(catalog, 1)
    seen = 0
    while seen < p0:  # every row of the first split, not one more (the next split not begun)
        b = next(batches)
        assert set(b.column("partition").to_pylist()) == {"p0"}
        seen += b.num_rows
    assert seen == p0
    store.delete([c.key for c in catalog.checkpoints()])
    coordinator = CheckpointCoordinator.recover(store, "job", retained=1)
    try:
        assert coordinator.collect_orphans(0.0)
    finally:
        coordinator.close()
    with pytest.raises(CheckpointDeletedError) as exc:
        list(batches)
    assert exc.value.checkpoint_id == 1


# --------------------------------------------------------------------------- damaged objects


#: the row path's two tables, the column-wise read of the Spark source (per split), and the
#: whole checkpoint column-wise (``dstl state dump --format parquet``)
READERS = ("heap", "lmdb", "columns", "table")


def _read(catalog: CheckpointCatalog, cid: int | None, reader: str, **kw: Any) -> Any:
    if reader == "columns":
        return read_state_columns(catalog, cid, **kw)
    if reader == "table":
        return read_state_table_rows(catalog, cid, **kw)
    return read_state(catalog, cid, table=reader, **kw)


def _replace(store: BlobStore, key: str, data: bytes) -> None:
    store.delete([key])
    store.put(key, data)


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "not-a-handle"])
def test_a_damaged_manifest_is_a_typed_error_naming_it(store: BlobStore, damage: str,
                                                       capsys: pytest.CaptureFixture[str],
                                                       tmp_path: Path) -> None:
    _small_job(store).close()
    catalog = _catalog(store)
    key = catalog.find().key
    data = store.get(key)
    if damage == "flip":
        bad = bytearray(data)
        bad[len(bad) // 2] ^= 0x01
        data = bytes(bad)
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = b""
    else:  # a well-formed manifest whose task state is not a DSTL handle
        from dstl.checkpoint.manifest import decode_manifest

        m = decode_manifest(data, key)
        other_store = open_store(str(tmp_path / "other"))
        coordinator = CheckpointCoordinator(other_store, job_id="job")
        coordinator.trigger(["p0"], checkpoint_id=m.checkpoint_id)
        coordinator.acknowledge(m.checkpoint_id, "p0", {"not": "a handle"}, [], 0, 0)
        other = coordinator.latest()
        assert other is not None
        data = other_store.get(other.key)
        coordinator.close()
        other_store.close()
    _replace(store, key, data)
    with pytest.raises(CorruptObjectError) as exc:
        list(read_state(catalog))
    assert key in str(exc.value)
    with pytest.raises(CorruptObjectError):
        read_changes(catalog, None)
    report = verify_checkpoint(catalog)
    assert not report.ok and report.problems[0].key == key
    assert main(["verify", str(tmp_path / "state")]) == 1
    assert key in capsys.readouterr().out + capsys.readouterr().err


@pytest.mark.parametrize("table", ["heap", "lmdb"])
@pytest.mark.parametrize("what", ["snapshot", "segment"])
@pytest.mark.parametrize("damage", ["truncate", "empty", "flip-record", "flip-trailer"])
def test_damaged_snapshots_and_segments_are_typed_errors_naming_them(
        store: BlobStore, table: str, what: str, damage: str) -> None:
    job = MiniJob(store, partitions=1, seed=8, table=table, retained=3)
    try:
        job.run(200)
        job.checkpoint()
        job.materialize()
        job.run(50)
        job.checkpoint()
    finally:
        job.close()
    catalog = _catalog(store)
    handle = task_states(catalog.manifest(1))[0].handle
    ref = handle.non_materialized[-1].change_sets[-1]
    key = handle.materialized[0].key if what == "snapshot" else ref.key
    data = store.get(key)
    at = ref.offset + ref.length // 2 if what == "segment" else len(data) // 2
    bad = {"truncate": data[:at], "empty": b"",
           "flip-record": data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1:],
           "flip-trailer": data[:-1] + bytes([data[-1] ^ 0x80])}[damage]
    _replace(store, key, bad)
    assert [p.key for p in verify_checkpoint(catalog, 1).problems] == [key]
    if what == "segment" and damage == "flip-trailer":
        # ranged reads fetch and verify exactly the change sets a checkpoint names; their bytes
        # are intact, so the read is right (and dstl verify, which checks whole objects, fails)
        for reader_table in READERS:
            assert state_of(_read(catalog, 1, reader_table)) == job.checkpoint_models[1]
        return
    for reader_table in READERS:
        with pytest.raises(CorruptObjectError) as exc:
            list(_read(catalog, 1, reader_table))
        assert key in str(exc.value)
    if what == "segment":
        with pytest.raises(CorruptObjectError, match=key):
            list(read_changes(catalog, 0, 1))


def _lmdb_snapshot_job(store: BlobStore, seed: int) -> None:
    """One LMDB partition: 200 changes, a checkpoint, a v2 snapshot, checkpoint 1 on it."""
    job = MiniJob(store, partitions=1, seed=seed, table="lmdb", retained=3)
    try:
        job.run(200)
        job.checkpoint()
        job.materialize()
        job.checkpoint()
    finally:
        job.close()


@pytest.mark.parametrize("payload", ["garbage", "zeros", "short", "empty"])
def test_a_v2_snapshot_whose_checksums_hold_around_no_lmdb_file_is_a_typed_error(
        store: BlobStore, tmp_path: Path, payload: str) -> None:
    """A forged (or buggy) v2 object: its framing, zstd frame and checksums are right, but the
    file inside is no LMDB environment; every reader names the object."""
    from materializer.file_snapshot import verify_file_snapshot, write_file_snapshot

    _lmdb_snapshot_job(store, seed=8)
    catalog = _catalog(store)
    key = task_states(catalog.manifest(1))[0].handle.materialized[0].key
    data = store.get(key)
    layout = verify_file_snapshot(lambda o, n: data[o:o + n], len(data), key=key)
    body = {"garbage": random.Random(1).randbytes(65536), "zeros": bytes(65536),
            "short": b"\x01" * 100, "empty": b""}[payload]
    out = io.BytesIO()
    write_file_snapshot(lambda fd: os.write(fd, body), layout.meta, out, tmp_dir=str(tmp_path))
    _replace(store, key, out.getvalue())
    assert [p.key for p in verify_checkpoint(catalog, 1).problems] == [key]
    for reader_table in READERS:
        with pytest.raises(CorruptObjectError) as exc:
            list(_read(catalog, 1, reader_table))
        assert key in str(exc.value), reader_table


# --------------------------------------------------------------------------- keys and codecs


def _one_backend(store: BlobStore, table: str) -> tuple[ChangelogStorage,
                                                        ChangelogKeyedStateBackend]:
    storage = ChangelogStorage(store=_Borrowed(store))
    backend = ChangelogKeyedStateBackend(storage, "job/p0", KeyGroupRange(0, 15), 16,
                                         table=table, auto_materialize=False)
    return storage, backend


def _commit(store: BlobStore, backend: ChangelogKeyedStateBackend, cid: int) -> None:
    coordinator = CheckpointCoordinator(store, job_id="job")
    coordinator.trigger(["p0"], checkpoint_id=cid)
    h = backend.snapshot(cid).result(timeout=30)
    coordinator.acknowledge(cid, "p0", h.to_json_obj(), h.referenced_keys(), h.full_size,
                            h.incremental_size)
    coordinator.close()


@pytest.mark.parametrize("table", ["heap", "lmdb"])
def test_binary_keys_read_and_filter_by_their_bytes(store: BlobStore, table: str) -> None:
    storage, backend = _one_backend(store, table)
    keys: list[str | bytes] = [b"\xff\x00bin", "caf\u00e9", b"plain", "k"]
    try:
        st = backend.get_state(ValueStateDescriptor("v"))
        for i, k in enumerate(keys):
            backend.set_current_key(k)
            st.update(i)
        _commit(store, backend, 0)
    finally:
        backend.close()
        storage.close()
    catalog = _catalog(store)
    # keys are stored as bytes; one that is UTF-8 reads back as str (the key codec's rule, the
    # same a restored job sees), key_bytes is always the stored bytes
    read_back = [b"\xff\x00bin", "caf\u00e9", "plain", "k"]
    rows = {r.key: r for r in read_state(catalog)}
    assert rows.keys() == set(read_back)
    assert all(rows[k].value == i for i, k in enumerate(read_back))
    assert {r.key_bytes for r in rows.values()} == {
        b"\xff\x00bin", "caf\u00e9".encode(), b"plain", b"k"}
    for reader in READERS:
        rows = {r.key: r for r in _read(catalog, None, reader)}
        assert rows.keys() == set(read_back)
        assert all(rows[k].value == i for i, k in enumerate(read_back))
        only = list(_read(catalog, None, reader, keys=[b"\xff\x00bin", "caf\u00e9", b"plain"]))
        assert {r.key for r in only} == {b"\xff\x00bin", "caf\u00e9", "plain"}
    feed = list(read_changes(catalog, None))
    assert {r.key for r in feed} == set(read_back)
    pytest.importorskip("pyarrow")
    from dstl.reader.arrow import STATE_SCHEMA, batches

    table_ = next(batches(read_state(catalog), STATE_SCHEMA)).to_pydict()
    by_bytes = dict(zip(table_["key_bytes"], table_["key"], strict=True))
    assert by_bytes[b"\xff\x00bin"] is None and by_bytes["caf\u00e9".encode()] == "caf\u00e9"


def test_pickle_states_need_allow_pickle(store: BlobStore) -> None:
    storage, backend = _one_backend(store, "heap")
    try:
        st = backend.get_state(ValueStateDescriptor("p", serializer=PickleCodec()))
        backend.set_current_key("k")
        st.update(frozenset({1, 2}))
        _commit(store, backend, 0)
    finally:
        backend.close()
        storage.close()
    catalog = _catalog(store)
    for table in READERS:
        with pytest.raises(UsageError, match="pickle"):
            list(_read(catalog, None, table))
        rows = list(_read(catalog, None, table, allow_pickle=True))
        # the row path gives the object; the tables its repr (what to_json makes of it)
        assert [r.value for r in rows] == [frozenset({1, 2})] if table in ("heap", "lmdb") else [
            {"$repr": "frozenset({1, 2})"}]
    with pytest.raises(UsageError, match="pickle"):
        list(read_changes(catalog, None))
    assert [r.value for r in read_changes(catalog, None, allow_pickle=True)] == [
        frozenset({1, 2})]


def test_a_missing_segment_with_its_manifest_present_says_the_store_is_damaged(
        store: BlobStore) -> None:
    job = _small_job(store)
    job.close()
    catalog = _catalog(store)
    handle = task_states(catalog.manifest())[0].handle
    key = handle.non_materialized[-1].change_sets[0].key
    store.delete([key])
    with pytest.raises(ObjectNotFoundError) as exc:
        list(read_changes(catalog, None))
    assert not isinstance(exc.value, CheckpointDeletedError)
    assert key in str(exc.value) and "dstl verify" in str(exc.value)


@pytest.mark.parametrize("table", ["heap", "lmdb"])
@pytest.mark.parametrize("materialize", [False, True])
def test_internal_raw_states_are_not_shown(store: BlobStore, table: str,
                                           materialize: bool) -> None:
    """The timer service's ``$timer_index`` is a raw state (raw key and namespace bytes, no
    codecs): the reader leaves it out of state rows and change rows instead of failing to
    decode its namespace."""
    storage, backend = _one_backend(store, table)
    try:
        st = backend.get_state(ValueStateDescriptor("v"))
        sid = backend.register_raw_state("$index")
        for i, k in enumerate(["a", "b", "c"]):
            backend.set_current_key(k)
            st.update(i)
            backend.raw_put(sid, backend.current_key_group, b"\x00" * 7 + bytes([i]),
                            b"\xff\xfe" + k.encode(), b"\x01")
        if materialize:
            assert backend.materialize_now(timeout_s=30) is not None
            backend.set_current_key("d")
            st.update(3)
        _commit(store, backend, 0)
    finally:
        backend.close()
        storage.close()
    catalog = _catalog(store)
    want = {("v", k, None): i for i, k in enumerate("abcd" if materialize else "abc")}
    for reader_table in READERS:
        assert state_of(_read(catalog, None, reader_table)) == want
    assert replay(read_changes(catalog, None)) == want
    assert verify_checkpoint(catalog).ok


_CACHE_CHILD = """
import os, sys
from dstl.spark.datasource import _process_cache
cache = _process_cache()
print(cache.directory, flush=True)
if sys.argv[1] == "hold":
    sys.stdin.readline()  # alive, holding its cache, until the test lets go
os._exit(0)  # as a Spark Python worker ends: no atexit clean-up
"""


def _cache_dirs(root: Path) -> list[str]:
    return sorted(str(root / n) for n in os.listdir(root) if n.startswith("dstl-reader-cache-"))


def test_the_spark_reader_cache_of_a_worker_that_is_gone_is_removed_by_the_next(
        tmp_path: Path) -> None:
    """A Python worker exits with os._exit, so its reader cache's atexit clean-up never runs:
    the next worker's cache removes the directories of processes that are gone, never one whose
    process still holds it; the caches live under the executor's local directory."""
    import subprocess
    import sys

    local = tmp_path / "executor"
    local.mkdir()
    env = {**os.environ, "SPARK_LOCAL_DIRS": f"{local},{tmp_path / 'second'}"}

    def child(mode: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-c", _CACHE_CHILD, mode], env=env, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def directory(p: subprocess.Popen[str]) -> str:
        assert p.stdout is not None
        return p.stdout.readline().strip()

    gone = child("exit")
    first = directory(gone)
    assert gone.wait(30) == 0
    assert _cache_dirs(local) == [first]  # left behind, under the executor's local directory
    (Path(first) / "payload.obj").write_bytes(b"x" * 1000)
    holder = child("hold")
    held = directory(holder)
    try:
        assert _cache_dirs(local) == [held]  # the dead worker's directory is gone
        late = child("exit")
        second = directory(late)
        assert late.wait(30) == 0
        assert _cache_dirs(local) == sorted([held, second])  # the live one is kept
    finally:
        assert holder.stdin is not None
        holder.stdin.write("\n")
        holder.stdin.close()
        assert holder.wait(30) == 0
    assert not (tmp_path / "second").exists()


def test_a_decompressed_snapshot_lives_in_an_own_directory_that_the_next_read_sweeps(
        store: BlobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A v2 snapshot is decompressed into ``dstl-reader-snapshot-<pid>-<random>`` under the
    executor's local directory, locked while read and removed after; the directory a killed
    reader left (its pid gone, its lock free) is removed by the next read, one whose process
    lives is not."""
    import fcntl
    import subprocess
    import sys

    from dstl.reader.image import READER_SNAPSHOT_PREFIX, decompressed_file_snapshot

    _lmdb_snapshot_job(store, seed=9)
    ref = task_states(_catalog(store).manifest(1))[0].handle.materialized[0]
    local = tmp_path / "executor"
    local.mkdir()
    monkeypatch.setenv("SPARK_LOCAL_DIRS", str(local))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = local / f"{READER_SNAPSHOT_PREFIX}{dead}-killed"
    stale.mkdir()
    (stale / "owner.lock").touch()
    (stale / "data.mdb").write_bytes(b"x" * 4096)  # what a killed reader left
    held = local / f"{READER_SNAPSHOT_PREFIX}{dead}-held"  # a pid seen dead, lock held
    held.mkdir()
    fd = os.open(held / "owner.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with decompressed_file_snapshot(store, ref, ref.key_groups, False, None) as opened:
            assert opened is not None
            staged = Path(opened[0].directory)
            directory = staged.parent
            assert directory.parent == local
            assert directory.name.startswith(f"{READER_SNAPSHOT_PREFIX}{os.getpid()}-")
            assert (staged / "data.mdb").stat().st_size > 0
            assert not stale.exists() and held.exists()
        assert not directory.exists()
    finally:
        os.close(fd)
    assert sorted(p.name for p in local.iterdir()) == [held.name]
