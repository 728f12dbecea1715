"""The user-facing processor API under Spark: ``StatefulProcessor`` and its handle.

Shaped like Spark's ``transformWithState`` (``init(handle)``, ``handle_input_rows(key, rows,
timer_values)`` — the two-argument form ``handle_input_rows(key, rows)`` works too —,
``handle_expired_timer(key, timer_values, expired_timer_info)``, ``close()``), but state calls
go to the local DSTL backend (microseconds, no RPC to the JVM). The states answer to Spark's
method names and to PyFlink's (:mod:`materializer.states`); every state kind takes a time to
live (``ttl_s``, or Spark's ``ttl_duration_ms``: :mod:`materializer.ttl`). Timers (``register_timer``,
``delete_timer``, ``list_timers``) are DSTL state too (:mod:`materializer.timers`); the task
sets the handle's current key before each call. State names starting with ``$`` are DSTL's.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from dstl.checks import check_number
from dstl.errors import UsageError
from dstl.spark.timing import ExpiredTimerInfo, TimerValues
from materializer.backend import ChangelogKeyedStateBackend
from materializer.codecs import Codec
from materializer.states import (
    MAX_TTL_S,
    AggregateFunction,
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueState,
    ValueStateDescriptor,
)
from materializer.timers import TimerService

__all__ = ["StatefulProcessor", "StatefulProcessorHandle", "ValueStateView",
           "input_rows_takes_timer_values"]

#: State names with this prefix are DSTL's own (timers, indexes).
RESERVED_STATE_PREFIX = "$"


def _state_name(name: Any) -> Any:
    if isinstance(name, str) and name.startswith(RESERVED_STATE_PREFIX):
        raise UsageError(f"state name {name!r}: names starting with "
                         f"{RESERVED_STATE_PREFIX!r} are reserved for DSTL's own states "
                         "(timers); rename the state")
    return name


def _ttl_s(ttl_s: Any, ttl_duration_ms: Any) -> Any:
    """The state's TTL in seconds from ``ttl_s`` or Spark's ``ttl_duration_ms`` (checked
    again by the descriptor).

    Raises:
        UsageError: both given. ConfigError / ConfigTypeError: a bad ``ttl_duration_ms``.
    """
    if ttl_duration_ms is None:
        return ttl_s
    if ttl_s is not None:
        raise UsageError(f"give the TTL once: ttl_s={ttl_s!r} and ttl_duration_ms="
                         f"{ttl_duration_ms!r} are both set; keep one")
    ms = check_number(ttl_duration_ms, "ttl_duration_ms", "StatefulProcessorHandle", lo=0.0,
                      hi=MAX_TTL_S * 1000, lo_open=True, unit="milliseconds",
                      fix="the state's time to live in milliseconds (Spark's ttlDurationMs)")
    return ms / 1000.0


#: The former wrapper type of value states: value states now have Spark's names themselves
#: (``get``/``update``/``exists``/``clear``) and PyFlink's (``value``).
ValueStateView = ValueState


class StatefulProcessorHandle:
    """Gives a processor its states; every state is scoped to the key being processed."""

    def __init__(self, backend: ChangelogKeyedStateBackend, time_mode: str = "none") -> None:
        self._backend = backend
        self._time_mode = time_mode
        self._timers = TimerService(backend) if time_mode != "none" else None
        self._key: Any = None
        self._has_key = False

    def get_value_state(self, name: str, serializer: Codec | None = None,
                        ttl_s: float | None = None, *,
                        ttl_duration_ms: int | None = None, schema: Any = None) -> ValueState:
        """The value state ``name``; with ``ttl_s`` (or Spark's ``ttl_duration_ms``) its value
        expires that long after its last update (:mod:`materializer.ttl`). ``schema`` declares
        the value's type (a Spark type name, DDL string or ``DataType``; every ``get_*_state``
        takes it: :mod:`materializer.schema`): writes are checked against it, and a restore
        compares it with the type the state was written with."""
        return self._backend.get_state(  # type: ignore[no-any-return]
            ValueStateDescriptor(_state_name(name), serializer,
                                 ttl_s=_ttl_s(ttl_s, ttl_duration_ms), schema=schema))

    def get_list_state(self, name: str, serializer: Codec | None = None,
                       ttl_s: float | None = None, *, ttl_duration_ms: int | None = None,
                       schema: Any = None) -> Any:
        """The list state ``name``; with a TTL each element expires that long after it was
        written; ``schema``: the elements' declared type."""
        return self._backend.get_state(ListStateDescriptor(
            _state_name(name), serializer, ttl_s=_ttl_s(ttl_s, ttl_duration_ms), schema=schema))

    def get_map_state(self, name: str, serializer: Codec | None = None,
                      key_serializer: Codec | None = None, ttl_s: float | None = None, *,
                      ttl_duration_ms: int | None = None, schema: Any = None) -> Any:
        """The map state ``name``; with a TTL each entry expires that long after it was
        last written; ``schema``: the map values' declared type."""
        return self._backend.get_state(MapStateDescriptor(
            _state_name(name), serializer, key_serializer=key_serializer,
            ttl_s=_ttl_s(ttl_s, ttl_duration_ms), schema=schema))

    def get_reducing_state(self, name: str, reduce_fn: Any, serializer: Codec | None = None,
                           ttl_s: float | None = None, *,
                           ttl_duration_ms: int | None = None, schema: Any = None) -> Any:
        """The reducing state ``name``; with a TTL its value expires that long after its last
        ``add`` (an ``add`` after that starts from the new value alone)."""
        return self._backend.get_state(ReducingStateDescriptor(
            _state_name(name), reduce_fn, serializer, ttl_s=_ttl_s(ttl_s, ttl_duration_ms),
            schema=schema))

    def get_aggregating_state(self, name: str, agg: AggregateFunction,
                              serializer: Codec | None = None, ttl_s: float | None = None, *,
                              ttl_duration_ms: int | None = None, schema: Any = None) -> Any:
        """The aggregating state ``name``; with a TTL its accumulator expires that long after
        its last ``add`` (an ``add`` after that starts from a new accumulator); ``schema``:
        the accumulator's declared type."""
        return self._backend.get_state(AggregatingStateDescriptor(
            _state_name(name), agg, serializer, ttl_s=_ttl_s(ttl_s, ttl_duration_ms),
            schema=schema))

    def delete_if_exists(self, name: str) -> None:
        """Delete state ``name`` for every key of this partition (Spark's ``deleteIfExists``;
        a name never used: nothing happens). Logged, so restores and rescales agree; the state
        objects stay usable and see no value until written again."""
        if not isinstance(name, str):
            raise UsageError(f"delete_if_exists: the state name must be a str, not "
                             f"{type(name).__name__}; pass the name given to get_*_state")
        self._backend.delete_state_entries(_state_name(name))

    # ------------------------------------------------------------------ timers

    @property
    def timer_service(self) -> TimerService | None:
        """The backend's timers (``None`` with ``time_mode="none"``)."""
        return self._timers

    def set_key(self, key: Any) -> None:
        """The key of the rows or timer being handled (the task sets it; timers need it)."""
        self._key, self._has_key = key, True

    def clear_key(self) -> None:
        self._key, self._has_key = None, False

    def _service(self, op: str) -> TimerService:
        if self._timers is None:
            raise UsageError(f"{op}: the operator's time_mode is 'none'; pass "
                             "time_mode='processing_time' or 'event_time' to "
                             "DstlStatefulOperator to use timers")
        if not self._has_key:
            raise UsageError(f"{op}: timers belong to a key; call it from handle_input_rows "
                             "or handle_expired_timer")
        return self._timers

    def register_timer(self, expiry_timestamp_ms: int) -> None:
        """Register a timer for the current key at ``expiry_timestamp_ms`` (epoch ms: the
        processing time or the event time, by the operator's ``time_mode``). Registering the
        same time twice makes one timer; a time already reached fires in the next batch."""
        self._service("register_timer").register(expiry_timestamp_ms, self._key)

    def delete_timer(self, expiry_timestamp_ms: int) -> None:
        """Delete the current key's timer at ``expiry_timestamp_ms`` (none: nothing happens)."""
        self._service("delete_timer").delete(expiry_timestamp_ms)

    def list_timers(self) -> list[int]:
        """The current key's timers, ascending."""
        return self._service("list_timers").list_timers()


