"""Forged v2 snapshots: a store whose snapshot object is valid on the outside (object crc, zstd
content checksum, a manifest recording its size) around a malicious LMDB data file.

Every case (:data:`support.forged_lmdb.FORGERIES`, Hypothesis-driven byte flips, the unmodified
object) is read along every path of ``support/read_forged.py`` — restore into LMDB (install by
rename), into the heap, rescaled (range copy, and a range spanning two snapshots), the column
reader (``dstl state dump``), ``dstl verify``, ``dstl inspect`` — each in a fresh process forked
from a server that has done the imports. The oracle, for every case:

* no path ends by a signal, a timeout or an untyped exception, and none reads an inconsistent
  state (listed entries that lookups do not find);
* a typed error names the snapshot object;
* the paths that succeed read the same state (compared on the key groups they share);
* ``verify`` fails if and only if ``restore-lmdb`` fails;
* after a failed ``restore-lmdb``, no table with a marker is left for the adopt path;
* a named forgery that breaks the file's structure fails typed on every path; one that leaves
  the file describing the model's state (``model``) reads the model's state or fails typed;
* the unmodified object reads the model's state on every path (the positive control).

CI: every named forgery once (but those marked ``deep``) and 40 flips (``FLIPS``);
``DSTL_DEEP=1``: every named forgery and 600 flips (4,200 path runs). ``read_forged.py <case>
<path>`` reruns one path of a kept case by hand.

The same paths and oracle run over a **delta** (snapshot format v3, ``support/forged_delta.py``):
the checkpoint names a full snapshot and a delta, the delta is replaced by each named delta
forgery (metadata that lies about the chain, entries in another key group, out of order, twice,
of an undescribed state, a full snapshot in its place, a truncation, another valid value) and by
byte flips anywhere in it (4 in CI, ``DELTA_FLIPS``; 200 with ``DSTL_DEEP=1``).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from support import forged_delta as D
from support import forged_lmdb as F
from support.read_forged import PATHS

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("forged")]

DEEP = os.environ.get("DSTL_DEEP") == "1"
FLIPS = 600 if DEEP else 40
ROOT = Path(__file__).resolve().parents[3]
READER = ROOT / "tests" / "support" / "read_forged.py"
SERVERS = max(2, min(4, os.cpu_count() or 2))
PATH_TIMEOUT_S = 180.0
#: the named forgeries read along the paths (the ``deep`` ones with ``DSTL_DEEP=1`` only)
NAMED = [f for f in F.FORGERIES if DEEP or not f.deep]


# --------------------------------------------------------------------------- running paths


@dataclass
class Result:
    """One path's outcome: ``outcome`` is read_forged's, or ``signal`` / ``timeout`` /
    ``no-result`` (the child ended without printing its line)."""

    path: str
    outcome: str
    error: str | None = None
    message: str | None = None
    state: Any = None
    key_groups: list[list[int]] | None = None
    stage: str | None = None

    def short(self) -> str:
        first = (self.message or "").strip().splitlines()
        at = f" (stage {self.stage})" if self.stage else ""
        return f"{self.outcome}{at} {self.error or ''}: {first[0][:160] if first else ''}".strip()


class _Server:
    def __init__(self) -> None:
        env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OPENBLAS_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, str(READER), "--serve"], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def run(self, case: Path, path: str) -> Result:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"case": str(case), "path": path,
                                          "timeout": PATH_TIMEOUT_S}) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        rc = reply["returncode"]
        if rc is None:
            return Result(path, "timeout", message=f"no result after {PATH_TIMEOUT_S:.0f} s")
        if rc < 0:
            return Result(path, "signal", signal.Signals(-rc).name, reply["stderr"][-1500:])
        if reply["line"] is None:
            return Result(path, "no-result", f"exit {rc}", reply["stderr"][-1500:])
        line = json.loads(reply["line"])
        return Result(path, line["outcome"], line["error"], line["message"], line["state"],
                      line["key_groups"], line.get("stage"))

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(30)
        self.proc.stdout.close()


class Readers:
    """:data:`SERVERS` read_forged servers; each case's paths run on them in parallel."""

    def __init__(self) -> None:
        self.idle: queue.Queue[_Server] = queue.Queue()
        self.servers = [_Server() for _ in range(SERVERS)]
        for s in self.servers:
            self.idle.put(s)
        self.executor = ThreadPoolExecutor(SERVERS, thread_name_prefix="forged-reader")
        self.lock = threading.Lock()

    def _run(self, case: Path, paths: tuple[str, ...]) -> list[Result]:
        server = self.idle.get()
        try:
            return [server.run(case, p) for p in paths]
        finally:
            self.idle.put(server)

    def submit(self, case: Path) -> list[Any]:
        """Every path of ``case`` (``adopt`` right after ``restore-lmdb``, on its server)."""
        groups = [("restore-lmdb", "adopt")] + [(p,) for p in PATHS if p != "restore-lmdb"]
        return [self.executor.submit(self._run, case, g) for g in groups]

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        for s in self.servers:
            s.close()


