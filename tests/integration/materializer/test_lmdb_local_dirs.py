"""LMDB local directories: a new backend never adopts the rows a killed
process left in its directory (only an explicit ``adopt_local=True`` does, as the Spark task's
adopt path with the table marker), and the temporary directories of killed processes and of
constructors that failed midway do not pile up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.errors import UsageError
from dstl.stores import MemoryBlobStore
from materializer.backend import ChangelogKeyedStateBackend
from materializer.options import BackendOptions
from materializer.states import ValueStateDescriptor

MP = 16
ALL = KeyGroupRange(0, MP - 1)
OPTS = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)
ROOT = Path(__file__).resolve().parents[3]

#: Writes k0..k9 into an LMDB backend (argv[1]: local directory, or "" for a temp directory),
#: prints the table's path, and SIGKILLs itself: nothing is closed or cleaned up.
_CHILD = """
import os, signal, sys
sys.path.insert(0, sys.argv[2])
from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.stores import MemoryBlobStore
from materializer.backend import ChangelogKeyedStateBackend
from materializer.options import BackendOptions
from materializer.states import ValueStateDescriptor
s = ChangelogStorage(store=MemoryBlobStore(), options=DstlOptions(persist_delay_s=0.0))
b = ChangelogKeyedStateBackend(s, "op", KeyGroupRange(0, 15), 16, table="lmdb",
                               options=BackendOptions(materialization_interval_s=None,
                                                      materialize_log_ratio=None),
                               local_directory=sys.argv[1] or None)
v = b.get_state(ValueStateDescriptor("v"))
for i in range(10):
    b.set_current_key(f"k{i}")
    v.update(i)
print(b.tables.path, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _killed_child(local_directory: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run([sys.executable, "-c", _CHILD, local_directory, str(ROOT)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    path = proc.stdout.strip()
    assert os.path.isdir(path), proc.stdout
    return path


@pytest.fixture
def storage() -> Iterator[ChangelogStorage]:
    s = ChangelogStorage(store=MemoryBlobStore(), options=DstlOptions(persist_delay_s=0.0))
    yield s
    s.close()


def _values(b: ChangelogKeyedStateBackend) -> dict[str, int]:
    v = b.get_state(ValueStateDescriptor("v"))
    out = {}
    for i in range(10):
        b.set_current_key(f"k{i}")
        if v.value() is not None:
            out[f"k{i}"] = v.value()
    return out


def test_a_new_backend_never_adopts_a_killed_process_table(storage: ChangelogStorage,
                                                          tmp_path: Path) -> None:
    local = tmp_path / "local"
    local.mkdir()
    _killed_child(str(local))
    b = ChangelogKeyedStateBackend(storage, "op", ALL, MP, table="lmdb", options=OPTS,
                                   local_directory=str(local))
    try:
        assert _values(b) == {}  # the killed process's rows are gone, not adopted
        assert b.snapshot(1).result(10).non_materialized == ()
    finally:
        b.close()


def test_adopting_a_local_table_is_explicit(storage: ChangelogStorage, tmp_path: Path) -> None:
    local = tmp_path / "local"
    local.mkdir()
    _killed_child(str(local))
    b = ChangelogKeyedStateBackend(storage, "op", ALL, MP, table="lmdb", options=OPTS,
                                   local_directory=str(local), adopt_local=True)
    try:
        assert _values(b) == {f"k{i}": i for i in range(10)}
    finally:
        b.close()
    with pytest.raises(UsageError, match="adopt_local"):
        ChangelogKeyedStateBackend(storage, "op", ALL, MP, table="lmdb", options=OPTS,
                                   local_directory=str(local), adopt_local=True,
                                   clear_local=True)
    with pytest.raises(UsageError, match="adopt_local"):
        ChangelogKeyedStateBackend(storage, "op", ALL, MP, table="heap", options=OPTS,
                                   adopt_local=True)


def _own_dirs(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("dstl-lmdb-"))


def test_temp_directories_of_killed_processes_are_removed(storage: ChangelogStorage,
                                                          tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    first = _killed_child("", env={"TMPDIR": str(tmp)})
    assert [os.path.dirname(first)] == [str(tmp / d) for d in _own_dirs(tmp)]
    second = _killed_child("", env={"TMPDIR": str(tmp)})
    # the second process already removed the first one's directory
    assert [os.path.dirname(second)] == [str(tmp / d) for d in _own_dirs(tmp)]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    b = ChangelogKeyedStateBackend(storage, "op", ALL, MP, table="lmdb", options=OPTS)
    try:
        assert _values(b) == {}
        assert len(_own_dirs(tmp)) == 1  # only the live backend's own directory
    finally:
        b.close()
    assert _own_dirs(tmp) == []


def test_a_failed_constructor_leaves_no_temp_directory(storage: ChangelogStorage,
                                                       tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    live = ChangelogKeyedStateBackend(storage, "op", ALL, MP, table="lmdb", options=OPTS)
    try:
        assert len(_own_dirs(tmp_path)) == 1
        with pytest.raises(UsageError, match="already open"):  # the same log id twice
            ChangelogKeyedStateBackend(storage, "op", ALL, MP, table="lmdb", options=OPTS)
        assert len(_own_dirs(tmp_path)) == 1
        # a failure while the table opens: the writer and the directory are released
        import materializer.lmdb_table as lmdb_table

        def broken(*args: object, **kwargs: object) -> None:
            raise OSError("injected: cannot open the environment")

        monkeypatch.setattr(lmdb_table, "LmdbStateTable", broken)
        with pytest.raises(OSError, match="injected"):
            ChangelogKeyedStateBackend(storage, "other", ALL, MP, table="lmdb", options=OPTS)
        assert len(_own_dirs(tmp_path)) == 1
        monkeypatch.undo()
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        again = ChangelogKeyedStateBackend(storage, "other", ALL, MP, table="heap", options=OPTS)
        again.close()  # the failed constructor released the log id "other"
    finally:
        live.close()
    assert _own_dirs(tmp_path) == []
