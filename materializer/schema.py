"""Declared state types: a state's value type, checked on write and compared on restore. Pure.

A state may declare the type of its values (``handle.get_value_state("count", schema="long")``);
an undeclared state takes any value its codec encodes, as before. The declared type is given as
a Spark type name or DDL string (``"long"``, ``"array<string>"``, ``"total long, last string"``),
a PySpark ``DataType`` (``StructType([...])``), or Spark's JSON form of a type. This module turns
any of them into Spark's JSON form (``DataType.jsonValue()``, with field ``metadata`` dropped),
which is what the state's metadata records under ``"schema"`` (format.md) and what every function
here works on; ``pyspark.sql.types.DataType.fromJson`` reads it back.

Rules
-----
1. **Values.** ``boolean`` is a ``bool``; ``byte``/``short``/``integer``/``long`` an ``int`` (not a
   ``bool``) in the type's range; ``float``/``double`` a ``float`` or an ``int``; ``string`` a
   ``str``; ``binary`` ``bytes``; ``array<T>`` a list or tuple of T; ``map<K,V>`` a dict; a struct
   a dict with the struct's field names (a missing nullable field is null; an unknown name is
   refused). ``None`` is a value only where the type is nullable (a struct field, an array
   element with ``containsNull``, a map value with ``valueContainsNull``); a state's value itself
   is never null (``update(None)`` clears it).
2. **Evolution** (the rules Spark documents for ``transformWithState`` state variables): a field
   may be added (it must be nullable: stored values have none), removed, or moved; a type may be
   widened (``byte`` < ``short`` < ``integer`` < ``long``; an integral type or ``float`` to
   ``double``; ``byte``/``short``/``integer`` to ``float``); a non-nullable field, element or map
   value may become nullable. Everything else is refused: narrowing, any other type change
   (``long`` -> ``string``, a struct -> a primitive), a map's key type, and nullable -> not null.
   A rename is a removal plus an addition (the old field's values are not carried over).
3. **Conversion.** A compatible change converts each stored value once, at restore
   (:func:`conform`): added fields become ``None``, removed fields are dropped, integers of a
   field widened to a floating type become floats. Widening between integral types changes
   nothing in Python.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Final, NoReturn

from dstl.errors import ConfigError, ConfigTypeError

__all__ = ["SCHEMA_FORMAT", "Checker", "compatibility_problems", "compile_checker", "conform",
           "normalize_schema", "read_recorded", "record", "type_string"]

#: Version of the recorded ``"schema"`` field: ``{"format": 1, "type": <Spark JSON type>}``.
SCHEMA_FORMAT: Final = 1

#: Nesting limit of a declared type (a recorded schema is untrusted input).
MAX_SCHEMA_DEPTH: Final = 32

_INT_RANGES: Final = {"byte": (-(1 << 7), (1 << 7) - 1), "short": (-(1 << 15), (1 << 15) - 1),
                      "integer": (-(1 << 31), (1 << 31) - 1),
                      "long": (-(1 << 63), (1 << 63) - 1)}
_PRIMITIVES: Final = frozenset({"boolean", "float", "double", "string", "binary",
                                *_INT_RANGES})
_ALIASES: Final = {"bool": "boolean", "tinyint": "byte", "smallint": "short", "int": "integer",
                   "bigint": "long", "real": "float", "bytes": "binary", "str": "string"}
#: Widening allowed by rule 2: old type -> the types it may become.
_WIDER: Final = {
    "byte": frozenset({"short", "integer", "long", "float", "double"}),
    "short": frozenset({"integer", "long", "float", "double"}),
    "integer": frozenset({"long", "float", "double"}),
    "long": frozenset({"double"}),
    "float": frozenset({"double"}),
}
_SUPPORTED: Final = ("boolean, byte, short, integer (int), long (bigint), float, double, string, "
                     "binary, array<T>, map<K,V>, struct<name:T,...> or a field list "
                     "'name T, ...' (Spark DDL), a pyspark.sql.types DataType, or Spark's JSON "
                     "form of one")

#: A compiled check: ``None`` when a value fits, else what does not fit (a short phrase).
Checker = Callable[[Any], "str | None"]


# --------------------------------------------------------------------------- declaring


def normalize_schema(schema: Any, owner: str = "StateDescriptor", field: str = "schema"
                     ) -> Any:
    """Spark's JSON form of a declared type (see the module docstring for the accepted forms).

    Raises:
        ConfigTypeError: ``schema`` is none of the accepted forms.
        ConfigError: a DDL string that does not parse, or an unsupported type (decimal, date,
            timestamp: the safe codec stores none of them).
    """
    fix = f"declare one of: {_SUPPORTED}"
    if isinstance(schema, str):
        parsed = _Ddl(schema, owner, field).parse()
    elif hasattr(schema, "jsonValue") and callable(schema.jsonValue):
        parsed = schema.jsonValue()
    elif isinstance(schema, dict):
        parsed = schema
    else:
        raise ConfigTypeError(field, schema, "a type name, a DDL string, a pyspark DataType or "
                              "Spark's JSON form of a type", owner=owner, fix=fix)
    try:
        return _canonical(parsed, 0)
    except ValueError as exc:
        raise ConfigError(field, schema, f"a supported type ({exc})", owner=owner,
                          fix=fix) from exc


def read_recorded(recorded: Any) -> Any:
    """The type in a recorded ``"schema"`` field (untrusted: from a snapshot or the log).

    Raises:
        ValueError: not ``{"format": 1, "type": <a supported type>}`` (the caller names the
            object).
    """
    if not isinstance(recorded, dict) or set(recorded) != {"format", "type"}:
        raise ValueError("a recorded schema is an object with 'format' and 'type'")
    if recorded["format"] != SCHEMA_FORMAT:
        raise ValueError(f"schema format {recorded['format']!r:.20} is not {SCHEMA_FORMAT}, the "
                         "one this DSTL reads")
    return _canonical(recorded["type"], 0)


def record(schema: Any) -> dict[str, Any]:
    """The ``"schema"`` field recorded in a state's metadata for the normalized ``schema``."""
    return {"format": SCHEMA_FORMAT, "type": schema}


