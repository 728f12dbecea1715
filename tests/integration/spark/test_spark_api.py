"""The processor API through a real local SparkSession: Spark's state method names in a running
operator across a restart, and output rows of every Spark SQL type (one schema with all of them)
plus rows that do not match the schema (typed error naming the processor, the key, the field)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from spark_support import spark  # noqa: F401

from dstl.errors import ConfigError, OutputSchemaError
from dstl.spark import DstlStatefulOperator, StatefulProcessor

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]


class SparkNames(StatefulProcessor):
    """Per key: a count (value state), the last 3 items (list state), item counts (map state);
    the item ``reset`` deletes the item counts of every key of the partition."""

    def init(self, handle: Any) -> None:
        self.handle = handle
        self.count = handle.get_value_state("count")
        self.recent = handle.get_list_state("recent")
        self.items = handle.get_map_state("items")

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]], timer_values: Any
                          ) -> Iterator[dict[str, Any]]:
        items = [r["item"] for r in rows]
        if "reset" in items:
            self.handle.delete_if_exists("items")
        self.count.update((self.count.get() if self.count.exists() else 0) + len(items))
        if self.recent.exists():
            self.recent.append_list(items)
            self.recent.put(list(self.recent.get())[-3:])
        else:
            self.recent.put(items[:1])
            self.recent.append_list(items[1:])
            self.recent.put(list(self.recent.get())[-3:])
        for it in items:
            if it == "reset":
                continue
            n = self.items.get_value(it) if self.items.contains_key(it) else 0
            self.items.update_value(it, n + 1)
        if self.items.contains_key("drop"):
            self.items.remove_key("drop")
        pairs = sorted(f"{k}={v}" for k, v in self.items.iterator())
        yield {"key": key, "count": self.count.get(), "recent": ",".join(self.recent.get()),
               "items": ";".join(pairs)}


def _model(batches: list[list[tuple[str, str]]], partition_of: Any
           ) -> list[dict[str, dict[str, Any]]]:
    """The expected output per batch: the processor's rules on plain dicts."""
    count: dict[str, int] = {}
    recent: dict[str, list[str]] = {}
    items: dict[str, dict[str, int]] = {}
    out = []
    for batch in batches:
        by_key: dict[str, list[str]] = {}
        for k, it in batch:
            by_key.setdefault(k, []).append(it)
        resets = {partition_of(k) for k, its in by_key.items() if "reset" in its}
        for k in list(items):
            if partition_of(k) in resets:
                del items[k]
        got = {}
        for k, its in by_key.items():
            count[k] = count.get(k, 0) + len(its)
            recent[k] = (recent.get(k, []) + its)[-3:]
            m = items.setdefault(k, {})
            for it in its:
                if it != "reset":
                    m[it] = m.get(it, 0) + 1
            m.pop("drop", None)
            got[k] = {"count": count[k], "recent": ",".join(recent[k]),
                      "items": ";".join(sorted(f"{a}={b}" for a, b in m.items()))}
        out.append(got)
    return out


def test_spark_state_names_in_a_running_operator(spark: Any, tmp_path: Path  # noqa: F811
                                                 ) -> None:
    # heap: the restart restores from the store, so every Spark-named write must be in the log
    # (both tables against a model: tests/unit/materializer/test_spark_names.py)
    from dstl import key_group_for
    from materializer.codecs import StrOrBytesKeyCodec

    mp, parts = 16, 2

    def partition_of(k: str) -> int:
        return key_group_for(StrOrBytesKeyCodec().encode(k), mp) * parts // mp

    got: list[dict[str, dict[str, Any]]] = []

    def sink(out_df: Any, batch_id: int) -> None:
        got.append({r["key"]: {"count": r["count"], "recent": r["recent"], "items": r["items"]}
                    for r in out_df.collect()})

    def run(batch_id: int, rows: list[tuple[str, str]], op: DstlStatefulOperator) -> None:
        op.foreach_batch(spark.createDataFrame(rows, "key string, item string"), batch_id)

    def new_op() -> DstlStatefulOperator:
        return DstlStatefulOperator(
            name="names", processor=SparkNames, key_column="key",
            output_schema="key string, count long, recent string, items string",
            state_uri=str(tmp_path / "state"), partitions=parts, max_parallelism=mp,
            table="heap", sink=sink, local_dir=str(tmp_path / "local"),
            materialization_interval_s=None)

    keys = [f"k{i}" for i in range(6)]
    batches = [[(k, f"i{(j * 3 + n) % 4}") for n, k in enumerate(keys) for j in range(2)],
               [("k2", "reset")],  # alone: it deletes the partition's maps before any other key
               [("k0", "drop"), ("k1", "i1"), ("k3", "i9"), ("k4", "drop"), ("k4", "i0")],
               [(k, "i2") for k in keys]]
    op = new_op()
    for i, b in enumerate(batches[:3]):
        run(i, b, op)
    op.close()
    op = new_op()  # a restart: the state comes back from the store (the Spark names' log)
    run(3, batches[3], op)
    op.close()
    assert got == _model(batches, partition_of)
    assert any(partition_of(k) == partition_of("k2") for k in keys if k != "k2")  # reset seen


