"""Decoding untrusted JSON: a size limit before parsing, a nesting limit after, typed errors.

Theory of operation
-------------------
A checkpoint directory is untrusted input, and several stored things are small JSON documents
(change-log metadata records, a snapshot's metadata block, backend and changelog handles, the
table marker; manifests and agent frames have their own framing around one). Python's ``json``
module can fail on them in four ways that are not :class:`ValueError`: nesting deeper than the
interpreter's recursion limit raises :class:`RecursionError`; a huge document takes memory
proportional to its size times a large factor (a list of ``{}`` costs 72 bytes per 3 bytes);
NaN/Infinity are accepted; and a document nested a few hundred levels deep decodes but makes
the next ``repr`` or ``copy`` of it raise :class:`RecursionError` far from the decoder.

:func:`load_json` closes all four, in one order: the byte size is checked against the caller's
limit before anything is decoded, then UTF-8, then JSON (NaN and Infinity refused), then the
nesting depth of the result (iteratively, against :data:`MAX_JSON_DEPTH`). Every failure is a
:class:`~dstl.errors.CorruptObjectError` naming the object key and a byte offset (the offset of
the document in its object plus, for syntax errors, the position of the error in it).

:func:`check_depth` is the nesting check on its own (for documents decoded elsewhere).
"""

from __future__ import annotations

import json
from typing import Any, Final, NoReturn

from dstl.errors import CorruptObjectError

__all__ = ["MAX_JSON_DEPTH", "check_depth", "load_json"]

#: Deepest nesting accepted in a stored JSON document. DSTL's own documents nest at most 5
#: levels; 64 leaves room for opaque task state while every ``repr``/``copy`` stays far from
#: the interpreter's recursion limit.
MAX_JSON_DEPTH: Final = 64


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not allowed")


def load_json(data: bytes | bytearray | memoryview | str, *, key: str, what: str,
              max_bytes: int, offset: int = 0) -> Any:
    """Decode one untrusted JSON document (see the module docstring).

    Args:
        data: the document's bytes (or text).
        key: the object it was read from (named in every error).
        what: what the document is (``"metadata record"``), for messages.
        max_bytes: the largest document accepted (checked before decoding).
        offset: where the document starts in the object.

    Raises:
        CorruptObjectError: too large, not UTF-8, not JSON, NaN/Infinity, or nested deeper
            than :data:`MAX_JSON_DEPTH`.
    """
    size = len(data)
    if size > max_bytes:
        raise CorruptObjectError(key, offset, f"{what} of {size} bytes is larger than the "
                                              f"limit of {max_bytes} bytes")
    if isinstance(data, str):
        text = data
    else:
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CorruptObjectError(key, offset + exc.start,
                                     f"{what} is not UTF-8 ({exc.reason})") from exc
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise CorruptObjectError(key, offset + exc.pos, f"{what} is not JSON ({exc.msg})") from exc
    except (ValueError, RecursionError, MemoryError) as exc:
        raise CorruptObjectError(key, offset, f"{what} is not a valid JSON document "
                                              f"({type(exc).__name__}: {exc!s:.200})") from exc
    check_depth(value, key=key, what=what, offset=offset)
    return value


def check_depth(value: Any, *, key: str, what: str, offset: int = 0,
                max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise :class:`~dstl.errors.CorruptObjectError` if ``value`` (decoded JSON: lists, dicts
    and scalars) nests deeper than ``max_depth``. Iterative: any depth is checked safely."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth >= max_depth:
            raise CorruptObjectError(key, offset, f"{what} nests deeper than {max_depth} "
                                                  "levels")
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))
