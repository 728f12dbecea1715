"""LmdbStateTable: snapshots while writing, reopen, map growth and its limit, the fork rule."""

from __future__ import annotations

import hashlib
import os
import random
import struct
import subprocess
import sys
import threading
from pathlib import Path

import lmdb
import pytest

from dstl.errors import ClosedError, StateTableFullError, UnsupportedFormatError, UsageError
from dstl.keygroups import KeyGroupRange
from materializer import ForkedTableError, LmdbStateTable, SnapshotReader

RANGE = KeyGroupRange(0, 15)


def _table(path: Path, **kw: int) -> LmdbStateTable:
    kw.setdefault("map_size_bytes", 1 << 20)
    kw.setdefault("max_map_size_bytes", 1 << 28)
    return LmdbStateTable(path, RANGE, **kw)  # type: ignore[arg-type]


def test_snapshot_is_written_out_while_a_writer_thread_continues(tmp_path: Path) -> None:
    t = _table(tmp_path / "env")
    try:
        model = {}
        with t.write_batch():
            for i in range(5000):
                kg = i % 16
                t.put(1, kg, b"k%06d" % i, b"", b"v%d" % i)
                model[(1, kg, b"k%06d" % i, b"")] = b"v%d" % i
        snap = t.snapshot()
        started = threading.Event()
        stop = threading.Event()
        written: list[int] = []

        def writer() -> None:
            i = 0
            while not stop.is_set() or i < 2000:
                with t.write_batch():
                    for _ in range(50):
                        t.put(1, i % 16, b"k%06d" % (i % 6000), b"", b"new%d" % i)
                        i += 1
                started.set()
            written.append(i)

        th = threading.Thread(target=writer, name="dstl-test-lmdb-writer")
        th.start()
        try:
            started.wait()
            data = snap.to_bytes(metadata=b"m")  # on this thread, while the writer commits
        finally:
            stop.set()
            th.join()
        got = {(sid, kg, k, ns): v for kg, es in SnapshotReader(data).read()
               for sid, k, ns, v in es}
        assert got == model
        assert written and written[0] >= 2000
        assert t.get(1, 0, b"k000000", b"") != b"v0"
    finally:
        t.close()


def test_reopen_after_close_sees_the_data_and_close_is_idempotent(tmp_path: Path) -> None:
    t = _table(tmp_path / "env")
    t.put(3, 5, b"key", b"ns", b"value")
    t.close()
    t.close()
    with pytest.raises(ClosedError, match="reopen"):
        t.get(3, 5, b"key", b"ns")
    with _table(tmp_path / "env") as again:
        assert again.get(3, 5, b"key", b"ns") == b"value"


def test_map_grows_when_full_and_batches_stay_atomic(tmp_path: Path) -> None:
    t = _table(tmp_path / "env", map_size_bytes=1 << 20, max_map_size_bytes=1 << 26)
    try:
        rng = random.Random(3)   # incompressible values: the dictionary cannot shrink them
        values = [rng.randbytes(1000) for _ in range(6000)]
        value = values[5]
        with t.write_batch():
            for i in range(6000):  # ~6 MB in one transaction: several doublings + replays
                t.put(0, i % 16, b"%d" % i, b"", values[i])
        assert t.map_size_bytes >= 8 << 20
        assert len(t) == 6000
        assert t.get(0, 5, b"5", b"") == value
        for i in range(200):  # single-op transactions grow too
            t.put(1, 0, b"%d" % i, b"", value * 20)
        assert t.get(1, 0, b"199", b"") == value * 20
    finally:
        t.close()


def test_full_at_max_map_size_is_a_typed_error_naming_the_setting(tmp_path: Path) -> None:
    t = _table(tmp_path / "env", map_size_bytes=1 << 20, max_map_size_bytes=2 << 20)
    try:
        t.put(0, 0, b"before", b"", b"ok")
        with pytest.raises(StateTableFullError, match="max_map_size_bytes") as info, \
                t.write_batch():
            for i in range(5000):
                t.put(0, i % 16, b"%d" % i, b"", b"y" * 1000)
        assert info.value.setting == "max_map_size_bytes"
        assert info.value.path == str(tmp_path / "env")
        assert t.get(0, 0, b"before", b"") == b"ok"
        assert t.get(0, 1, b"1", b"") is None  # the failed batch left nothing behind
        t.put(0, 0, b"after", b"", b"still usable")
        assert t.get(0, 0, b"after", b"") == b"still usable"
    finally:
        t.close()


