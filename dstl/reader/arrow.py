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
from collections.abc import Callable, Iterable, Iterator
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


def _converter(name: str) -> Callable[[Any], Any] | None:
    """How a row field becomes a column value (``None``: as it is)."""
    if name in _JSON_COLUMNS:
        return to_json
    return _text_key if name == "key" else None


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
        pyarrow.ArrowInvalid / ArrowTypeError: a value does not convert to ``typed``'s type.
    """
    convs = [_converter(f.name) for f in schema]
    value_at = schema.get_field_index("value")
    out_schema = schema.append(pa.field(typed[0], typed[1])) if typed is not None else schema
    it = iter(rows)
    while True:
        chunk = list(itertools.islice(it, batch_rows))
        if not chunk:
            return
        columns = list(zip(*chunk, strict=True))  # column-wise: one conversion loop per column
        arrays = [pa.array(col if conv is None else list(map(conv, col)),
                           type=out_schema.field(i).type)
                  for i, (col, conv) in enumerate(zip(columns, convs, strict=True))]
        if typed is not None:
            arrays.append(pa.array(columns[value_at], type=typed[1]))
        yield pa.RecordBatch.from_arrays(arrays, schema=out_schema)
