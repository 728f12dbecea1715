"""State TTL under Spark against a model (capability 4): value, list and map states
with a TTL (``ttl_s`` and Spark's ``ttl_duration_ms``) in a running operator. Each batch's output
is the state its keys see after the batch's purge; the model purges at the batch's processing
time, so every output and the purge count per batch (``ttl_purged``) must match it. Also: a
re-run of a committed batch with another clock keeps the batch's recorded processing time (the
same output), a clock that steps back does not move the processing time back, a rescale (3 -> 2
partitions), a restart in a fresh SparkSession, and the state reader (each value with its
expiry; nothing expired left after a batch's purge). Reducing and aggregating states with a
TTL against their own model (expire, purge, restart from nothing, rescale, reader). Heap and
LMDB, executor agent on and off.
The deduplication example (examples/dedup_ttl.py) runs here at full size against its
plain-Python definition, which shares no code with its processor."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from spark_support import load_example, new_session, spark  # noqa: F401

from dstl.reader import CheckpointCatalog, ReadOnlyBlobStore, read_state
from dstl.spark import DstlStatefulOperator, StatefulProcessor, TimerValues
from dstl.stores import open_store

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]

SCHEMA = "key string, op string, arg string"
OUT = "key string, v string, l string, m string"
TTL_MS = 1_000


class TtlJob(StatefulProcessor):
    """Per key: outputs what its states hold (after the batch's purge), then applies its rows
    in ``arg`` order (Spark does not keep the order of a key's rows across input partitions):
    ``v`` updates the value, ``l`` appends to the list, ``m`` puts the map entry ``arg[0]``."""

    def init(self, handle: Any) -> None:
        self.v = handle.get_value_state("v", ttl_s=TTL_MS / 1000)
        self.l = handle.get_list_state("l", ttl_duration_ms=TTL_MS)
        self.m = handle.get_map_state("m", ttl_s=TTL_MS / 1000)

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]],
                          timer_values: TimerValues) -> Iterator[dict[str, Any]]:
        yield {"key": key, "v": json.dumps(self.v.get()), "l": json.dumps(self.l.get()),
               "m": json.dumps(sorted(self.m.items()))}
        for r in sorted(rows, key=lambda r: r["arg"]):
            if r["op"] == "v":
                self.v.update(r["arg"])
            elif r["op"] == "l":
                self.l.append_value(r["arg"])
            else:
                self.m.update_value(r["arg"][:2], r["arg"])


class Model:
    """Per key: value (x, expiry), list [(x, expiry)], map {k: (x, expiry)}."""

    def __init__(self) -> None:
        self.v: dict[str, tuple[str, int]] = {}
        self.l: dict[str, list[tuple[str, int]]] = {}
        self.m: dict[str, dict[str, tuple[str, int]]] = {}

    def purge(self, now: int) -> int:
        n = sum(1 for p in self.v.values() if p[1] <= now)
        n += sum(1 for lst in self.l.values() for p in lst if p[1] <= now)
        n += sum(1 for d in self.m.values() for p in d.values() if p[1] <= now)
        self.v = {k: p for k, p in self.v.items() if p[1] > now}
        self.l = {k: kept for k, lst in self.l.items() if (kept := [p for p in lst if p[1] > now])}
        self.m = {k: kept for k, d in self.m.items()
                  if (kept := {mk: p for mk, p in d.items() if p[1] > now})}
        return n

    def batch(self, now: int, rows: list[tuple[str, str, str]]
              ) -> tuple[list[tuple[str, ...]], int]:
        """The batch's sorted output and purge count."""
        purged = self.purge(now)
        out = []
        for key in sorted({r[0] for r in rows}):
            v = self.v.get(key)
            out.append((key, json.dumps(v[0] if v else None),
                        json.dumps([x for x, _ in self.l.get(key, [])]),
                        json.dumps(sorted([k, x] for k, (x, _) in self.m.get(key, {}).items()))))
        for key, op, arg in sorted(rows, key=lambda r: (r[0], r[2])):
            exp = now + TTL_MS
            if op == "v":
                self.v[key] = (arg, exp)
            elif op == "l":
                self.l.setdefault(key, []).append((arg, exp))
            else:
                self.m.setdefault(key, {})[arg[:2]] = (arg, exp)
        return out, purged

    def stored(self) -> set[tuple[Any, ...]]:
        """What the state reader must show: (key, state, user key, (expiry, value))."""
        out: set[tuple[Any, ...]] = {(k, "v", None, (p[1], p[0])) for k, p in self.v.items()}
        out |= {(k, "l", None, tuple((e, x) for x, e in lst)) for k, lst in self.l.items()}
        out |= {(k, "m", mk, (p[1], p[0])) for k, d in self.m.items() for mk, p in d.items()}
        return out


def _rows(rng: random.Random, n: int, serial: list[int]) -> list[tuple[str, str, str]]:
    out = []
    for _ in range(n):
        op = rng.choice("vlm")
        serial[0] += 1
        prefix = rng.choice(["m1", "m2", "m3"]) if op == "m" else op
        out.append((f"k{rng.randrange(12)}", op, f"{prefix}{serial[0]:05d}"))
    return out


def _reader_rows(state_uri: str, name: str) -> set[tuple[Any, ...]]:
    store = open_store(state_uri)
    try:
        catalog = CheckpointCatalog(ReadOnlyBlobStore(store), job_id=name)
        out: set[tuple[Any, ...]] = set()
        for r in read_state(catalog):
            value = tuple(tuple(p) for p in r.value) if r.state == "l" else tuple(r.value)
            out.add((r.key, r.state, r.user_key, value))
        return out
    finally:
        store.close()


class _Run:
    """Batches through one operator, each checked against the model."""

    def __init__(self, session: Any, tmp: Path, partitions: int, table: str, agent: bool,
                 model: Model, tag: str) -> None:
        self.session, self.model = session, model
        self.out: dict[int, list[tuple[Any, ...]]] = {}
        self.op = DstlStatefulOperator(
            name="ttl", processor=TtlJob, key_column="key", output_schema=OUT,
            state_uri=str(tmp / "store"), partitions=partitions, max_parallelism=16,
            table=table, agent=agent, local_dir=str(tmp / f"local-{tag}"),
            materialization_interval_s=0.0,
            sink=lambda df, b: self.out.__setitem__(b, sorted(tuple(r) for r in df.collect())))

    def batch(self, batch_id: int, clock: int, rows: list[tuple[str, str, str]],
              now: int | None = None) -> None:
        """Run ``batch_id`` with the driver's clock at ``clock``; ``now``: the processing time
        the batch must run at (default ``clock``)."""
        now = clock if now is None else now
        want, purged = self.model.batch(now, rows)
        self.op.clock_ms = lambda: clock
        self.op.foreach_batch(self.session.createDataFrame(rows, SCHEMA), batch_id)
        stats = self.op.batch_stats[-1]
        assert stats["processing_time_ms"] == now, f"batch {batch_id}"
        assert self.out[batch_id] == want, f"batch {batch_id}"
        assert stats["ttl_purged"] == purged, f"batch {batch_id}: purged"


@pytest.mark.parametrize("table,agent", [("lmdb", True), ("heap", False)])
def test_ttl_expires_purges_and_survives_reruns_and_a_rescale(
        spark: Any, tmp_path: Path, table: str, agent: bool) -> None:  # noqa: F811
    rng = random.Random(15)
    serial = [0]
    model = Model()
    run = _Run(spark, tmp_path, 3, table, agent, model, "a")
    run.batch(0, 10_000, _rows(rng, 60, serial))
    run.batch(1, 10_400, _rows(rng, 60, serial))
    run.batch(2, 11_100, _rows(rng, 40, serial))  # batch 0's values expired
    assert run.op.batch_stats[-1]["ttl_purged"] > 0
    # Spark re-runs batch 2 after its checkpoint committed: the driver's clock is later now,
    # but the re-run keeps the batch's recorded processing time and sees the same state
    before_3 = copy.deepcopy(model)
    rows_3 = _rows(rng, 40, serial)
    run.batch(3, 11_600, rows_3)
    run.model = copy.deepcopy(before_3)
    run.batch(3, 19_000, rows_3, now=11_600)
    model = run.model
    # the clock steps back: the processing time stays at the last batch's
    run.batch(4, 9_000, _rows(rng, 30, serial), now=11_600)
    assert _reader_rows(str(tmp_path / "store"), "ttl") == model.stored()
    run.op.close()
    # rescale: 3 -> 2 partitions; expiries move with their keys
    run = _Run(spark, tmp_path, 2, table, agent, model, "b")
    run.batch(5, 12_300, _rows(rng, 40, serial))
    assert "rescale" in run.op.batch_stats[-1]["accesses"]
    run.batch(6, 14_000, [("k1", "v", "v99999")])  # every value but the new one expires
    assert len(model.stored()) == 1
    assert _reader_rows(str(tmp_path / "store"), "ttl") == model.stored()
    run.op.close()


def test_ttl_across_a_restart_in_a_fresh_session(tmp_path: Path) -> None:
    rng = random.Random(16)
    serial = [0]
    model = Model()
    for tag, partitions, batches in (("first", 2, [(0, 5_000), (1, 5_500)]),
                                     ("second", 3, [(2, 6_200), (3, 6_400)])):
        session = new_session("dstl-ttl")
        run = _Run(session, tmp_path, partitions, "lmdb", True, model, tag)
        try:
            for batch_id, clock in batches:
                run.batch(batch_id, clock, _rows(rng, 40, serial))
            first_access = run.op.batch_stats[0]["accesses"]
            assert first_access == (["new", "new"] if tag == "first" else
                                    ["rescale", "rescale", "rescale"]), first_access
        finally:
            run.op.close()
            session.stop()
    assert _reader_rows(str(tmp_path / "store"), "ttl") == model.stored()


def test_dedup_example_at_full_size_equals_the_definition(spark: Any,  # noqa: F811
                                                          tmp_path: Path) -> None:
    ex = load_example("dedup_ttl")
    # a batch every second of processing time: an id emitted in batch k expires exactly at the
    # time of batch k + 4 (TTL_S = 4)
    clock = iter(range(1_000_000, 10_000_000, 1_000))
    r = ex.run(spark, tmp_path, table="heap", agent=False, clock_ms=lambda: next(clock))
    cases = r["cases"]
    print(f"dedup input cases: {cases}")
    assert all(cases.values()), f"a case the input must have is missing: {cases}"
    assert len(r["emitted"]) == len(r["batches"]) == 20
    assert r["emitted"] == r["expected"]
    emitted = [row[0] for rows in r["emitted"].values() for row in rows]
    ids = {row["event_id"] for b in r["batches"] for row in b}
    assert len(emitted) == len(ids) + cases["emitted_after_ttl"]
    assert sum(s["ttl_purged"] for s in r["stats"]) > 0


class _Count:
    """An aggregating state's function: how many rows (the accumulator, a one-element list,
    mutated in place)."""

    def create_accumulator(self) -> list[int]:
        return [0]

    def add(self, value: Any, acc: list[int]) -> list[int]:
        acc[0] += 1
        return acc

    def get_result(self, acc: list[int]) -> int:
        return acc[0]

    def merge(self, a: list[int], b: list[int]) -> list[int]:
        return [a[0] + b[0]]


class FoldingTtlJob(StatefulProcessor):
    """Per key: outputs its reducing state (the longest ``arg`` so far) and aggregating state
    (rows so far), both with a TTL, after the batch's purge; then adds the batch's rows."""

    def init(self, handle: Any) -> None:
        self.r = handle.get_reducing_state("r", max, ttl_s=TTL_MS / 1000)
        self.g = handle.get_aggregating_state("g", _Count(), ttl_duration_ms=TTL_MS)

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]],
                          timer_values: TimerValues) -> Iterator[dict[str, Any]]:
        yield {"key": key, "r": json.dumps(self.r.get()), "g": json.dumps(self.g.get())}
        for r in rows:
            self.r.add(r["arg"])
            self.g.add(r["arg"])


