"""The log-only demo (``python -m dstl demo --log-only``); ``make demo`` runs the Spark job
(:mod:`dstl.spark.demo`).

Several writers of one process (one per simulated backend, driven by a few threads) append
changes and checkpoint (persist) every ``--checkpoint-interval`` for ``--seconds`` against a store
(a local directory by default). At the end every handle is read back and compared with what was
appended, and the demo prints segments written, bytes, persist latencies and the check's result.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field

from dstl.cli.common import add_storage_options, storage_options
from dstl.handle import ChangelogHandle
from dstl.keygroups import KeyGroupRange
from dstl.layout import SEGMENT_PREFIX
from dstl.options import DstlOptions
from dstl.storage import ChangelogStorage
from dstl.writer import ChangelogWriter
from restore.reader import ChangelogReader

MAX_PARALLELISM = 128


@dataclass
class _Backend:
    writer: ChangelogWriter
    appended: list[tuple[int, bytes]] = field(default_factory=list)
    handles: list[ChangelogHandle] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)


def _drive(backends: list[_Backend], seconds: float, interval_s: float, seed: int,
           errors: list[BaseException]) -> None:
    rng = random.Random(seed)
    checkpoint = 0
    deadline = time.monotonic() + seconds
    next_cp = time.monotonic() + interval_s
    try:
        while time.monotonic() < deadline:
            for b in backends:
                kgr = b.writer.key_groups
                for _ in range(200):
                    kg = rng.randint(kgr.start, kgr.end)
                    payload = b"user-%06d:%d" % (rng.randrange(100_000), rng.randrange(1000))
                    b.writer.append(kg, payload)
                    b.appended.append((kg, payload))
            if time.monotonic() >= next_cp:
                checkpoint += 1
                t0 = time.monotonic()
                futs = [(b, b.writer.persist(0, checkpoint)) for b in backends]
                for b, f in futs:
                    h = f.result(timeout=60)
                    b.latencies_s.append(time.monotonic() - t0)
                    b.handles.append(h)
                    b.writer.confirm(h.from_sqn, h.to_sqn, checkpoint)  # checkpoint complete
                next_cp = time.monotonic() + interval_s
    except BaseException as exc:  # noqa: BLE001 - handed to the main thread, re-raised there
        errors.append(exc)


def run(argv: list[str] | None = None) -> int:
    """``dstl demo``: the Spark job, or with ``--log-only`` this log demo."""
    argv = list(argv or [])
    if "--log-only" not in argv:
        from dstl.spark.demo import run as spark_demo

        return spark_demo(argv)
    argv.remove("--log-only")
    p = _parser()
    args = p.parse_args(argv)
    tmp = None
    uri = args.state_uri
    if uri is None:
        tmp = tempfile.mkdtemp(prefix="dstl-demo-")
        uri = tmp
    print(f"DSTL log demo: {args.writers} writers on {args.threads} threads for "
          f"{args.seconds:.1f}s, checkpoint every {args.checkpoint_interval * 1000:.0f} ms, "
          f"store {uri}")
    storage = ChangelogStorage(uri, options=DstlOptions(),
                               storage_options=storage_options(p, args))
    try:
        backends = [_Backend(storage.create_writer(
            f"demo-op/{i}", KeyGroupRange.of_operator(MAX_PARALLELISM, args.writers, i)))
            for i in range(args.writers)]
        elapsed = _drive_all(backends, args)
        ok, changes = _read_back(storage, backends)
        _report(storage, backends, elapsed, ok, changes)
        return 0 if ok else 1
    finally:
        storage.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dstl demo --log-only", description=__doc__)
    add_storage_options(p)
    p.add_argument("--state-uri", default=None,
                   help="store root (default: a fresh temporary directory)")
    p.add_argument("--writers", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--checkpoint-interval", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=7)
    return p


def _drive_all(backends: list[_Backend], args: argparse.Namespace) -> float:
    """Run the writers on ``args.threads`` threads for ``args.seconds``; returns the elapsed
    seconds and re-raises the first error of a thread."""
    errors: list[BaseException] = []
    groups = [backends[i::args.threads] for i in range(args.threads)]
    threads = [threading.Thread(target=_drive, name=f"demo-driver-{i}",
                                args=(g, args.seconds, args.checkpoint_interval,
                                      args.seed + i, errors))
               for i, g in enumerate(groups)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.monotonic() - t0


def _read_back(storage: ChangelogStorage, backends: list[_Backend]) -> tuple[bool, int]:
    """Read the last handle of every writer (it covers [0, to)) and compare it with what was
    appended; returns whether all matched and how many changes were read."""
    reader = ChangelogReader(storage)
    ok = True
    changes = 0
    for b in backends:
        last = b.handles[-1]
        got = list(reader.read(last))
        sent = b.appended[:sum(r.change_count for r in last.change_sets)]
        # within a change set the log groups changes by key group, order kept per key group
        expected = []
        pos = 0
        for ref in last.change_sets:
            chunk = sent[pos:pos + ref.change_count]
            pos += ref.change_count
            expected.extend(sorted(chunk, key=lambda c: c[0]))
        ok &= got == expected
        changes += len(got)
    return ok, changes


def _report(storage: ChangelogStorage, backends: list[_Backend], elapsed: float, ok: bool,
            changes: int) -> None:
    m = storage.metrics()
    lat = sorted(x for b in backends for x in b.latencies_s)
    segments = list(storage.store.list(SEGMENT_PREFIX))
    checkpoints = len(backends[0].handles)
    appended = sum(len(b.appended) for b in backends)
    print()
    print(f"{'changes appended':<34}{appended:>14,}")
    print(f"{'change rate':<34}{appended / elapsed:>14,.0f} /s")
    print(f"{'checkpoints (persist rounds)':<34}{checkpoints:>14,}")
    print(f"{'segments written':<34}{int(m['ChangelogStorage.numberOfSegments']):>14,}")
    print(f"{'segments per checkpoint':<34}"
          f"{m['ChangelogStorage.numberOfSegments'] / max(1, checkpoints):>14.2f}")
    print(f"{'writers per segment (mean)':<34}"
          f"{m['ChangelogStorage.writersPerSegment.mean']:>14.2f}")
    print(f"{'bytes uploaded':<34}{int(m['ChangelogStorage.uploadedBytes']):>14,}")
    print(f"{'objects in store':<34}{len(segments):>14,}")
    if lat:
        p99 = lat[min(len(lat) - 1, int(0.99 * (len(lat) - 1) + 0.5))]
        print(f"{'persist latency p50 / p99':<34}"
              f"{statistics.median(lat) * 1e3:>8.1f} / {p99 * 1e3:.1f} ms")
    print(f"{'read back and compared':<34}{changes:>14,} changes: "
          f"{'OK' if ok else 'MISMATCH'}")
