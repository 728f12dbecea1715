"""Sessionization with event-time timers on DSTL state (docs/spark.md, "Timers and watermarks").

A session of a user is a maximal run of the user's on-time clicks whose consecutive event-time
gaps are at most ``GAP_MS``. Clicks arrive out of order, inside a batch and across batches (up
to the watermark delay), so the processor keeps every *open* session of a user, in a map state
``open``: session end (epoch ms) -> ``(start_ms, clicks)``. Open sessions are more than
``GAP_MS`` apart: a click within ``GAP_MS`` of one session extends it, a click within
``GAP_MS`` of two bridges them into one, a click near none opens a new one. Each open session
has one event-time timer at ``end + GAP_MS``; a session whose end a click moves, or that a
bridge merges into another, has its timer deleted, and the session that results gets its own.
When the watermark reaches ``end + GAP_MS`` every later on-time click is more than ``GAP_MS``
after the end (and after the start), so no click can change the session any more:
``handle_expired_timer`` emits it, exactly once, and removes it. Clicks at or below the
watermark are late: here they go to a side output.

Run it (a local SparkSession, a file source fed one file per micro-batch, state under a temp
directory)::

    python examples/sessionization.py [--quick] [--table heap|lmdb]

It checks its output against :func:`expected_sessions`, a plain-Python definition that shares
no code with the processor (which clicks are on time, then each user's on-time clicks sorted
and split at the gaps), and counts in the input the cases that matter (:func:`input_cases`):
gaps inside a batch and between batches, clicks out of order inside a batch and across batches,
clicks that bridge two open sessions, gaps of exactly ``GAP_MS``, clicks at the watermark.
"""

from __future__ import annotations

import datetime as dt
import random
import sys
from collections.abc import Iterable, Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

from _harness import main, run_available_now, write_files

from dstl.spark import DstlStatefulOperator, ExpiredTimerInfo, StatefulProcessor, TimerValues

GAP_MS = 30_000
DELAY = "10 seconds"
DELAY_MS = 10_000
#: how much arrival time one micro-batch (one input file) covers
BATCH_MS = 60_000
START = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
MS = dt.timedelta(milliseconds=1)
START_MS = (START - EPOCH) // MS
OUTPUT = "user string, start_ms long, end_ms long, clicks long"


# ----------------------------------------------------------------- the processor


def event_ms(ts: dt.datetime) -> int:
    """A row's timestamp as epoch ms, exactly (Spark's ``floor(unix_micros / 1000)``; float
    seconds times 1000 can be 1 ms off); a naive timestamp is taken as UTC."""
    if ts.tzinfo is None:
        ts = ts.replace(tzinfo=dt.UTC)
    return (ts - EPOCH) // MS


def add_clicks(open_: dict[int, tuple[int, int]], times: Iterable[int]
               ) -> dict[int, tuple[int, int]]:
    """The open sessions (end -> ``(start, clicks)``) after the clicks at ``times``: each click
    and every session within ``GAP_MS`` of it become one session."""
    spans = [(start, end, clicks) for end, (start, clicks) in open_.items()]
    for t in times:
        near = [s for s in spans if s[0] - GAP_MS <= t <= s[1] + GAP_MS]
        spans = [s for s in spans if s not in near]
        spans.append((min([t, *(s[0] for s in near)]), max([t, *(s[1] for s in near)]),
                      1 + sum(s[2] for s in near)))
    return {end: (start, clicks) for start, end, clicks in sorted(spans)}


class Sessions(StatefulProcessor):
    def init(self, handle: Any) -> None:
        self.handle = handle
        self.open = handle.get_map_state("open")  # end_ms -> (start_ms, clicks)

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]],
                          timer_values: TimerValues) -> Iterator[dict[str, Any]]:
        before = {end: tuple(v) for end, v in self.open.iterator()}
        after = add_clicks(before, sorted(event_ms(r["ts"]) for r in rows))
        for end in before.keys() - after.keys():  # extended or merged into another
            self.open.remove_key(end)
            self.handle.delete_timer(end + GAP_MS)
        for end, session in after.items():
            if end not in before:
                self.handle.register_timer(end + GAP_MS)
            if before.get(end) != session:
                self.open.update_value(end, session)
        return iter(())

    def handle_expired_timer(self, key: Any, timer_values: TimerValues,
                             expired_timer_info: ExpiredTimerInfo) -> Iterator[dict[str, Any]]:
        end = expired_timer_info.expiry_time_ms - GAP_MS
        start, clicks = self.open.get_value(end)
        self.open.remove_key(end)
        yield {"user": key, "start_ms": start, "end_ms": end, "clicks": clicks}


