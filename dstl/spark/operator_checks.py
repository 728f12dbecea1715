"""The Spark operator's constructor arguments, checked on the driver before Spark is touched.

Every argument of :class:`~dstl.spark.operator.DstlStatefulOperator` is checked here, in one
place: a bad value is a :class:`~dstl.errors.ConfigError` naming the argument, the value, what
is accepted and the fix (:class:`~dstl.errors.ConfigTypeError` for a wrong type). The time
settings come out as one :class:`TimeSettings`; the output schema is parsed by Spark when the
operator gets ready (:func:`spark_schema`).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dstl.checkpoint.manifest import MAX_RETAINED
from dstl.checks import (
    check_bool,
    check_callable,
    check_choice,
    check_instance,
    check_int,
    check_mapping,
    check_number,
    check_optional_path,
    check_str,
)
from dstl.errors import ConfigError, ConfigTypeError
from dstl.keygroups import MAX_PARALLELISM_LIMIT
from dstl.options import DstlOptions
from dstl.spark.processor import StatefulProcessor
from dstl.spark.report import INITIAL_STATE_COLUMN, REPORT_COLUMN
from dstl.spark.session_conf import with_interval
from dstl.spark.timing import (
    EVENT_TIME_COLUMN,
    HEARTBEAT_COLUMN,
    LATE_ROWS,
    parse_delay_ms,
    parse_time_mode,
)
from dstl.stores import check_store_uri
from materializer.options import MAX_MATERIALIZATION_INTERVAL_S, BackendOptions

__all__ = ["OWNER", "RESERVED_COLUMNS", "TimeSettings", "check_arguments", "check_initial_state",
           "check_time", "ddl_column_names", "spark_schema"]

@dataclass(frozen=True)
class TimeSettings:
    """The operator's time settings, checked (:func:`check_time`)."""

    mode: str  # dstl.spark.timing.TIME_MODES
    event_time_column: str | None
    delay_ms: int  # 0 without a watermark
    late_rows: str
    late_sink: Callable[[Any, int], None] | None
    late_column: str = "late_row"


OWNER = "DstlStatefulOperator"
#: Columns the operator adds to the input (routing) or output (task reports).
RESERVED_COLUMNS = (REPORT_COLUMN, "_dstl_pid", EVENT_TIME_COLUMN, HEARTBEAT_COLUMN,
                     INITIAL_STATE_COLUMN)


def check_initial_state(initial_state: Any, processor: Any, key_column: str) -> Any:
    """``initial_state``: None, or a batch DataFrame with the key column, for a processor that
    implements ``handle_initial_state``."""
    if initial_state is None:
        return None
    if not (hasattr(initial_state, "columns") and hasattr(initial_state, "sparkSession")):
        raise ConfigTypeError("initial_state", initial_state, "a pyspark DataFrame or None",
                              owner=OWNER)
    if initial_state.isStreaming:
        raise ConfigError("initial_state", "a streaming DataFrame", "a batch DataFrame",
                          owner=OWNER, fix="read the initial state with spark.read")
    if key_column not in initial_state.columns:
        raise ConfigError("initial_state", f"columns {initial_state.columns}",
                          f"a DataFrame with the key column {key_column!r}", owner=OWNER)
    if getattr(processor, "handle_initial_state", None) is StatefulProcessor.handle_initial_state:
        raise ConfigError("initial_state", "given", "a processor that overrides "
                          "handle_initial_state", owner=OWNER,
                          fix=f"implement {processor.__name__}.handle_initial_state(key, "
                              "initial_state, timer_values)")
    return initial_state


def check_arguments(*, name: Any, processor: Any, key_column: Any, output_schema: Any,
                     state_uri: Any, partitions: Any, max_parallelism: Any, table: Any,
                     sink: Any, storage_options: Any, options: Any, backend_options: Any,
                     retained: Any, materialization_interval_s: Any, local_dir: Any,
                     agent: Any, tasks: Any) -> None:
    """Every constructor argument, checked on the driver before Spark is touched (one place).

    Raises:
        ConfigError: naming the argument, the value, the accepted range and the fix
            (ConfigTypeError: a wrong type).
    """
    check_str(name, "name", OWNER, forbidden="/",
              fix="the operator's name: the job id of its checkpoints and the prefix of its "
                  "partitions' ids")
    _check_processor(processor)
    check_str(key_column, "key_column", OWNER, forbidden="`",
              fix="the name of the grouping column of the input")
    if key_column in RESERVED_COLUMNS:
        raise ConfigError("key_column", key_column, f"a column not named {RESERVED_COLUMNS}",
                          owner=OWNER, fix="DSTL adds these columns; rename the key column")
    _check_output_schema(output_schema)
    check_store_uri(state_uri, check_mapping(storage_options, "storage_options", OWNER),
                    owner=OWNER, field="state_uri")
    check_int(max_parallelism, "max_parallelism", OWNER, lo=1, hi=MAX_PARALLELISM_LIMIT,
              fix="the number of key groups, fixed for the life of the state")
    check_int(partitions, "partitions", OWNER, lo=1, hi=max_parallelism,
              fix="at most max_parallelism partitions (each owns at least one key group)")
    check_choice(table, "table", OWNER, ("lmdb", "heap"))
    if sink is not None:
        check_callable(sink, "sink", OWNER, args=2, fix="sink(out_df, batch_id)")
    if options is not None:
        check_instance(options, "options", OWNER, DstlOptions)
    if backend_options is not None:
        check_instance(backend_options, "backend_options", OWNER, BackendOptions)
    check_int(retained, "retained", OWNER, lo=2, hi=MAX_RETAINED,
              fix="a re-run batch restores from the checkpoint before it, so keep >= 2")
    _check_interval(materialization_interval_s, backend_options)
    check_optional_path(local_dir, "local_dir", OWNER)
    check_bool(agent, "agent", OWNER)
    if tasks is not None:
        check_int(tasks, "tasks", OWNER, lo=1, hi=partitions,
                  fix="Spark tasks per batch, at most the number of partitions; None: one per "
                      "task slot")


