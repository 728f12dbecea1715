"""S3 faults as S3 produces them (reliability matrix R4): G1, G3, G5, G6, G7.

Real DSTL work — the mini job of ``tests/support/job_model.py``: three heap backends writing value,
list and map states, checkpoints committed by the coordinator with retention (deletes),
materializations (snapshot puts), then a restart that recovers (list, get) and restores (ranged
gets) — runs against moto through ``tests/support/s3_fault_proxy.py``, a separate HTTP proxy
process. Every fault kind x operation is one case, in two phases:

- **transient** (per target: one fault alone, one request through, then two faults in a row):
  every checkpoint commits, and the oracle finds no acknowledged checkpoint lost, every retained
  checkpoint restoring to exactly its model, and exactly the retained manifests and the objects
  they name in the bucket (no duplicate, no leak) — except objects whose write the proxy held
  past the client's timeout, which may land after their cleanup (they are allowed, by name);
- **permanent** (every matching request fails): the operation that needs it gives a typed error
  within ``retry_deadline_s`` + one read timeout (measured), nothing half-done becomes visible,
  and after the fault clears the job recovers and the oracle passes again.

Sizes: CI runs a covering subset (``CI_TRANSIENT``, ``CI_PERMANENT``: every operation and every
kind in each phase, 15 + 7 = 22 cases); ``DSTL_DEEP=1`` runs all 6 kinds x 5 operations in both
phases and moves the transient faults to 4 positions (``SKIPS``): 120 + 30 = 150 cases. Besides, the throttling backoff itself
is measured at the proxy (503 ``SlowDown`` on each operation, 500 ``InternalError`` on put and
get: 7 cases): with the jitter's draw fixed, each retry must wait at least its exponential
backoff, and no retry may start past the deadline.

Operations: ``put`` (segments, snapshots, manifests), ``get`` (manifests on recovery),
``ranged_get`` (restore), ``list`` (recovery, orphan collection), ``delete`` (retention, segment
release, ghost cleanup). Kinds: 500 ``InternalError``, 503 ``SlowDown``, connection reset,
truncated body, stall past the read timeout, response lost after the request was applied.
The self-tests break the write path on purpose and require the oracle to notice.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import random
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support import moto_server
from support.job_model import (
    JOB_ID,
    JobConfig,
    Journal,
    JournalView,
    MiniJob,
    check_objects,
    check_store,
)
from support.s3_fault_proxy import KINDS, FaultProxy, Rule

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.checkpoint import CheckpointCoordinator
from dstl.errors import (
    DstlError,
    ThrottledError,
    TransientStorageError,
    UploadFailedError,
)
from dstl.registry import SegmentRegistry
from dstl.retry import RetryPolicy
from dstl.stores import FsspecBlobStore, open_store
from materializer import BackendOptions

moto_endpoint = moto_server.moto_endpoint
s3_bucket = moto_server.s3_bucket

pytestmark = [pytest.mark.s3, pytest.mark.slow]

OPERATIONS = ("put", "get", "ranged_get", "list", "delete")
DEEP = os.environ.get("DSTL_DEEP") == "1"
#: Requests of each target let through before the first fault (deep runs move the faults, and
#: restart the job more often so that later positions exist for every operation).
SKIPS = (0, 1, 2, 3) if DEEP else (0,)
RESTARTS = 3 if DEEP else 1
#: The (operation, kind) pairs CI runs: each operation with the kinds its callers handle apart
#: (the write path: every kind that can hide or repeat an upload), each kind at least twice.
CI_TRANSIENT = (("put", "slowdown"), ("put", "reset"), ("put", "stall"), ("put", "lost_response"),
                ("get", "internal_error"), ("get", "truncate"), ("get", "lost_response"),
                ("ranged_get", "reset"), ("ranged_get", "truncate"), ("ranged_get", "stall"),
                ("list", "slowdown"), ("list", "lost_response"),
                ("delete", "internal_error"), ("delete", "stall"), ("delete", "lost_response"))
CI_PERMANENT = (("put", "stall"), ("put", "lost_response"), ("get", "slowdown"),
                ("ranged_get", "reset"), ("ranged_get", "truncate"), ("list", "internal_error"),
                ("delete", "stall"))
#: The client's read timeout; a stall holds a request longer than that.
READ_TIMEOUT_S = 1
STALL_S = 1.5
#: Two faults in a row must be absorbed: four attempts and a deadline that fits two stalls leave
#: room for one more failure that a loaded CI machine may add by itself (a slow answer).
OPTIONS = DstlOptions(
    persist_delay_s=0.002, preemptive_persist_threshold_bytes=2048, upload_timeout_s=1.5,
    upload_retry_delay_s=0.05, upload_max_attempts=4, retry_backoff_base_s=0.05,
    retry_backoff_max_s=0.4, retry_deadline_s=4.0, read_max_attempts=4)
CONFIG = JobConfig(table="heap", n_backends=2, retained=2, materialize_probability=0.5,
                   options=OPTIONS, backend_options=BackendOptions(
                       materialization_interval_s=None, materialize_log_ratio=None))
#: Permanent faults: a shorter deadline (the retries cannot succeed anyway).
PERMANENT = dataclasses.replace(CONFIG, options=OPTIONS.replace(retry_deadline_s=1.5))
#: When the fault is permanent, the typed error must arrive within this after the first failed
#: request: the deadline, plus the attempt in flight at the deadline (bounded by the read
#: timeout; an upload gives up at the deadline itself), plus scheduling slack on a loaded
#: 2-core machine.
TYPED_ERROR_BOUND_S = PERMANENT.options.retry_deadline_s + READ_TIMEOUT_S + 1.0
#: The error a caller gets when each operation fails for good.
TYPED = {"put": UploadFailedError, "get": TransientStorageError,
         "ranged_get": TransientStorageError, "list": TransientStorageError,
         "delete": TransientStorageError}


@pytest.fixture(scope="session")
def fault_proxy(moto_endpoint: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy.start(moto_endpoint)
    try:
        yield proxy
    finally:
        proxy.stop()


@dataclass
class Env:
    """One bucket behind the proxy, a journal, and what the oracle found."""

    proxy: FaultProxy
    endpoint: str
    bucket: str
    work: Path
    seed: int = 0
    config: JobConfig = CONFIG

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.journal = Journal(self.work / "journal.jsonl")

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/job"

    def proxied(self) -> Any:
        opts = moto_server.s3_storage_options(self.proxy.endpoint)
        opts["config_kwargs"] = {"connect_timeout": READ_TIMEOUT_S,
                                 "read_timeout": READ_TIMEOUT_S}
        return open_store(self.url, opts, retry=RetryPolicy.for_store(self.config.options))

    def direct(self) -> Any:
        return open_store(self.url, moto_server.s3_storage_options(self.endpoint))

    def open_job(self, store: Any = None) -> MiniJob:
        view = JournalView.read(self.journal.path)
        return MiniJob.open(store if store is not None else self.proxied(), self.config,
                            intents=view.intents, journal=self.journal)

    def step(self, job: MiniJob, *, materialize: bool = True) -> None:
        job.write(self.rng)
        if materialize:
            job.materialize(self.rng)
        job.checkpoint()

    def lingering(self) -> set[str]:
        """Keys of writes the proxy stalled: they may land after their cleanup."""
        prefix = f"/{self.bucket}/job/"
        out = set()
        for f in self.proxy.stats()["injected"]:
            path = urllib.parse.urlsplit(f["path"]).path
            if f["kind"] == "stall" and f["op"] == "put" and path.startswith(prefix):
                out.add(path[len(prefix):])
        return out

    def check(self, *, collect_orphans: bool = False) -> list[str]:
        """The oracle over a direct (fault-free) view of the bucket."""
        self.proxy.clear()
        self.proxy.wait_idle()
        store = self.direct()
        try:
            problems = check_store(store, JournalView.read(self.journal.path), self.config)
            linger = self.lingering()
            if collect_orphans:
                coord = CheckpointCoordinator.recover(store, JOB_ID,
                                                      retained=self.config.retained)
                collected = set(coord.collect_orphans(min_age_s=0))
                coord.close()
                linger |= collected
            problems += check_objects(store, self.config, may_linger=linger)
            return problems
        finally:
            store.close()


@pytest.fixture
def env(fault_proxy: FaultProxy, moto_endpoint: str, s3_bucket: str,
        tmp_path: Path) -> Iterator[Env]:
    fault_proxy.reset()
    e = Env(fault_proxy, moto_endpoint, s3_bucket, tmp_path)
    yield e
    fault_proxy.clear()
    fault_proxy.wait_idle()
    e.journal.close()


def run_transient(env: Env, rules: list[Rule], *,
                  job_store: Callable[[], Any] | None = None) -> list[str]:
    """Checkpoints with materializations, then ``RESTARTS`` times a restart (recovery + restore),
    a checkpoint and an orphan pass; the rules are active from the second checkpoint to the end.
    Returns the oracle's problems (a failure of the job itself is one too)."""
    problems: list[str] = []
    job = env.open_job(job_store() if job_store else None)
    try:
        env.step(job, materialize=False)
        env.proxy.set_rules(*rules)
        for _ in range(2):
            env.step(job)
    except DstlError as exc:
        problems.append(f"JOB FAILED under a transient fault: {type(exc).__name__}: {exc}")
    finally:
        job.close()
    for _ in range(RESTARTS):
        try:
            job = env.open_job(job_store() if job_store else None)
            try:
                env.step(job)
                # an orphan pass while the job runs (its grace period spares every live
                # upload); only a write the proxy stalled may be collected: it landed after its
                # attempt was given up (a stale manifest is collected whatever its age)
                collected = set(job.coord.collect_orphans(min_age_s=3600))
                assert collected <= env.lingering(), sorted(collected - env.lingering())
            finally:
                job.close()
        except DstlError as exc:
            problems.append(f"RESTART FAILED under a transient fault: {type(exc).__name__}: "
                            f"{exc}")
    return problems + env.check()