def collect(futures: list[Any]) -> dict[str, Result]:
    return {r.path: r for f in futures for r in f.result()}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> F.Built:
    return F.build_store(tmp_path_factory.mktemp("forged-original"))


@pytest.fixture(scope="module")
def readers() -> Iterator[Readers]:
    r = Readers()
    yield r
    r.close()


class Cases:
    """Forged objects installed in copies of the store, read along every path."""

    def __init__(self, built: F.Built, readers: Readers, root: Path) -> None:
        self.built = built
        self.readers = readers
        self.root = root
        self.original = built.object_bytes()

    def start(self, name: str, obj: bytes) -> tuple[Path, list[Any]]:
        case = self.root / name
        F.install(F.copy_store(self.built, case), obj)
        return case, self.readers.submit(case)

    def finish(self, case: Path, futures: list[Any]) -> dict[str, Result]:
        results = collect(futures)
        shutil.rmtree(case, ignore_errors=True)
        return results


@pytest.fixture(scope="module")
def named(built: F.Built, readers: Readers, tmp_path_factory: pytest.TempPathFactory
          ) -> dict[str, dict[str, Result]]:
    """Every named forgery and the unmodified object, read (in parallel) once per module."""
    cases = Cases(built, readers, tmp_path_factory.mktemp("forged-named"))
    objects = {"unmodified": F.reencode(cases.original, F.data_file(cases.original))}
    objects |= {f.name: f.make(built, cases.original) for f in NAMED}
    started = {name: cases.start(name, obj) for name, obj in objects.items()}
    return {name: cases.finish(*s) for name, s in started.items()}


# --------------------------------------------------------------------------- the oracle


def _covered(r: Result) -> set[int]:
    return {kg for a, b in r.key_groups or [] for kg in range(a, b + 1)}


def _rows_in(rows: list[list[Any]], kgs: set[int]) -> list[str]:
    return sorted(json.dumps(x, sort_keys=True) for x in rows if x[0] in kgs)


def _differ(a: list[str], b: list[str]) -> str:
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    sample = (only_a or only_b or [""])[0][:160]
    return f"{len(only_a)} rows only in the first, {len(only_b)} only in the second (e.g. {sample})"


def violations(built: F.Built, results: dict[str, Result], expect: str | None) -> list[str]:
    """What ``results`` (every path of one case) break of the oracle (module docstring);
    ``expect``: ``fail``, ``chain`` (``fail`` on every path that reads the checkpoint:
    ``inspect`` reads the object alone), ``model``, ``None`` or ``any`` (no promise about the
    state), ``unmodified``."""
    out = []
    bad = {"signal", "timeout", "no-result", "untyped", "inconsistent"}
    for r in results.values():
        if r.outcome in bad:
            out.append(f"{r.path}: {r.short()}")
        elif r.outcome == "typed" and built.target not in (r.message or ""):
            at = f" (stage {r.stage})" if r.stage else ""
            out.append(f"{r.path}: typed {r.error}{at} does not name {built.target}: "
                       f"{(r.message or '')[:200]}")
    readers = [r for r in results.values() if r.outcome == "ok" and r.key_groups]
    for i, a in enumerate(readers):
        for b in readers[i + 1:]:
            shared = _covered(a) & _covered(b)
            ra, rb = _rows_in(a.state, shared), _rows_in(b.state, shared)
            if ra != rb:
                out.append(f"{a.path} and {b.path} read different states: {_differ(ra, rb)}")
    lmdb, verify = results["restore-lmdb"], results["verify"]
    ended = {"ok", "typed", "inconsistent", "untyped"}
    if lmdb.outcome in ended and verify.outcome in ended and \
            (verify.outcome != "ok") != (lmdb.outcome not in ("ok", "inconsistent")):
        out.append(f"verify is {verify.outcome} but restore-lmdb is {lmdb.short()[:200]}")
    adopt = results["adopt"]
    if lmdb.outcome != "ok":
        if adopt.outcome != "ok":
            out.append(f"adopt check after the failed restore-lmdb: {adopt.short()}")
        elif adopt.state["marker"] is not None:
            out.append("the failed restore-lmdb left a table with a marker (adoptable): "
                       f"{adopt.state['marker'][:120]}")
    target = F.key_groups_of(F.TARGET_PARTITION)
    whole = set(range(target.start, target.end + 1))
    for r in readers:
        model = _rows_in(built.rows, _covered(r))
        if expect == D.DAMAGED and not whole <= _covered(r):
            if _rows_in(r.state, _covered(r)) != model:
                out.append(f"{r.path}: read part of the damaged file without error, and a "
                           "state other than the model's: "
                           f"{_differ(_rows_in(r.state, _covered(r)), model)}")
        elif expect in (F.FAIL, D.CHAIN, D.DAMAGED):
            same = "the model's" if _rows_in(r.state, _covered(r)) == model else "another"
            out.append(f"{r.path}: read the forged file without error ({len(r.state)} rows, "
                       f"{same} state)")
        elif expect in (F.MODEL, "unmodified") and _rows_in(r.state, _covered(r)) != model:
            out.append(f"{r.path}: read a state other than the model's: "
                       f"{_differ(_rows_in(r.state, _covered(r)), model)}")
    for r in results.values():
        if r.path in PATHS and r.outcome == "ok" and not r.key_groups and (
                expect in (F.FAIL, D.DAMAGED) or (expect == D.CHAIN and r.path != "inspect")):
            out.append(f"{r.path}: accepted the forged file")
    if expect == "unmodified":
        out += [f"{r.path}: {r.short()}" for r in results.values()
                if r.outcome != "ok" and r.outcome not in bad]
    return out


