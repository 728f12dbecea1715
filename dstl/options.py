"""Options of the log core (``DstlOptions``).

Defaults start from Flink's DSTL (``FsStateChangelogOptions``, reference §3) and change only with a
benchmark; each field's reason is in ``docs/configuration.md`` (a test checks that every field is
documented there). No environment variable or global is read here; :meth:`DstlOptions.from_mapping`
is the one string-parsing entry point (used for Spark conf keys ``spark.dstl.*``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from dstl.checks import MAX_INT64, check_int, check_number
from dstl.errors import ConfigError

__all__ = ["KiB", "MiB", "DstlOptions"]

KiB: Final = 1024
MiB: Final = 1024 * 1024
#: Bounds of ``max_change_set_bytes``: a change set must hold at least a small state value, and
#: no reader decompresses more than 2 GiB for one record (dstl.segment.MAX_CHANGE_SET_BYTES).
MIN_CHANGE_SET_LIMIT_BYTES: Final = 1 * MiB
MAX_CHANGE_SET_LIMIT_BYTES: Final = 2048 * MiB


#: Upper bounds of the duration options. Beyond them a setting only stalls the job (a persist
#: that waits an hour to batch, an upload attempt given a day), and far beyond them a wait
#: overflows a lock timeout and kills the thread that waits (see ``dstl.checks``).
#: A Spark task waits at most 300 s for its checkpoint: a persist that waits longer for its batch
#: could never complete one.
MAX_PERSIST_DELAY_S: Final = 300.0
MAX_BACK_PRESSURE_TIMEOUT_S: Final = 86_400.0
MAX_UPLOAD_TIMEOUT_S: Final = 3_600.0
MAX_UPLOAD_RETRY_DELAY_S: Final = 600.0
#: Upper bound of the thread-count options (threads per storage, i.e. per process).
MAX_THREADS: Final = 256
#: The attempt number is two hex digits of a segment's object name.
MAX_UPLOAD_ATTEMPTS: Final = 255
#: Upper bounds of the retry options: a single backoff longer than ten minutes, or an operation
#: retried for more than an hour, only stalls the job (a Spark task waits 300 s for a checkpoint).
MAX_RETRY_BACKOFF_S: Final = 600.0
MAX_RETRY_DEADLINE_S: Final = 3_600.0
MAX_READ_ATTEMPTS: Final = 255

_OWNER = "DstlOptions"


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
    #: Largest change set (uncompressed record body): the writer rolls a change set over before
    #: it grows past this, refuses a single change that cannot fit, and a reader never
    #: decompresses more for one record of a segment, however crafted (32 MiB: a crafted segment
    #: of 1 MiB cannot make a restore allocate more than a few times this). Readers must use at
    #: least the writers' value. Beyond Flink, which has no such bound.
    max_change_set_bytes: int = 32 * MiB
    #: Throttling (503 SlowDown, 429, 500 InternalError): the first retry waits a random time
    #: below this; the ceiling doubles per retry (full jitter, ``dstl/retry.py``). Not in Flink.
    retry_backoff_base_s: float = 0.1
    #: Largest backoff before one retry.
    retry_backoff_max_s: float = 5.0
    #: A store operation (segment upload, read, delete) starts no retry later than this after its
    #: first attempt; throttled retries are bounded by it, not by the attempt limits.
    retry_deadline_s: float = 30.0
    #: Attempts of a read or delete for failures other than throttling (the first included).
    read_max_attempts: int = 3

    def __post_init__(self) -> None:
        _validate(self)

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


def _validate(o: DstlOptions) -> None:
    """Every field's type and range, then the cross-field rule (the one place they live)."""
    _seconds(o, "persist_delay_s", lo=0.0, hi=MAX_PERSIST_DELAY_S,
             fix="in seconds: a persist waits this long for other writers' change sets to "
                 "join its segment - default 0.010 = 10 ms")
    _int(o, "persist_size_threshold_bytes", lo=1)
    _int(o, "max_change_set_bytes", lo=MIN_CHANGE_SET_LIMIT_BYTES, hi=MAX_CHANGE_SET_LIMIT_BYTES,
         fix="the largest change set a writer builds and a reader decompresses for one record")
    _int(o, "preemptive_persist_threshold_bytes", lo=1, hi=MAX_CHANGE_SET_LIMIT_BYTES,
         fix="a change set must stay below the 2 GiB that one record may hold")
    _int(o, "max_in_flight_bytes", lo=1)
    _seconds(o, "back_pressure_timeout_s", lo=0.0, hi=MAX_BACK_PRESSURE_TIMEOUT_S, lo_open=True,
             fix="a writer blocked this long for upload capacity fails with UploadTimeoutError")
    _int(o, "upload_threads", lo=1, hi=MAX_THREADS)
    _seconds(o, "upload_timeout_s", lo=0.0, hi=MAX_UPLOAD_TIMEOUT_S, lo_open=True,
             fix="after this long a concurrent attempt starts")
    _int(o, "upload_max_attempts", lo=1, hi=MAX_UPLOAD_ATTEMPTS,
         fix="the attempt is two hex digits of the object name")
    _seconds(o, "upload_retry_delay_s", lo=0.0, hi=MAX_UPLOAD_RETRY_DELAY_S)
    _int(o, "zstd_level", lo=-7, hi=22)
    _int(o, "discard_threads", lo=1, hi=MAX_THREADS)
    if o.preemptive_persist_threshold_bytes >= o.max_change_set_bytes:
        raise ConfigError("preemptive_persist_threshold_bytes",
                          o.preemptive_persist_threshold_bytes,
                          f"< max_change_set_bytes ({o.max_change_set_bytes})", owner=_OWNER,
                          fix="a change set is persisted before it reaches the record limit: "
                          "lower it or raise max_change_set_bytes")
    _seconds(o, "retry_backoff_base_s", lo=0.0, hi=MAX_RETRY_BACKOFF_S, lo_open=True,
             fix="the first throttled retry waits a random time below this")
    _seconds(o, "retry_backoff_max_s", lo=0.0, hi=MAX_RETRY_BACKOFF_S, lo_open=True,
             fix="the largest single backoff")
    _seconds(o, "retry_deadline_s", lo=0.0, hi=MAX_RETRY_DEADLINE_S, lo_open=True,
             fix="no retry of one store operation starts later than this after its first "
                 "attempt")
    _int(o, "read_max_attempts", lo=1, hi=MAX_READ_ATTEMPTS)
    if o.retry_backoff_max_s < o.retry_backoff_base_s:
        raise ConfigError("retry_backoff_max_s", o.retry_backoff_max_s,
                          f">= retry_backoff_base_s ({o.retry_backoff_base_s})", owner=_OWNER,
                          fix="raise retry_backoff_max_s or lower retry_backoff_base_s")
    if o.persist_size_threshold_bytes > o.max_in_flight_bytes:
        raise ConfigError("persist_size_threshold_bytes", o.persist_size_threshold_bytes,
                          f"<= max_in_flight_bytes ({o.max_in_flight_bytes})", owner=_OWNER,
                          fix="else a batch could never be sent: lower it or raise "
                          "max_in_flight_bytes")


def _int(o: DstlOptions, name: str, *, lo: int, hi: int = MAX_INT64, fix: str = "") -> None:
    object.__setattr__(o, name, check_int(getattr(o, name), name, _OWNER, lo=lo, hi=hi, fix=fix))


def _seconds(o: DstlOptions, name: str, *, lo: float, hi: float, lo_open: bool = False,
             fix: str = "") -> None:
    """A duration option, stored as a float (the frozen instance keeps the normalised value)."""
    object.__setattr__(o, name, check_number(getattr(o, name), name, _OWNER, lo=lo, hi=hi,
                                             lo_open=lo_open, unit="seconds", fix=fix))
