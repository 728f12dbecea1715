"""Argument checks shared by every options class and constructor: one rule, one message shape.

Theory of operation
-------------------
Each check takes a value, the field's name and its *owner* (the class or function whose argument
it is), and returns the value — normalised where that is safe (a number becomes a ``float``, a
path a ``str``) — or raises:

- :class:`~dstl.errors.ConfigTypeError` (a ``ConfigError`` and a ``TypeError``) for a wrong type,
- :class:`~dstl.errors.ConfigError` for a value out of range,

with a message ``owner.field=value is invalid: expected <type and range> (<fix>)``.

The rules every check applies, because each one was a real bug somewhere:

- ``bool`` is not an int or a number (``True`` is ``1`` to Python, never to a config);
- NaN and infinities are not numbers (NaN compares false with everything, so a NaN deadline
  breaks a timer heap; ``inf`` overflows a lock timeout);
- every duration has an upper bound: a timeout beyond what ``threading`` can wait
  (``threading.TIMEOUT_MAX``, about 292 years, less on some platforms) raises ``OverflowError``
  inside a background thread and kills it, so no option may get near it;
- every integer fits a signed 64-bit value (options travel through Spark conf and JSON);
- strings that name things are non-empty and have no control characters.

Each options class and constructor calls these from *one* validation function, so the rules of a
class are read in one place.
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
from collections.abc import Iterable, Mapping
from typing import Any, Final, TypeVar

from dstl.errors import ConfigError, ConfigTypeError

__all__ = [
    "MAX_INT64",
    "check_bool",
    "check_callable",
    "check_choice",
    "check_instance",
    "check_int",
    "check_mapping",
    "check_number",
    "check_optional_path",
    "check_protocol",
    "check_str",
]

#: Largest integer option (a signed 64-bit value, as Spark conf and the JVM hold them).
MAX_INT64: Final = (1 << 63) - 1

_T = TypeVar("_T")


def _is_int(value: object) -> bool:
    # numbers.Integral: numpy's integers too; bool is an Integral to Python, never to a config
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(value: Any, field: str, owner: str, *, lo: int, hi: int = MAX_INT64,
              fix: str = "") -> int:
    """``value`` if it is an int (not a bool) in ``[lo, hi]``."""
    if type(value) is int and lo <= value <= hi:  # the common case first: no message built
        return value
    expected = f"an int in [{lo}, {hi}]"
    if not _is_int(value):
        raise ConfigTypeError(field, value, expected, owner=owner, fix=fix)
    if not lo <= value <= hi:
        raise ConfigError(field, value, expected, owner=owner, fix=fix)
    return int(value)


def check_number(value: Any, field: str, owner: str, *, lo: float, hi: float,
                 lo_open: bool = False, unit: str = "", fix: str = "") -> float:
    """``value`` as a float if it is a finite int or float (not a bool) in ``[lo, hi]`` (or
    ``(lo, hi]`` with ``lo_open``)."""
    what = f"a finite number{' of ' + unit if unit else ''}"
    expected = f"{what} in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigTypeError(field, value, expected, owner=owner, fix=fix)
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float is out of every range
        raise ConfigError(field, value, expected, owner=owner, fix=fix) from None
    if not math.isfinite(number) or number < lo or number > hi or (lo_open and number == lo):
        raise ConfigError(field, value, expected, owner=owner, fix=fix)
    return number


def check_bool(value: Any, field: str, owner: str) -> bool:
    """``value`` if it is ``True`` or ``False`` (not ``0``, ``"false"`` or ``None``)."""
    if not isinstance(value, bool):
        raise ConfigTypeError(field, value, "True or False", owner=owner)
    return value


def check_str(value: Any, field: str, owner: str, *, max_chars: int = 1024,
              forbidden: str = "", fix: str = "") -> str:
    """``value`` if it is a non-empty string of at most ``max_chars`` characters, without
    control characters, surrounding whitespace or any character of ``forbidden``."""
    extra = f" and without {', '.join(repr(c) for c in forbidden)}" if forbidden else ""
    expected = (f"a non-empty string of at most {max_chars} characters, without control "
                f"characters or surrounding whitespace{extra}")
    if not isinstance(value, str):
        raise ConfigTypeError(field, value, expected, owner=owner, fix=fix)
    if (not value or len(value) > max_chars or value != value.strip()
            or any(ord(c) < 0x20 or ord(c) == 0x7F for c in value)
            or any(c in value for c in forbidden)):
        raise ConfigError(field, value, expected, owner=owner, fix=fix)
    return value


def check_choice(value: Any, field: str, owner: str, choices: Iterable[str]) -> str:
    """``value`` if it is one of ``choices`` (strings)."""
    options = tuple(choices)
    expected = "one of " + ", ".join(repr(c) for c in options)
    if not isinstance(value, str):
        raise ConfigTypeError(field, value, expected, owner=owner)
    if value not in options:
        raise ConfigError(field, value, expected, owner=owner)
    return value


def check_instance(value: Any, field: str, owner: str, cls: type[_T], *,
                   fix: str = "") -> _T:
    """``value`` if it is an instance of ``cls``."""
    if not isinstance(value, cls):
        raise ConfigTypeError(field, value, f"a {cls.__module__}.{cls.__qualname__}",
                              owner=owner, fix=fix)
    return value


def check_protocol(value: Any, field: str, owner: str, methods: Iterable[str], what: str,
                   *, fix: str = "") -> Any:
    """``value`` if it has every method in ``methods`` (a structural check of a protocol such
    as ``BlobStore`` or ``Timer``; ``isinstance`` cannot check a plain ``Protocol``)."""
    missing = [m for m in methods if not callable(getattr(value, m, None))]
    if missing:
        raise ConfigTypeError(field, value, f"{what} (missing: {', '.join(missing)})",
                              owner=owner, fix=fix)
    return value


def check_callable(value: Any, field: str, owner: str, *, args: int, fix: str = "") -> Any:
    """``value`` if it is callable with ``args`` positional arguments (checked against its
    signature when it has one; builtins without a signature are accepted)."""
    expected = f"a callable taking {args} positional argument{'s' if args != 1 else ''}"
    if not callable(value):
        raise ConfigTypeError(field, value, expected, owner=owner, fix=fix)
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):
        return value  # no introspectable signature (some builtins): the call will tell
    try:
        signature.bind(*([None] * args))
    except TypeError as exc:
        raise ConfigTypeError(field, value, f"{expected} ({exc})", owner=owner,
                              fix=fix) from None
    return value


def check_optional_path(value: Any, field: str, owner: str) -> str | None:
    """``None``, or ``value`` as a ``str`` if it is a non-empty ``str`` or ``os.PathLike``
    (string) path without NUL characters."""
    expected = "None or a non-empty path (str or os.PathLike)"
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigTypeError(field, value, expected, owner=owner)
    path = os.fspath(value)
    if not isinstance(path, str):
        raise ConfigTypeError(field, value, expected + " of str", owner=owner)
    if not path or "\0" in path:
        raise ConfigError(field, value, expected, owner=owner)
    return path


def check_mapping(value: Any, field: str, owner: str, *, fix: str = ""
                  ) -> dict[str, Any] | None:
    """``None``, or a copy of ``value`` as a ``dict`` if it is a mapping with non-empty string
    keys. Values are never shown in a message (they may hold credentials)."""
    expected = "None or a mapping of non-empty str keys"
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigTypeError(field, f"<{type(value).__name__}>", expected, owner=owner, fix=fix)
    bad = [k for k in value if not isinstance(k, str) or not k]
    if bad:
        raise ConfigTypeError(field, f"<mapping with key {bad[0]!r:.60}>", expected,
                              owner=owner, fix=fix)
    return dict(value)

