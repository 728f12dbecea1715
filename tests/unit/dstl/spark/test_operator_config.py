"""``DstlStatefulOperator`` checks every argument on the driver, at construction, without
starting Spark.

Before, ``processor=None``, ``sink=5``, ``state_uri='s3:/typo/app'`` (a local directory named
``s3:``) and ``'ftp://...'`` were accepted and failed — or silently did the wrong thing — at the
first batch, on the executors; ``max_parallelism=0`` blamed ``partitions``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dstl import DstlOptions
from dstl.errors import ConfigError
from dstl.spark import DstlStatefulOperator, StatefulProcessor
from materializer import BackendOptions


class Count(StatefulProcessor):
    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        yield {"key": key, "count": sum(1 for _ in rows)}


class Abstract(StatefulProcessor):
    """Does not implement handle_input_rows."""


class NeedsArgs(Count):
    def __init__(self, factor: int) -> None:
        self.factor = factor


class NotAProcessor:
    def handle_input_rows(self, key: Any, rows: Any) -> Any:
        return iter(())


def _sink(df: Any, batch_id: int) -> None:
    pass


def _good(tmp_path: Path) -> dict[str, Any]:
    return dict(name="count", processor=Count, key_column="key",
                output_schema="key string, count long", state_uri=str(tmp_path / "state"),
                partitions=4, max_parallelism=128, sink=_sink)


TYPE, RANGE = "type", "range"
BAD: list[tuple[str, Any, str]] = [
    ("name", "", RANGE),
    ("name", "a/b", RANGE),
    ("name", 5, TYPE),
    ("processor", None, TYPE),
    ("processor", 5, TYPE),
    ("processor", Count(), TYPE),  # unchecked: an instance, not the class
    ("processor", NotAProcessor, TYPE),
    ("processor", Abstract, RANGE),
    ("processor", NeedsArgs, RANGE),
    ("key_column", "", RANGE),
    ("key_column", 5, TYPE),
    ("key_column", "a`b", RANGE),  # unchecked: broke the routing SQL
    ("key_column", "_dstl_pid", RANGE),  # unchecked: the routing column replaced it
    ("output_schema", 5, TYPE),
    ("output_schema", "", RANGE),
    ("output_schema", "key string,", RANGE),
    ("output_schema", "key", RANGE),
    ("output_schema", "key string, count array<long", RANGE),
    ("output_schema", "key string, KEY long", RANGE),
    ("output_schema", "key string, _dstl_report string", RANGE),
    ("state_uri", "s3:/typo/app", RANGE),  # unchecked: (a local directory 's3:')
    ("state_uri", "s3//bucket/app", RANGE),  # not a local directory 's3'
    ("state_uri", "ftp://host/app", RANGE),
    ("state_uri", "s3://bucket/app?x=1", RANGE),
    ("state_uri", "", RANGE),
    ("state_uri", None, TYPE),
    ("partitions", 0, RANGE),
    ("partitions", 129, RANGE),
    ("partitions", True, TYPE),
    ("partitions", 2.0, TYPE),
    ("max_parallelism", 0, RANGE),  # blamed partitions before
    ("max_parallelism", 32769, RANGE),
    ("max_parallelism", True, TYPE),  # blamed partitions before
    ("max_parallelism", "128", TYPE),  # raw TypeError before
    ("table", "disk", RANGE),
    ("table", None, TYPE),
    ("sink", 5, TYPE),
    ("sink", lambda df: None, TYPE),  # unchecked: the wrong arity
    ("storage_options", 5, TYPE),
    ("storage_options", {1: "x"}, TYPE),
    ("options", 5, TYPE),
    ("options", BackendOptions(), TYPE),  # unchecked: the wrong options class
    ("backend_options", DstlOptions(), TYPE),
    ("retained", 1, RANGE),
    ("retained", True, TYPE),  # a bool was 1: refused, but as a range error
    ("retained", "3", TYPE),
    ("materialization_interval_s", -1.0, RANGE),
    ("materialization_interval_s", 1e10, RANGE),
    ("materialization_interval_s", "60", TYPE),
    ("local_dir", 5, TYPE),
    ("local_dir", "", RANGE),
    ("agent", "no", TYPE),  # unchecked: "no" is truthy
    ("agent", 0, TYPE),
    ("tasks", 0, RANGE),
    ("tasks", 5, RANGE),  # more tasks than the 4 partitions
    ("tasks", True, TYPE),
    ("tasks", 2.0, TYPE),
]


@pytest.mark.parametrize(("field", "value", "kind"), BAD)
def test_bad_arguments_are_refused_at_construction(tmp_path: Path, field: str, value: Any,
                                                   kind: str) -> None:
    args = {**_good(tmp_path), field: value}
    with pytest.raises(ConfigError) as info:
        DstlStatefulOperator(**args)
    err = info.value
    assert err.field == field, f"blamed {err.field!r}, not {field!r}: {err}"
    assert f"DstlStatefulOperator.{field}=" in str(err)
    if kind == TYPE:
        assert isinstance(err, TypeError), repr(err)
    assert not (tmp_path / "state").exists()  # nothing was opened


def test_a_scheme_without_its_colon_names_the_uri_meant(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``s3//bucket/app`` (the colon forgotten) would be a local directory ``./s3/bucket/app``:
    the message a user sees names the URI meant and how to write that directory."""
    monkeypatch.chdir(tmp_path)
    args = {**_good(tmp_path), "state_uri": "s3//bucket/app"}
    with pytest.raises(ConfigError) as info:
        DstlStatefulOperator(**args)
    assert str(info.value) == (
        "DstlStatefulOperator.state_uri='s3//bucket/app' is invalid: expected a local path or a "
        "URI with one of the schemes file://, memory://, s3://, s3a://, hdfs://, gs://, gcs://, "
        "abfs://, abfss://, az://; did you mean s3://bucket/app? A local directory whose name is "
        "'s3' is written ./s3//bucket/app")
    assert list(tmp_path.iterdir()) == []  # no ./s3 directory was made


