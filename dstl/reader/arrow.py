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

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import pyarrow as pa

from dstl.reader.rows import ChangeRow, StateRow, to_json

__all__ = ["CHANGE_DDL", "CHANGE_SCHEMA", "STATE_DDL", "STATE_SCHEMA", "batches"]

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

#: The same as Spark DDL (the sources' ``schema()``).
STATE_DDL = ("checkpoint bigint, partition string, key_group int, key string, key_bytes binary, "
             "state string, kind string, namespace string, user_key string, value string")
CHANGE_DDL = ("checkpoint bigint, partition string, key_group int, seq bigint, key string, "
              "key_bytes binary, state string, kind string, namespace string, op string, "
              "user_key string, value string, source string")

_JSON_COLUMNS = frozenset({"namespace", "user_key", "value"})


def _text_key(k: Any) -> str | None:
    return k if type(k) is str else None


def _columns(names: Sequence[str]) -> list[Callable[[Any], Any]]:
    out: list[Callable[[Any], Any]] = []
    for n in names:
        if n in _JSON_COLUMNS:
            out.append(to_json)
        elif n == "key":
            out.append(_text_key)
        else:
            out.append(lambda v: v)
    return out


def batches(rows: Iterable[StateRow] | Iterable[ChangeRow], schema: pa.Schema, *,
            batch_rows: int = 8192, typed: tuple[str, pa.DataType] | None = None
            ) -> Iterator[pa.RecordBatch]:
    """Rows as record batches of ``schema`` (:data:`STATE_SCHEMA` or :data:`CHANGE_SCHEMA`).

    Args:
        rows: state or change rows (their fields in the schema's order).
        schema: the batches' schema.
        batch_rows: rows per batch.
        typed: ``(column name, Arrow type)``: also a column of the raw ``value`` converted to
            that type (the Spark sources' ``valueType`` option).

    Raises:
        pyarrow.ArrowInvalid / ArrowTypeError: a value does not convert to ``typed``'s type.
    """
    names = [f.name for f in schema]
    conv = _columns(names)
    width = len(names)
    value_at = names.index("value")
    out_schema = schema.append(pa.field(typed[0], typed[1])) if typed is not None else schema
    cols: list[list[Any]] = [[] for _ in range(width)]
    raw: list[Any] = []
    n = 0
    for row in rows:
        for i in range(width):
            cols[i].append(conv[i](row[i]))
        if typed is not None:
            raw.append(row[value_at])
        n += 1
        if n == batch_rows:
            yield _batch(cols, raw, out_schema, typed)
            cols, raw, n = [[] for _ in range(width)], [], 0
    if n:
        yield _batch(cols, raw, out_schema, typed)


def _batch(cols: list[list[Any]], raw: list[Any], schema: pa.Schema,
           typed: tuple[str, pa.DataType] | None) -> pa.RecordBatch:
    arrays = [pa.array(c, type=schema.field(i).type) for i, c in enumerate(cols)]
    if typed is not None:
        arrays.append(pa.array(raw, type=typed[1]))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)