def _check_processor(processor: Any) -> None:
    """A concrete :class:`StatefulProcessor` subclass, instantiable without arguments (each
    partition makes its own instance)."""
    expected = "a StatefulProcessor subclass (the class, not an instance)"
    if isinstance(processor, StatefulProcessor):
        raise ConfigTypeError("processor", processor, expected, owner=OWNER,
                              fix=f"pass {type(processor).__name__}, the class: every "
                                  "partition makes its own instance")
    if not isinstance(processor, type) or not issubclass(processor, StatefulProcessor):
        raise ConfigTypeError("processor", processor, expected, owner=OWNER,
                              fix="subclass dstl.spark.StatefulProcessor")
    if inspect.isabstract(processor):
        raise ConfigError("processor", processor, expected + " that implements "
                          "handle_input_rows", owner=OWNER)
    try:
        signature = inspect.signature(processor)
    except ValueError:  # no introspectable signature: instantiation will tell
        return
    try:
        signature.bind()
    except TypeError as exc:
        raise ConfigError("processor", processor, expected + " whose constructor takes no "
                          f"arguments ({exc})", owner=OWNER,
                          fix="set state up in init(handle), not in __init__") from None


def _check_output_schema(output_schema: Any) -> None:
    """A DDL string whose structure is sound (Spark parses it fully at :meth:`validate` or the
    first batch) or a ``StructType``; column names unique and not reserved."""
    if isinstance(output_schema, str):
        names = ddl_column_names(output_schema)
    elif type(output_schema).__name__ == "StructType" and hasattr(output_schema, "fields"):
        names = [f.name for f in output_schema.fields]
    else:
        raise ConfigTypeError("output_schema", output_schema, "a DDL string ('key string, "
                              "count long') or a pyspark StructType", owner=OWNER)
    folded = [n.lower() for n in names]  # Spark compares column names case-insensitively
    dup = sorted({n for n in names if folded.count(n.lower()) > 1})
    reserved = sorted(n for n in names if n.lower() in RESERVED_COLUMNS)
    if dup or reserved:
        raise ConfigError("output_schema", output_schema, "unique column names, none of "
                          f"{RESERVED_COLUMNS}", owner=OWNER,
                          fix=f"rename {dup or reserved}")


def check_time(time_mode: Any, event_time_column: Any, watermark_delay: Any, late_rows: Any,
                late_sink: Any, key_column: str, sink: Any = None, late_column: Any = "late_row",
                output_schema: Any = "") -> TimeSettings:
    """The time settings: a known mode; a watermark is a column and a delay, both or neither;
    event-time timers need one; late rows are kept only with a watermark, and go to a
    ``late_sink`` when the operator has a ``sink`` (``foreach_batch``), else to the output's
    ``late_column``.

    Raises:
        ConfigError: naming the argument and the fix (ConfigTypeError: a wrong type).
    """
    mode = parse_time_mode(time_mode, OWNER)
    if event_time_column is not None:
        check_str(event_time_column, "event_time_column", OWNER, forbidden="`",
                  fix="the input column with each row's event time")
        if event_time_column in RESERVED_COLUMNS or event_time_column == key_column:
            raise ConfigError("event_time_column", event_time_column,
                              f"a column other than the key and {RESERVED_COLUMNS}",
                              owner=OWNER)
    if (event_time_column is None) != (watermark_delay is None):
        missing = "watermark_delay" if watermark_delay is None else "event_time_column"
        raise ConfigError(missing, None, "set together with "
                          f"{'event_time_column' if missing == 'watermark_delay' else 'watermark_delay'}"
                          " (a watermark needs both)", owner=OWNER)
    delay_ms = 0 if watermark_delay is None else parse_delay_ms(watermark_delay, OWNER)
    if mode == "event_time" and event_time_column is None:
        raise ConfigError("time_mode", time_mode, "'event_time' only with a watermark",
                          owner=OWNER, fix="set event_time_column and watermark_delay, or "
                                            "use time_mode='processing_time'")
    check_choice(late_rows, "late_rows", OWNER, LATE_ROWS)
    if late_rows == "side_output":
        if event_time_column is None:
            raise ConfigError("late_rows", late_rows, "'drop' without a watermark",
                              owner=OWNER, fix="late rows exist only with event_time_column "
                                                "and watermark_delay")
        if late_sink is None and sink is not None:
            raise ConfigError("late_sink", None, "a callable late_sink(late_df, batch_id) with "
                              "late_rows='side_output' and a sink", owner=OWNER,
                              fix="foreach_batch hands late rows to late_sink; inside the query "
                                  "(op.transform, no sink) they arrive in the output's "
                                  "late_column")
        check_str(late_column, "late_column", OWNER, forbidden="`",
                  fix="the name of the output's column of late rows")
        names = (ddl_column_names(output_schema) if isinstance(output_schema, str)
                 else [f.name for f in getattr(output_schema, "fields", ())])
        if late_column.lower() in {n.lower() for n in names} \
                or late_column.lower() in RESERVED_COLUMNS:
            raise ConfigError("late_column", late_column, "a name that is not an output "
                              f"column nor one of {RESERVED_COLUMNS}", owner=OWNER,
                              fix="pass late_column='<another name>'")
    elif late_column != "late_row":
        raise ConfigError("late_column", late_column, "left out unless "
                          "late_rows='side_output'", owner=OWNER,
                          fix="pass late_rows='side_output' to keep late rows")
    if late_sink is not None:
        check_callable(late_sink, "late_sink", OWNER, args=2, fix="late_sink(late_df, batch_id)")
        if late_rows != "side_output":
            raise ConfigError("late_sink", late_sink, "None unless late_rows='side_output'",
                              owner=OWNER, fix="pass late_rows='side_output' to use it")
    return TimeSettings(mode, event_time_column, delay_ms, late_rows, late_sink,
                        str(late_column))


