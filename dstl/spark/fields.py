"""Typed reads of untrusted JSON objects, for the messages that cross a process boundary under
Spark: the executor agent's frames (:mod:`dstl.spark.agent.protocol`) and the task reports the
driver reads (:mod:`dstl.spark.report`).

Each read checks one field's presence, type and range and raises the caller's error type with
the object's name and the field's name, value and expected shape — so a bad message says what
and where, never ``KeyError: 'x'`` from deep inside.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dstl.errors import DstlError

__all__ = ["Fields"]

#: Builds the error for a malformed object: ``(where, detail)``.
ErrorFactory = Callable[[str, str], DstlError]


class Fields:
    """Reads of one untrusted JSON object named ``where``.

    Raises (every read): whatever ``error(where, detail)`` builds.
    """

    __slots__ = ("error", "obj", "where")

    def __init__(self, obj: dict[str, Any], where: str, error: ErrorFactory) -> None:
        if not isinstance(obj, dict):
            raise error(where, f"the message is a {type(obj).__name__}, not an object")
        self.obj = obj
        self.where = where
        self.error = error

    def bad(self, name: str, expected: str) -> DstlError:
        """The error for field ``name`` (not ``expected``)."""
        got = repr(self.obj.get(name, "<missing>"))
        got = got if len(got) <= 200 else got[:200] + "..."
        return self.error(self.where, f"field {name!r} is {got}, expected {expected}")

    def get(self, name: str) -> Any:
        if name not in self.obj:
            raise self.error(self.where, f"field {name!r} is missing")
        return self.obj[name]

    def text(self, name: str) -> str:
        v = self.get(name)
        if not isinstance(v, str):
            raise self.bad(name, "a string")
        return v

    def opt_text(self, name: str) -> str | None:
        return None if self.get(name) is None else self.text(name)

    def integer(self, name: str, minimum: int = 0, maximum: int | None = None) -> int:
        v = self.get(name)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum \
                or (maximum is not None and v > maximum):
            raise self.bad(name, f"an integer >= {minimum}" if maximum is None
                           else f"an integer in [{minimum}, {maximum}]")
        return v

    def opt_integer(self, name: str, minimum: int = 0) -> int | None:
        return None if self.get(name) is None else self.integer(name, minimum)

    def number(self, name: str, minimum: float = 0.0) -> float:
        v = self.get(name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= minimum:
            raise self.bad(name, f"a number >= {minimum:g}")
        return float(v)

    def array(self, name: str) -> list[Any]:
        v = self.get(name)
        if not isinstance(v, list):
            raise self.bad(name, "a list")
        return v

    def texts(self, name: str) -> tuple[str, ...]:
        v = self.array(name)
        if not all(isinstance(x, str) for x in v):
            raise self.bad(name, "a list of strings")
        return tuple(v)

    def mapping(self, name: str) -> dict[str, Any]:
        v = self.get(name)
        if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
            raise self.bad(name, "an object")
        return v

    def opt_mapping(self, name: str) -> dict[str, Any] | None:
        return None if self.get(name) is None else self.mapping(name)

    def numbers(self, name: str) -> dict[str, float]:
        v = self.mapping(name)
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v.values()):
            raise self.bad(name, "an object of numbers")
        return {k: float(x) for k, x in v.items()}

    def sub(self, name: str, where: str) -> Fields:
        """The object in field ``name``, named ``<this object>: <where>``."""
        return Fields(self.mapping(name), f"{self.where}: {where}", self.error)