def transient_rules(op: str, kind: str, skip: int) -> list[Rule]:
    """Per target, after ``skip`` requests: one fault alone (a single lost response is what makes
    aiohttp resend a PUT into a 412), then, after one request passes, two in a row. Puts of each
    object kind (segment, snapshot, manifest) are separate targets, so every writer meets the
    faults. (The second rule sees every request the first lets through.)"""
    targets = ("/job/dstl/", "/job/snapshots/", "/job/checkpoints/") if op == "put" else ("",)
    return [rule for target in targets for rule in (
        Rule(op, kind, count=1, skip=skip, stall_s=STALL_S, path_contains=target),
        Rule(op, kind, count=2, skip=skip + 1, stall_s=STALL_S, path_contains=target))]


def _pairs(ci: tuple[tuple[str, str], ...]) -> list[tuple[str, str]]:
    return [(op, kind) for op in OPERATIONS for kind in KINDS] if DEEP else list(ci)


@pytest.mark.parametrize("skip", SKIPS)
@pytest.mark.parametrize(("op", "kind"), _pairs(CI_TRANSIENT))
def test_transient_fault(env: Env, op: str, kind: str, skip: int) -> None:
    rules = transient_rules(op, kind, skip)
    problems = run_transient(env, rules)
    injected = [f["path"] for f in env.proxy.stats()["injected"]
                if f["op"] == op and f["kind"] == kind]
    assert not problems, "\n".join(problems)
    for target in {r.path_contains for r in rules}:
        hits = sum(1 for path in injected if target in path)
        # later starts (deep runs) may reach the end of the work before all three faults
        assert hits == 3 or (skip and hits), f"{kind} hit {op} {target or ''} {hits} times"


