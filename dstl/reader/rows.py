"""The rows a reader produces, their fixed columns, and how values become JSON.

State rows (:class:`StateRow`): one per value, list, reducing or aggregating state entry, and one
per **map entry** (``user_key`` set). Change rows (:class:`ChangeRow`): one per elementary change
in log order; a ``put_all``/``add_all`` record becomes one row per entry or element, so every row
is one of five ops with one meaning each:

========  ===========================================================================
op        replaying it on a model of the state
========  ===========================================================================
``set``   the state of (key, namespace) becomes ``value`` (value, reducing and
          aggregating states; for lists and maps the whole list or dict)
``clear`` the state of (key, namespace) is removed
``add``   list state: ``value`` is appended
``put``   map state: ``user_key`` maps to ``value``
``remove`` map state: ``user_key`` is removed (an empty map is removed)
========  ===========================================================================

Values stay Python objects in the rows (the library's callers — tests, the CLI — compare them
as they are); :func:`to_json` is the one encoding the Spark sources and ``dstl state dump``
write. It is plain JSON for what JSON has; the rest is tagged so it round-trips
(:func:`from_json`): bytes as ``{"$b64": ...}``, a dict whose keys are not all strings as
``{"$map": [[k, v], ...]}``, a tuple as ``{"$tuple": [...]}``; non-finite floats are the
``NaN``/``Infinity`` tokens Spark's JSON functions accept. A JSON object that happens to have
exactly one of these tag keys is itself wrapped in ``{"$map": ...}``, so decoding is unambiguous.
"""

from __future__ import annotations

import base64
import json
from typing import Any, NamedTuple

__all__ = ["CHANGE_COLUMNS", "CHANGE_DDL", "STATE_COLUMNS", "STATE_DDL", "ChangeRow",
           "StateRow", "from_json", "to_json", "to_plain"]

_TAGS = frozenset({"$b64", "$map", "$tuple"})

#: The Spark sources' columns as Spark DDL (their ``schema()``; the Arrow schemas of
#: :mod:`dstl.reader.arrow` are the same columns). Here, without pyarrow: a driver that only
#: plans a read (Spark's planner workers) needs no more.
STATE_DDL = ("checkpoint bigint, partition string, key_group int, key string, key_bytes binary, "
             "state string, kind string, namespace string, user_key string, value string")
CHANGE_DDL = ("checkpoint bigint, partition string, key_group int, seq bigint, key string, "
              "key_bytes binary, state string, kind string, namespace string, op string, "
              "user_key string, value string, source string")


class StateRow(NamedTuple):
    """One entry of one state (one map entry for map states)."""

    checkpoint: int
    partition: str
    key_group: int
    key: Any
    key_bytes: bytes
    state: str
    kind: str
    namespace: Any
    user_key: Any
    value: Any


class ChangeRow(NamedTuple):
    """One elementary change (see the module docstring for ``op``)."""

    checkpoint: int
    partition: str
    key_group: int
    seq: int
    key: Any
    key_bytes: bytes
    state: str
    kind: str
    namespace: Any
    op: str
    user_key: Any
    value: Any
    source: str  # "log", or "snapshot" for a difference recovered from snapshots


STATE_COLUMNS = StateRow._fields
CHANGE_COLUMNS = ChangeRow._fields


def to_plain(v: Any) -> Any:
    """``v`` as JSON-able data (the tagged form of :func:`to_json`)."""
    t = type(v)
    if v is None or t in (bool, int, float, str):
        return v
    if t is bytes or t is bytearray:
        return {"$b64": base64.b64encode(v).decode("ascii")}
    if t is list:
        return [to_plain(x) for x in v]
    if t is tuple:
        return {"$tuple": [to_plain(x) for x in v]}
    if t is dict:
        if all(type(k) is str for k in v) and not (len(v) == 1 and next(iter(v)) in _TAGS):
            return {k: to_plain(x) for k, x in v.items()}
        return {"$map": [[to_plain(k), to_plain(x)] for k, x in v.items()]}
    return {"$repr": repr(v)}  # only values of a pickle codec get here


_encode_str = json.encoder.encode_basestring_ascii  # the C encoder behind json.dumps(str)
_COMPACT = json.JSONEncoder(separators=(",", ":"))


def to_json(value: Any) -> str | None:
    """``value`` as compact JSON (``None`` stays ``None``: a SQL null, not the JSON ``null``).

    Scalars take a direct path (one call per value, millions per read): ``str(int)`` and the C
    string encoder give exactly what ``json.dumps`` gives."""
    if value is None:
        return None
    t = type(value)
    if t is int:
        return str(value)
    if t is str:
        return _encode_str(value)
    return _COMPACT.encode(to_plain(value))


def _unplain(v: Any) -> Any:
    if isinstance(v, list):
        return [_unplain(x) for x in v]
    if isinstance(v, dict):
        if len(v) == 1:
            (tag, inner), = v.items()
            if tag == "$b64":
                return base64.b64decode(inner)
            if tag == "$tuple":
                return tuple(_unplain(x) for x in inner)
            if tag == "$map":
                return {_hashable(_unplain(k)): _unplain(x) for k, x in inner}
        return {k: _unplain(x) for k, x in v.items()}
    return v


def _hashable(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def from_json(text: str | None) -> Any:
    """Inverse of :func:`to_json`."""
    return None if text is None else _unplain(json.loads(text))
