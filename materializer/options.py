"""Options of a keyed state backend (``BackendOptions``). Every field is documented, with the
reason for its default, in ``docs/configuration.md``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Final

from dstl.checks import MAX_INT64, check_bool, check_choice, check_int, check_number
from dstl.errors import ConfigError

__all__ = ["LMDB_SNAPSHOT_FORMATS", "BackendOptions"]

_OWNER = "BackendOptions"
#: Longest time trigger: a week (None turns the time trigger off). Far longer values only
#: postpone, and beyond ``threading.TIMEOUT_MAX`` they would kill the timer thread.
MAX_MATERIALIZATION_INTERVAL_S: Final = 7 * 86_400.0
#: Largest log/snapshot ratio that still means something (None turns the size trigger off).
MAX_LOG_RATIO: Final = 1e6
#: Consecutive failures tolerated at most.
MAX_FAILURES: Final = 1_000_000
#: Smallest LMDB map: a few pages of LMDB's own metadata fit.
MIN_LMDB_MAP_SIZE_BYTES: Final = 1 << 20
#: Largest LMDB map (64 TiB): the map is reserved address space, and x86-64 user space is 128 TiB.
MAX_LMDB_MAP_SIZE_BYTES: Final = 1 << 46
#: The values of ``lmdb_snapshot_format``.
LMDB_SNAPSHOT_FORMATS: Final = ("file", "entries")


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendOptions:
    """Options of one :class:`~materializer.ChangelogKeyedStateBackend`."""

    #: The time trigger (one meaning everywhere, rules in ``materializer/policy.py``): the first
    #: materialization is due a random delay in [0, interval) after the table starts being
    #: scheduled (so tables do not materialize together), then this long after each attempt
    #: ends (Flink: 10 min). 0: due at every check. None: never due by time.
    materialization_interval_s: float | None = 600.0
    #: Also materialize when the log since the last snapshot (uncompressed change bytes) exceeds
    #: this multiple of the last snapshot object's (compressed) size — beyond Flink, whose
    #: time-only trigger let logs grow 45x. None: off.
    materialize_log_ratio: float | None = 2.0
    #: ...but never for less log than this (small states would otherwise materialize constantly).
    materialize_min_log_bytes: int = 8 * 1024 * 1024
    #: Consecutive materialization failures tolerated; one more fails the backend (Flink: 3).
    max_failures: int = 3
    #: zstd level of snapshot blocks (as for segments).
    zstd_level: int = 1
    #: Initial LMDB map size; grows by doubling on demand.
    lmdb_map_size_bytes: int = 64 * 1024 * 1024
    #: Largest LMDB map size; beyond it writes fail with StateTableFullError naming this setting.
    lmdb_max_map_size_bytes: int = 64 * 1024 * 1024 * 1024
    #: Largest snapshot block (one key group's entries, uncompressed): a materialization refuses
    #: to write a larger one and a restore never decompresses more for one block, however
    #: crafted the snapshot (64 MiB: 8 GiB of state per operator at max_parallelism 128).
    #: Restores must use at least the writers' value. Beyond Flink.
    max_snapshot_block_bytes: int = 64 * 1024 * 1024
    #: Largest estimated in-memory size of one decoded state value (safe codec): a crafted value
    #: cannot make a restore allocate more (a 3 MB pickle can decode to 70 MB of dicts), and
    #: writing a larger value fails. Beyond Flink.
    max_value_decoded_bytes: int = 64 * 1024 * 1024
    #: How an LMDB table is materialized: ``"file"`` (snapshot format v2: the environment file
    #: copied from a read transaction and zstd-compressed; restored without per-entry work) or
    #: ``"entries"`` (format v1, entry by entry, as the heap table always writes).
    lmdb_snapshot_format: str = "file"
    #: Incremental materialization: a materialization writes only the entries changed since the
    #: previous one (a delta, snapshot format v3), and checkpoints name the last full snapshot
    #: plus the deltas since. On by default: a steady interval then stores about what changed
    #: instead of the whole table (bench/scale.py, docs/benchmarks.md); ``False`` writes a
    #: full snapshot every time. Under Spark the executor agent writes the deltas of LMDB
    #: partitions from the change sets it uploads (``dstl.spark.agent.materializer``).
    incremental_snapshots: bool = True
    #: With ``incremental_snapshots``: at most this many deltas follow a full snapshot; the next
    #: materialization merges them into one delta that follows the full snapshot (bounds the
    #: pieces a restore reads; ``materializer.compaction``).
    max_snapshot_deltas: int = 8
    #: With ``incremental_snapshots``: a full snapshot is written instead of a delta once the
    #: deltas since the last full one add up to more than this fraction of its bytes (bounds
    #: what a restore reads beyond the state itself, and the store's space).
    max_delta_ratio: float = 0.5
    #: With ``incremental_snapshots``: the changed entries remembered for the next delta (in
    #: memory, one small tuple each: 235 MB per million 32-byte keys); beyond this many the
    #: next materialization is a full one.
    max_delta_entries: int = 250_000

    def __post_init__(self) -> None:
        _validate(self)

    def replace(self, **changes: Any) -> BackendOptions:
        return dataclasses.replace(self, **changes)


def _validate(o: BackendOptions) -> None:
    """Every field's type and range, then the cross-field rule (the one place they live)."""
    if o.materialization_interval_s is not None:
        _number(o, "materialization_interval_s", lo=0.0, hi=MAX_MATERIALIZATION_INTERVAL_S,
                unit="seconds", fix="use None to materialize by size only")
    if o.materialize_log_ratio is not None:
        _number(o, "materialize_log_ratio", lo=0.0, hi=MAX_LOG_RATIO, lo_open=True,
                fix="use None to turn the size trigger off")
    _int(o, "materialize_min_log_bytes", lo=0)
    _int(o, "max_failures", lo=0, hi=MAX_FAILURES)
    _int(o, "zstd_level", lo=-7, hi=22)
    _int(o, "lmdb_map_size_bytes", lo=MIN_LMDB_MAP_SIZE_BYTES, hi=MAX_LMDB_MAP_SIZE_BYTES)
    _int(o, "lmdb_max_map_size_bytes", lo=MIN_LMDB_MAP_SIZE_BYTES, hi=MAX_LMDB_MAP_SIZE_BYTES)
    _int(o, "max_snapshot_block_bytes", lo=1 << 20, hi=1 << 30)
    _int(o, "max_value_decoded_bytes", lo=1 << 20)
    check_choice(o.lmdb_snapshot_format, "lmdb_snapshot_format", _OWNER, LMDB_SNAPSHOT_FORMATS)
    object.__setattr__(o, "incremental_snapshots",
                       check_bool(o.incremental_snapshots, "incremental_snapshots", _OWNER))
    _int(o, "max_snapshot_deltas", lo=1, hi=1000)
    _number(o, "max_delta_ratio", lo=0.0, hi=100.0, lo_open=True,
            fix="a fraction of the full snapshot's size, e.g. 0.5")
    _int(o, "max_delta_entries", lo=1)
    if o.lmdb_max_map_size_bytes < o.lmdb_map_size_bytes:
        raise ConfigError("lmdb_max_map_size_bytes", o.lmdb_max_map_size_bytes,
                          f">= lmdb_map_size_bytes ({o.lmdb_map_size_bytes})", owner=_OWNER,
                          fix="the map grows from lmdb_map_size_bytes up to this limit")


def _int(o: BackendOptions, name: str, *, lo: int, hi: int = MAX_INT64) -> None:
    object.__setattr__(o, name, check_int(getattr(o, name), name, _OWNER, lo=lo, hi=hi))


def _number(o: BackendOptions, name: str, *, lo: float, hi: float, lo_open: bool = False,
            unit: str = "", fix: str = "") -> None:
    """A number option, stored as a float (the frozen instance keeps the normalised value)."""
    object.__setattr__(o, name, check_number(getattr(o, name), name, _OWNER, lo=lo, hi=hi,
                                             lo_open=lo_open, unit=unit, fix=fix))
