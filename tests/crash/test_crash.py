"""SIGKILL crash suite (reliability matrix R1 and R2): G1, G2, G3, G5.

A child process (``crash_child.py``) runs the mini job of ``tests/support/job_model.py`` —
heap or LMDB backends on one storage, a coordinator with retention, materializations — against
a local directory, S3 on moto or HDFS (a MiniDFSCluster; the moto server and the cluster live
in this process, so they survive every kill), and journals each checkpoint's intended state
before triggering it and an ACK only after its commit returned. This process SIGKILLs the child

- at **named points** (it pauses there and says so through a marker file): inside a segment
  upload, after a segment landed but before DSTL heard of it, inside a snapshot upload, inside the
  manifest put, after the manifest landed, halfway through a delete, between commit and ACK;
- at **random moments** (a uniform delay after the child finished its recovery, with a
  materialization timer running so snapshot uploads overlap writes and checkpoints),

then checks the store with the oracle (``job_model.check_store``): the recovered checkpoint is at
least the last acknowledged one, every retained checkpoint restores to exactly its journaled
model, every object a manifest names exists. The next child continues from what was recovered,
so every test crashes the same store several times. At the end a clean run must succeed, and
orphan collection must leave exactly the objects the retained checkpoints name.

Sizes: CI 7 points x 4 targets + 2 random kills x 4 targets = 36 kills (heap on the local
store, LMDB on local, S3 and HDFS), plus the incremental targets;
``DSTL_DEEP=1`` (``make test-deep``): 7 points x 6 targets x 25 rounds + 8 x 10 random kills x 6
targets = 1530 kills, split into tests of one round (7 kills) or ten random kills each.
The self-tests run the child with a deliberate bug and require the oracle to report it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from support import moto_server
from support.job_model import (
    INCREMENTAL,
    JOB_ID,
    JobConfig,
    JournalView,
    all_objects,
    check_store,
    expected_objects,
    journal_path,
)
from support.minidfs import hdfs_uri

from dstl.checkpoint import CheckpointCoordinator
from dstl.stores import open_store
from materializer.options import BackendOptions

moto_endpoint = moto_server.moto_endpoint
s3_bucket = moto_server.s3_bucket

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("crash_child.py")
DEEP = os.environ.get("DSTL_DEEP") == "1"
POINTS = ("segment-put", "segment-landed", "snapshot-put", "manifest-put", "manifest-landed",
          "delete", "before-ack")
#: Rounds of the named points per target (each round is one test on a fresh store: all seven
#: points, each child continuing from what the previous kill left).
NAMED_ROUNDS = 25 if DEEP else 1
#: Random kills per target: chunks (one test on a fresh store each) of kills.
RANDOM_CHUNKS, RANDOM_KILLS = (8, 10) if DEEP else (1, 2)
#: A child that neither pauses nor finishes within this is hung: the test fails.
CHILD_TIMEOUT_S = 120.0
#: Random kills land this long after the child finished its recovery.
RANDOM_DELAY_S = (0.0, 1.5)
#: At a named point the kill comes this long after the child paused there: the paused thread
#: stays paused, the rest of the child runs on. A correct job cannot acknowledge anything that
#: waits for the paused operation; one that acknowledges too early does so within a few ms and
#: is caught. (Well below the job's ``upload_timeout_s``, 5 s: a paused upload is not retried.)
LINGER_S = (0.0, 0.3)

TARGETS = [pytest.param(("local", "heap"), id="local-heap"),
           pytest.param(("local", "lmdb"), id="local-lmdb"),
           pytest.param(("s3", "lmdb"), id="s3-lmdb", marks=pytest.mark.s3),
           pytest.param(("hdfs", "lmdb"), id="hdfs-lmdb", marks=pytest.mark.hdfs)]
if DEEP:  # the heap on the remote stores (the heap and each store are in CI on their own)
    TARGETS += [pytest.param(("s3", "heap"), id="s3-heap", marks=pytest.mark.s3),
                pytest.param(("hdfs", "heap"), id="hdfs-heap", marks=pytest.mark.hdfs)]
#: Incremental materialization (full snapshots and the deltas after them, shared by
#: checkpoints): pieces deleted exactly when no retained checkpoint names them.
INCREMENTAL_TARGETS = [pytest.param(("local", "heap", True), id="local-heap-incremental"),
                       pytest.param(("local", "lmdb", True), id="local-lmdb-incremental")]


@dataclass
class Target:
    """One store the children crash on, and the directory of their journal."""

    url: str
    storage_options: dict[str, Any]
    work: Path
    table: str
    incremental: bool = False
    kills: int = 0
    log: list[str] = field(default_factory=list)

    def config(self) -> JobConfig:
        if self.incremental:
            return JobConfig(table=self.table, backend_options=BackendOptions(
                materialization_interval_s=None, materialize_log_ratio=None, **INCREMENTAL))
        return JobConfig(table=self.table)

    def deltas_written(self) -> int:
        """Deltas the children reported writing (their logs)."""
        return sum(Path(p).read_text().count("deltas written:") for p in self.log)

    def check(self) -> list[str]:
        """The oracle over a direct view of the store (no pausing wrapper)."""
        store = open_store(self.url, dict(self.storage_options))
        try:
            view = JournalView.read(journal_path(self.work))
            problems = [f"FAILED CHECKPOINT without an injected fault: {e}"
                        for e in view.errors]
            return problems + check_store(store, view, self.config(),
                                          local_dir=str(self.work / "check"))
        finally:
            store.close()


@pytest.fixture
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Target:
    where, table, *incremental = request.param
    work = tmp_path / "work"
    work.mkdir()
    if where == "local":
        return Target(str(tmp_path / "store"), {}, work, table, bool(incremental))
    if where == "hdfs":  # the MiniDFSCluster of tests/support/minidfs.py
        return Target(hdfs_uri(request.getfixturevalue("hdfs_cluster"), "crash"), {}, work,
                      table)
    endpoint = request.getfixturevalue("moto_endpoint")
    bucket = request.getfixturevalue("s3_bucket")
    return Target(f"s3://{bucket}/job", moto_server.s3_storage_options(endpoint), work, table)


def run_child(t: Target, seed: int, *, pause_at: str = "", kill_after_s: float | None = None,
              checkpoints: int = 40, mat_interval_s: float = 0.0, bug: str = "",
              linger_s: float = 0.0, materialize_probability: float | None = None
              ) -> str | None:
    """Run one child; kill it ``linger_s`` after it paused at its point, or ``kill_after_s``
    after its recovery.

    Returns:
        The kill point (``"random"`` for a timed kill), or ``None`` if the child finished.
    """
    for name in ("paused", "ready"):
        (t.work / name).unlink(missing_ok=True)
    cmd = [sys.executable, str(CHILD), "--store", t.url, "--storage-options",
           json.dumps(t.storage_options), "--work", str(t.work), "--seed", str(seed),
           "--table", t.table, "--checkpoints", str(checkpoints), "--pause-at", pause_at,
           "--mat-interval", str(mat_interval_s), "--bug", bug]
    if t.incremental:
        # materialize often, so that chains of deltas form between the kills
        cmd.append("--incremental")
        materialize_probability = materialize_probability or 0.8
    if materialize_probability is not None:
        cmd += ["--materialize-probability", str(materialize_probability)]

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
           "PYTHONDONTWRITEBYTECODE": "1"}
    log_path = t.work / f"child-{len(t.log)}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    t.log.append(str(log_path))
    try:
        point = _wait_for_kill_moment(t, proc, pause_at, kill_after_s)
        if point is not None and point != "random":
            time.sleep(linger_s)
        if point is not None:
            os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    if point is None and code != 0:
        raise AssertionError(f"child (seed={seed}) exited with {code}:\n{_tail(log_path)}")
    if point is not None:
        t.kills += 1
    return point


def _wait_for_kill_moment(t: Target, proc: subprocess.Popen[bytes], pause_at: str,
                          kill_after_s: float | None) -> str | None:
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    kill_at: float | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return None
        if pause_at and (t.work / "paused").exists():
            return (t.work / "paused").read_text()
        if kill_after_s is not None and kill_at is None and (t.work / "ready").exists():
            kill_at = time.monotonic() + kill_after_s
        if kill_at is not None and time.monotonic() >= kill_at:
            return "random"
        time.sleep(0.005)
    raise AssertionError(f"child neither paused nor finished in {CHILD_TIMEOUT_S}s "
                         f"({pause_at or 'random'}):\n{_tail(Path(t.log[-1]))}")


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def assert_consistent(t: Target, what: str) -> None:
    problems = t.check()
    assert not problems, f"after {what} (target {t.url}, {t.table}):\n" + "\n".join(problems) \
        + f"\nlast child log:\n{_tail(Path(t.log[-1]))}"


def finish_cleanly(t: Target, seed: int) -> None:
    """A last run without a kill must succeed, and orphan collection must leave exactly the
    objects of the retained checkpoints (and restore must still be exact)."""
    assert run_child(t, seed, checkpoints=5) is None
    assert_consistent(t, "a clean run after the crashes")
    store = open_store(t.url, dict(t.storage_options))
    try:
        coord = CheckpointCoordinator.recover(store, JOB_ID, retained=t.config().retained)
        coord.collect_orphans(min_age_s=0)
        coord.run_deletions()  # stale manifests left by killed commits
        coord.close()
        assert all_objects(store) == expected_objects(store, t.config())
    finally:
        store.close()
    assert_consistent(t, "orphan collection")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("round_no", range(NAMED_ROUNDS))
@pytest.mark.parametrize("target", TARGETS + INCREMENTAL_TARGETS, indirect=True)
def test_sigkill_at_named_points(target: Target, round_no: int) -> None:
    rng = random.Random(20_140 + round_no)
    print(f"seed={20_140 + round_no}")
    for point in POINTS:
        nth = rng.randint(1, 3)
        linger = rng.uniform(*LINGER_S)
        got = run_child(target, rng.randrange(1 << 30), pause_at=f"{point}:{nth}",
                        linger_s=linger)
        assert got == point, f"the child finished without reaching {point}:{nth}"
        assert_consistent(target, f"a kill {linger:.3f}s after pausing at {point}:{nth} "
                                  f"(round {round_no})")
    finish_cleanly(target, 7)
    print(f"{target.url} {target.table}: {target.kills} kills at named points")
    assert target.kills == len(POINTS)
    if target.incremental:
        assert target.deltas_written() > 0, "no delta was written: the target tests nothing new"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("chunk", range(RANDOM_CHUNKS))
@pytest.mark.parametrize("target", TARGETS + INCREMENTAL_TARGETS[1:], indirect=True)
def test_sigkill_at_random_moments(target: Target, chunk: int) -> None:
    rng = random.Random(20_141 + 1000 * chunk)
    print(f"seed={20_141 + 1000 * chunk}")
    for i in range(RANDOM_KILLS):
        delay = rng.uniform(*RANDOM_DELAY_S)
        got = run_child(target, rng.randrange(1 << 30), kill_after_s=delay, checkpoints=100_000,
                        mat_interval_s=0.05)
        assert got == "random"
        assert_consistent(target, f"random kill {i} after {delay:.3f}s")
    finish_cleanly(target, 8)
    print(f"{target.url} {target.table}: {target.kills} kills at random moments")
    assert target.kills == RANDOM_KILLS
    if target.incremental:
        assert target.deltas_written() > 0, "no delta was written: the target tests nothing new"


# --------------------------------------------------------------------------- self-tests


@pytest.mark.parametrize("target", [TARGETS[0]], indirect=True)
def test_oracle_reports_an_acknowledgement_before_the_upload(target: Target) -> None:
    """A job that journals its ACK before the segment upload, killed during that upload,
    has acknowledged a checkpoint that does not exist: the oracle must say LOST."""
    assert run_child(target, 11, pause_at="segment-put:1",
                     bug="ack-before-durable") == "segment-put"
    problems = target.check()
    assert any(p.startswith("LOST: checkpoint 1 was acknowledged") for p in problems), problems


@pytest.mark.parametrize("target", [TARGETS[0]], indirect=True)
def test_oracle_reports_a_store_that_returns_before_the_write_is_stored(target: Target) -> None:
    """Puts that return at once while the write goes on in the background: the segment put
    pauses there, the job goes on and commits checkpoints that name it; the kill (after the
    same kind of linger the named points use) leaves manifests naming a missing object. (No
    materializations here: a snapshot taken after the lost segment would make the retained
    checkpoints independent of it, and the loss invisible in the end state.)"""
    assert run_child(target, 13, pause_at="segment-put:2", bug="async-put", linger_s=0.1,
                     materialize_probability=0.0) == "segment-put"
    problems = target.check()
    assert any(p.startswith(("ATOMICITY", "LOST")) for p in problems), problems


@pytest.mark.parametrize("target", [TARGETS[0]], indirect=True)
def test_oracle_reports_a_write_the_backend_never_saw(target: Target) -> None:
    assert run_child(target, 12, checkpoints=1, bug="drop-write") is None
    problems = target.check()
    assert any(p.startswith("MISMATCH: checkpoint 1 backend op-0") and "k0" in p
               for p in problems), problems
