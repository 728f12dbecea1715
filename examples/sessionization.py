"""Sessionization with event-time timers on DSTL state (docs/spark.md, "Timers and watermarks").

A session of a user is a run of clicks with gaps of at most ``GAP_MS`` in event time. The
processor keeps the open session (start, end, clicks) in a value state and one event-time timer
at ``end + GAP_MS``; each click moves the timer; when the watermark passes it (no click can
extend the session any more), ``handle_expired_timer`` emits the session and clears the state.
Clicks at or below the watermark are late: here they go to a side output.

Run it (a local SparkSession, a file source fed one file per micro-batch, state under a temp
directory)::

    python examples/sessionization.py [--quick] [--table heap|lmdb]

It checks its output against a batch computation of the same sessions (every session the final
watermark closed, each exactly once) and prints them.
"""

from __future__ import annotations

import datetime as dt
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _harness import main, run_available_now, write_files

from dstl.spark import DstlStatefulOperator, ExpiredTimerInfo, StatefulProcessor, TimerValues

GAP_MS = 30_000
DELAY = "10 seconds"
DELAY_MS = 10_000
START = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
OUTPUT = "user string, start_ms long, end_ms long, clicks long"


def epoch_ms(ts: dt.datetime) -> int:
    """A row's timestamp as epoch ms (Spark hands timestamps over as aware datetimes)."""
    if ts.tzinfo is None:  # timestamp_ntz: take it as UTC
        ts = ts.replace(tzinfo=dt.UTC)
    return int(ts.timestamp() * 1000)


class Sessions(StatefulProcessor):
    def init(self, handle: Any) -> None:
        self.handle = handle
        self.session = handle.get_value_state("session")  # (start_ms, end_ms, clicks)

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]],
                          timer_values: TimerValues) -> Iterator[dict[str, Any]]:
        s = self.session.get()
        start, end, clicks = s if s is not None else (None, None, 0)
        for row in rows:
            t = epoch_ms(row["ts"])
            start = t if start is None else min(start, t)
            end = t if end is None else max(end, t)
            clicks += 1
        if s is not None and s[1] != end:
            self.handle.delete_timer(s[1] + GAP_MS)
        self.handle.register_timer(end + GAP_MS)
        self.session.update((start, end, clicks))
        return iter(())

    def handle_expired_timer(self, key: Any, timer_values: TimerValues,
                             expired_timer_info: ExpiredTimerInfo) -> Iterator[dict[str, Any]]:
        start, end, clicks = self.session.get()
        self.session.clear()
        yield {"user": key, "start_ms": start, "end_ms": end, "clicks": clicks}


def make_batches(rng: random.Random, users: int, batches: int, per_batch: int
                 ) -> list[list[dict[str, Any]]]:
    """Clicks in event-time order batch by batch (jittered by less than the delay inside a
    batch), with pauses longer than the gap; a few late clicks from long ago."""
    out: list[list[dict[str, Any]]] = []
    clock = 0
    for b in range(batches):
        rows = []
        for _ in range(per_batch):
            clock += rng.choice((500, 1_000, 2_000))
            u = rng.randrange(users)
            if rng.random() < 0.05 and b > 1:
                t = clock - 120_000  # late: far below the watermark
            else:
                t = clock + rng.randrange(-DELAY_MS // 2, 1)
            rows.append({"user": f"user{u}", "ts": (START + dt.timedelta(milliseconds=t))
                         .isoformat()})
        out.append(rows)
        clock += 40_000 if b % 3 == 2 else 0  # a pause longer than the gap
    return out


def expected_sessions(batches: list[list[dict[str, Any]]]) -> tuple[set[tuple[Any, ...]], int]:
    """The sessions the operator must emit, computed in plain Python with the operator's rules
    (docs/spark.md): at the start of each batch, sessions whose ``end + GAP_MS`` the batch's
    watermark reached close; then the batch's on-time clicks (above the watermark) extend or
    open sessions; then the watermark moves to ``max(event time) - delay``. Returns them and the
    last watermark a batch applied."""
    sessions: set[tuple[Any, ...]] = set()
    open_: dict[str, list[int]] = {}
    wm = applied = 0
    for rows in batches:
        applied = wm
        for u in sorted(open_):
            s = open_[u]
            if s[1] + GAP_MS <= wm:
                sessions.add((u, s[0], s[1], s[2]))
                del open_[u]
        ts = [(r["user"], epoch_ms(dt.datetime.fromisoformat(r["ts"]))) for r in rows]
        ok = [(u, t) for u, t in ts if t > wm]
        for u, t in ok:
            s = open_.setdefault(u, [t, t, 0])
            s[0], s[1], s[2] = min(s[0], t), max(s[1], t), s[2] + 1
        if ok:
            wm = max(wm, max(t for _, t in ok) - DELAY_MS)
    return sessions, applied


def run(spark: Any, workdir: Path, *, quick: bool = False, table: str = "lmdb",
        agent: bool = True) -> dict[str, Any]:
    """Feed the generated clicks through the operator, one file per micro-batch; returns the
    sessions, the late clicks, the expected sessions and the batch stats."""
    rng = random.Random(20)
    batches = make_batches(rng, users=8 if quick else 40, batches=6 if quick else 15,
                           per_batch=30 if quick else 200)
    write_files(workdir / "src", batches)
    sessions: set[tuple[Any, ...]] = set()
    late: list[Any] = []
    op = DstlStatefulOperator(
        name="sessions", processor=Sessions, key_column="user", output_schema=OUTPUT,
        state_uri=str(workdir / "state"), partitions=2, max_parallelism=32, table=table,
        agent=agent, local_dir=str(workdir / "local"), time_mode="event_time",
        event_time_column="ts", watermark_delay=DELAY, late_rows="side_output",
        late_sink=lambda df, b: late.extend(df.collect()),
        sink=lambda df, b: sessions.update(tuple(r) for r in df.collect()))
    try:
        run_available_now(spark, "user string, ts timestamp", workdir / "src", op, workdir)
        return {"sessions": sessions, "late": late, "stats": op.batch_stats,
                "expected": expected_sessions(batches)}
    finally:
        op.close()


def report(r: dict[str, Any]) -> int:
    want, wm = r["expected"]
    for s in sorted(r["sessions"], key=lambda s: (s[1], s[0])):
        print(f"{s[0]:>8}  {START + dt.timedelta(milliseconds=s[1]):%H:%M:%S} - "
              f"{START + dt.timedelta(milliseconds=s[2]):%H:%M:%S}  {s[3]:>4} clicks")
    print(f"{len(r['sessions'])} sessions closed by the watermark (last "
          f"{START + dt.timedelta(milliseconds=wm):%H:%M:%S}), {len(r['late'])} late clicks "
          f"to the side output, {len(r['stats'])} batches")
    if r["sessions"] != want:
        print(f"MISMATCH: expected {len(want)} sessions", file=sys.stderr)
        return 1
    print("equal to the batch computation")
    return 0


if __name__ == "__main__":
    sys.exit(main(__doc__, "dstl-sessionization", run, report,
                  conf={"spark.sql.session.timeZone": "UTC"}))