ALL_TYPES = ("key string, n long, ts timestamp, ntz timestamp_ntz, d date, dec decimal(10,2), "
             "b binary, arr array<int>, m map<string,double>, st struct<a:int,b:string>, "
             "nested array<struct<x:array<long>,y:map<string,array<date>>>>, f float, "
             "by byte, bo boolean, sh short")


def _typed_row(key: str, n: int) -> dict[str, Any]:
    return {"key": key, "n": n,
            "ts": dt.datetime(2024, 1, 2, 3, 4, 5, 6000 + n, tzinfo=dt.UTC),
            "ntz": dt.datetime(2024, 1, 2, 3, 4, n), "d": dt.date(2024, 2, 29),
            "dec": Decimal(n) / 100, "b": bytes([n, 255]), "arr": [n, None],
            "m": {"x": n / 2}, "st": {"a": n, "b": key},
            "nested": [{"x": [n], "y": {key: [dt.date(2020, 1, n)]}}],
            "f": 1.5, "by": n, "bo": n % 2 == 0, "sh": 300 + n}


class Typed(StatefulProcessor):
    """Counts rows per key and yields one row of every Spark SQL type; an input row's ``bad``
    column makes the output row wrong in that way (missing/extra/nested-type)."""

    def init(self, handle: Any) -> None:
        self.count = handle.get_value_state("count")

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        rows = list(rows)
        n = (self.count.get() or 0) + len(rows)
        self.count.update(n)
        out = _typed_row(key, n)
        bad = {r["bad"] for r in rows} - {None}
        if "missing" in bad:
            del out["ts"]
        if "nested" in bad:
            out["nested"][0]["y"][key] = ["2020-01-01"]
        yield out


def test_every_spark_sql_type_and_mismatched_rows(spark: Any, tmp_path: Path  # noqa: F811
                                                  ) -> None:
    got: list[Any] = []
    op = DstlStatefulOperator(
        name="typed", processor=Typed, key_column="key", output_schema=ALL_TYPES,
        state_uri=str(tmp_path / "state"), partitions=2, max_parallelism=8, table="lmdb",
        agent=False, sink=lambda df, b: got.extend(df.collect()),
        local_dir=str(tmp_path / "local"), materialization_interval_s=None)

    def run(batch_id: int, rows: list[tuple[str, str | None]]) -> None:
        op.foreach_batch(spark.createDataFrame(rows, "key string, bad string"), batch_id)

    run(0, [("a", None), ("b", None), ("b", None)])
    by_key = {r["key"]: r.asDict(recursive=True) for r in got}
    for key, n in (("a", 1), ("b", 2)):
        want = _typed_row(key, n)
        row = by_key[key]
        assert row.pop("ts").astimezone(dt.UTC) == want.pop("ts")  # collect: local
        want["m"], want["st"] = {"x": n / 2}, {"a": n, "b": key}
        assert row == want, key
    for bad, field in (("missing", "'ts'"), ("nested", "\"nested[0].y['b'][0]\"")):
        with pytest.raises(OutputSchemaError) as ei:
            run(1, [("a", None), ("b", bad)])
        msg = str(ei.value)
        assert "Typed of operator 'typed'" in msg and "key 'b'" in msg, msg
        assert f"field {field}" in msg, msg
    got.clear()
    run(1, [("a", None), ("b", None)])  # the failed attempts committed nothing
    assert sorted((r["key"], r["n"]) for r in got) == [("a", 2), ("b", 3)]
    op.close()