def test_storage_options_for_a_local_state_uri_are_refused(tmp_path: Path) -> None:
    args = {**_good(tmp_path), "storage_options": {"secret": "hidden"}}
    with pytest.raises(ConfigError, match="storage_options") as info:
        DstlStatefulOperator(**args)
    assert "hidden" not in str(info.value)


def test_backend_options_that_disagree_with_the_interval_are_refused_at_once(
        tmp_path: Path) -> None:
    args = {**_good(tmp_path), "backend_options": BackendOptions(materialization_interval_s=5.0),
            "materialization_interval_s": 60.0}
    with pytest.raises(ConfigError, match="materialization_interval_s"):
        DstlStatefulOperator(**args)


@pytest.mark.parametrize(("field", "value"), [
    ("output_schema", "`odd name` map<string, int> NOT NULL, c decimal(10,2) COMMENT 'a, b'"),
    ("output_schema", "key: string, count: long"),
    ("state_uri", "s3://bucket/app"), ("state_uri", "memory://x"),
    ("partitions", 128), ("max_parallelism", 32768), ("sink", None), ("sink", print),
    ("materialization_interval_s", None), ("materialization_interval_s", 0),
    ("retained", 2), ("agent", False), ("table", "heap"),
])
def test_good_arguments_are_accepted(tmp_path: Path, field: str, value: Any) -> None:
    op = DstlStatefulOperator(**{**_good(tmp_path), field: value})
    assert getattr(op, field) == value
    op.close()


def test_an_output_struct_type_is_accepted(tmp_path: Path) -> None:
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    schema = StructType([StructField("key", StringType()), StructField("count", LongType())])
    DstlStatefulOperator(**{**_good(tmp_path), "output_schema": schema}).close()
    dup = StructType([StructField("key", StringType()), StructField("Key", LongType())])
    with pytest.raises(ConfigError, match="output_schema"):
        DstlStatefulOperator(**{**_good(tmp_path), "output_schema": dup})
