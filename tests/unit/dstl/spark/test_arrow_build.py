"""The state task's Arrow columns built without pandas equal what ``pyarrow.array`` builds, and
everything the fast path declines still converts (or fails) as ``pyarrow.array`` does."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dstl.spark.arrow_build import flat_array, int64_list_row, to_array

_INTS = {pa.int8(): 8, pa.int16(): 16, pa.int32(): 32, pa.int64(): 64}
_UINTS = {pa.uint8(): 8, pa.uint16(): 16, pa.uint32(): 32, pa.uint64(): 64}


def _values_for(t: Any) -> st.SearchStrategy[Any]:
    """Mostly values of the column's kind, some that do not fit or have another type."""
    if t in _INTS:
        bits = _INTS[t]
        ok: st.SearchStrategy[Any] = st.integers(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    elif t in _UINTS:
        ok = st.integers(0, 2 ** _UINTS[t] - 1)
    elif t in (pa.float32(), pa.float64()):
        ok = st.floats(allow_nan=False) | st.integers(-(2**53), 2**53)
    elif t == pa.bool_():
        ok = st.booleans()
    elif t in (pa.string(), pa.large_string()):
        ok = st.text()
    else:
        ok = st.binary()
    odd = st.integers(-(2**70), 2**70) | st.booleans() | st.floats() | st.text(max_size=3) \
        | st.binary(max_size=3) | st.just("\ud800")
    return st.one_of(ok, ok, ok, st.none(), odd)


_TYPES = [*_INTS, *_UINTS, pa.float32(), pa.float64(), pa.bool_(), pa.string(),
          pa.large_string(), pa.binary(), pa.large_binary()]


@given(data=st.data(), t=st.sampled_from(_TYPES))
def test_a_built_column_equals_pyarrows_and_a_declined_one_converts_as_pyarrow_does(
        data: st.DataObject, t: Any) -> None:
    values = data.draw(st.lists(_values_for(t), max_size=40))
    built = flat_array(values, t)
    try:
        expected = pa.array(values, type=t)
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
        assert built is None, f"built {built} where pyarrow refuses: {exc}"
        with pytest.raises(type(exc)):
            to_array(values, t)
        return
    if built is not None:
        built.validate(full=True)
        assert built.type == t and built.equals(expected), (values, built, expected)
    assert to_array(values, t).equals(expected)


def test_the_common_columns_take_the_fast_path() -> None:
    cases: list[tuple[list[Any], Any]] = [
        ([1, None, -3], pa.int64()), ([7], pa.int32()), (["a", None, "é" * 3], pa.string()),
        ([b"\x00", None], pa.binary()), ([True, None, False], pa.bool_()),
        ([1.5, 2, None], pa.float64()), ([], pa.string()), ([None, None], pa.large_string())]
    for values, t in cases:
        built = flat_array(values, t)
        assert built is not None and built.equals(pa.array(values, type=t)), (values, t)


def test_other_types_are_left_to_pyarrow() -> None:
    assert flat_array([1], pa.timestamp("us", tz="UTC")) is None
    assert flat_array([[1]], pa.list_(pa.int64())) is None
    assert to_array([[1, 2]], pa.list_(pa.int64())).to_pylist() == [[1, 2]]


def test_the_metrics_row() -> None:
    row = int64_list_row([3, -1, 2**62])
    assert row.type == pa.list_(pa.int64())
    assert row.to_pylist() == [[3, -1, 2**62]]
    assert int64_list_row([]).to_pylist() == [[]]


def test_a_task_s_rows_do_not_import_pandas() -> None:
    """The output rows, the report row and the metrics row of a task."""
    code = (
        "import sys\n"
        "import pyarrow as pa\n"
        "from dstl.spark.arrow_build import int64_list_row, to_array\n"
        "from dstl.spark.outputs import OutputRows\n"
        "schema = pa.schema([('key', pa.string()), ('n', pa.int64()), ('ok', pa.bool_()),\n"
        "                    ('x', pa.float64()), ('report', pa.string())])\n"
        "rows = OutputRows(schema.remove(4), 'P', 'UTC')\n"
        "rows.extend('k', [{'key': 'k', 'n': 1, 'ok': True, 'x': 0.5}])\n"
        "batch = rows.to_batch(schema, {'report': [None]})\n"
        "pa.RecordBatch.from_arrays([pa.nulls(1, pa.string()), int64_list_row([1, 2])],\n"
        "                           names=['a', 'm'])\n"
        "print(batch.num_rows, 'pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "False"]


def test_an_int_a_float_column_cannot_hold_exactly_is_left_to_pyarrow() -> None:
    """Arrow refuses an int beyond 2**24 (float32) or 2**53 (float64) in a float column, even
    one the float holds; the fast path declines it, so the task gets Arrow's error, not a
    rounded value."""
    for t, limit in ((pa.float32(), 1 << 24), (pa.float64(), 1 << 53)):
        for v in (limit, -limit, 1.5):
            built = flat_array([v, None], t)
            assert built is not None and built.equals(pa.array([v, None], type=t)), (t, v)
        for v in (limit + 1, -limit - 1, limit * 2):
            assert flat_array([1, v], t) is None, (t, v)
            with pytest.raises(pa.ArrowInvalid):
                to_array([1, v], t)
