"""The reading commands (``checkpoints list|show``, ``verify``, ``state dump|changes``) refuse a
root that is not a DSTL store — an empty or mistyped directory or prefix, a Spark checkpoint
directory, a directory of other files — with exit 2 and a message naming the root, what is there
and the fix; a DSTL store without a checkpoint yet (DSTL's layout, no manifest) still lists
nothing and exits 0."""

from __future__ import annotations

from pathlib import Path

import pytest

from dstl import ChangelogStorage, KeyGroupRange
from dstl.cli import main
from dstl.stores import open_store

READING = (["checkpoints", "list"], ["checkpoints", "show"], ["verify"], ["state", "dump"],
           ["state", "changes"])


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2, argv
    captured = capsys.readouterr()
    assert captured.out == "", argv
    return captured.err


def test_an_empty_directory_is_no_store(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "typo"
    root.mkdir()
    for cmd in READING:
        err = _error(capsys, [*cmd, str(root)])
        assert err == (f"dstl {cmd[0]}: NoStoreError: no DSTL store at {root}: it is empty; "
                       "pass the state_uri the job writes to (a DSTL store holds objects below "
                       "checkpoints/, dstl/ or snapshots/)\n"), cmd


def test_a_spark_checkpoint_directory_is_named(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "chk"
    for name in ("offsets/0", "commits/0", "metadata", "sources/0/0"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("v1\n")
    for cmd in READING:
        err = _error(capsys, [*cmd, str(root)])
        assert (f"no DSTL store at {root}: it holds a Spark checkpoint (offsets/, commits/); "
                "pass the operator's state_uri, not the query's checkpointLocation") in err, cmd


def test_other_files_are_listed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "other"
    for name in ("a.csv", "b.json", "c/d", "e", "f", "g", "h"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x")
    err = _error(capsys, ["checkpoints", "list", str(root)])
    assert (f"no DSTL store at {root}: it holds other files (a.csv, b.json, c/, e, f, ... 7 "
            "entries)") in err


def test_a_store_without_a_checkpoint_lists_nothing(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "state"
    store = open_store(str(root))
    with ChangelogStorage(store=store) as storage:
        writer = storage.create_writer("op-0", KeyGroupRange(0, 3))
        writer.append(1, b"change")
        writer.persist(0, -1).result(10)
        writer.close()
    store.close()
    assert [p.name for p in root.iterdir()] == ["dstl"]
    assert main(["checkpoints", "list", str(root)]) == 0
    assert f"0 checkpoints in {root}" in capsys.readouterr().err
    assert main(["state", "changes", str(root)]) == 0
    assert main(["checkpoints", "show", str(root)]) == 2
    assert "CheckpointNotFoundError" in capsys.readouterr().err