def _check_interval(interval: Any, backend_options: BackendOptions | None) -> None:
    """The interval's range; and, when ``backend_options`` are given, that they agree with it
    (checked again with the Spark conf at the first batch)."""
    if interval is not None:
        check_number(interval, "materialization_interval_s", OWNER, lo=0.0,
                     hi=MAX_MATERIALIZATION_INTERVAL_S, unit="seconds",
                     fix="use None to materialize by size only")
    if backend_options is not None:
        with_interval(backend_options, {}, interval)


def ddl_column_names(ddl: str) -> list[str]:
    """The column names of a DDL schema (``"key string, count long"``, ``"a: int"``,
    ``"`odd name` map<string, int> NOT NULL"``), after a structural check that needs no Spark:
    balanced brackets and quotes, and every field a name followed by a type.

    Raises:
        ConfigError: the string is not such a schema (names the field that is not).
    """
    fields_ = _split_top_level(ddl)
    if not ddl.strip() or fields_ is None:
        raise ConfigError("output_schema", ddl, "a DDL schema such as 'key string, count "
                          "long' (balanced <>, () and quotes)", owner=OWNER)
    names = []
    for text in fields_:
        m = _DDL_FIELD.fullmatch(text.strip())
        if m is None:
            raise ConfigError("output_schema", ddl, "a DDL schema such as 'key string, count "
                              f"long' (every field a name and a type; not {text.strip()!r})",
                              owner=OWNER)
        names.append(m.group("quoted") if m.group("quoted") is not None else m.group("plain"))
    return names


#: One field of a DDL schema: a name (plain, or in backticks), ``:`` or blanks, a type.
_DDL_FIELD = re.compile(r"(?:`(?P<quoted>[^`]+)`|(?P<plain>[A-Za-z0-9_]+))\s*(?::\s*|\s+)"
                        r"[A-Za-z].*", re.DOTALL)


def _split_top_level(ddl: str) -> list[str] | None:
    """``ddl`` split at the commas outside brackets and quotes; ``None`` if unbalanced."""
    parts: list[str] = []
    quote, start = "", 0
    pairs = {"<": ">", "(": ")"}
    stack: list[str] = []
    for i, c in enumerate(ddl):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"`":
            quote = c
        elif c in pairs:
            stack.append(pairs[c])
        elif c in ">)":
            if not stack or stack.pop() != c:
                return None
        elif c == "," and not stack:
            parts.append(ddl[start:i])
            start = i + 1
    if quote or stack:
        return None
    parts.append(ddl[start:])
    return parts


def spark_schema(spark: Any, output_schema: Any) -> Any:
    """The Spark schema of the output rows; a schema Spark cannot parse is a ConfigError.

    A ``StructType`` is taken as is and a DDL string of columns is parsed alone (one call to
    Spark's parser); anything else is what ``createDataFrame`` makes of it, which builds an empty
    DataFrame (about 0.4 s more in a fresh session, on the start of every query)."""
    from pyspark.sql.types import StructType

    try:
        if isinstance(output_schema, StructType):
            return output_schema
        if isinstance(output_schema, str):
            parsed = StructType.fromDDL(output_schema)
            if isinstance(parsed, StructType):
                return parsed
        return spark.createDataFrame([], output_schema).schema
    except Exception as exc:
        raise ConfigError("output_schema", output_schema, "a DDL string or StructType that "
                          "Spark parses", owner=OWNER, fix=f"{exc!s:.300}") from exc
