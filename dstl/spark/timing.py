"""Time in the processor API: time modes, the values a processor sees, the watermark rules.

Theory of operation
-------------------
An operator runs in one *time mode* (Spark's ``timeMode``): ``none`` (no timers),
``processing_time`` (a timer fires once the batch's processing time reaches it) or
``event_time`` (once the watermark does).

*Processing time* is the driver's wall clock when the batch starts, in epoch milliseconds; every
task of the batch sees the same value (a re-run of a batch takes a new one).

*The watermark* follows Spark: the watermark of batch N is ``max(watermark of N-1, largest event
time seen in batches < N - delay)``, starting at 0. It never decreases, it is known when the
batch starts (so late rows are filtered and event-time timers fire before the batch's input),
and the driver stores the next one in the batch's manifest (``properties.watermark_ms``), so a
restart — or a re-run of the batch — continues from the checkpoint it starts from. A row is
late when its event time is at or below the batch's watermark; a timer is due when its time is
at or below the mode's time (both as in Spark).

:class:`TimerValues` and :class:`ExpiredTimerInfo` carry Spark's attribute names
(``current_processing_time_ms``, ``current_watermark_ms``; ``expiry_time_ms``) and Spark's
getters (``get_current_processing_time_in_ms()``... and the camel-case ones of
``pyspark.sql.streaming.stateful_processor``). A value that does not apply is ``-1``, as in
Spark: no watermark configured.
"""

from __future__ import annotations

import datetime
import math
import re
from dataclasses import dataclass
from typing import Final

from dstl.errors import ConfigError, ConfigTypeError

__all__ = [
    "EVENT_TIME_COLUMN",
    "HEARTBEAT_COLUMN",
    "LATE_ROWS",
    "TIME_MODES",
    "ExpiredTimerInfo",
    "TimerValues",
    "next_watermark",
    "parse_delay_ms",
    "parse_time_mode",
]

#: ``none``, ``processing_time``, ``event_time`` (Spark's ``None``/``ProcessingTime``/
#: ``EventTime`` are accepted too).
TIME_MODES: Final = ("none", "processing_time", "event_time")
#: What happens to late rows: dropped, or handed to ``late_sink``.
LATE_ROWS: Final = ("drop", "side_output")
#: The column the driver adds with each row's event time in epoch ms (tasks take its maximum).
EVENT_TIME_COLUMN: Final = "_dstl_event_ms"
#: The marker column of heartbeat rows (:func:`dstl.spark.with_heartbeat`); the operator drops
#: those rows before routing.
HEARTBEAT_COLUMN: Final = "_dstl_heartbeat"

_SPARK_MODES: Final = {"none": "none", "processingtime": "processing_time",
                       "eventtime": "event_time"}
_UNITS_MS: Final = {"ms": 1, "millisecond": 1, "milliseconds": 1, "s": 1000, "sec": 1000,
                    "second": 1000, "seconds": 1000, "m": 60_000, "min": 60_000,
                    "minute": 60_000, "minutes": 60_000, "h": 3_600_000, "hour": 3_600_000,
                    "hours": 3_600_000, "d": 86_400_000, "day": 86_400_000,
                    "days": 86_400_000}
_DELAY: Final = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*")
#: A delay beyond ten years is a unit mistake.
MAX_DELAY_MS: Final = 10 * 365 * 86_400_000


def parse_time_mode(value: object, owner: str) -> str:
    """The time mode ``value`` names, normalised to one of :data:`TIME_MODES`.

    Raises:
        ConfigError: not a time mode (ConfigTypeError: not a string).
    """
    expected = "one of 'none', 'processing_time', 'event_time' (or Spark's 'None', " \
               "'ProcessingTime', 'EventTime')"
    if not isinstance(value, str):
        raise ConfigTypeError("time_mode", value, expected, owner=owner)
    mode = _SPARK_MODES.get(value.lower().replace("_", ""))
    if mode is None:
        raise ConfigError("time_mode", value, expected, owner=owner)
    return mode


def parse_delay_ms(value: object, owner: str, field: str = "watermark_delay") -> int:
    """A delay as whole milliseconds: a number of seconds, a ``datetime.timedelta``, or a
    string such as ``"10 seconds"``, ``"1.5 min"``, ``"200 ms"`` (Spark's ``withWatermark``
    style).

    Raises:
        ConfigError: negative, not finite, longer than ten years, or an unknown unit
            (ConfigTypeError: another type).
    """
    expected = "seconds (a number >= 0), a datetime.timedelta, or a string like '10 seconds'"
    if isinstance(value, bool) or not isinstance(value, (int, float, str, datetime.timedelta)):
        raise ConfigTypeError(field, value, expected, owner=owner)
    if isinstance(value, datetime.timedelta):
        ms = value.total_seconds() * 1000.0
    elif isinstance(value, str):
        m = _DELAY.fullmatch(value)
        unit = _UNITS_MS.get(m.group(2).lower()) if m is not None else None
        if m is None or unit is None:
            raise ConfigError(field, value, expected + f"; units: {', '.join(_UNITS_MS)}",
                              owner=owner)
        ms = float(m.group(1)) * unit
    else:
        ms = float(value) * 1000.0
    if not math.isfinite(ms) or ms < 0 or ms > MAX_DELAY_MS:
        raise ConfigError(field, value, "a finite delay in [0, 10 years]", owner=owner)
    return round(ms)


def next_watermark(current_ms: int, max_event_time_ms: int | None, delay_ms: int) -> int:
    """The watermark after a batch: never below ``current_ms``."""
    if max_event_time_ms is None:
        return current_ms
    return max(current_ms, max_event_time_ms - delay_ms)


@dataclass(frozen=True)
class TimerValues:
    """The batch's times, as a processor sees them (epoch ms; ``-1``: does not apply)."""

    current_processing_time_ms: int
    current_watermark_ms: int

    def get_current_processing_time_in_ms(self) -> int:
        return self.current_processing_time_ms

    def get_current_watermark_in_ms(self) -> int:
        return self.current_watermark_ms

    # pyspark.sql.streaming.stateful_processor.TimerValues' names
    getCurrentProcessingTimeInMs = get_current_processing_time_in_ms
    getCurrentWatermarkInMs = get_current_watermark_in_ms


@dataclass(frozen=True)
class ExpiredTimerInfo:
    """The timer being delivered to ``handle_expired_timer``."""

    expiry_time_ms: int

    def get_expiry_time_in_ms(self) -> int:
        return self.expiry_time_ms

    getExpiryTimeInMs = get_expiry_time_in_ms
