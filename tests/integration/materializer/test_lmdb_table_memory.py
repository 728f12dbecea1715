"""An LMDB state table does not keep a large transaction's pages in memory: LMDB (without
``writemap``) keeps the page buffers of a write transaction for reuse until its environment
closes, so the table reopens it after a batch that may have changed many pages — unless a
snapshot or a scan of the process still reads from it — and a bulk load commits before its
transaction holds that many."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dstl import KeyGroupRange
from materializer.lmdb_table import RELEASE_PAGES_BYTES, LmdbStateTable

KGS = KeyGroupRange(0, 31)

_BATCH = r"""
import json, os, sys
from dstl.keygroups import KeyGroupRange
from materializer.lmdb_table import LmdbStateTable
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
t = LmdbStateTable(sys.argv[1], KeyGroupRange(0, 31), map_size_bytes=1 << 30)
value = os.urandom(150).hex().encode()
start = anon()
with t.write_batch():
    for i in range(100_000):
        t.put(1, i % 32, b"key-%09d" % i, b"", value)
print(json.dumps({"kept": anon() - start, "entries": len(t)}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssAnon from /proc")
def test_a_large_batch_leaves_no_pages_in_memory(tmp_path: Path) -> None:
    """100 k puts of 300 bytes in one batch: LMDB's page buffers of that transaction (~50 MB)
    are gone once the batch ends."""
    out = subprocess.run([sys.executable, "-c", _BATCH, str(tmp_path / "t")],
                         capture_output=True, text=True, timeout=120, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["entries"] == 100_000
    assert r["kept"] < RELEASE_PAGES_BYTES, f"{r['kept']} bytes of anonymous memory kept"


def _fill(t: LmdbStateTable, n: int, value: bytes, start: int = 0) -> None:
    with t.write_batch():
        for i in range(start, start + n):
            t.put(1, i % 32, b"key-%09d" % i, b"", value)


def test_open_snapshots_and_scans_keep_reading_across_a_large_batch(tmp_path: Path) -> None:
    """A snapshot and an ``entries()`` scan opened before a large batch read their own view
    after it (the environment is not reopened under them); the next large batch without them
    reopens it, and the table goes on as before."""
    t = LmdbStateTable(str(tmp_path / "t"), KGS, map_size_bytes=1 << 28)
    try:
        _fill(t, 20_000, b"a" * 200)
        env = t._env
        snap = t.snapshot()
        scan = t.entries(1, 0)
        first = next(scan)
        large = RELEASE_PAGES_BYTES // 4096 + 1000   # more changes than pages to release
        _fill(t, large, b"b" * 200)
        assert t._env is env   # still the same environment
        # the layout and dictionary records and the snapshot's entries
        assert t.dictionaries == [0] and snap.entry_count() == 20_002
        rest = list(scan)
        assert len(rest) + 1 == 20_000 // 32 and first[2] == b"a" * 200
        snap.release()
        _fill(t, large, b"c" * 200, start=large)
        assert t._env is not env   # reopened: its page buffers are gone
        assert t.get(1, 0, b"key-%09d" % 0, b"") == b"b" * 200
        assert len(t) == max(20_000, 2 * large)
    finally:
        t.close()


def test_a_bulk_load_commits_before_its_transaction_holds_too_many_pages(tmp_path: Path
                                                                        ) -> None:
    """The replay's bulk load: a change set of many small changes (each may change a whole
    page) commits at the next step once the changes could fill the page budget, not only after
    ``COMMIT_BYTES`` of change sets."""
    t = LmdbStateTable(str(tmp_path / "t"), KGS, map_size_bytes=1 << 28)
    try:
        commits = []
        with t.bulk_load() as load:
            real_commit = t._commit_batch_txn

            def counting(batch: object) -> None:
                commits.append(1)
                real_commit(batch)   # type: ignore[arg-type]

            t._commit_batch_txn = counting   # type: ignore[method-assign]
            for step in range(3):
                load.step(64 << 10)   # 64 KiB of change sets: far below COMMIT_BYTES
                prefix = load.prefix(step, 1)
                load.put_raw([(prefix + (9).to_bytes(4, "big") + b"k%08d" % i, b"v")
                              for i in range(RELEASE_PAGES_BYTES // 4096 + 1)])
        assert len(commits) >= 2   # at the steps after each large change set, then the end
    finally:
        t.close()