# --------------------------------------------------------------------------- permanent faults


@dataclass
class Outcome:
    """What a call raised, when it started and when it ended (wall clock, as the proxy stamps
    its faults)."""

    error: BaseException | None
    started: float
    ended: float


def _error_of(fn: Any) -> Outcome:
    t0 = time.time()
    try:
        fn()
    except BaseException as exc:
        return Outcome(exc, t0, time.time())
    return Outcome(None, t0, time.time())


def _fail_for_good(env: Env, op: str, kind: str) -> Outcome:
    """Run what needs ``op`` while it fails for good."""
    rule = Rule(op, kind, count=None, stall_s=STALL_S)
    job = env.open_job()
    if op == "put":
        try:
            env.step(job, materialize=False)
            env.proxy.set_rules(rule)
            return _error_of(lambda: env.step(job, materialize=False))
        finally:
            env.proxy.clear()
            job.close()
    if op == "delete":
        try:
            for _ in range(2):
                env.step(job)
            env.proxy.set_rules(rule)
            # retention's deletes fail: the checkpoint still commits, the keys stay doomed ...
            commit = _error_of(lambda: env.step(job))
            assert commit.error is None, repr(commit.error)
            assert any(job.coord.doomed()), "failed deletes stay doomed"
        finally:
            job.close()
        store = env.proxied()
        try:  # ... and a delete itself gives its typed error
            return _error_of(lambda: store.delete(["dstl/any-key"]))
        finally:
            env.proxy.clear()
            store.close()
    # reads: the restart needs them
    try:
        env.step(job)
        env.step(job)
    finally:
        job.close()
    env.proxy.set_rules(rule)
    try:
        return _error_of(env.open_job)
    finally:
        env.proxy.clear()


