"""Deduplication with state TTL on DSTL state (docs/spark.md, "State TTL").

Events carry an ``event_id``; a source that retries sends some of them again, later. The
processor keeps, per event id, a value state ``seen`` with a time to live: the first copy of an
id is emitted and marks it seen; copies that arrive while ``seen`` is alive are dropped. The
TTL bounds the state: an id not seen for ``TTL_S`` seconds of processing time expires (invisible
at once, purged by the next batch, logged), so the state holds only the ids of the last
``TTL_S`` seconds — a copy arriving later than that is emitted again, which is the trade-off a
TTL makes. ``seen`` is written once per emitted copy and not refreshed by dropped copies (as
Spark's ``dropDuplicatesWithinWatermark`` does not extend its window).

Run it (a local SparkSession, a file source fed one file per micro-batch, state under a temp
directory)::

    python examples/dedup_ttl.py [--quick] [--table heap|lmdb]

It checks its output against :func:`expected_output`, a plain-Python definition that follows
each event id through the batches its copies arrive in, driven by the processing time each batch
ran at (recorded in the operator's ``batch_stats``), and prints how many copies it dropped and
how many ids the TTL forgot, and how often the input has each case (:func:`input_cases`).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from _harness import main, run_available_now, write_files

from dstl.spark import DstlStatefulOperator, StatefulProcessor, TimerValues

TTL_S = 4.0
TTL_MS = int(TTL_S * 1000)
OUTPUT = "event_id string, seq long, payload string"


class Dedup(StatefulProcessor):
    def init(self, handle: Any) -> None:
        # the processing time the id was first emitted at; expires TTL_S after that
        self.seen = handle.get_value_state("seen", ttl_s=TTL_S)

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]],
                          timer_values: TimerValues) -> Iterator[dict[str, Any]]:
        copies = list(rows)
        if self.seen.exists():
            return  # a duplicate while the id is remembered: dropped
        self.seen.update(timer_values.current_processing_time_ms)
        first = min(copies, key=lambda r: r["seq"])  # the batch's copies: keep the earliest
        yield {"event_id": key, "seq": first["seq"], "payload": first["payload"]}


def make_batches(rng: random.Random, batches: int, per_batch: int) -> list[list[dict[str, Any]]]:
    """New events, plus copies of recent ones (a retry shortly after) and of old ones (a
    retry long after: older than the TTL by the time it arrives)."""
    out: list[list[dict[str, Any]]] = []
    sent: list[str] = []
    seq = 0
    for _ in range(batches):
        rows = []
        for _ in range(per_batch):
            r = rng.random()
            if sent and r < 0.25:
                eid = rng.choice(sent[-per_batch:])  # a recent one
            elif sent and r < 0.35:
                eid = rng.choice(sent[:per_batch])  # one of the first ones
            else:
                eid = f"e{len(sent):05d}"
                sent.append(eid)
            rows.append({"event_id": eid, "seq": seq, "payload": f"p{seq}"})
            seq += 1
        out.append(rows)
    return out


def arrivals(batches: list[list[dict[str, Any]]], times: list[int]
             ) -> dict[str, list[tuple[int, int, dict[str, Any]]]]:
    """Per event id, the batches its copies arrive in, in order: ``(batch, processing time,
    the batch's copy with the smallest seq)``."""
    out: dict[str, list[tuple[int, int, dict[str, Any]]]] = {}
    for b, rows in enumerate(batches):
        for r in sorted(rows, key=lambda r: r["seq"]):
            seen = out.setdefault(r["event_id"], [])
            if not seen or seen[-1][0] != b:
                seen.append((b, times[b], r))
    return out


def expected_output(batches: list[list[dict[str, Any]]], times: list[int]
                    ) -> dict[int, list[tuple[Any, ...]]]:
    """What each batch must emit (sorted), by definition, per event id over the batches its copies
    arrive in (processing times ``times``): the first batch emits the id's earliest copy; a
    later batch emits its earliest copy again when the id's last emission is ``TTL_MS`` or
    more before it (the remembered id expired at ``emission + TTL_MS``, at or before this
    batch's time), and drops its copies otherwise."""
    out: dict[int, list[tuple[Any, ...]]] = {b: [] for b in range(len(batches))}
    for eid, arrived in arrivals(batches, times).items():
        last: int | None = None
        for b, t, r in arrived:
            if last is None or t - last >= TTL_MS:
                out[b].append((eid, r["seq"], r["payload"]))
                last = t
    return {b: sorted(rows) for b, rows in out.items()}


def input_cases(batches: list[list[dict[str, Any]]], times: list[int]) -> dict[str, int]:
    """How often the input has each case the processor must get right: an id twice or more
    in one batch (``copies_in_one_batch``); a copy in a later batch while the id is remembered
    (``dropped_within_ttl``); a later batch that emits an id again (``emitted_after_ttl``),
    ``TTL_MS`` exactly after its last emission (``emitted_at_ttl_exactly``)."""
    cases = dict.fromkeys(("copies_in_one_batch", "dropped_within_ttl", "emitted_after_ttl",
                           "emitted_at_ttl_exactly"), 0)
    for rows in batches:
        ids = [r["event_id"] for r in rows]
        cases["copies_in_one_batch"] += len(ids) - len(set(ids))
    for arrived in arrivals(batches, times).values():
        last = arrived[0][1]
        for _, t, _ in arrived[1:]:
            if t - last < TTL_MS:
                cases["dropped_within_ttl"] += 1
                continue
            cases["emitted_after_ttl"] += 1
            cases["emitted_at_ttl_exactly"] += t - last == TTL_MS
            last = t
    return cases


def run(spark: Any, workdir: Path, *, quick: bool = False, table: str = "lmdb",
        agent: bool = True, clock_ms: Callable[[], int] | None = None) -> dict[str, Any]:
    """Feed the generated events through the operator, one file per micro-batch; returns the
    output per batch, the expected output and the batch stats. ``clock_ms``: the operator's
    clock (default: the wall clock; the test passes a simulated one, so that a fast machine
    expires ids too)."""
    rng = random.Random(7)
    batches = make_batches(rng, batches=8 if quick else 20, per_batch=20 if quick else 200)
    write_files(workdir / "src", batches)
    emitted: dict[int, list[tuple[Any, ...]]] = {}
    op = DstlStatefulOperator(
        name="dedup", processor=Dedup, key_column="event_id", output_schema=OUTPUT,
        state_uri=str(workdir / "state"), partitions=2, max_parallelism=32, table=table,
        agent=agent, local_dir=str(workdir / "local"),
        sink=lambda df, b: emitted.__setitem__(b, sorted(tuple(r) for r in df.collect())))
    if clock_ms is not None:
        op.clock_ms = clock_ms
    try:
        run_available_now(spark, "event_id string, seq long, payload string", workdir / "src",
                          op, workdir)
        stats = sorted(op.batch_stats, key=lambda s: s["batch_id"])
        times = [s["processing_time_ms"] for s in stats]
        return {"emitted": {s["batch_id"]: emitted.get(s["batch_id"], []) for s in stats},
                "stats": stats, "batches": batches,
                "expected": expected_output(batches, times),
                "cases": input_cases(batches, times)}
    finally:
        op.close()


def report(r: dict[str, Any]) -> int:
    rows = sum(len(b) for b in r["batches"])
    out = sum(len(v) for v in r["emitted"].values())
    ids = {row["event_id"] for b in r["batches"] for row in b}
    print("input: " + ", ".join(f"{k} {v}" for k, v in r["cases"].items()))
    print(f"{rows} events in {len(r['batches'])} batches, {len(ids)} distinct ids: {out} "
          f"emitted, {rows - out} copies dropped; {out - len(ids)} ids emitted again after the "
          f"TTL ({TTL_S:g} s) forgot them; {sum(s['ttl_purged'] for s in r['stats'])} "
          "expired values purged")
    if r["emitted"] != r["expected"]:
        print("MISMATCH with the definition", file=sys.stderr)
        return 1
    print("equal to the definition")
    return 0


if __name__ == "__main__":
    sys.exit(main(__doc__, "dstl-dedup-ttl", run, report))
