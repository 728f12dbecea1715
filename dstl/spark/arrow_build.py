"""Arrow arrays of flat columns built from Python values without pandas.

Theory of operation
-------------------
``pyarrow.array`` asks pandas whether its input is a pandas object before it converts
anything, and so imports pandas the first time a process calls it: 0.5-1 s of CPU per fresh
Python worker on this machine class, on the first batch after every restart. A state task
returns few types: strings, integers, floats, booleans, binaries, and its metrics (a list of
integers). :func:`flat_array` builds those from the values' own bytes (``array``, ``bytes.join``,
numpy's bit packing) and ``pa.Array.from_buffers``, which does not consult pandas.

It returns ``None`` for anything else — another type, a value that does not fit (an ``int``
beyond the column's range, a string that is not valid UTF-8, offsets beyond 32 bits) — and the
caller then converts with ``pyarrow.array``, so every value Arrow refuses is refused with
Arrow's own error, and the result is always the array ``pyarrow.array`` would build.
"""

from __future__ import annotations

import array
from itertools import accumulate
from typing import Any

__all__ = ["flat_array", "int64_list_row", "to_array"]

#: Arrow integer/float type id -> the ``array`` type code of the same width and kind
_NUMERIC = {"int8": "b", "int16": "h", "int32": "i", "int64": "q",
            "uint8": "B", "uint16": "H", "uint32": "I", "uint64": "Q",
            "float": "f", "double": "d"}
#: float type code -> the largest magnitude of an int Arrow takes into it (every int up to it
#: is exactly representable; Arrow refuses any beyond, even one that is, such as 2**25)
_EXACT_INT = {"f": 1 << 24, "d": 1 << 53}
#: variable-width types -> (offset type code, whether values are ``str``)
_VARIABLE = {"string": ("i", True), "large_string": ("q", True),
             "binary": ("i", False), "large_binary": ("q", False)}


def _validity(values: list[Any]) -> tuple[Any, int]:
    """(validity bitmap buffer or ``None``, null count) of ``values``."""
    import numpy as np
    import pyarrow as pa

    valid = np.fromiter((v is not None for v in values), dtype=bool, count=len(values))
    nulls = len(values) - int(valid.sum())
    if not nulls:
        return None, 0
    return pa.py_buffer(np.packbits(valid, bitorder="little").tobytes()), nulls


def flat_array(values: list[Any], arrow_type: Any) -> Any | None:
    """``values`` as an Arrow array of ``arrow_type`` (``None`` entries are nulls), or
    ``None`` when the type or a value needs ``pyarrow.array`` (see the module docstring)."""
    import pyarrow as pa

    name = str(arrow_type)
    code = _NUMERIC.get(name)
    variable = _VARIABLE.get(name)
    if code is None and variable is None and name != "bool":
        return None
    n = len(values)
    validity, nulls = _validity(values)
    try:
        if code is not None:
            if any(type(v) is bool for v in values):
                return None  # Arrow refuses a bool in a numeric column: let it say so
            limit = _EXACT_INT.get(code)
            if limit is not None and any(type(v) is int and not -limit <= v <= limit
                                         for v in values):
                return None  # Arrow refuses it (array.array would round it): let it say so
            filled = values if not nulls else [0 if v is None else v for v in values]
            data = pa.py_buffer(array.array(code, filled))
            return pa.Array.from_buffers(arrow_type, n, [validity, data], null_count=nulls)
        if variable is None:  # bool
            import numpy as np

            if any(type(v) is not bool for v in values if v is not None):
                return None
            bits = np.packbits(np.fromiter((v is True for v in values), dtype=bool, count=n),
                               bitorder="little")
            data = pa.py_buffer(bits.tobytes())
            return pa.Array.from_buffers(arrow_type, n, [validity, data], null_count=nulls)
        offset_code, text = variable
        if text:
            if any(type(v) is not str for v in values if v is not None):
                return None
            encoded = [b"" if v is None else v.encode() for v in values]
        else:
            if any(type(v) is not bytes for v in values if v is not None):
                return None
            encoded = [b"" if v is None else v for v in values]
        offsets = array.array(offset_code, accumulate(map(len, encoded), initial=0))
        return pa.Array.from_buffers(
            arrow_type, n, [validity, pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))],
            null_count=nulls)
    except (OverflowError, UnicodeEncodeError, TypeError):
        return None  # out of range, a lone surrogate, a float in an integer column, ...


def int64_list_row(values: list[int]) -> Any:
    """A one-row ``list<int64>`` array holding ``values``."""
    import pyarrow as pa

    items = pa.Array.from_buffers(pa.int64(), len(values),
                                  [None, pa.py_buffer(array.array("q", values))])
    offsets = pa.Array.from_buffers(pa.int32(), 2,
                                    [None, pa.py_buffer(array.array("i", [0, len(values)]))])
    return pa.ListArray.from_arrays(offsets, items)


def to_array(values: list[Any], arrow_type: Any) -> Any:
    """``values`` as an Arrow array of ``arrow_type``: :func:`flat_array` where it applies,
    else ``pyarrow.array`` (whose errors it raises)."""
    built = flat_array(values, arrow_type)
    if built is not None:
        return built
    import pyarrow as pa

    return pa.array(values, type=arrow_type)
