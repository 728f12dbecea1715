"""A processor's output rows: checked against the operator's ``output_schema``, then Arrow.

Theory of operation
-------------------
The driver turns ``output_schema`` into an Arrow schema once (Spark's own mapping, timestamps
as UTC instants). A task collects the rows its processor yields with the key they were yielded
for (:meth:`OutputRows.extend`, which checks each row's fields), and checks the values column by
column (:meth:`OutputRows.to_batch`, before the task checkpoints): a flat column whose values
all have an exact accepted type (one ``set(map(type, values))``) needs nothing more; any other
column is checked value by value by a checker built once from the column's Arrow type:

- a row is a dict (or a ``pyspark.sql.Row``) with exactly the schema's columns: a missing or an
  extra field is an error, as is ``None`` in a non-nullable field or element;
- a value must have a Python type that Spark's ``createDataFrame`` takes for that SQL type:
  ``str`` for string, ``bytes``/``bytearray`` for binary, ``bool`` for boolean, ``int`` (not
  ``bool``) for integral types, ``float``/``int`` for floating types, ``Decimal``/``int`` for
  decimals, ``date`` for date, ``datetime`` for timestamps, lists/tuples for arrays, dicts for
  maps, dicts/Rows with exactly their fields for structs — nested to any depth. Arrow alone is
  more lenient (it truncates ``1.5`` into a ``long``, takes a ``str`` for binary), which would
  silently corrupt outputs.
- A naive ``datetime`` in a ``timestamp`` column is wall time in the Spark session's time zone
  (Spark's rule for Python datetimes); an aware one is its instant.

:meth:`OutputRows.to_batch` then builds the Arrow record batch column by column; Arrow's own
range checks (an ``int`` too large for its column, a decimal beyond its precision) are located
to their row only on that failure path, by converting the column's values one at a time. Every mismatch raises
:class:`~dstl.errors.OutputSchemaError` naming the processor, the key and the field path
(``items[2].price``), so the batch fails with the cause, and its state is not committed.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable, Iterable, Mapping
from decimal import Decimal
from typing import Any

from dstl.errors import OutputSchemaError, UsageError

__all__ = ["OutputRows", "time_zone"]

#: Spark's fixed-offset zone ids: ``+08:00``, ``-0530``, ``UTC+2``, ``GMT-03:00``.
_OFFSET_RE = re.compile(r"^(?:UTC|GMT)?([+-])(\d{1,2})(?::?(\d{2}))?$")


def time_zone(name: str) -> dt.tzinfo:
    """The zone of a Spark session time zone id (a region such as ``Europe/Paris``, ``UTC``,
    or a fixed offset).

    Raises:
        UsageError: an id that is neither.
    """
    if name in ("UTC", "Z", "GMT", "Etc/UTC"):
        return dt.UTC
    m = _OFFSET_RE.match(name)
    if m and int(m.group(2)) <= 18 and int(m.group(3) or 0) < 60:
        minutes = int(m.group(2)) * 60 + int(m.group(3) or 0)
        return dt.timezone(dt.timedelta(minutes=-minutes if m.group(1) == "-" else minutes))
    from zoneinfo import ZoneInfo

    try:
        return ZoneInfo(name)
    except (KeyError, ValueError, OSError) as exc:  # not found (a KeyError), malformed id
        raise UsageError(f"Spark session time zone {name!r} is unknown to Python's zoneinfo; "
                         "set spark.sql.session.timeZone to a region id or an offset "
                         "such as '+02:00'") from exc

#: A column checker: the value (possibly converted for Arrow), or :class:`_Mismatch`.
Checker = Callable[[Any], Any]


class _Mismatch(Exception):
    """A value that does not fit its type; ``path`` grows as it leaves nested values."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.message = message


def _is_row(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "asDict")


def _simple(kinds: tuple[type, ...], name: str, no_bool: bool = False) -> Checker:
    def check(x: Any) -> Any:
        if not isinstance(x, kinds) or (no_bool and isinstance(x, bool)):
            raise _Mismatch("", f"expected {name}, got {type(x).__name__} {x!r:.60}")
        return x
    return check


def _nullable(check: Checker, nullable: bool) -> Checker:
    def run(x: Any) -> Any:
        if x is None:
            if nullable:
                return None
            raise _Mismatch("", "None in a non-nullable field")
        return check(x)
    return run


def _timestamp(zone: dt.tzinfo | None) -> Checker:
    def check(x: Any) -> Any:
        if not isinstance(x, dt.datetime):
            raise _Mismatch("", f"expected datetime.datetime, got {type(x).__name__} {x!r:.60}")
        return x.replace(tzinfo=zone) if zone is not None and x.tzinfo is None else x
    return check


