"""release_free_memory: the free pages of the heap go back to the system."""

from __future__ import annotations

import platform
from pathlib import Path

from materializer.heap import release_free_memory


def _anon_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_freed_blocks_between_live_ones_are_returned() -> None:
    assert platform.libc_ver()[0] == "glibc", "these tests run on glibc (malloc_trim)"
    release_free_memory()
    # 600-byte blocks come from malloc's heap (pymalloc serves 512 bytes and less); one in 16
    # stays alive, so the heap cannot shrink from its top
    blocks = [bytes(600) for _ in range(200_000)]
    live = blocks[::16]
    del blocks
    before = _anon_mb()
    assert release_free_memory() is True
    after = _anon_mb()
    print(f"anonymous memory {before:.0f} MB -> {after:.0f} MB")
    assert before - after > 50
    assert all(len(b) == 600 for b in live)  # what stays allocated is intact