@pytest.mark.parametrize(("op", "kind"), _pairs(CI_PERMANENT))
def test_permanent_fault_gives_a_typed_error_in_time(env: Env, op: str, kind: str) -> None:
    env.config = PERMANENT
    out = _fail_for_good(env, op, kind)
    err = out.error
    faults = [f["t"] for f in env.proxy.stats()["injected"]
              if f["op"] == op and f["t"] >= out.started]
    assert faults, f"no {kind} was injected into {op}"
    took = out.ended - min(faults)  # from the first failed request to the typed error
    print(f"{op}/{kind}: {type(err).__name__} {took:.2f}s after the first failed request")
    assert isinstance(err, TYPED[op]), f"{op}/{kind}: expected {TYPED[op].__name__}, got {err!r}"
    if kind in ("internal_error", "slowdown") and op != "put":
        cause = err if isinstance(err, ThrottledError) else err.__cause__
        assert isinstance(cause, ThrottledError), repr(err)
    assert took <= TYPED_ERROR_BOUND_S, f"{op}/{kind}: typed error after {took:.2f}s"
    # the fault is gone: the job recovers, continues, and nothing is lost or left over
    env.proxy.wait_idle()
    job = env.open_job()
    try:
        env.step(job)
    finally:
        job.close()
    problems = env.check(collect_orphans=op == "delete")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- backoff, measured


#: Throttling backoff seen from the proxy: the jitter's draw is fixed near its maximum, so the
#: k-th throttled retry of one operation must arrive at least ``DRAW * min(max, base * 2**(k-1))``
#: after the k-th failed request (latency, and s3fs's own short sleep, only add to the gap), and
#: no retry may start past ``retry_deadline_s``. One attempt for non-throttling failures: every
#: retry seen here is a throttled one, so more than one request also shows that throttled
#: attempts do not use up the attempt limit.
BACKOFF = DstlOptions(persist_delay_s=0.002, upload_timeout_s=10.0, upload_max_attempts=1,
                      retry_backoff_base_s=0.1, retry_backoff_max_s=0.8, retry_deadline_s=3.0,
                      read_max_attempts=1)
DRAW = 0.999
#: The proxy stamps arrivals with the wall clock of another process: allow this much skew.
CLOCK_SLACK_S = 0.02


def _backoff_ceilings() -> list[float]:
    """The expected wait before each retry, and as many as fit in the deadline with no
    latency at all (so no correct run makes more requests). Computed here from the options,
    not with ``dstl.retry``: the oracle must not share the code it checks."""
    o = BACKOFF
    waits: list[float] = []
    while True:
        wait = DRAW * min(o.retry_backoff_max_s, o.retry_backoff_base_s * 2 ** len(waits))
        if sum(waits) + wait > o.retry_deadline_s:
            return waits
        waits.append(wait)