# ----------------------------------------------------------------- the input


def make_batches(rng: random.Random, users: int, batches: int) -> list[list[dict[str, Any]]]:
    """Clicks of ``users`` users over ``batches`` files of ``BATCH_MS`` of arrival time each.

    Each user visits the site again and again, ``GAP_MS + 1`` ms (one in 12) up to 4 gaps
    apart. A visit is 1-6 clicks with gaps of 1 s up to ``GAP_MS`` (one in 12 exactly
    ``GAP_MS``). A click reaches the source some time after its event time: mostly within 9 s,
    one in 20 around the watermark delay (8-13 s: on time or late depending on the watermark),
    one in 30 minutes later (late). One visit in 10 is three clicks ``a < c < b`` placed around
    a file boundary: ``b - a > GAP_MS`` but ``c`` within ``GAP_MS`` of both, ``a`` and ``b``
    reach the source before the boundary, ``c`` after it (within 9 s, so on time): two open
    sessions that ``c`` bridges. A file holds the clicks that reached the source in its
    ``BATCH_MS``, shuffled. Into a few files, a click exactly at the watermark the batch applies
    (late) and one 1 ms above it (on time) are added (:func:`watermarks`)."""
    horizon = batches * BATCH_MS
    out: list[list[dict[str, Any]]] = [[] for _ in range(batches)]

    def send(user: int, t: int, delay: int) -> None:
        if t + delay < horizon:
            out[(t + delay) // BATCH_MS].append(_click(user, t))

    for u in range(users):
        t = rng.randrange(0, 2 * GAP_MS)
        while t < horizon:
            if rng.random() < 0.1:
                boundary = (t + GAP_MS + 9_000) // BATCH_MS * BATCH_MS + BATCH_MS
                b = boundary - rng.randrange(1_000, 3_000)
                c = b - rng.randrange(2_000, 6_000)
                a = rng.randrange(c - GAP_MS, b - GAP_MS)
                send(u, a, rng.randrange(0, DELAY_MS - 1_000))
                send(u, b, rng.randrange(0, boundary - b))
                send(u, c, rng.randrange(boundary - c, DELAY_MS - 1_000))
                t = b
            else:
                for i in range(rng.randint(1, 6)):
                    if i:
                        t += GAP_MS if rng.random() < 1 / 12 else rng.randrange(1_000, GAP_MS)
                    r = rng.random()
                    send(u, t, rng.randrange(0, DELAY_MS - 1_000) if r < 0.92 else
                         rng.randrange(DELAY_MS - 2_000, DELAY_MS + 3_000) if r < 0.97 else
                         rng.randrange(60_000, 180_000))
            t += GAP_MS + 1 if rng.random() < 1 / 12 else rng.randrange(GAP_MS + 1, 4 * GAP_MS)
    for rows in out:
        rng.shuffle(rows)
    for b in range(1, batches, 4):
        wm = watermarks(out)[b] - START_MS
        for t in (wm, wm + 1) if wm > 0 else ():
            out[b].insert(rng.randrange(len(out[b]) + 1), _click(rng.randrange(users), t))
    return out


def _click(user: int, t: int) -> dict[str, Any]:
    return {"user": f"user{user:02d}", "ts": (START + t * MS).isoformat()}


# ----------------------------------------------------------------- the definition


def click_ms(row: dict[str, Any]) -> int:
    """An input row's event time in epoch ms (its ISO 8601 ``ts``)."""
    return (dt.datetime.fromisoformat(row["ts"]) - EPOCH) // dt.timedelta(milliseconds=1)


def watermarks(batches: list[list[dict[str, Any]]]) -> list[int]:
    """The watermark each batch applies, and last the one after the last batch (Spark's rule,
    docs/spark.md "Watermark"; ``dstl/spark/timing.py``): 0 for the first batch; after a batch,
    ``max(watermark, largest event time of its rows - DELAY_MS)``. Whether the batch's late
    rows count does not matter: a late row is at or below the watermark, so it minus the delay
    is below it."""
    wm = [0]
    for rows in batches:
        wm.append(max([wm[-1], *(click_ms(r) - DELAY_MS for r in rows)]))
    return wm


def on_time_clicks(batches: list[list[dict[str, Any]]]) -> list[tuple[str, int, int]]:
    """``(user, event ms, batch)`` of every on-time click: above the watermark its batch
    applies (a click at or below it is late)."""
    wm = watermarks(batches)
    return [(r["user"], click_ms(r), b) for b, rows in enumerate(batches) for r in rows
            if click_ms(r) > wm[b]]


def expected_sessions(batches: list[list[dict[str, Any]]]) -> tuple[set[tuple[Any, ...]], int]:
    """The sessions the query must emit, by definition: per user, all on-time clicks sorted
    by event time and cut wherever two consecutive ones are more than ``GAP_MS`` apart; of
    those, the ones whose ``end + GAP_MS`` is at or below the last watermark a batch applied
    (the watermark after the last batch is applied by no batch). Returns the sessions
    ``(user, start_ms, end_ms, clicks)`` and that watermark."""
    by_user: dict[str, list[int]] = {}
    for user, t, _ in on_time_clicks(batches):
        by_user.setdefault(user, []).append(t)
    closed_by = watermarks(batches)[-2]
    sessions: set[tuple[Any, ...]] = set()
    for user, times in by_user.items():
        times.sort()
        cuts = [0, *(i for i in range(1, len(times)) if times[i] - times[i - 1] > GAP_MS),
                len(times)]
        for a, b in pairwise(cuts):
            if times[b - 1] + GAP_MS <= closed_by:
                sessions.add((user, times[a], times[b - 1], b - a))
    return sessions, closed_by


def input_cases(batches: list[list[dict[str, Any]]]) -> dict[str, int]:
    """How often the input has each case the processor must get right, among on-time clicks
    of a user (consecutive = next in event-time order over the whole input):

    - ``gap_inside_batch``, ``gap_between_batches``: consecutive clicks more than ``GAP_MS``
      apart that arrive in the same batch, in different batches;
    - ``gap_equal_to_gap_ms``, ``gap_one_ms_over``: consecutive clicks exactly ``GAP_MS`` apart
      (one session), ``GAP_MS + 1`` apart (two);
    - ``out_of_order_inside_batch``: a click listed in its file after a later click of the user;
    - ``out_of_order_across_batches``: a click earlier than a click of the user in an earlier
      batch;
    - ``bridge``: a click whose nearest clicks of the user from earlier batches, one before and
      one after it, are each within ``GAP_MS`` of it but more than ``GAP_MS`` apart (two open
      sessions that the click joins);
    - ``late``, ``late_at_watermark``, ``on_time_at_watermark_plus_1``: late clicks, clicks
      exactly at their batch's watermark, 1 ms above it."""
    wm = watermarks(batches)
    on = on_time_clicks(batches)
    cases = dict.fromkeys(("gap_inside_batch", "gap_between_batches", "gap_equal_to_gap_ms",
                           "gap_one_ms_over", "out_of_order_inside_batch",
                           "out_of_order_across_batches", "bridge", "late",
                           "late_at_watermark", "on_time_at_watermark_plus_1"), 0)
    by_user: dict[str, list[tuple[int, int]]] = {}
    for user, t, b in on:
        by_user.setdefault(user, []).append((t, b))
    for clicks in by_user.values():
        clicks.sort()
        for (t0, b0), (t1, b1) in pairwise(clicks):
            if t1 - t0 > GAP_MS:
                cases["gap_inside_batch" if b0 == b1 else "gap_between_batches"] += 1
            cases["gap_equal_to_gap_ms"] += t1 - t0 == GAP_MS
            cases["gap_one_ms_over"] += t1 - t0 == GAP_MS + 1
        for t, b in clicks:
            earlier = [e for e, eb in clicks if eb < b]
            cases["out_of_order_across_batches"] += any(e > t for e in earlier)
            below = [e for e in earlier if e < t]
            above = [e for e in earlier if e > t]
            if below and above and t - max(below) <= GAP_MS and min(above) - t <= GAP_MS \
                    and min(above) - max(below) > GAP_MS:
                cases["bridge"] += 1
    for b, rows in enumerate(batches):
        latest: dict[str, int] = {}
        for r in rows:
            t = click_ms(r)
            if t <= wm[b]:
                cases["late"] += 1
                cases["late_at_watermark"] += t == wm[b]
                continue
            cases["on_time_at_watermark_plus_1"] += t == wm[b] + 1
            cases["out_of_order_inside_batch"] += t < latest.get(r["user"], t)
            latest[r["user"]] = max(t, latest.get(r["user"], t))
    return cases


# ----------------------------------------------------------------- the run


def run(spark: Any, workdir: Path, *, quick: bool = False, table: str = "lmdb",
        agent: bool = True, restart_after: int | None = None) -> dict[str, Any]:
    """Feed the generated clicks through the operator, one file per micro-batch; with
    ``restart_after``, the query stops after that many files and a new operator and query on
    the same state and checkpoint read the rest. Returns the sessions (a list: an emitted twice
    shows), the late clicks, the batch stats, the input, the expected sessions and the input's
    cases."""
    batches = make_batches(random.Random(20), users=8 if quick else 50,
                           batches=6 if quick else 15)
    parts = [batches] if restart_after is None else \
        [batches[:restart_after], batches[restart_after:]]
    sessions: list[tuple[Any, ...]] = []
    late: list[Any] = []
    stats: list[dict[str, Any]] = []
    first = 0
    for part in parts:
        write_files(workdir / "src", part, first=first)
        first += len(part)
        op = DstlStatefulOperator(
            name="sessions", processor=Sessions, key_column="user", output_schema=OUTPUT,
            state_uri=str(workdir / "state"), partitions=2, max_parallelism=32, table=table,
            agent=agent, local_dir=str(workdir / "local"), time_mode="event_time",
            event_time_column="ts", watermark_delay=DELAY, late_rows="side_output",
            late_sink=lambda df, b: late.extend(df.collect()),
            sink=lambda df, b: sessions.extend(tuple(r) for r in df.collect()))
        try:
            run_available_now(spark, "user string, ts timestamp", workdir / "src", op,
                              workdir)
            stats.extend(op.batch_stats)
        finally:
            op.close()
    return {"sessions": sessions, "late": late, "stats": stats, "batches": batches,
            "expected": expected_sessions(batches), "cases": input_cases(batches)}


def _clock(epoch_ms: int) -> str:
    """An epoch-ms time as the input's clock time, to the millisecond."""
    t = START + (epoch_ms - START_MS) * MS
    return f"{t:%H:%M:%S}.{t.microsecond // 1000:03d}"


def report(r: dict[str, Any]) -> int:
    want, wm = r["expected"]
    got = r["sessions"]
    print("input: " + ", ".join(f"{k} {v}" for k, v in r["cases"].items()))
    for s in sorted(got, key=lambda s: (s[1], s[0]))[:10]:
        print(f"{s[0]:>8}  {_clock(s[1])} - {_clock(s[2])}  {s[3]:>4} clicks")
    print(f"{len(got)} sessions closed by the watermark (last {_clock(wm)}; the first 10 "
          f"above), {len(r['late'])} late clicks to the side output, {len(r['stats'])} batches")
    if len(got) != len(set(got)) or set(got) != want:
        print(f"MISMATCH: expected {len(want)} sessions, {len(set(got) - want)} unexpected, "
              f"{len(want - set(got))} missing, {len(got) - len(set(got))} emitted twice",
              file=sys.stderr)
        return 1
    print("equal to the definition")
    return 0


if __name__ == "__main__":
    sys.exit(main(__doc__, "dstl-sessionization", run, report,
                  conf={"spark.sql.session.timeZone": "UTC"}))
