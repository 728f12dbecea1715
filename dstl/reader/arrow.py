"""Reader rows as Arrow record batches: the one column layout of the Spark sources and of
``dstl state dump --format parquet``. Needs ``pyarrow`` (the ``spark`` extra); importing this
module is what requires it.

Columns (``namespace``, ``user_key`` and ``value`` as JSON text, :func:`~dstl.reader.rows.to_json`):

- state: ``checkpoint bigint, partition string, key_group int, key string, key_bytes binary,
  state string, kind string, namespace string, user_key string, value string``;
- changes: ``checkpoint bigint, partition string, key_group int, seq bigint, key string,
  key_bytes binary, state string, kind string, namespace string, op string, user_key string,
  value string, source string``.

``key`` is the key as text (a UTF-8 key; ``null`` for a binary key that is not UTF-8), and
``key_bytes`` the key's bytes always.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from dstl.reader.errors import ValueTypeError
from dstl.reader.rows import CHANGE_DDL, STATE_DDL, ChangeRow, StateRow, to_json

__all__ = ["CHANGE_DDL", "CHANGE_SCHEMA", "STATE_DDL", "STATE_SCHEMA", "batches",
           "state_json_lines", "typed_column"]

STATE_SCHEMA = pa.schema([
    ("checkpoint", pa.int64()), ("partition", pa.string()), ("key_group", pa.int32()),
    ("key", pa.string()), ("key_bytes", pa.binary()), ("state", pa.string()),
    ("kind", pa.string()), ("namespace", pa.string()), ("user_key", pa.string()),
    ("value", pa.string())])
CHANGE_SCHEMA = pa.schema([
    ("checkpoint", pa.int64()), ("partition", pa.string()), ("key_group", pa.int32()),
    ("seq", pa.int64()), ("key", pa.string()), ("key_bytes", pa.binary()),
    ("state", pa.string()), ("kind", pa.string()), ("namespace", pa.string()),
    ("op", pa.string()), ("user_key", pa.string()), ("value", pa.string()),
    ("source", pa.string())])


_JSON_COLUMNS = frozenset({"namespace", "user_key", "value"})
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
#: what ``pyarrow.array`` raises for a value that does not convert to the type asked for
_CONVERSION_ERRORS = (pa.ArrowException, ValueError, TypeError, OverflowError)


def typed_column(values: Sequence[Any], kind: pa.DataType,
                 where: Callable[[int], tuple[str, Any]]) -> pa.Array:
    """``values`` (decoded) as a column of ``kind``, converted by ``pyarrow.array``.

    Raises:
        ValueTypeError: a value does not convert; it names the first such value with its state
            and key (``where(i)``: the state name and key of ``values[i]``).
    """
    try:
        return pa.array(values, type=kind)
    except _CONVERSION_ERRORS as exc:
        for i, v in enumerate(values):
            try:
                pa.array([v], type=kind)
            except _CONVERSION_ERRORS as one:
                state, key = where(i)
                raise ValueTypeError(state, key, v, kind, str(one) or type(one).__name__) \
                    from exc
        raise  # each value converts alone: the column's error as it is


def _text_key(k: Any) -> str | None:
    return k if type(k) is str else None


def _converter(name: str) -> Callable[[Any], Any] | None:
    """How a row field becomes a column value (``None``: as it is)."""
    if name in _JSON_COLUMNS:
        return to_json
    return _text_key if name == "key" else None


def _column(name: str, col: tuple[Any, ...], conv: Callable[[Any], Any] | None,
            kind: pa.DataType) -> pa.Array:
    if name == "value" and all(type(v) is int and _I64_MIN <= v <= _I64_MAX for v in col):
        # integer values (counters, sums): JSON text in one vectorised cast
        return pa.array(col, type=pa.int64()).cast(pa.string())
    if name == "key":
        return pa.nulls(len(col), type=pa.string())  # filled from key_bytes by the caller
    return pa.array(col if conv is None else list(map(conv, col)), type=kind)


def _text_keys(key_bytes: pa.Array, keys: tuple[Any, ...]) -> pa.Array:
    """``key``: the UTF-8 keys as text (the usual case, one vectorised cast), else the decoded
    key where it is text and null where it is not."""
    try:
        return key_bytes.cast(pa.string())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([k if type(k) is str else None for k in keys], type=pa.string())


def _state_and_key(columns: list[tuple[Any, ...]], state_at: int, key_at: int, i: int
                   ) -> tuple[str, Any]:
    return columns[state_at][i], columns[key_at][i]


def batches(rows: Iterable[StateRow] | Iterable[ChangeRow], schema: pa.Schema, *,
            batch_rows: int = 16384, typed: tuple[str, pa.DataType] | None = None
            ) -> Iterator[pa.RecordBatch]:
    """Rows as record batches of ``schema`` (:data:`STATE_SCHEMA` or :data:`CHANGE_SCHEMA`).

    Args:
        rows: state or change rows (their fields in the schema's order).
        schema: the batches' schema.
        batch_rows: rows per batch.
        typed: ``(column name, Arrow type)``: also a column of the raw ``value`` converted to
            that type (the Spark sources' ``valueType`` option).

    Raises:
        ValueTypeError: a value does not convert to ``typed``'s type.
    """
    names = [f.name for f in schema]
    convs = [_converter(n) for n in names]
    value_at = schema.get_field_index("value")
    state_at, key_col = names.index("state"), names.index("key")
    key_at = key_col if "key_bytes" in names else None
    key_bytes_at = names.index("key_bytes") if key_at is not None else -1
    out_schema = schema.append(pa.field(typed[0], typed[1])) if typed is not None else schema
    it = iter(rows)
    while True:
        chunk = list(itertools.islice(it, batch_rows))
        if not chunk:
            return
        columns = list(zip(*chunk, strict=True))  # column-wise: one conversion loop per column
        arrays = [_column(names[i], col, conv, out_schema.field(i).type)
                  for i, (col, conv) in enumerate(zip(columns, convs, strict=True))]
        if key_at is not None:  # the key as text: one vectorised UTF-8 check of key_bytes
            arrays[key_at] = _text_keys(arrays[key_bytes_at], columns[key_at])
        if typed is not None:
            arrays.append(typed_column(columns[value_at], typed[1],
                                       partial(_state_and_key, columns, state_at, key_col)))
        yield pa.RecordBatch.from_arrays(arrays, schema=out_schema)


#: Text ``json.dumps`` writes as it is between quotes: printable ASCII but ``"`` and ``\``.
_PLAIN_TEXT = r"^[ !#-\[\]-~]*$"


def _json_strings(col: pa.Array, null: Callable[[int], str]) -> pa.Array:
    """A string column as the JSON string literals ``json.dumps`` writes (ASCII escapes); a null
    at row ``i`` as ``null(i)``. Vectorised when every value is plain text (the usual case:
    names, ASCII keys), else row by row with the encoder ``json.dumps`` uses."""
    if col.null_count == 0 and pc.all(pc.match_substring_regex(col, _PLAIN_TEXT)).as_py():
        return pc.binary_join_element_wise('"', col, '"', "")
    return pa.array([null(i) if v is None else to_json(v) for i, v in enumerate(col.to_pylist())],
                    type=pa.string())


def _json_null(_: int) -> str:
    return "null"


def state_json_lines(batch: pa.RecordBatch) -> str:
    """The JSON lines ``dstl state dump`` writes for the rows of a :data:`STATE_SCHEMA` batch:
    each line ``json.dumps`` of the row's fields but ``key_bytes``, compact, values in their
    tagged JSON form (:func:`~dstl.reader.rows.to_plain`; a binary key as ``{"$b64": ...}``) —
    put together column by column (the JSON columns are that text already)."""
    col = batch.column
    key_bytes = col("key_bytes")
    parts: list[Any] = [
        '{"checkpoint":', col("checkpoint").cast(pa.string()),
        ',"partition":', _json_strings(col("partition"), _json_null),
        ',"key_group":', col("key_group").cast(pa.string()),
        ',"key":', _json_strings(col("key"), lambda i: to_json(key_bytes[i].as_py()) or "null"),
        ',"state":', _json_strings(col("state"), _json_null),
        ',"kind":', _json_strings(col("kind"), _json_null)]
    for name in ("namespace", "user_key", "value"):
        parts += [f',"{name}":', pc.fill_null(col(name), "null")]
    lines = pc.binary_join_element_wise(*parts, "}\n", "")
    if len(lines) == 0:
        return ""
    offsets = pa.Array.from_buffers(pa.int32(), len(lines) + 1, [None, lines.buffers()[1]],
                                    offset=lines.offset)
    data = lines.buffers()[2]
    assert data is not None  # a string array of >= 1 row has a data buffer
    return memoryview(data)[offsets[0].as_py():offsets[-1].as_py()].tobytes().decode("ascii")