class StatefulProcessor(ABC):
    """Subclass it: ``init`` gets the states, ``handle_input_rows`` sees one key's rows of a
    micro-batch (dicts) and yields output rows (dicts matching the operator's output schema);
    ``handle_expired_timer`` is called for each expired timer, before the batch's input."""

    def init(self, handle: StatefulProcessorHandle) -> None:  # noqa: B027 - optional hook
        """Called once per partition backend, before the first rows."""

    @abstractmethod
    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]],
                          timer_values: TimerValues) -> Iterator[dict[str, Any]]:
        """Process one key's rows of the micro-batch; yield output rows. Subclasses may leave
        out ``timer_values`` (the two-argument form)."""

    def handle_initial_state(self, key: Any, initial_state: dict[str, Any],
                             timer_values: TimerValues) -> None:
        """One row of the operator's ``initial_state`` DataFrame (a dict) for ``key``, with
        the key's state in scope: called in the first batch of a query without a checkpoint,
        before the batch's timers and input, never again. Override it to use
        ``initial_state``."""
        raise UsageError(f"{type(self).__name__} got an initial_state row but does not "
                         "implement handle_initial_state(key, initial_state, timer_values)")

    def handle_expired_timer(self, key: Any, timer_values: TimerValues,
                             expired_timer_info: ExpiredTimerInfo
                             ) -> Iterator[dict[str, Any]]:
        """A timer of ``key`` expired (its state is in scope); yield output rows. Default:
        nothing."""
        return iter(())

    def close(self) -> None:  # noqa: B027 - optional hook
        """Called when the partition's backend is closed."""


def input_rows_takes_timer_values(processor: Any) -> bool:
    """Whether ``processor.handle_input_rows`` takes ``timer_values`` (three arguments) or not
    (two): decided once per processor from its signature."""
    try:
        params = inspect.signature(processor.handle_input_rows).parameters.values()
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)