def _canonical(t: Any, depth: int) -> Any:
    """``t`` (Spark's JSON form) checked and with field metadata dropped.

    Raises:
        ValueError: not a supported type.
    """
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"nested deeper than {MAX_SCHEMA_DEPTH} levels")
    if isinstance(t, str):
        if t not in _PRIMITIVES:
            raise ValueError(f"{t[:40]!r} is not a supported type")
        return t
    if not isinstance(t, dict):
        raise ValueError(f"a type is a name or an object, not {type(t).__name__}")
    kind = t.get("type")
    if kind == "array":
        return {"type": "array", "elementType": _canonical(t.get("elementType"), depth + 1),
                "containsNull": _flag(t, "containsNull")}
    if kind == "map":
        return {"type": "map", "keyType": _canonical(t.get("keyType"), depth + 1),
                "valueType": _canonical(t.get("valueType"), depth + 1),
                "valueContainsNull": _flag(t, "valueContainsNull")}
    if kind == "struct":
        fields = t.get("fields")
        if not isinstance(fields, list):
            raise ValueError("a struct has a list of fields")
        out, seen = [], set()
        for f in fields:
            name = f.get("name") if isinstance(f, dict) else None
            if not isinstance(name, str) or not name or len(name) > 255:
                raise ValueError("a struct field has a name (a non-empty string)")
            if name in seen:
                raise ValueError(f"struct field {name!r} appears twice")
            seen.add(name)
            out.append({"name": name, "type": _canonical(f.get("type"), depth + 1),
                        "nullable": _flag(f, "nullable")})
        return {"type": "struct", "fields": out}
    raise ValueError(f"{str(kind)[:40]!r} is not a supported type")


def _flag(t: dict[str, Any], name: str) -> bool:
    v = t.get(name, True)
    if not isinstance(v, bool):
        raise ValueError(f"{name} is true or false")
    return v