class Seeded(StatefulProcessor):
    """A count per key, seeded from the initial state's ``start`` column (plus ``bonus``)."""

    def init(self, handle: Any) -> None:
        self.count = handle.get_value_state("count")

    def handle_initial_state(self, key: Any, initial_state: dict[str, Any],
                             timer_values: Any) -> None:
        self.count.update((self.count.get() or 0) + initial_state["start"]
                          + initial_state["bonus"])

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        rows = list(rows)
        assert all("_dstl_init" not in r for r in rows)  # internal columns never shown
        n = (self.count.get() or 0) + len(rows)
        self.count.update(n)
        yield {"key": key, "count": n}


class SeededYields(Seeded):
    """Emits from ``handle_initial_state``, which Spark's ``handleInitialState`` does not."""

    def handle_initial_state(self, key: Any, initial_state: dict[str, Any],  # type: ignore[override]
                             timer_values: Any) -> Iterator[dict[str, Any]]:
        yield {"key": key, "count": initial_state["start"]}


def test_initial_state_applied_in_the_first_batch_only(spark: Any, tmp_path: Path  # noqa: F811
                                                       ) -> None:
    got: dict[int, dict[str, int]] = {}

    def sink(df: Any, batch_id: int) -> None:
        got[batch_id] = {r["key"]: r["count"] for r in df.collect()}

    init = spark.createDataFrame([("a", 10, 0), ("b", 20, 1), ("b", 100, 0)],
                                 "key string, start long, bonus int")

    def new_op() -> DstlStatefulOperator:
        return DstlStatefulOperator(
            name="seeded", processor=Seeded, key_column="key", output_schema="key string, "
            "count long", state_uri=str(tmp_path / "state"), partitions=2, max_parallelism=8,
            table="heap", sink=sink, local_dir=str(tmp_path / "local"),
            materialization_interval_s=None, initial_state=init)

    def run(op: DstlStatefulOperator, batch_id: int, keys: list[str]) -> None:
        op.foreach_batch(spark.createDataFrame([(k,) for k in keys], "key string"), batch_id)

    op = new_op()
    run(op, 0, ["a", "c"])
    assert got[0] == {"a": 11, "c": 1}
    run(op, 1, ["b"])
    assert got[1] == {"b": 122}  # both initial rows of b, applied once
    run(op, 1, ["b"])  # a re-run of batch 1 starts from checkpoint 0: not applied again
    assert got[1] == {"b": 122}
    op.close()
    op = new_op()  # a restart of the query (its checkpoint exists): never applied again
    run(op, 2, ["a", "b", "c"])
    assert got[2] == {"a": 12, "b": 123, "c": 2}
    op.close()
    # a handle_initial_state that yields would never run its body: refused, nothing committed
    op = DstlStatefulOperator(
        name="yields", processor=SeededYields, key_column="key", output_schema="key string, "
        "count long", state_uri=str(tmp_path / "yields"), partitions=1, table="heap",
        sink=sink, local_dir=str(tmp_path / "local-yields"), materialization_interval_s=None,
        initial_state=init)
    with pytest.raises(Exception, match=r"SeededYields.handle_initial_state returned generator"):
        run(op, 0, ["a"])
    assert op.coordinator is not None and op.coordinator.latest() is None
    op.close()
    with pytest.raises(ConfigError, match="handle_initial_state"):
        DstlStatefulOperator(name="x", processor=Typed, key_column="key",
                             output_schema="key string", state_uri=str(tmp_path / "x"),
                             initial_state=init)
    with pytest.raises(ConfigError, match="key column 'user'"):
        DstlStatefulOperator(name="x", processor=Seeded, key_column="user",
                             output_schema="key string", state_uri=str(tmp_path / "x"),
                             initial_state=init)