def _array(item: Checker) -> Checker:
    def check(x: Any) -> Any:
        if not isinstance(x, (list, tuple)):
            raise _Mismatch("", f"expected a list, got {type(x).__name__} {x!r:.60}")
        out = []
        for i, v in enumerate(x):
            try:
                out.append(item(v))
            except _Mismatch as m:
                raise _Mismatch(f"[{i}]{m.path}", m.message) from None
        return out
    return check


def _map(key: Checker, value: Checker) -> Checker:
    def check(x: Any) -> Any:
        if not isinstance(x, Mapping):
            raise _Mismatch("", f"expected a dict, got {type(x).__name__} {x!r:.60}")
        out = []
        for k, v in x.items():
            try:
                ck = key(k)
            except _Mismatch as m:
                raise _Mismatch(f"[key {k!r:.40}]{m.path}", m.message) from None
            try:
                out.append((ck, value(v)))
            except _Mismatch as m:
                raise _Mismatch(f"[{k!r:.40}]{m.path}", m.message) from None
        return out
    return check


def _struct(fields: dict[str, Checker]) -> Checker:
    names = frozenset(fields)

    def check(x: Any) -> Any:
        if _is_row(x):
            x = x.asDict()
        if not isinstance(x, Mapping):
            raise _Mismatch("", f"expected a dict with fields {sorted(names)}, got "
                                f"{type(x).__name__} {x!r:.60}")
        return _fields(x, fields, names, ".")
    return check


def _fields(x: Mapping[Any, Any], fields: dict[str, Checker], names: frozenset[str],
            sep: str) -> dict[str, Any]:
    """The checked fields of a struct or row (exactly ``names``)."""
    if x.keys() != names:
        missing, extra = sorted(names - x.keys()), sorted(map(str, x.keys() - names))
        where = missing[0] if missing else extra[0]
        raise _Mismatch(f"{sep}{where}", (f"missing field(s) {missing}" if missing else "")
                        + ("; " if missing and extra else "")
                        + (f"extra field(s) {extra} not in the schema" if extra else ""))
    out = {}
    for name, check in fields.items():
        try:
            out[name] = check(x[name])
        except _Mismatch as m:
            raise _Mismatch(f"{sep}{name}{m.path}", m.message) from None
    return out


def checker_for(t: Any, nullable: bool, zone: dt.tzinfo | None) -> Checker:
    """The checker of an Arrow type (see the module docstring); types it does not know are left
    to Arrow."""
    import pyarrow as pa

    T = pa.types
    if T.is_string(t) or T.is_large_string(t):
        c = _simple((str,), "str")
    elif T.is_binary(t) or T.is_large_binary(t):
        c = _simple((bytes, bytearray), "bytes")
    elif T.is_boolean(t):
        c = _simple((bool,), "bool")
    elif T.is_integer(t):
        c = _simple((int,), "int", no_bool=True)
    elif T.is_floating(t):
        c = _simple((float, int), "float", no_bool=True)
    elif T.is_decimal(t):
        c = _simple((Decimal, int), "decimal.Decimal", no_bool=True)
    elif T.is_date(t):
        c = _simple((dt.date,), "datetime.date")
    elif T.is_timestamp(t):
        c = _timestamp(zone if t.tz is not None else None)
    elif T.is_list(t) or T.is_large_list(t):
        c = _array(checker_for(t.value_type, t.value_field.nullable, zone))
    elif T.is_map(t):
        c = _map(checker_for(t.key_type, False, zone),
                 checker_for(t.item_type, t.item_field.nullable, zone))
    elif T.is_struct(t):
        c = _struct({t.field(i).name: checker_for(t.field(i).type, t.field(i).nullable, zone)
                     for i in range(t.num_fields)})
    else:
        return lambda x: x
    return _nullable(c, nullable)


_zone_of = time_zone  # OutputRows' argument is named time_zone too


def _fast_types(t: Any, nullable: bool) -> frozenset[type] | None:
    """The exact Python types a column of a flat type takes as they are (a column whose
    values all have one of them needs no per-value check), or None (nested types, and
    timestamps with a zone, whose naive values are converted)."""
    import pyarrow as pa

    T = pa.types
    if T.is_string(t) or T.is_large_string(t):
        kinds: set[type] = {str}
    elif T.is_binary(t) or T.is_large_binary(t):
        kinds = {bytes, bytearray}
    elif T.is_boolean(t):
        kinds = {bool}
    elif T.is_integer(t):
        kinds = {int}
    elif T.is_floating(t):
        kinds = {float, int}
    elif T.is_decimal(t):
        kinds = {Decimal, int}
    elif T.is_date(t):
        kinds = {dt.date, dt.datetime}
    elif T.is_timestamp(t) and t.tz is None:
        kinds = {dt.datetime}
    else:
        return None
    return frozenset(kinds | ({type(None)} if nullable else set()))