# --------------------------------------------------------------------------- the tests


def test_the_snapshot_has_every_shape_the_forgeries_need(built: F.Built) -> None:
    f = F.LmdbFile(F.data_file(built.object_bytes()))
    assert len(f.levels) >= 3 and len(f.branches) >= 3, "a tree of depth >= 3"
    assert len(f.overflow) >= 3, "overflow pages"
    assert any(count > 1 for count in _overflow_counts(f)), "multi-page values"
    assert f.pages * f.psize == len(f.data) == (f.meta_u64(F.M_LAST) + 1) * f.psize
    keys = [f.key(n) for n in f.leaf_nodes()]
    assert keys == sorted(keys) and keys[-2:] == [F.LAYOUT_KEY, b"\xff\xffdstl-marker"]
    kgs = F.key_groups_of(F.TARGET_PARTITION)
    assert {int.from_bytes(k[:2], "big") for k in keys[:-2]} == set(range(kgs.start, kgs.end + 1))
    assert {r[1] for r in built.rows} == {"v", "l", "m"} and len(built.rows_in(kgs)) > 500
    original = built.object_bytes()
    for forgery in F.FORGERIES:
        assert forgery.make(built, original) != original, forgery.name


def _overflow_counts(f: F.LmdbFile) -> list[int]:
    return [int.from_bytes(f.data[pg * f.psize + 12:pg * f.psize + 16], "little")
            for pg in f.overflow]


def test_unmodified_snapshot_reads_the_model_on_every_path(
        built: F.Built, named: dict[str, dict[str, Result]]) -> None:
    results = named["unmodified"]
    assert set(results) == {*PATHS, "adopt"}
    problems = violations(built, results, "unmodified")
    assert not problems, "\n".join(problems)
    for r in results.values():
        if r.key_groups:
            assert r.state == F.sorted_rows(r.state)
            assert _rows_in(r.state, _covered(r)) == _rows_in(built.rows, _covered(r)), r.path


@pytest.mark.parametrize("forgery", NAMED, ids=[f.name for f in NAMED])
def test_named_forgery(built: F.Built, named: dict[str, dict[str, Result]],
                       forgery: F.Forgery) -> None:
    problems = violations(built, named[forgery.name], forgery.expect)
    assert not problems, f"{forgery.name} ({forgery.expect}):\n" + "\n".join(problems)


_REGIONS = [r for r, w in F.REGIONS.items() for _ in range(w)]
_FLIP = st.tuples(st.sampled_from(_REGIONS), st.integers(0, 1 << 30),
                  st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 0xFF]))


def test_random_flips(built: F.Built, readers: Readers,
                      tmp_path_factory: pytest.TempPathFactory) -> None:
    """Byte flips weighted into meta pages, branch pages, leaf node headers, leaf keys and
    overflow page headers; the oracle without a promise about the state."""
    original = built.object_bytes()
    targets = F.flip_targets(F.LmdbFile(F.data_file(original)))
    drawn: list[tuple[tuple[int, int], ...]] = []

    @settings(max_examples=FLIPS, phases=[Phase.generate], database=None, deadline=None,
              derandomize=not DEEP)
    @given(st.lists(_FLIP, min_size=1, max_size=3))
    def draw(flips: list[tuple[str, int, int]]) -> None:
        chosen: dict[int, int] = {}   # one mask per offset: a second flip would undo the first
        for region, i, mask in flips:
            chosen.setdefault(targets[region][i % len(targets[region])], mask)
        positions = tuple(chosen.items())
        if positions not in drawn:
            drawn.append(positions)

    draw()
    assert len(drawn) >= FLIPS // 2
    cases = Cases(built, readers, tmp_path_factory.mktemp("forged-flips"))
    problems: list[str] = []
    window: list[tuple[tuple[tuple[int, int], ...], Path, list[Any]]] = []

    def finish_one() -> None:
        positions, case, futures = window.pop(0)
        found = violations(built, cases.finish(case, futures), None)
        problems.extend(f"flip {list(positions)}: {p}" for p in found)

    for n, positions in enumerate(drawn):
        case, futures = cases.start(f"flip-{n}", F.flipped(original, positions))
        window.append((positions, case, futures))
        if len(window) > 2 * SERVERS:
            finish_one()
    while window:
        finish_one()
    assert not problems, f"{len(problems)} violations in {len(drawn)} flipped files:\n" + \
        "\n".join(problems)