def test_growth_waits_for_an_open_snapshot_to_be_released(tmp_path: Path) -> None:
    reached_remap = threading.Event()

    class Observed(LmdbStateTable):
        def _remap(self, new_size: int, *, wait_for_snapshots: bool = True) -> None:
            if wait_for_snapshots:
                reached_remap.set()
            super()._remap(new_size, wait_for_snapshots=wait_for_snapshots)

    t = Observed(tmp_path / "env", RANGE, map_size_bytes=1 << 20, max_map_size_bytes=1 << 26)
    try:
        t.put(0, 0, b"old", b"", b"1")
        snap = t.snapshot()
        errors: list[BaseException] = []

        def writer() -> None:
            try:
                with t.write_batch():
                    for i in range(4000):
                        t.put(0, i % 16, b"%d" % i, b"", b"z" * 1000)
            except BaseException as exc:
                errors.append(exc)

        th = threading.Thread(target=writer, name="dstl-test-lmdb-grower")
        th.start()
        reached_remap.wait()
        data = snap.to_bytes()  # still valid: the resize has not happened yet
        th.join()
        assert not errors, errors
        assert [e[1] for _, es in SnapshotReader(data).read() for e in es] == [b"old"]
        assert len(t) == 4001
    finally:
        t.close()


def test_growth_blocked_by_a_snapshot_gives_up_with_a_hint(tmp_path: Path) -> None:
    t = LmdbStateTable(tmp_path / "env", RANGE, map_size_bytes=1 << 20,
                       max_map_size_bytes=1 << 26, grow_wait_s=0.05)
    try:
        snap = t.snapshot()
        with pytest.raises(StateTableFullError, match="open snapshot"), t.write_batch():
            for i in range(4000):
                t.put(0, i % 16, b"%d" % i, b"", b"z" * 1000)
        snap.release()
        t.put(0, 0, b"k", b"", b"v")
    finally:
        t.close()


def test_forked_child_never_uses_the_parent_environment(tmp_path: Path) -> None:
    t = _table(tmp_path / "env")
    try:
        t.put(0, 1, b"k", b"", b"parent")
        snap = t.snapshot()  # an open read transaction at fork time
        pid = os.fork()
        if pid == 0:  # child: report through the exit code only, never return into pytest
            code = 1
            try:
                try:
                    t.get(0, 1, b"k", b"")
                    code = 2
                except ForkedTableError as exc:
                    code = 3 if exc.opened_pid == os.getppid() else 4
                t.close()  # must not touch the parent's environment
                if code == 3:
                    try:  # py-lmdb: the inherited environment blocks reopening in the child
                        LmdbStateTable(tmp_path / "env", RANGE)
                        code = 5
                    except UsageError as exc:
                        code = 0 if "already open in this process" in str(exc) else 7
            except BaseException:
                code = 6
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        # the parent's environment and its snapshot are intact
        assert t.get(0, 1, b"k", b"") == b"parent"
        t.put(0, 1, b"k2", b"", b"after fork")
        assert [e[1] for _, es in SnapshotReader(snap.to_bytes()).read() for e in es] == [b"k"]
    finally:
        t.close()


def test_keys_values_and_ids_are_validated(tmp_path: Path) -> None:
    with _table(tmp_path / "env") as t:
        with pytest.raises(UsageError, match="key limit"):
            t.put(0, 0, b"k" * 600, b"", b"v")
        with pytest.raises(UsageError, match="bytes"):
            t.put(0, 0, b"k", b"", "str")  # type: ignore[arg-type]
        with pytest.raises(UsageError, match="bytes"):
            t.get(0, 0, "str", b"")  # type: ignore[arg-type]
        with pytest.raises(UsageError, match="state id"):
            t.put(70000, 0, b"k", b"", b"v")
        with pytest.raises(UsageError):
            t.snapshot().to_bytes(encode=lambda *a: (b"", b"", b""))