class OutputRows:
    """The checked output rows of one task, with the key each was yielded for.

    Args:
        schema: the Arrow schema of the output columns (not the report column).
        processor: names the processor in errors (``"Sessions of operator 'sessions'"``).
        time_zone: the Spark session's time zone (naive datetimes in timestamp columns).
    """

    def __init__(self, schema: Any, processor: str, time_zone: str = "UTC") -> None:
        from zoneinfo import ZoneInfo

        zone = ZoneInfo(time_zone) if time_zone not in ("UTC", "Z") else dt.UTC
        self._schema = schema
        self._processor = processor
        self._checkers = {f.name: checker_for(f.type, f.nullable, zone) for f in schema}
        self._fast = {f.name: _fast_types(f.type, f.nullable) for f in schema}
        self._names = frozenset(self._checkers)
        self.rows: list[dict[str, Any]] = []
        self.keys: list[Any] = []

    def __len__(self) -> int:
        return len(self.rows)

    def extend(self, key: Any, rows: Iterable[Any]) -> None:
        """Keep the rows a processor call yielded for ``key``; each must have exactly the
        output columns (their values are checked by :meth:`to_batch`, column by column).

        Raises:
            OutputSchemaError: a row is not a dict or a Row, or has other fields.
        """
        names, keep, keys = self._names, self.rows.append, self.keys.append
        for row in rows:
            if type(row) is not dict:
                row = self._as_dict(key, row)
            if row.keys() != names:
                try:
                    _fields(row, self._checkers, names, "")
                except _Mismatch as m:
                    raise self._error(key, m.path, m.message) from None
            keep(row)
            keys(key)

    def _as_dict(self, key: Any, row: Any) -> Any:
        if _is_row(row):
            return row.asDict()
        if not isinstance(row, Mapping):
            raise self._error(key, "", f"an output row must be a dict of the output "
                                       f"columns, got {type(row).__name__} {row!r:.60}")
        return row

    def _column(self, name: str) -> list[Any]:
        """The checked values of one output column (see the module docstring)."""
        values = [r[name] for r in self.rows]
        fast = self._fast[name]
        if fast is not None and set(map(type, values)) <= fast:
            return values  # every value has an exact accepted type: nothing to convert
        check = self._checkers[name]
        out = []
        for i, v in enumerate(values):
            try:
                out.append(check(v))
            except _Mismatch as m:
                raise self._error(self.keys[i], f"{name}{m.path}", m.message) from None
        return out

    def _error(self, key: Any, path: str, message: str) -> OutputSchemaError:
        field = f"field {path!r}" if path else "a row"
        return OutputSchemaError(
            f"processor {self._processor}, key {key!r:.80}: output {field}: {message}; "
            "yield rows matching the operator's output_schema")

    def to_batch(self, full_schema: Any, extra: dict[str, list[Any]]) -> Any:
        """The rows as one Arrow record batch of ``full_schema`` (the output columns and the
        columns of ``extra``, given in full).

        Raises:
            OutputSchemaError: a value Arrow refuses (out of range, too precise), located.
        """
        import pyarrow as pa

        from dstl.spark.arrow_build import to_array

        arrays = []
        for f in full_schema:
            if f.name in extra:
                arrays.append(to_array(extra[f.name], f.type))
                continue
            values = self._column(f.name)
            try:
                arrays.append(to_array(values, f.type))
            except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
                raise self._locate(f, values, exc) from exc
        return pa.RecordBatch.from_arrays(arrays, schema=full_schema)

    def _locate(self, f: Any, values: list[Any], exc: BaseException) -> OutputSchemaError:
        import pyarrow as pa

        for i, v in enumerate(values):
            try:
                pa.array([v], type=f.type)
            except (pa.ArrowException, TypeError, ValueError, OverflowError) as one:
                return self._error(self.keys[i], f.name, f"{v!r:.60} does not fit {f.type}: "
                                                         f"{one}")
        return self._error(self.keys[0] if self.keys else None, f.name,
                           f"the column does not convert to {f.type}: {exc}")