class _Ddl:
    """A recursive-descent parser of Spark's DDL type strings (the subset of rule 1)."""

    _TOKEN = re.compile(r"\s*(?:(`(?:[^`]|``)+`)|([A-Za-z_][A-Za-z0-9_]*)|([<>,:]))")

    def __init__(self, text: str, owner: str, field: str) -> None:
        self._text, self._owner, self._field = text, owner, field
        self._tokens: list[str] = []
        pos = 0
        while pos < len(text):
            m = self._TOKEN.match(text, pos)
            if m is None:
                if text[pos:].strip():
                    self._fail(f"unexpected {text[pos:pos + 10].strip()!r}")
                break
            self._tokens.append(m.group(1) or m.group(2) or m.group(3))
            pos = m.end()
        self._i = 0

    def _fail(self, why: str) -> NoReturn:
        raise ConfigError(self._field, self._text, f"a Spark DDL type ({why})",
                          owner=self._owner, fix=f"declare one of: {_SUPPORTED}")

    def _peek(self, ahead: int = 0) -> str | None:
        i = self._i + ahead
        return self._tokens[i] if i < len(self._tokens) else None

    def _take(self, want: str | None = None) -> str:
        tok = self._peek()
        if tok is None or (want is not None and tok != want):
            self._fail(f"expected {want or 'more'}, got {tok or 'the end'}")
        self._i += 1
        return tok

    def parse(self) -> Any:
        if not self._tokens:
            self._fail("it is empty")
        # A lone type ("long", "array<int>") or a field list ("a long, b string").
        if self._peek(1) in (None, "<"):
            t = self._type()
        else:
            t = {"type": "struct", "fields": self._fields(end=None)}
        if self._peek() is not None:
            self._fail(f"unexpected {self._peek()!r}")
        return t

    def _type(self) -> Any:
        name = self._take().lower()
        if name == "array":
            self._take("<")
            elem = self._type()
            self._take(">")
            return {"type": "array", "elementType": elem, "containsNull": True}
        if name == "map":
            self._take("<")
            k = self._type()
            self._take(",")
            v = self._type()
            self._take(">")
            return {"type": "map", "keyType": k, "valueType": v, "valueContainsNull": True}
        if name == "struct":
            self._take("<")
            fields = self._fields(end=">")
            self._take(">")
            return {"type": "struct", "fields": fields}
        name = _ALIASES.get(name, name)
        if name not in _PRIMITIVES:
            self._fail(f"{name!r} is not a supported type")
        return name

    def _fields(self, end: str | None) -> list[dict[str, Any]]:
        fields: list[dict[str, Any]] = []
        if self._peek() == end:
            return fields
        while True:
            raw = self._take()
            name = raw[1:-1].replace("``", "`") if raw.startswith("`") else raw
            if self._peek() == ":":
                self._take(":")
            t = self._type()
            nullable = True
            if (self._peek() or "").lower() == "not":
                self._take()
                if (self._peek() or "").lower() != "null":
                    self._fail("expected NULL after NOT")
                self._take()
                nullable = False
            fields.append({"name": name, "type": t, "nullable": nullable})
            if self._peek() != ",":
                break
            self._take(",")
        return fields


def type_string(t: Any) -> str:
    """A declared type as Spark's DDL (``struct<a:long,b:string>``), for messages."""
    if isinstance(t, str):
        return t
    kind = t["type"]
    if kind == "array":
        return f"array<{type_string(t['elementType'])}>"
    if kind == "map":
        return f"map<{type_string(t['keyType'])},{type_string(t['valueType'])}>"
    return "struct<" + ",".join(
        f"{f['name']}:{type_string(f['type'])}{'' if f['nullable'] else ' NOT NULL'}"
        for f in t["fields"]) + ">"


# --------------------------------------------------------------------------- checking values


def compile_checker(t: Any) -> Checker:
    """A function that tells whether a value fits ``t`` (rule 1): ``None``, or the mismatch."""
    if isinstance(t, str):
        return _primitive_checker(t)
    kind = t["type"]
    if kind == "array":
        elem, nulls = compile_checker(t["elementType"]), t["containsNull"]

        def array(v: Any) -> str | None:
            if type(v) is not list and type(v) is not tuple:
                return f"{_tname(v)} is not an array (a list or tuple)"
            for i, e in enumerate(v):
                why = _nested(e, elem, nulls)
                if why is not None:
                    return f"element {i}: {why}"
            return None
        return array
    if kind == "map":
        key, val, nulls = compile_checker(t["keyType"]), compile_checker(t["valueType"]), \
            t["valueContainsNull"]

        def map_(v: Any) -> str | None:
            if type(v) is not dict:
                return f"{_tname(v)} is not a map (a dict)"
            for k, x in v.items():
                why = key(k) if k is not None else "a map key is null"
                if why is None:
                    why = _nested(x, val, nulls)
                if why is not None:
                    return f"map entry {k!r:.40}: {why}"
            return None
        return map_
    fields = [(f["name"], compile_checker(f["type"]), f["nullable"]) for f in t["fields"]]
    names = frozenset(n for n, _, _ in fields)

    def struct(v: Any) -> str | None:
        if type(v) is not dict:
            return f"{_tname(v)} is not a struct (a dict of its fields)"
        for name, check, nullable in fields:
            why = _nested(v.get(name), check, nullable)
            if why is not None:
                return f"field {name!r}: {why}"
        extra = [k for k in v if k not in names]
        if extra:
            return f"field {extra[0]!r:.40} is not in the struct"
        return None
    return struct