def _throttled_call(env: Env, op: str) -> tuple[Outcome, str]:
    """Run one ``op`` through the proxy with the fixed draw; return its outcome and the path
    part that marks its requests."""
    proxied = env.proxied()
    if op == "put":
        storage = ChangelogStorage(store=proxied, options=BACKOFF, draw=lambda: DRAW)
        try:
            writer = storage.create_writer("w", KeyGroupRange(0, 127))
            writer.append(1, b"x" * 100)
            future = writer.persist(0, 1)
            return _error_of(lambda: future.result(BACKOFF.retry_deadline_s + 30)), "/job/dstl/"
        finally:
            storage.close()
    direct = env.direct()
    try:
        direct.put("probe/k", b"0123456789" * 10)
    finally:
        direct.close()
    store = FsspecBlobStore(proxied.filesystem, f"{env.bucket}/job", location=proxied.location,
                            retry=RetryPolicy.for_store(BACKOFF), draw=lambda: DRAW)
    calls: dict[str, Callable[[], Any]] = {
        "get": lambda: store.get("probe/k"),
        "ranged_get": lambda: store.get_range("probe/k", 10, 20),
        "list": lambda: list(store.list("probe/")),
        "delete": lambda: store.delete(["probe/k"]),
    }
    try:
        # a DeleteObjects request names its keys in the body, not in the path
        return _error_of(calls[op]), "" if op == "delete" else "probe"
    finally:
        store.close()
        proxied.close()


@pytest.mark.parametrize(("op", "kind"), [(op, "slowdown") for op in OPERATIONS]
                         + [("put", "internal_error"), ("get", "internal_error")])
def test_throttling_backs_off_exponentially_until_the_deadline(env: Env, op: str,
                                                              kind: str) -> None:
    env.proxy.set_rules(Rule(op, kind, count=None))
    out, mark = _throttled_call(env, op)
    env.proxy.clear()
    arrivals = [f["t"] for f in env.proxy.stats()["injected"]
                if f["op"] == op and mark in f["path"]]
    waits = _backoff_ceilings()
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    print(f"{op}/{kind}: {len(arrivals)} requests, gaps "
          f"{[round(g, 3) for g in gaps]}, backoffs {[round(w, 3) for w in waits]}")
    typed = UploadFailedError if op == "put" else ThrottledError
    assert isinstance(out.error, typed), repr(out.error)
    if op == "put":
        assert isinstance(out.error.__cause__, ThrottledError), repr(out.error.__cause__)
    assert 3 <= len(arrivals) <= len(waits) + 1, (arrivals, waits)
    for k, (gap, wait) in enumerate(zip(gaps, waits), start=1):
        assert gap >= wait - CLOCK_SLACK_S, f"retry {k} came {gap:.3f}s after the failure, " \
            f"before its backoff of {wait:.3f}s (gaps {gaps})"
    took = out.ended - arrivals[0]
    assert took <= BACKOFF.retry_deadline_s + READ_TIMEOUT_S + 1.0, took


# --------------------------------------------------------------------------- self-tests


class SwallowingStore:
    """A broken write path: a put whose response never came is taken for a success."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.location = inner.location

    def put(self, key: str, data: bytes) -> None:
        with contextlib.suppress(TransientStorageError):  # the bug under test
            self.inner.put(key, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_oracle_catches_a_write_path_that_takes_a_failed_put_for_success(env: Env) -> None:
    rules = [Rule("put", "reset", count=2, path_contains="/job/dstl/")]
    problems = run_transient(env, rules, job_store=lambda: SwallowingStore(env.proxied()))
    assert env.proxy.injected("put", "reset") == 2
    assert any(p.startswith(("ATOMICITY", "LOST", "RESTART FAILED")) for p in problems), problems


def test_oracle_catches_ghost_attempts_left_behind(env: Env,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # a broken write path: the object of an attempt whose response was lost is not deleted
    monkeypatch.setattr(SegmentRegistry, "discard_untracked", lambda self, key: None)
    rules = [Rule("put", "lost_response", count=2, path_contains="/job/dstl/")]
    problems = run_transient(env, rules)
    assert any(p.startswith("UNEXPECTED OBJECT: dstl/") for p in problems), problems
