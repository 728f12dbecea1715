"""The reading commands through dstl.cli.main on a local store: ``checkpoints list|show``,
``verify`` (progress, damaged and missing objects named, exit 1), ``state dump|changes`` (JSON
lines equal to the model; Parquet with the Spark sources' columns), ``inspect`` of every object
kind, and the exit codes of --help (0) and usage errors (2) for every command. The same on a
moto S3 store: tests/integration/cli/test_cli_s3.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.state_job import MiniJob, state_of

from dstl.cli import COMMANDS, main
from dstl.reader import from_json
from dstl.stores import open_store


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, MiniJob]]:
    root = tmp_path_factory.mktemp("cli") / "state"
    store = open_store(str(root))
    job = MiniJob(store, partitions=2, seed=21, retained=3)
    job.run(120)
    job.checkpoint()
    job.materialize()
    job.run(80)
    job.checkpoint()
    job.run(40)
    job.checkpoint()
    job.close()
    store.close()
    yield root, job


def _snapshot_then_tail(job: MiniJob, first: int, tail: int) -> None:
    """``first`` rows checkpointed and materialized (v2 snapshots with LMDB), then ``tail`` more
    checkpointed as a log after them; the job closed."""
    job.run(first)
    job.checkpoint()
    job.materialize()
    job.run(tail)
    job.checkpoint()
    job.close()


@pytest.fixture(scope="module")
def lmdb_job_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, MiniJob]]:
    """LMDB tables: v2 snapshots (the column path parses their pages), then a log tail."""
    root = tmp_path_factory.mktemp("cli-lmdb") / "state"
    store = open_store(str(root))
    job = MiniJob(store, partitions=2, seed=22, table="lmdb", retained=3)
    _snapshot_then_tail(job, 150, 60)
    store.close()
    yield root, job


class _Row:
    def __init__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)


def _lines(out: str) -> list[_Row]:
    rows = []
    for line in out.splitlines():
        d = json.loads(line)
        for f in ("key", "namespace", "user_key", "value"):
            d[f] = from_json(json.dumps(d[f])) if d[f] is not None else None
        rows.append(_Row(d))
    return rows


def test_every_command_has_help_and_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(c in out for c in COMMANDS)
    for cmd in COMMANDS:
        assert main([cmd, "--help"]) == 0, cmd
        assert "usage: dstl" in capsys.readouterr().out
    for args in ([], ["nope"], ["checkpoints"], ["checkpoints", "list"], ["state", "dump"],
                 ["verify", "/x", "--checkpoint", "one"], ["state", "dump", "/x", "--format",
                                                            "parquet"],
                 ["verify", "/x", "--storage-option", "novalue"]):
        assert main(args) == 2, args
    for sub in ("list", "show"):
        assert main(["checkpoints", sub, "--help"]) == 0
    for sub in ("dump", "changes"):
        assert main(["state", sub, "--help"]) == 0


def test_checkpoints_list_and_show(job_dir: tuple[Path, MiniJob],
                                   capsys: pytest.CaptureFixture[str]) -> None:
    root, _ = job_dir
    assert main(["checkpoints", "list", str(root), "--json"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["checkpoint"] for r in rows] == [0, 1, 2]
    assert all(r["partitions"] == 2 and r["job"] == "job" and r["objects"] >= 2 and
               r["bytes"] > 0 for r in rows)
    assert main(["checkpoints", "list", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:2] == ["checkpoint", "attempt"] and len(out) == 4
    assert main(["checkpoints", "show", str(root), "--checkpoint", "1", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["checkpoint"] == 1 and [t["task"] for t in d["tasks"]] == ["p0", "p1"]
    assert all(len(t["snapshots"]) == 1 for t in d["tasks"])
    assert main(["checkpoints", "show", str(root)]) == 0
    assert "checkpoint 2 (attempt 1) of job 'job'" in capsys.readouterr().out
    assert main(["checkpoints", "show", str(root), "--checkpoint", "9"]) == 2
    assert "CheckpointNotFoundError" in capsys.readouterr().err
    assert main(["checkpoints", "list", str(root), "--job", "other"]) == 1  # another job's store
    assert main(["checkpoints", "list", str(root / "absent")]) == 2


def test_state_dump_and_changes_equal_the_model(job_dir: tuple[Path, MiniJob], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    import pyarrow.parquet as pq

    root, job = job_dir
    assert main(["state", "dump", str(root), "--checkpoint", "1"]) == 0
    out, err = capsys.readouterr()
    assert state_of(_lines(out)) == job.checkpoint_models[1]
    assert err.strip().endswith(f"{len(out.splitlines())} rows")
    assert main(["state", "dump", str(root), "--key", "k5", "--table", "lmdb"]) == 0
    rows = _lines(capsys.readouterr().out)
    assert state_of(rows) == {i: v for i, v in job.model.items() if i[1] == "k5"}
    assert main(["state", "changes", str(root), "--start", "1"]) == 0
    changes = _lines(capsys.readouterr().out)
    assert {c.checkpoint for c in changes} == {2} and {c.source for c in changes} == {"log"}
    out_file = tmp_path / "state.parquet"
    assert main(["state", "dump", str(root), "--format", "parquet", "-o", str(out_file)]) == 0
    table = pq.read_table(out_file)
    assert table.column_names[:4] == ["checkpoint", "partition", "key_group", "key"]
    assert table.num_rows == sum(len(v) if isinstance(v, dict) else 1
                                 for v in job.model.values())
    assert main(["state", "changes", str(root), "--start", "0", "--end", "2", "--format",
                 "parquet", "-o", str(tmp_path / "c.parquet")]) == 0
    assert "op" in pq.read_table(tmp_path / "c.parquet").column_names


def test_state_changes_from_a_checkpoint_no_longer_retained(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # retained 2 of 4 checkpoints: a feed from checkpoint 0 lost checkpoint 1's changes; it
    # fails naming the command's own flag, and with it starts after the oldest retained one
    root = tmp_path / "state"
    store = open_store(str(root))
    job = MiniJob(store, partitions=2, seed=23, retained=2)
    for rows in (60, 40, 30, 20):
        job.run(rows)
        job.checkpoint()
    job.close()
    store.close()
    assert main(["state", "changes", str(root), "--start", "0"]) == 1
    err = capsys.readouterr().err
    assert "ChangesLostError" in err and "--on-lost oldest" in err and "on_lost=" not in err
    assert main(["state", "changes", str(root), "--start", "0", "--on-lost", "oldest"]) == 0
    changes = _lines(capsys.readouterr().out)
    assert {c.checkpoint for c in changes} == {3}
    assert len(changes) == sum(1 for c in job.changes if c.checkpoint == 3)


def test_verify_names_damaged_and_missing_objects(job_dir: tuple[Path, MiniJob], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    root, _ = job_dir
    assert main(["verify", str(root)]) == 0
    out, err = capsys.readouterr()
    assert out.rstrip().endswith("verified: OK") and "[####" in err and "objects" in err
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    assert main(["checkpoints", "show", str(copy), "--json"]) == 0
    task = json.loads(capsys.readouterr().out)["tasks"][0]
    segment = task["logs"][-1]["segments"][-1]
    snapshot = task["snapshots"][0]["key"]
    data = bytearray((copy / segment).read_bytes())
    data[-30] ^= 1
    (copy / segment).write_bytes(bytes(data))
    (copy / snapshot).unlink()
    assert main(["verify", str(copy), "--quiet"]) == 1
    out, err = capsys.readouterr()
    assert not err
    problems = [line for line in out.splitlines() if line.startswith("PROBLEM")]
    assert len(problems) == 2
    assert any(segment in p and "ChecksumMismatchError" in p for p in problems)
    assert any(snapshot in p and "ObjectNotFoundError" in p for p in problems)
    assert "FAILED (2 problems)" in out
    # the reader names them too (exit 1, typed error on stderr)
    assert main(["state", "dump", str(copy)]) == 1
    err = capsys.readouterr().err
    assert "dstl state: ObjectNotFoundError" in err and snapshot in err


def test_inspect_recognises_every_object_kind(job_dir: tuple[Path, MiniJob], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    root, _ = job_dir
    manifest = next((root / "checkpoints").iterdir())
    snapshot = next((root / "snapshots").rglob("*.snap"))
    segment = next((root / "dstl").iterdir())
    assert main(["inspect", str(segment)]) == 0
    assert ": segment," in capsys.readouterr().out
    assert main(["inspect", str(root), "--key", str(snapshot.relative_to(root))]) == 0
    out = capsys.readouterr().out
    assert ": snapshot," in out and "'attrs' (map" in out
    assert main(["inspect", str(root), "--key", f"checkpoints/{manifest.name}"]) == 0
    assert ": manifest," in capsys.readouterr().out
    other = tmp_path / "other.bin"
    other.write_bytes(b"PAR1" + bytes(20))
    assert main(["inspect", str(other)]) == 1
    err = capsys.readouterr().err
    assert "UnsupportedFormatError" in err and str(other) in err


def test_exit_codes_are_one_rule_for_every_reading_command(
        job_dir: tuple[Path, MiniJob], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """2: the command line must change (no such store, a root that is not a DSTL store, no such
    checkpoint, bad arguments); 1: any other DSTL error (a damaged or missing object); 0: done."""
    root, _ = job_dir
    missing, empty = str(tmp_path / "missing"), tmp_path / "empty"
    empty.mkdir()
    reading = (["checkpoints", "list"], ["checkpoints", "show"], ["verify"], ["state", "dump"],
               ["state", "changes"])
    for cmd in reading:
        assert main([*cmd, missing]) == 2, cmd
        assert "does not exist" in capsys.readouterr().err, cmd
    assert main(["inspect", missing]) == 2
    assert main(["inspect", str(root), "--key", "checkpoints/nope.manifest"]) == 1  # not there
    capsys.readouterr()
    for cmd in reading:
        assert main([*cmd, str(empty)]) == 2, cmd
        assert "NoStoreError: no DSTL store at" in capsys.readouterr().err, cmd
    capsys.readouterr()
    for cmd in (["checkpoints", "show"], ["verify"], ["state", "dump"]):
        assert main([*cmd, str(root), "--checkpoint", "9"]) == 2, cmd
        assert "CheckpointNotFoundError" in capsys.readouterr().err, cmd
    assert main(["verify", str(root), "--job", "other"]) == 1
    assert main(["state", "changes", str(root), "--start", "2", "--end", "1"]) == 2
    capsys.readouterr()


@pytest.mark.parametrize("fixture", ["job_dir", "lmdb_job_dir"])
def test_state_dump_parquet_reads_column_wise_and_equals_the_row_path(
        fixture: str, request: pytest.FixtureRequest, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``dump --format parquet`` (heap table) goes through dstl.reader.columns and writes the
    rows of the row path, for every checkpoint and filter (keys, states, a key no one has);
    ``--table lmdb`` stays on the row path."""
    import pyarrow.parquet as pq
    from support.columnar import row_table, sorted_rows

    import dstl.reader.columns as columns
    from dstl.reader import CheckpointCatalog, open_read_only

    root, _ = request.getfixturevalue(fixture)
    calls: list[Any] = []
    real = columns.read_state_table

    def spy(*a: Any, **kw: Any) -> Any:
        calls.append(a[1:])
        return real(*a, **kw)

    monkeypatch.setattr(columns, "read_state_table", spy)
    catalog = CheckpointCatalog(open_read_only(str(root)))
    filters: list[tuple[list[str], dict[str, Any]]] = [
        ([], {}), (["--key", "k5", "--key", "k11"], {"keys": ["k5", "k11"]}),
        (["--state", "count", "--state", "attrs"], {"states": ["count", "attrs"]}),
        (["--key", "nobody"], {"keys": ["nobody"]})]
    nonempty = 0
    for cid in catalog.ids():
        for args, kw in filters:
            out = tmp_path / f"s{cid}-{len(calls)}.parquet"
            before = len(calls)
            assert main(["state", "dump", str(root), "--checkpoint", str(cid), "--format",
                         "parquet", "-o", str(out), *args]) == 0
            assert len(calls) == before + 1
            got = pq.read_table(out)
            want = row_table(catalog, cid, **kw)
            assert got.schema.names == want.schema.names
            assert sorted_rows(got) == sorted_rows(want), (cid, args)
            nonempty += got.num_rows > 0
        assert pq.read_table(tmp_path / f"s{cid}-{len(calls) - 1}.parquet").num_rows == 0
    assert nonempty >= 2 * len(catalog.ids())
    out = tmp_path / "lmdb.parquet"
    before = len(calls)
    assert main(["state", "dump", str(root), "--format", "parquet", "--table", "lmdb", "-o",
                 str(out)]) == 0
    assert len(calls) == before
    assert sorted_rows(pq.read_table(out)) == sorted_rows(row_table(catalog, None))