def _nested(v: Any, check: Checker, nullable: bool) -> str | None:
    if v is None:
        return None if nullable else "null where the type is NOT NULL"
    return check(v)


def _tname(v: Any) -> str:
    name = type(v).__name__
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"


def _primitive_checker(name: str) -> Checker:
    if name in _INT_RANGES:
        lo, hi = _INT_RANGES[name]

        def integral(v: Any) -> str | None:
            if type(v) is not int:
                return f"{_tname(v)} is not an integer"
            return None if lo <= v <= hi else f"{v} is outside {name}'s range [{lo}, {hi}]"
        return integral
    if name in ("float", "double"):
        return lambda v: None if type(v) is float or type(v) is int else \
            f"{_tname(v)} is not a number"
    py = {"boolean": bool, "string": str, "binary": bytes}[name]
    return lambda v: None if type(v) is py else f"{_tname(v)} is not a {name} ({py.__name__})"


# --------------------------------------------------------------------------- evolution


def compatibility_problems(old: Any, new: Any, path: str = "") -> list[str]:
    """Why values of the recorded type ``old`` cannot be read as the declared ``new`` (rule 2);
    empty when they can. ``path`` names the place (``a.b``; ``[]`` an array's elements, ``{}``
    a map's values)."""
    where = f"field {path!r}" if path else "the value"
    if old == new:
        return []
    if isinstance(old, str) and isinstance(new, str):
        if new in _WIDER.get(old, ()):
            return []
        how = "narrowed" if old in _WIDER.get(new, ()) else "changed"
        return [f"{where}: {how} from {old} to {new}"]
    if isinstance(old, str) or isinstance(new, str) or old["type"] != new["type"]:
        return [f"{where}: changed from {type_string(old)} to {type_string(new)}"]
    kind = old["type"]
    if kind == "array":
        out = compatibility_problems(old["elementType"], new["elementType"], f"{path}[]")
        if old["containsNull"] and not new["containsNull"]:
            out.append(f"field {path + '[]'!r}: nullable became NOT NULL")
        return out
    if kind == "map":
        out = []
        if old["keyType"] != new["keyType"]:
            out.append(f"{where}: map key changed from {type_string(old['keyType'])} to "
                       f"{type_string(new['keyType'])} (a map's key type cannot change)")
        out += compatibility_problems(old["valueType"], new["valueType"], f"{path}{{}}")
        if old["valueContainsNull"] and not new["valueContainsNull"]:
            out.append(f"field {path + '{}'!r}: nullable became NOT NULL")
        return out
    before = {f["name"]: f for f in old["fields"]}
    out = []
    for f in new["fields"]:
        sub = f"{path}.{f['name']}" if path else f["name"]
        was = before.get(f["name"])
        if was is None:
            if not f["nullable"]:
                out.append(f"field {sub!r}: added as NOT NULL (stored values have no value for "
                           "it; add it nullable)")
            continue
        out += compatibility_problems(was["type"], f["type"], sub)
        if was["nullable"] and not f["nullable"]:
            out.append(f"field {sub!r}: nullable became NOT NULL")
    return out


def conform(v: Any, t: Any) -> tuple[Any, bool]:
    """``v`` (a value of an older compatible type) as a value of ``t`` (rule 3), and whether it
    changed. A value that already fits is returned as it is."""
    if v is None or isinstance(t, str):
        if t in ("float", "double") and type(v) is int:
            return float(v), True
        return v, False
    kind = t["type"]
    if kind == "array" and type(v) in (list, tuple):
        items = [conform(e, t["elementType"]) for e in v]
        if not any(c for _, c in items):
            return v, False
        return type(v)(x for x, _ in items), True
    if kind == "map" and type(v) is dict:
        entries = {k: conform(x, t["valueType"]) for k, x in v.items()}
        if not any(c for _, c in entries.values()):
            return v, False
        return {k: x for k, (x, _) in entries.items()}, True
    if kind == "struct" and type(v) is dict:
        changed = len(v) != len(t["fields"])
        out = {}
        for f in t["fields"]:
            name = f["name"]
            if name not in v:
                changed = True
            x, c = conform(v.get(name), f["type"])
            out[name] = x
            changed = changed or c
        return (out, True) if changed else (v, False)
    return v, False
