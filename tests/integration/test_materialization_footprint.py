"""What a file-level materialization of an LMDB table costs besides the table: the copy streams
through a pipe into the compressor (no uncompressed copy on disk or in memory), the object is
spooled in an unnamed file, and nothing is left beside the table — from another process (the
executor agent's materializer) and in the writer's own process."""

from __future__ import annotations

import json
import os
import random
import stat
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from materializer import BackendOptions, ChangelogKeyedStateBackend, ValueStateDescriptor
from materializer.lmdb_table import LmdbTableSnapshot

MP = 16
KGS = KeyGroupRange(0, MP - 1)
OP = "op-footprint"
NO_TIMER = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)
ENTRIES = 30_000
#: Chunks a streamed write holds at most besides the object: the compressor's input chunk
#: (4 MiB), its output and Python's buffers around them.
CHUNK_ALLOWANCE = 12 << 20

# The agent's materializer in a process of its own (py-lmdb opens an environment once per
# process), with the copy and the directory beside the table watched.
_MATERIALIZE = r"""
import json, os, stat, sys, tracemalloc
from dstl.keygroups import KeyGroupRange
from dstl.stores import open_store
from materializer.external import materialize_table_directory
from materializer.lmdb_table import LmdbTableSnapshot
directory, store_uri, end = sys.argv[1], sys.argv[2], int(sys.argv[3])
parent = os.path.dirname(directory)
seen = {}
copy_to = LmdbTableSnapshot.copy_to
def watched(self, fd):
    seen["fifo"] = stat.S_ISFIFO(os.fstat(fd).st_mode)
    seen["copy_size"] = self.copy_size()
    seen["beside"] = sorted(os.listdir(parent))
    copy_to(self, fd)
LmdbTableSnapshot.copy_to = watched
before = sorted(os.listdir(parent))
tracemalloc.start()
m = materialize_table_directory(directory, KeyGroupRange(0, end), open_store(store_uri))
peak = tracemalloc.get_traced_memory()[1]
print(json.dumps({"peak": peak, "size": m.ref.size, "before": before,
                  "after": sorted(os.listdir(parent)), **seen}))
"""


@pytest.fixture
def storage(tmp_path: Path) -> Iterator[ChangelogStorage]:
    s = ChangelogStorage(str(tmp_path / "store"), options=DstlOptions(persist_delay_s=0.0))
    yield s
    s.close()


def _filled(storage: ChangelogStorage, local: Path) -> ChangelogKeyedStateBackend:
    """A table of ``ENTRIES`` compressible 1 KiB values (its copy ~10x its object), checkpointed
    with its marker as a Spark task leaves it."""
    b = ChangelogKeyedStateBackend(storage, OP, KGS, MP, table="lmdb", options=NO_TIMER,
                                   local_directory=str(local))
    state = b.get_state(ValueStateDescriptor("v"))
    rng = random.Random(5)
    with b.write_batch():
        for i in range(ENTRIES):
            b.set_current_key(f"key-{i:07d}")
            state.update(f"{rng.getrandbits(64):016x}" + "text " * 200)
        h = b.snapshot(1).result(30)
        b.write_table_marker(h)
    b.notify_checkpoint_complete(1)
    return b


def test_agent_materialization_streams_the_copy_and_leaves_nothing(storage: ChangelogStorage,
                                                                   tmp_path: Path) -> None:
    b = _filled(storage, tmp_path / "local")
    try:
        out = subprocess.run([sys.executable, "-c", _MATERIALIZE, b.tables.path,
                              str(tmp_path / "store"), str(MP - 1)], capture_output=True,
                             text=True, timeout=120, check=True)
        r: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        b.close()
    assert r["fifo"], "the copy went to a file, not to the compressor's pipe"
    # no named file appears beside the table while the copy runs, nor stays after it
    assert r["beside"] == r["before"] == r["after"]
    assert r["copy_size"] > 8 * r["size"]   # the point: the copy is much larger than the object
    assert r["peak"] <= r["size"] + CHUNK_ALLOWANCE, (
        f"held {r['peak']} bytes in memory for an object of {r['size']} bytes")


def test_in_process_materialization_streams_the_copy(storage: ChangelogStorage,
                                                     tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's own materialization (no agent): same pipeline, Python memory bounded by the
    object, nothing left beside the table."""
    fifo: list[bool] = []
    copy_to = LmdbTableSnapshot.copy_to

    def watched(self: LmdbTableSnapshot, fd: int) -> None:
        fifo.append(stat.S_ISFIFO(os.fstat(fd).st_mode))
        copy_to(self, fd)

    monkeypatch.setattr(LmdbTableSnapshot, "copy_to", watched)
    b = _filled(storage, tmp_path / "local")
    try:
        parent = os.path.dirname(b.tables.path)
        before = sorted(os.listdir(parent))
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            start = tracemalloc.get_traced_memory()[0]
            ref = b.materialize_now(timeout_s=60)
            peak = tracemalloc.get_traced_memory()[1] - start
        finally:
            tracemalloc.stop()
        assert ref is not None
        assert fifo == [True]
        assert sorted(os.listdir(parent)) == before
        assert peak <= ref.size + CHUNK_ALLOWANCE, (
            f"held {peak} bytes in memory for an object of {ref.size} bytes")
    finally:
        b.close()
