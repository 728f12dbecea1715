"""A stream source DSTL refuses (``readStream.format("dstl")``, a bad option of
``dstl_changes``) fails with DSTL's typed error as the error itself, not as the context of another
one: PySpark's stream runner creates the reader inside ``try: ... finally: reader.stop()``, so a
reader constructor that raises leaves ``reader`` unbound and ``stop()`` raises an
``UnboundLocalError`` that becomes the summary line. The runner's steps are replayed here on
PySpark's own reader factory (``_streamReader``)."""

from __future__ import annotations

from typing import Any

from pyspark.sql.datasource_internal import _streamReader

from dstl.errors import ConfigError
from dstl.spark.datasource import DstlChangesDataSource, DstlStateDataSource


def _run_like_pyspark(source: Any) -> BaseException:
    """What python_streaming_source_runner.main does: create the reader, ask it for its first
    offset, stop it in ``finally``; return what escapes."""
    try:
        try:
            reader = _streamReader(source, None)
            reader.initialOffset()
        finally:
            reader.stop()
    except BaseException as exc:  # the runner reports whatever escapes
        return exc
    raise AssertionError("the refused stream started")


def test_read_stream_of_the_state_source_is_a_config_error() -> None:
    err = _run_like_pyspark(DstlStateDataSource({"path": "/tmp/state"}))
    assert type(err) is ConfigError
    assert str(err) == (
        "readStream.format='dstl' is invalid: expected dstl_changes for a stream; "
        'spark.readStream.format("dstl_changes") streams the change feed; '
        'spark.read.format("dstl") reads state or a batch change feed')


def test_a_bad_option_of_the_change_stream_is_a_config_error() -> None:
    err = _run_like_pyspark(DstlChangesDataSource({"path": "/tmp/state",
                                                   "startingCheckpoint": "newest"}))
    assert type(err) is ConfigError and "startingCheckpoint" in str(err)
