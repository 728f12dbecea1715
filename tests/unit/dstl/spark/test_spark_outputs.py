"""Output rows against the output schema (dstl/spark/outputs.py), without a SparkSession: the
Arrow schema comes from Spark's own mapping (``to_arrow_schema``), as the driver makes it.

Every Spark SQL type converts (nested to depth 3), and every kind of mismatch — missing, extra,
wrong type at the top and nested, None where not nullable, out of range, not a dict — raises
OutputSchemaError naming the processor, the key and the field path."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

import pytest
from pyspark.sql import Row
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    ByteType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from dstl.errors import OutputSchemaError, UsageError
from dstl.spark.outputs import OutputRows, time_zone

INNER = StructType([StructField("x", ArrayType(LongType())),
                    StructField("y", MapType(StringType(), ArrayType(DateType())))])
SCHEMA = StructType([
    StructField("key", StringType()), StructField("ts", TimestampType()),
    StructField("ntz", TimestampNTZType()), StructField("d", DateType()),
    StructField("dec", DecimalType(10, 2)), StructField("b", BinaryType()),
    StructField("arr", ArrayType(IntegerType())), StructField("m", MapType(StringType(), DoubleType())),
    StructField("st", StructType([StructField("a", IntegerType()), StructField("b", StringType())])),
    StructField("nested", ArrayType(INNER)), StructField("f", FloatType()),
    StructField("by", ByteType()), StructField("bo", BooleanType()), StructField("sh", ShortType()),
    StructField("n", LongType(), nullable=False),
])
ARROW = to_arrow_schema(SCHEMA, timezone="UTC")
UTC = dt.UTC


def good_row(key: str = "k") -> dict[str, Any]:
    return {"key": key, "ts": dt.datetime(2024, 1, 2, 3, 4, 5, 6000, tzinfo=UTC),
            "ntz": dt.datetime(2024, 1, 2, 3, 4, 5), "d": dt.date(2024, 2, 29),
            "dec": Decimal("12.34"), "b": b"\x00\xff", "arr": [1, None, 3], "m": {"x": 1.5},
            "st": {"a": 1, "b": "s"}, "nested": [{"x": [1, 2], "y": {"k": [dt.date(2020, 1, 1)]}}],
            "f": 1.5, "by": 7, "bo": True, "sh": 300, "n": 5}


def _rows(tz: str = "UTC") -> OutputRows:
    return OutputRows(ARROW, "P of operator 'op'", tz)


def test_every_type_converts_and_reads_back() -> None:
    out = _rows()
    row = good_row()
    out.extend("k", [row])
    out.extend("k2", [Row(**{**good_row("k2"), "st": Row(a=2, b=None)})])  # Rows as Spark's
    batch = out.to_batch(ARROW, {})
    got = batch.to_pylist()
    assert len(out) == 2 and out.keys == ["k", "k2"]
    assert got[0]["ts"] == row["ts"] and got[0]["ntz"] == row["ntz"]
    assert got[0]["dec"] == Decimal("12.34") and got[0]["b"] == b"\x00\xff"
    assert got[0]["m"] == [("x", 1.5)] and got[0]["st"] == {"a": 1, "b": "s"}
    assert got[0]["nested"] == [{"x": [1, 2], "y": [("k", [dt.date(2020, 1, 1)])]}]
    assert got[1]["st"] == {"a": 2, "b": None} and got[1]["key"] == "k2"


def test_naive_timestamps_are_in_the_session_time_zone() -> None:
    out = _rows("America/New_York")
    out.extend("k", [{**good_row(), "ts": dt.datetime(2024, 7, 1, 12, 0)}])
    got = out.to_batch(ARROW, {}).to_pylist()[0]["ts"]
    assert got == dt.datetime(2024, 7, 1, 16, 0, tzinfo=UTC)  # EDT is UTC-4


BAD = [
    ("missing", lambda r: r.pop("arr"), "'arr'", "missing field"),
    ("extra", lambda r: r.update(zzz=1), "'zzz'", "extra field"),
    ("str for long", lambda r: r.update(n="5"), "'n'", "expected int, got str"),
    ("float for long", lambda r: r.update(n=1.5), "'n'", "expected int, got float"),
    ("bool for long", lambda r: r.update(n=True), "'n'", "expected int, got bool"),
    ("None not nullable", lambda r: r.update(n=None), "'n'", "non-nullable"),
    ("str for binary", lambda r: r.update(b="x"), "'b'", "expected bytes"),
    ("date for timestamp", lambda r: r.update(ts=dt.date(2024, 1, 1)), "'ts'", "datetime"),
    ("float for decimal", lambda r: r.update(dec=1.5), "'dec'", "Decimal"),
    ("str for date", lambda r: r.update(d="2024-01-01"), "'d'", "datetime.date"),
    ("array element", lambda r: r.update(arr=[1, "a"]), "'arr[1]'", "expected int"),
    ("array not list", lambda r: r.update(arr="abc"), "'arr'", "expected a list"),
    ("map value", lambda r: r.update(m={"x": "y"}), "\"m['x']\"", "expected float"),
    ("map key", lambda r: r.update(m={1: 1.0}), "'m[key 1]'", "expected str"),
    ("struct missing", lambda r: r.update(st={"a": 1}), "'st.b'", "missing field"),
    ("struct extra", lambda r: r.update(st={"a": 1, "b": "s", "c": 2}), "'st.c'",
     "extra field"),
    ("deep", lambda r: r.update(nested=[{"x": [1], "y": {"k": ["2020"]}}]),
     "\"nested[0].y['k'][0]\"", "datetime.date"),
    ("int8 overflow", lambda r: r.update(by=300), "'by'", "does not fit int8"),
    ("decimal precision", lambda r: r.update(dec=Decimal("1.234")), "'dec'", "does not fit"),
]


@pytest.mark.parametrize(("change", "field", "says"), [b[1:] for b in BAD],
                         ids=[b[0] for b in BAD])
def test_mismatches_name_processor_key_and_field(change: Any, field: str, says: str) -> None:
    out = _rows()
    out.extend("ok", [good_row("ok")])
    bad = good_row("bad")
    change(bad)
    with pytest.raises(OutputSchemaError) as ei:
        out.extend("bad-key", [bad])
        out.to_batch(ARROW, {})
    msg = str(ei.value)
    assert "P of operator 'op'" in msg and "'bad-key'" in msg, msg
    assert f"field {field}" in msg and says in msg, msg
    assert isinstance(ei.value, UsageError)


@pytest.mark.parametrize("row", [("k", 1), "k", None, 3])
def test_a_row_that_is_not_a_dict(row: Any) -> None:
    with pytest.raises(OutputSchemaError, match="must be a dict"):
        _rows().extend(7, [row])


@pytest.mark.parametrize(("name", "offset_min"), [
    ("UTC", 0), ("Etc/UTC", 0), ("+08:00", 480), ("-0530", -330), ("GMT+2", 120),
    ("UTC-03:00", -180), ("Asia/Kolkata", 330)])
def test_session_time_zone_ids(name: str, offset_min: int) -> None:
    zone = time_zone(name)
    assert dt.datetime(2024, 1, 1, tzinfo=zone).utcoffset() == dt.timedelta(minutes=offset_min)


@pytest.mark.parametrize("name", ["Mars/Olympus", "+99:00x", "+99:00", "+01:75", "",
                                  "../etc/passwd"])
def test_unknown_time_zone_is_a_usage_error(name: str) -> None:
    with pytest.raises(UsageError, match="session time zone"):
        time_zone(name)