def test_unknown_key_layout_is_refused(tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path / "env"), map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"\xff\xffdstl-layout", b"9")
    env.close()
    with pytest.raises(UnsupportedFormatError, match="layout"):
        _table(tmp_path / "env")


def test_cached_pid_is_refreshed_in_a_forked_child_and_checked(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """The fork check compares with a pid cached in the module (no getpid system call per
    operation): the at-fork hook must refresh it in a child, and a stale value must refuse."""
    from materializer import lmdb_table

    pid = os.fork()
    if pid == 0:
        os._exit(0 if os.getpid() == lmdb_table._CURRENT_PID else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert os.getpid() == lmdb_table._CURRENT_PID
    t = _table(tmp_path / "env")
    try:
        t.put(0, 1, b"k", b"", b"v")
        # a process whose cached pid differs from the table's (as in a child without the hook's
        # _forked flag) must be refused, not run LMDB code
        monkeypatch.setattr(lmdb_table, "_CURRENT_PID", os.getpid() + 1)
        with pytest.raises(ForkedTableError):
            t.put(0, 1, b"k", b"", b"w")
        with pytest.raises(ForkedTableError):
            t.get(0, 1, b"k", b"")
        monkeypatch.setattr(lmdb_table, "_CURRENT_PID", os.getpid())
        assert t.get(0, 1, b"k", b"") == b"v"
    finally:
        t.close()


def test_count_state_counts_one_states_records_in_every_key_group(tmp_path: Path) -> None:
    t = _table(tmp_path / "t")
    try:
        kgs = list(t.key_groups)
        for i, kg in enumerate(kgs):
            for j in range(i + 1):  # i + 1 records of state 1 in the i-th key group
                t.put(1, kg, f"k{j}".encode(), b"", b"v")
            t.put(0, kg, b"zero", b"", b"v")  # the neighbouring state ids are not counted
            t.put(2, kg, b"two", b"ns", b"v")
        t.write_marker(b"marker")
        n1 = sum(range(1, len(kgs) + 1))
        assert t.count_state(1) == n1
        assert t.count_state(0) == t.count_state(2) == len(kgs)
        assert t.count_state(3) == 0
        assert t.stats()["entries"] == n1 + 2 * len(kgs) + t.fixed_records()
        assert t.fixed_records() >= 2  # the layout and the marker record
    finally:
        t.close()


def test_a_batch_larger_than_the_journal_memory_survives_map_growth(tmp_path: Path) -> None:
    """A write batch whose journal passed JOURNAL_MEMORY_BYTES (the rest in a temporary file)
    hits a full map several times: every put replayed, a remove's result kept; an aborted one
    leaves nothing."""
    from materializer.lmdb_table import JOURNAL_MEMORY_BYTES

    t = _table(tmp_path / "env", map_size_bytes=JOURNAL_MEMORY_BYTES, max_map_size_bytes=1 << 28)
    # incompressible values (the table's dictionary would shrink repeated ones)
    value = random.Random(7).randbytes(1808)
    n = 2 * JOURNAL_MEMORY_BYTES // len(value)
    noise = random.Random(8).randbytes(1800 * n)

    def numbered(i: int) -> bytes:
        return noise[1800 * i:1800 * (i + 1)] + b"%08d" % i

    try:
        with t.write_batch():
            t.put(1, 0, b"gone", b"", b"x")
            for i in range(n):
                t.put(1, i % 4, b"k%08d" % i, b"", numbered(i))
            assert t.remove(1, 0, b"gone", b"") is True
            t.put_many([(2, 1, b"m%05d" % i, b"", b"v") for i in range(1000)])
        # its pages outgrew the journal's memory: the map grew after the file took over
        assert os.path.getsize(tmp_path / "env" / "data.mdb") > 2 * JOURNAL_MEMORY_BYTES
        assert t.get(1, 0, b"gone", b"") is None
        for i in range(0, n, 997):
            assert t.get(1, i % 4, b"k%08d" % i, b"") == numbered(i)
        assert t.get(1, (n - 1) % 4, b"k%08d" % (n - 1), b"") == numbered(n - 1)
        assert t.get(2, 1, b"m00999", b"") == b"v"

        class Boom(Exception):
            pass

        with pytest.raises(Boom), t.write_batch():
            for i in range(n):
                t.put(3, i % 4, b"a%08d" % i, b"", value)
            raise Boom
        assert t.get(3, 0, b"a%08d" % 0, b"") is None
        assert sorted(os.listdir(tmp_path)) == ["env"]  # no journal file left
    finally:
        t.close()


# --------------------------------------------------------------------------- key layout "2"


def _text(i: int) -> bytes:
    """A 200-byte value like a state's string (compressible with a dictionary)."""
    return (b"%08d:" % i) + hashlib.sha256(b"%d" % i).hexdigest().encode() * 2 + b"x" * 63


def _stored(t: LmdbStateTable) -> dict[bytes, bytes]:
    snap = t.snapshot()
    try:
        return dict(snap.records())
    finally:
        snap.release()


@pytest.mark.parametrize("n", [1500, 3000])
def test_the_first_large_batch_trains_a_dictionary_and_every_read_decodes(
        tmp_path: Path, n: int) -> None:
    """1,500 values: trained when the batch ends, every value rewritten; 3,000: trained at the
    2,000th sample, the later values encoded as they come."""
    t = _table(tmp_path / "env")
    try:
        assert t.layout == b"2" and t.dictionaries == []
        with t.write_batch():
            t.put(2, 3, b"small", b"", b"tiny")
            for i in range(n):
                t.put(1, i % 16, b"k%06d" % i, b"", _text(i))
            assert t.get(1, 5, b"k000005", b"") == _text(5)   # the batch reads its writes
        assert t.dictionaries == [0]
        stored = _stored(t)
        assert stored[b"\xff\xffdstl-dict\x00"] and stored[b"\xff\xffdstl-layout"] == b"2"
        framed = [v for k, v in stored.items() if k[:2] != b"\xff\xff" and v[0] == 1]
        assert len(framed) == n and sum(map(len, framed)) < n * len(_text(0)) // 2
        assert t.get(2, 3, b"small", b"") == b"tiny"
        assert t.get(1, 7, b"k000007", b"") == _text(7)
        assert [v for _, _, v in t.entries(1, 4)] == [_text(i) for i in range(4, n, 16)]
        snap = t.snapshot()
        try:
            assert snap.get_many([(1, 9, b"k000009", b""), (1, 9, b"none", b"")]) \
                == [_text(9), None]
            assert [e[3] for e in snap.entries(4) if e[0] == 1] == \
                [_text(i) for i in range(4, n, 16)]
        finally:
            snap.release()
    finally:
        t.close()
    with _table(tmp_path / "env") as again:   # reopened: the dictionary is read back
        assert again.dictionaries == [0]
        assert again.get(1, 11, b"k000011", b"") == _text(11)
        with again.write_batch():   # a written dictionary never changes: no second one
            for i in range(n):
                again.put(1, i % 16, b"j%06d" % i, b"", _text(i + n))
        assert again.dictionaries == [0]
        assert again.get(1, 3, b"j000003", b"") == _text(3 + n)


def test_an_aborted_batch_leaves_no_dictionary_and_removed_samples_stay_removed(
        tmp_path: Path) -> None:
    class Boom(Exception):
        pass

    t = _table(tmp_path / "env")
    try:
        with pytest.raises(Boom), t.write_batch():
            for i in range(2500):   # trains at the 2,000th value, then aborts
                t.put(1, i % 16, b"k%06d" % i, b"", _text(i))
            assert t.dictionaries == [0]
            raise Boom
        assert t.dictionaries == [] and len(t) == 0
        assert b"\xff\xffdstl-dict\x00" not in _stored(t)
        with t.write_batch():
            for i in range(1200):
                t.put(1, i % 16, b"k%06d" % i, b"", _text(i))
            t.remove(1, 0, b"k000000", b"")           # sampled, then removed: stays removed
            t.put(1, 1, b"k000001", b"", b"short")    # sampled, then overwritten
        assert t.dictionaries == [0]
        assert t.get(1, 0, b"k000000", b"") is None
        assert t.get(1, 1, b"k000001", b"") == b"short"
        assert t.get(1, 2, b"k000002", b"") == _text(2)
    finally:
        t.close()


def test_a_layout_1_table_stays_layout_1(tmp_path: Path) -> None:
    """Values as they are, no dictionary (a table written before layout "2", or installed
    from such a snapshot file)."""
    env = lmdb.open(str(tmp_path / "env"), map_size=1 << 20)
    with env.begin(write=True) as txn:
        txn.put(b"\xff\xffdstl-layout", b"1")
        txn.put(b"\x00\x03\x00\x01\x00\x00\x00\x01a", b"\x00raw")
    env.close()
    t = _table(tmp_path / "env")
    try:
        assert t.layout == b"1"
        assert t.get(1, 3, b"a", b"") == b"\x00raw"
        with t.write_batch():
            for i in range(1500):
                t.put(1, i % 16, b"k%06d" % i, b"", _text(i))
        assert t.dictionaries == []
        assert _stored(t)[b"\x00\x05\x00\x01\x00\x00\x00\x07k000005"] == _text(5)
        assert t.get(1, 5, b"k000005", b"") == _text(5)
    finally:
        t.close()


_WRITE = """
import hashlib, sys
sys.path.insert(0, sys.argv[2])
from dstl.keygroups import KeyGroupRange
from materializer.lmdb_table import LmdbStateTable
t = LmdbStateTable(sys.argv[1], KeyGroupRange(0, 15), map_size_bytes=1 << 20)
with t.write_batch():
    for i in range(int(sys.argv[3])):
        t.put(1, i % 16, b"k%06d" % i, b"",
              (b"%08d:" % i) + hashlib.sha256(b"%d" % i).hexdigest().encode() * 2 + b"x" * 63)
print(t.dictionaries)
t.close()
"""


def test_a_read_only_open_learns_the_dictionary_the_writer_trains_later(tmp_path: Path) -> None:
    """The executor agent opens a worker's table read-only; the worker trains afterwards."""
    root = str(Path(__file__).resolve().parents[3])
    env = str(tmp_path / "env")

    def write(n: int) -> str:
        return subprocess.run([sys.executable, "-c", _WRITE, env, root, str(n)], check=True,
                              capture_output=True, text=True, timeout=120).stdout.strip()

    assert write(1) == "[]"
    ro = LmdbStateTable(env, RANGE, readonly=True)
    try:
        assert ro.layout == b"2" and ro.dictionaries == []
        assert write(1500) == "[0]"
        assert ro.get(1, 7, b"k000007", b"") == _text(7)
        assert ro.dictionaries == [0]
        snap = ro.snapshot()
        try:
            assert [e[3] for e in snap.entries(5)] == [_text(i) for i in range(5, 1500, 16)]
        finally:
            snap.release()
    finally:
        ro.close()


def test_a_bulk_load_trains_the_dictionary_too(tmp_path: Path) -> None:
    """A restore's runs of records (``put_raw``) are samples like puts are."""
    t = _table(tmp_path / "env")
    try:
        with t.bulk_load() as bulk:
            bulk.put_raw([(bulk.prefix(i % 16, 1) + struct.pack(">I", 7) + b"k%06d" % i,
                           _text(i)) for i in range(1200)])
        assert t.dictionaries == [0]
        framed = [v for k, v in _stored(t).items() if k[:2] != b"\xff\xff" and v[0] == 1]
        assert len(framed) == 1200
        assert t.get(1, 9, b"k000009", b"") == _text(9)
    finally:
        t.close()
