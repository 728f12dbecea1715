"""The user-facing processor API under Spark: ``StatefulProcessor`` and its handle.

Shaped like Spark's ``transformWithState`` (``init(handle)``, ``handle_input_rows(key, rows)``,
``close()``), but state calls go to the local DSTL backend (microseconds, no RPC to the JVM).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from materializer.backend import ChangelogKeyedStateBackend
from materializer.codecs import Codec
from materializer.states import (
    AggregateFunction,
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)

__all__ = ["StatefulProcessor", "StatefulProcessorHandle", "ValueStateView"]


class ValueStateView:
    """A value state with Spark's method names (``get``/``update``/``exists``/``clear``)."""

    __slots__ = ("_s",)

    def __init__(self, state: Any) -> None:
        self._s = state

    def get(self) -> Any:
        return self._s.value()

    def value(self) -> Any:
        return self._s.value()

    def exists(self) -> bool:
        return self._s.value() is not None

    def update(self, value: Any) -> None:
        self._s.update(value)

    def clear(self) -> None:
        self._s.clear()


class StatefulProcessorHandle:
    """Gives a processor its states; every state is scoped to the key being processed."""

    def __init__(self, backend: ChangelogKeyedStateBackend) -> None:
        self._backend = backend

    def get_value_state(self, name: str, serializer: Codec | None = None) -> ValueStateView:
        return ValueStateView(self._backend.get_state(ValueStateDescriptor(name, serializer)))

    def get_list_state(self, name: str, serializer: Codec | None = None) -> Any:
        return self._backend.get_state(ListStateDescriptor(name, serializer))

    def get_map_state(self, name: str, serializer: Codec | None = None,
                      key_serializer: Codec | None = None) -> Any:
        return self._backend.get_state(MapStateDescriptor(name, serializer,
                                                          key_serializer=key_serializer))

    def get_reducing_state(self, name: str, reduce_fn: Any,
                           serializer: Codec | None = None) -> Any:
        return self._backend.get_state(ReducingStateDescriptor(name, reduce_fn, serializer))

    def get_aggregating_state(self, name: str, agg: AggregateFunction,
                              serializer: Codec | None = None) -> Any:
        return self._backend.get_state(AggregatingStateDescriptor(name, agg, serializer))


class StatefulProcessor(ABC):
    """Subclass it: ``init`` gets the states, ``handle_input_rows`` sees one key's rows of a
    micro-batch (dicts) and yields output rows (dicts matching the operator's output schema)."""

    def init(self, handle: StatefulProcessorHandle) -> None:  # noqa: B027 - optional hook
        """Called once per partition backend, before the first rows."""

    @abstractmethod
    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        """Process one key's rows of the micro-batch; yield output rows."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Called when the partition's backend is closed."""