def test_state_dump_parquet_of_damaged_or_missing_objects_fails_like_the_row_path(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "state"
    store = open_store(str(root))
    job = MiniJob(store, partitions=1, seed=23, table="lmdb", retained=3)
    _snapshot_then_tail(job, 120, 30)
    from dstl.reader import CheckpointCatalog, open_read_only, task_states

    catalog = CheckpointCatalog(open_read_only(str(root)))
    handle = task_states(catalog.manifest(1))[0].handle
    snapshot = handle.materialized[0].key
    data = store.get(snapshot)
    store.delete([snapshot])
    store.put(snapshot, data[: len(data) // 2])
    outcomes = []
    for damage in ("truncated", "missing"):
        if damage == "missing":
            store.delete([snapshot])
        for fmt in (["--format", "parquet", "-o", str(tmp_path / f"{damage}.parquet")], []):
            code = main(["state", "dump", str(root), *fmt])
            err = capsys.readouterr().err
            assert snapshot in err, (damage, fmt, err)
            # "dstl state: <error type>: ...": the same type and exit code in both paths
            outcomes.append((code, err.split(":")[1].strip()))
    store.close()
    assert outcomes[0] == outcomes[1] and outcomes[2] == outcomes[3], outcomes
    assert outcomes[0][0] != 0 and outcomes[2][0] != 0
    assert outcomes[0][1] == "TruncatedObjectError"


def _row_path_lines(root: Path, cid: int | None, tmp_path: Path, **kw: Any) -> list[str]:
    """The JSON lines of the row path (read_state, heap table), as the CLI writes them."""
    from dstl.cli import state as cli_state
    from dstl.reader import CheckpointCatalog, open_read_only, read_state

    out = tmp_path / "row-path.jsonl"
    with open_read_only(str(root)) as store:
        cli_state._jsonl(read_state(CheckpointCatalog(store), cid, **kw), str(out))
    return sorted(out.read_text().splitlines())


@pytest.mark.parametrize("fixture", ["job_dir", "lmdb_job_dir"])
def test_state_dump_json_lines_read_column_wise_are_the_row_paths_bytes(
        fixture: str, request: pytest.FixtureRequest, tmp_path: Path,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import dstl.reader.columns as columns

    root, _ = request.getfixturevalue(fixture)
    calls: list[Any] = []
    real = columns.read_state_table
    monkeypatch.setattr(columns, "read_state_table",
                        lambda *a, **kw: calls.append(a) or real(*a, **kw))
    for cid in (None, 0):
        for args, kw in (([], {}), (["--key", "k5", "--state", "attrs"],
                                    {"keys": ["k5"], "states": ["attrs"]}),
                         (["--key", "nobody"], {"keys": ["nobody"]})):
            cp = [] if cid is None else ["--checkpoint", str(cid)]
            assert main(["state", "dump", str(root), *cp, *args]) == 0
            out, err = capsys.readouterr()
            lines = out.splitlines()
            assert sorted(lines) == _row_path_lines(root, cid, tmp_path, **kw), (cid, args)
            assert err.strip() == f"{len(lines)} rows"
    assert len(calls) == 6


def test_state_dump_json_lines_escape_keys_and_values_as_json_dumps(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Keys and values json.dumps escapes (quotes, backslashes, control characters, DEL,
    non-ASCII, astral characters, binary keys that are not UTF-8), every value shape: the
    column-wise lines are the row path's bytes."""
    from dstl.checkpoint import CheckpointCoordinator
    from dstl.keygroups import KeyGroupRange
    from dstl.storage import ChangelogStorage
    from materializer.backend import ChangelogKeyedStateBackend
    from materializer.states import (
        ListStateDescriptor,
        MapStateDescriptor,
        ValueStateDescriptor,
    )

    keys: list[str | bytes] = ["plain", 'q"uote', "back\\slash", "\x01ctl", "del\x7f",
                               "caf\u00e9", "\U0001f600", "", "tab\tnl\n", b"\xff\x00bin",
                               b"ascii-bytes"]
    values: list[Any] = [1, -(2**70), 2.5, float("nan"), "s\u00e9\"", b"\x00\xff", [1, "a"],
                         (1, b"x"), {"a": 1}, {1: "x"}, None, True]
    for table in ("heap", "lmdb"):
        root = tmp_path / table
        store = open_store(str(root))
        storage = ChangelogStorage(store=store)
        backend = ChangelogKeyedStateBackend(storage, "job/p0", KeyGroupRange(0, 15), 16,
                                             table=table, auto_materialize=False)
        try:
            v = backend.get_state(ValueStateDescriptor("v"))
            m = backend.get_state(MapStateDescriptor("m"))
            lst = backend.get_state(ListStateDescriptor("l"))
            for i, k in enumerate(keys):
                backend.set_current_key(k)
                if values[i % len(values)] is not None:
                    v.update(values[i % len(values)])
                m.put(f"u\u00e9{i}" if i % 2 else i, values[(i + 3) % len(values)])
                lst.add(values[(i + 5) % len(values)])
                if table == "lmdb" and i == len(keys) // 2:
                    backend.materialize_now()  # a snapshot, then a log after it
            coordinator = CheckpointCoordinator(store, job_id="job")
            coordinator.trigger(["p0"], checkpoint_id=0)
            h = backend.snapshot(0).result(timeout=30)
            coordinator.acknowledge(0, "p0", h.to_json_obj(), h.referenced_keys(), h.full_size,
                                    h.incremental_size)
            coordinator.close()
        finally:
            backend.close()
            storage.close()
            store.close()
        assert main(["state", "dump", str(root)]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert sorted(lines) == _row_path_lines(root, None, tmp_path), table
        assert len(lines) == 3 * len(keys) - 1  # one value state left unset
        assert any('"key":{"$b64":' in line for line in lines)
        assert any("\\ud83d\\ude00" in line for line in lines)


@pytest.mark.parametrize("keys", [
    ["a", "b c", "~!#[]{}"],            # plain: the vectorised path
    ["a", 'q"uote'], ["a", "back\\slash"], ["a", "del\x7f"], ["a", "\x1f"],  # one to escape
    ["a", "caf\u00e9", "\U0001f600"], [b"\xff\x00", "a"], [b"\x80"], []])
def test_state_json_lines_are_json_dumps_of_the_rows(keys: list[str | bytes]) -> None:
    """Each batch as a whole takes the vectorised or the row-by-row path: one key that needs an
    escape among plain ones must still be escaped."""
    from dstl.cli.state import _record
    from dstl.reader import StateRow
    from dstl.reader.arrow import STATE_SCHEMA, batches, state_json_lines

    rows = [StateRow(7, "p1", i, k, k if isinstance(k, bytes) else k.encode(), "s\"t", "map",
                     None if i % 2 else ("ns", 1), {"u": b"\x00"} if i % 2 else i, 2.5 * i)
            for i, k in enumerate(keys)]
    want = "".join(json.dumps(_record(r), separators=(",", ":")) + "\n" for r in rows)
    got = "".join(state_json_lines(b) for b in batches(rows, STATE_SCHEMA))
    assert got == want
