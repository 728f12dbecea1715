"""Options of the log core (``DstlOptions``).

Defaults start from Flink's DSTL (``FsStateChangelogOptions``, reference §3) and change only with a
benchmark; each field's reason is in ``docs/configuration.md`` (a test checks that every field is
documented there). No environment variable or global is read here; :meth:`DstlOptions.from_mapping`
is the one string-parsing entry point (used for Spark conf keys ``spark.dstl.*``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from dstl.errors import ConfigError

__all__ = ["KiB", "MiB", "DstlOptions"]

KiB: Final = 1024
MiB: Final = 1024 * 1024
#: Largest pre-emptive threshold: with payloads below MAX_PAYLOAD_BYTES (dstl.writer) a change set
#: then stays below the 2 GiB a segment record may hold.
MAX_CHANGE_SET_TARGET_BYTES: Final = 1024 * MiB


def _positive(field: str, value: Any, *, allow_zero: bool = False, kind: type = float) -> None:
    ok_types: tuple[type, ...] = (int, float) if kind is float else (int,)
    if isinstance(value, bool) or not isinstance(value, ok_types):
        raise ConfigError(field, value, f"a {kind.__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(field, value, "a finite number")
    number = float(value)  # type: ignore[arg-type]  # checked above: int or float
    if number < 0 or (number == 0 and not allow_zero):
        raise ConfigError(field, value, ">= 0" if allow_zero else "> 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class DstlOptions:
    """Options of one :class:`dstl.ChangelogStorage` (one per process / task manager).

    Every field is documented, with the reason for its default, in ``docs/configuration.md``.
    """

    #: Wait after the first queued persist request before writing a segment, so requests of other
    #: writers join the same object (Flink: ``batch.persist-delay`` = 10 ms).
    persist_delay_s: float = 0.010
    #: Queued bytes over all writers that trigger an upload at once (Flink: 10 MB).
    persist_size_threshold_bytes: int = 10 * MiB
    #: Per writer: unsent bytes that trigger a pre-emptive persist (Flink: 5 MB).
    preemptive_persist_threshold_bytes: int = 5 * MiB
    #: Queued + uploading bytes above which ``append``/``persist`` block (Flink: 100 MB).
    max_in_flight_bytes: int = 100 * MiB
    #: Longest a caller waits for in-flight capacity before ``UploadTimeoutError`` (Flink: forever).
    back_pressure_timeout_s: float = 60.0
    #: Threads that write segments (Flink: 5).
    upload_threads: int = 5
    #: Per-attempt timeout; when it passes a concurrent attempt starts (Flink: 1 s).
    upload_timeout_s: float = 1.0
    #: Attempts per segment, the first included (Flink: 3).
    upload_max_attempts: int = 3
    #: Delay before retrying after an I/O error; none after a timeout (Flink: 500 ms).
    upload_retry_delay_s: float = 0.5
    #: zstd level of change-set frames. Level 1: same ratio as 3 on changelog data, ~2x faster
    #: (reference B.4; re-measured by ``bench/write_path.py``).
    zstd_level: int = 1
    #: Threads that delete released segments (Flink: ``discard.num-threads`` = 1).
    discard_threads: int = 1

    def __post_init__(self) -> None:
        _positive("persist_delay_s", self.persist_delay_s, allow_zero=True)
        _positive("persist_size_threshold_bytes", self.persist_size_threshold_bytes, kind=int)
        _positive("preemptive_persist_threshold_bytes", self.preemptive_persist_threshold_bytes,
                  kind=int)
        _positive("max_in_flight_bytes", self.max_in_flight_bytes, kind=int)
        _positive("back_pressure_timeout_s", self.back_pressure_timeout_s)
        _positive("upload_threads", self.upload_threads, kind=int)
        _positive("upload_timeout_s", self.upload_timeout_s)
        _positive("upload_max_attempts", self.upload_max_attempts, kind=int)
        if self.upload_max_attempts > 255:  # the attempt is two hex digits of the object name
            raise ConfigError("upload_max_attempts", self.upload_max_attempts, "<= 255")
        if self.preemptive_persist_threshold_bytes > MAX_CHANGE_SET_TARGET_BYTES:
            raise ConfigError("preemptive_persist_threshold_bytes",
                              self.preemptive_persist_threshold_bytes,
                              f"<= {MAX_CHANGE_SET_TARGET_BYTES} (a change set must stay below "
                              "the 2 GiB that one record may hold)")
        _positive("upload_retry_delay_s", self.upload_retry_delay_s, allow_zero=True)
        _positive("discard_threads", self.discard_threads, kind=int)
        if (isinstance(self.zstd_level, bool) or not isinstance(self.zstd_level, int)
                or not -7 <= self.zstd_level <= 22):
            raise ConfigError("zstd_level", self.zstd_level, "an int in [-7, 22]")
        if self.persist_size_threshold_bytes > self.max_in_flight_bytes:
            raise ConfigError("persist_size_threshold_bytes", self.persist_size_threshold_bytes,
                              f"<= max_in_flight_bytes ({self.max_in_flight_bytes}), or a batch "
                              "could never be sent")

    def replace(self, **changes: Any) -> DstlOptions:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_mapping(cls, conf: Mapping[str, str], prefix: str = "spark.dstl.") -> DstlOptions:
        """Build options from string settings such as Spark conf (``spark.dstl.upload_threads``).

        Keys under ``prefix`` that are not fields are rejected (typos must not pass silently);
        keys outside ``prefix`` are ignored.
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, raw in conf.items():
            if not key.startswith(prefix):
                continue
            name = key[len(prefix):]
            if "." in name:
                continue  # a sub-group (e.g. spark.dstl.backend.*) has its own options class
            if name not in fields:
                continue_keys = ", ".join(sorted(fields))
                raise ConfigError(name, raw, f"one of the known options: {continue_keys}",
                                  owner=prefix.rstrip("."))
            default = getattr(cls(), name)
            try:
                kwargs[name] = int(raw) if isinstance(default, int) else float(raw)
            except (TypeError, ValueError) as exc:
                raise ConfigError(name, raw, f"a {type(default).__name__}",
                                  owner=prefix.rstrip(".")) from exc
        return cls(**kwargs)
