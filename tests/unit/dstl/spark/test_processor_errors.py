"""A processor that raises fails its batch with a :class:`~dstl.errors.ProcessorError` naming
the processor, the operator, the method, the key (its repr cut short), the partition and the
batch, with the original exception as its cause and its type in the message. DSTL's own errors
(a row that does not fit the output schema, a stopping query) pass through unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from dstl.errors import BatchInterruptedError, ProcessorError
from dstl.spark.task import ProcessorCall, _process
from dstl.spark.timing import TimerValues

CALL = ProcessorCall(processor="Poison", operator="counts", partition=2, batch_id=7)


class _Backend:
    def set_current_key(self, key: Any) -> None:
        self.key = key


class _Outputs:
    def __init__(self) -> None:
        self.rows: list[Any] = []

    def extend(self, key: Any, rows: Any) -> None:
        self.rows.extend(rows)  # consumes a generator: a lazy processor raises here


def _slot(processor: Any) -> Any:
    return SimpleNamespace(handle=None, timer_values_arg=False, backend=_Backend(),
                           processor=processor)


class _Raises:
    def __init__(self, error: BaseException, *, lazily: bool) -> None:
        self.error, self.lazily = error, lazily

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]) -> Any:
        if not self.lazily and key.startswith("poison"):
            raise self.error
        return self._gen(key)

    def _gen(self, key: str) -> Iterator[dict[str, Any]]:
        yield {"key": key}
        if key.startswith("poison"):
            raise self.error


@pytest.mark.parametrize("lazily", [False, True])
def test_a_raising_processor_is_named_with_operator_partition_batch_and_key(
        lazily: bool) -> None:
    original = ValueError("refused the poison key")
    key = "poison-" + "x" * 200
    with pytest.raises(ProcessorError) as info:
        _process(_slot(_Raises(original, lazily=lazily)), {"a": [{}], key: [{}]},
                 TimerValues(-1, -1), _Outputs(), CALL)  # type: ignore[arg-type]
    err = info.value
    assert err.__cause__ is original
    shown = repr(key)[:57] + "..."
    assert str(err) == (f"processor Poison of operator 'counts' raised ValueError in "
                        f"handle_input_rows for key {shown} (partition 2, batch 7): "
                        "refused the poison key")
    assert (err.operator, err.partition, err.batch_id, err.key, err.method) == \
        ("counts", 2, 7, key, "handle_input_rows")


@pytest.mark.parametrize("error", [BatchInterruptedError("counts", 7, "x"), KeyboardInterrupt()])
def test_dstl_errors_and_interrupts_pass_through_unchanged(error: BaseException) -> None:
    with pytest.raises(type(error)) as info:
        _process(_slot(_Raises(error, lazily=True)), {"poison": [{}]}, TimerValues(-1, -1),
                 _Outputs(), CALL)  # type: ignore[arg-type]
    assert info.value is error
