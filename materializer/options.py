"""Options of a keyed state backend (``BackendOptions``). Every field is documented, with the
reason for its default, in ``docs/configuration.md``."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from dstl.errors import ConfigError

__all__ = ["BackendOptions"]

_OWNER = "BackendOptions"


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

    def __post_init__(self) -> None:
        v = self.materialization_interval_s
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not math.isfinite(v) or v < 0):
            raise ConfigError("materialization_interval_s", v, "a number >= 0 or None",
                              owner=_OWNER)
        v = self.materialize_log_ratio
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not math.isfinite(v) or v <= 0):
            raise ConfigError("materialize_log_ratio", v, "a positive number or None",
                              owner=_OWNER)
        for name in ("materialize_min_log_bytes", "max_failures", "lmdb_map_size_bytes",
                     "lmdb_max_map_size_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(name, v, "a non-negative int", owner=_OWNER)
        if isinstance(self.zstd_level, bool) or not isinstance(self.zstd_level, int) \
                or not -7 <= self.zstd_level <= 22:
            raise ConfigError("zstd_level", self.zstd_level, "an int in [-7, 22]", owner=_OWNER)
        if self.lmdb_max_map_size_bytes < self.lmdb_map_size_bytes:
            raise ConfigError("lmdb_max_map_size_bytes", self.lmdb_max_map_size_bytes,
                              f">= lmdb_map_size_bytes ({self.lmdb_map_size_bytes})",
                              owner=_OWNER)

    def replace(self, **changes: Any) -> BackendOptions:
        return dataclasses.replace(self, **changes)