def test_key_groups_of_the_paths_meet_the_target(built: F.Built,
                                                 named: dict[str, dict[str, Result]]) -> None:
    """The state comparisons are not vacuous: every pair of reading paths shares key groups of
    the forged snapshot."""
    target = set(range(F.key_groups_of(F.TARGET_PARTITION).start,
                       F.key_groups_of(F.TARGET_PARTITION).end + 1))
    readers = [r for r in named["unmodified"].values() if r.key_groups]
    assert {r.path for r in readers} == {"restore-lmdb", "restore-heap", "restore-rescale",
                                         "reader"}
    for r in readers:
        assert _covered(r) & target


# --------------------------------------------------------------------------- deltas (format v3)
# The same paths and oracle over a chain: partition 1's checkpoint names a full v2 snapshot and a
# delta, and the delta is the object replaced (support/forged_delta.py).

DELTA_FLIPS = 200 if DEEP else 4


@pytest.fixture(scope="module")
def built_delta(tmp_path_factory: pytest.TempPathFactory) -> F.Built:
    return D.build_delta_store(tmp_path_factory.mktemp("forged-delta-original"))


@pytest.fixture(scope="module")
def named_delta(built_delta: F.Built, readers: Readers,
                tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Result]]:
    cases = Cases(built_delta, readers, tmp_path_factory.mktemp("forged-delta-named"))
    objects = {"unmodified": cases.original}
    objects |= {f.name: f.make(built_delta, cases.original) for f in D.DELTA_FORGERIES}
    started = {name: cases.start(name, obj) for name, obj in objects.items()}
    return {name: cases.finish(*s) for name, s in started.items()}


def test_the_delta_case_is_a_chain_with_puts_and_tombstones(built_delta: F.Built) -> None:
    from materializer.delta_format import decode_delta
    meta, blocks = decode_delta(built_delta.object_bytes(), key=built_delta.target)
    entries = [e for es in blocks.values() for e in es]
    assert meta.key_groups == F.key_groups_of(F.TARGET_PARTITION)
    assert any(e[3] is None for e in entries) and any(e[3] is not None for e in entries)
    original = built_delta.object_bytes()
    for forgery in D.DELTA_FORGERIES:
        assert forgery.make(built_delta, original) != original, forgery.name


def test_unmodified_delta_reads_the_model_on_every_path(
        built_delta: F.Built, named_delta: dict[str, dict[str, Result]]) -> None:
    results = named_delta["unmodified"]
    problems = violations(built_delta, results, "unmodified")
    assert not problems, "\n".join(problems)
    assert any(r.key_groups for r in results.values())


@pytest.mark.parametrize("forgery", D.DELTA_FORGERIES, ids=[f.name for f in D.DELTA_FORGERIES])
def test_named_delta_forgery(built_delta: F.Built, named_delta: dict[str, dict[str, Result]],
                             forgery: F.Forgery) -> None:
    problems = violations(built_delta, named_delta[forgery.name], forgery.expect)
    assert not problems, f"{forgery.name} ({forgery.expect}):\n" + "\n".join(problems)


def test_random_delta_flips(built_delta: F.Built, readers: Readers,
                            tmp_path_factory: pytest.TempPathFactory) -> None:
    """Byte flips anywhere in the delta: every one breaks a checksum, so every path that reads
    the whole delta fails typed, naming it; a restore onto a sub-range reads only its key
    groups' blocks (the oracle's ``damaged``)."""
    import random
    seed = 29
    print("seed", seed)
    original = built_delta.object_bytes()
    drawn = D.flip_positions(original, random.Random(seed), DELTA_FLIPS)
    cases = Cases(built_delta, readers, tmp_path_factory.mktemp("forged-delta-flips"))
    started = [(positions, *cases.start(f"flip-{n}", D.flipped(original, positions)))
               for n, positions in enumerate(drawn)]
    problems = []
    for positions, case, futures in started:
        found = violations(built_delta, cases.finish(case, futures), D.DAMAGED)
        problems.extend(f"flip {list(positions)}: {p}" for p in found)
    assert not problems, f"{len(problems)} violations in {len(drawn)} flipped deltas:\n" + \
        "\n".join(problems)
