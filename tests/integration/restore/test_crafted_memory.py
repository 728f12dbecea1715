"""Bounded memory on crafted objects (docs/guarantees.md, "Untrusted stores").

Every crafted object of at most 1 MiB (``support.crafted``: zstd frames declaring gigabytes, zstd
bombs, pickle bombs, JSON bombs and nesting, handles of 2^62) is read in a fresh process the way
DSTL meets it — a restore from it (ranged reads, then through the restore cache, which verifies
the whole object), or its decoder — and that process must peak below 256 MiB RSS, with either no
error or a DSTL error (``support/read_crafted.py`` caps the address space at 4 GiB, so a decoder
that allocates gigabytes fails as ``MemoryError`` instead of swapping). A resource bound, not a
timing. A 44 MiB manifest with a bad CRC is included: it must be refused before it is
parsed.

``python tests/integration/restore/test_crafted_memory.py`` prints the table of peak RSS per object for
the report (docs/guarantees.md, "Untrusted stores").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/ (when run as a script)

from support.crafted import Crafted, MiB, crafted_objects

READER = Path(__file__).resolve().parents[2] / "support" / "read_crafted.py"
ROOT = Path(__file__).resolve().parents[3]
LIMIT_KIB = 256 * 1024
CRAFTED = crafted_objects()


def read_in_child(c: Crafted, directory: Path) -> dict[str, object]:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "spec.json").write_text(json.dumps({"read": c.read, "key": c.key,
                                                     "name": c.name}))
    (directory / "object").write_bytes(c.data)
    if c.handle:
        (directory / "handle.json").write_text(c.handle)
    env = {**os.environ, "MALLOC_ARENA_MAX": "2",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(READER), str(directory)], capture_output=True,
                          text=True, timeout=240, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
@pytest.mark.parametrize("crafted", CRAFTED, ids=[c.name for c in CRAFTED])
def test_reading_a_crafted_object_peaks_below_256_mib(crafted: Crafted, tmp_path: Path) -> None:
    assert len(crafted.data) <= MiB or "44 MiB" in crafted.name
    result = read_in_child(crafted, tmp_path / "case")
    assert result["outcome"] in ("ok", "typed"), result
    peak = result["peak_kib"]
    assert isinstance(peak, int) and peak < LIMIT_KIB, (
        f"{crafted.name}: peak RSS {peak / 1024:.0f} MiB ({crafted.what}): {result}")


def main() -> None:
    """Print the report table: object, size, outcome, peak RSS."""
    import tempfile

    print("| crafted object | size | outcome | peak RSS |")
    print("|---|---:|---|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for i, c in enumerate(CRAFTED):
            r = read_in_child(c, Path(tmp) / str(i))
            outcome = r["outcome"] if r["outcome"] == "ok" else f"{r['outcome']}: {r['error']}"
            peak = int(r["peak_kib"])  # type: ignore[call-overload]
            print(f"| {c.name} | {len(c.data):,} B | {outcome} | {peak / 1024:.0f} MiB |")


if __name__ == "__main__":
    main()