@pytest.mark.parametrize("table,agent", [("lmdb", True), ("heap", False)])
def test_reducing_and_aggregating_ttl_expire_purge_and_rescale(
        spark: Any, tmp_path: Path, table: str, agent: bool) -> None:  # noqa: F811
    """Folded values expire ``TTL_MS`` after their key's last row (every add refreshes), are
    purged by the next batch (counted in ``ttl_purged``), restart from nothing, move with their
    keys in a rescale, and the state reader shows the live ones with their expiries."""
    rng = random.Random(17)
    folded: dict[str, tuple[str, int, int]] = {}  # key -> (max arg, rows, expiry)
    out: dict[int, list[tuple[Any, ...]]] = {}

    def operator(partitions: int, tag: str) -> DstlStatefulOperator:
        return DstlStatefulOperator(
            name="fold", processor=FoldingTtlJob, key_column="key",
            output_schema="key string, r string, g string", state_uri=str(tmp_path / "store"),
            partitions=partitions, max_parallelism=16, table=table, agent=agent,
            local_dir=str(tmp_path / f"local-{tag}"), materialization_interval_s=0.0,
            sink=lambda df, b: out.__setitem__(b, sorted(tuple(r) for r in df.collect())))

    def batch(op: DstlStatefulOperator, batch_id: int, now: int, n: int) -> None:
        rows = [(f"k{rng.randrange(10)}", "x", f"a{rng.randrange(1000):04d}") for _ in range(n)]
        purged = sum(2 for p in folded.values() if p[2] <= now)
        live = {k: p for k, p in folded.items() if p[2] > now}
        want = sorted((k, json.dumps(live[k][0] if k in live else None),
                       json.dumps(live[k][1] if k in live else None)) for k in {r[0] for r in rows})
        for key, _, arg in rows:
            m, c, _ = live.get(key, ("", 0, 0))
            live[key] = (max(m, arg), c + 1, now + TTL_MS)
        folded.clear()
        folded.update(live)
        op.clock_ms = lambda: now
        op.foreach_batch(spark.createDataFrame(rows, SCHEMA), batch_id)
        assert out[batch_id] == want, f"batch {batch_id}"
        assert op.batch_stats[-1]["ttl_purged"] == purged, f"batch {batch_id}: purged"

    op = operator(3, "a")
    batch(op, 0, 10_000, 30)
    batch(op, 1, 10_600, 8)
    batch(op, 2, 11_200, 8)  # batch 0's keys that batch 1 did not refresh expired
    assert op.batch_stats[-1]["ttl_purged"] > 0
    op.close()
    op = operator(2, "b")  # rescale 3 -> 2: expiries move with their keys
    batch(op, 3, 11_500, 8)
    assert "rescale" in op.batch_stats[-1]["accesses"]
    batch(op, 4, 12_300, 5)
    want = {(k, "r", e, json.dumps(m)) for k, (m, _, e) in folded.items()}
    want |= {(k, "g", e, json.dumps([c])) for k, (_, c, e) in folded.items()}
    store = open_store(str(tmp_path / "store"))
    try:
        catalog = CheckpointCatalog(ReadOnlyBlobStore(store), job_id="fold")
        got = {(r.key, r.state, r.value[0], json.dumps(r.value[1]))
               for r in read_state(catalog)}
    finally:
        store.close()
    assert got == want
    op.close()
