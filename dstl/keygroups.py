"""Key groups: the unit of state partitioning and rescaling.

A key's key group is ``pmod(xxhash64(key_bytes, seed=42), max_parallelism)``. That is exactly the
Spark SQL expression ``pmod(xxhash64(col), max_parallelism)`` for a string or binary column (Spark's
``xxhash64`` is XXH64 with seed 42 over the UTF-8 / raw bytes, read as a signed 64-bit integer), so a
Spark job can route rows to the partition owning their key group inside the JVM, without a Python
UDF. ``tests/integration/spark/test_spark_routing.py`` proves the equality on a large random sample.

A backend owns a contiguous, inclusive key-group range; ranges are assigned to operator instances
the way Flink does (``KeyGroupRange.of_operator``), so rescaling moves whole key groups.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

import xxhash

from dstl.checks import check_int
from dstl.errors import ConfigError, UsageError

__all__ = [
    "MAX_PARALLELISM_LIMIT",
    "META_KEY_GROUP",
    "SEED",
    "KeyGroupRange",
    "key_group_for",
    "operator_index_for_key_group",
]

#: Key group of metadata changes (state registrations); written first in every change set.
META_KEY_GROUP: Final = -1
#: Flink's upper bound for max parallelism (2**15); key groups fit in a signed 16-bit range.
MAX_PARALLELISM_LIMIT: Final = 1 << 15

#: Spark SQL's xxhash64() seed.
SEED: Final = 42
_TWO_63: Final = 1 << 63
_TWO_64: Final = 1 << 64


def _check_max_parallelism(max_parallelism: int, owner: str = "key groups") -> None:
    check_int(max_parallelism, "max_parallelism", owner, lo=1, hi=MAX_PARALLELISM_LIMIT,
              fix="the number of key groups, fixed for the life of the state")


def key_group_for(key_bytes: bytes, max_parallelism: int) -> int:
    """Return the key group of a key's bytes.

    Args:
        key_bytes: the key as encoded by the key codec (str keys: UTF-8).
        max_parallelism: number of key groups, in ``[1, 32768]``.

    Returns:
        ``pmod(xxhash64(key_bytes, 42), max_parallelism)`` — equal to Spark SQL's
        ``pmod(xxhash64(key), max_parallelism)``.

    Raises:
        UsageError: ``key_bytes`` is not bytes-like.
        ConfigError: ``max_parallelism`` is out of range.
    """
    if not isinstance(key_bytes, (bytes, bytearray, memoryview)):
        raise UsageError(f"key_group_for needs the key's bytes, got {type(key_bytes).__name__} "
                         "(encode the key with the key codec first; str keys are UTF-8)")
    _check_max_parallelism(max_parallelism)
    h = xxhash.xxh64_intdigest(key_bytes, SEED)
    if h >= _TWO_63:
        h -= _TWO_64
    return h % max_parallelism  # Python's % is Spark's pmod for a positive divisor


def operator_index_for_key_group(key_group: int, max_parallelism: int, parallelism: int) -> int:
    """Index of the operator instance (Spark partition) that owns ``key_group`` (Flink's rule)."""
    owner = "operator_index_for_key_group"
    _check_max_parallelism(max_parallelism, owner)
    check_int(parallelism, "parallelism", owner, lo=1, hi=max_parallelism)
    if not isinstance(key_group, int) or isinstance(key_group, bool) \
            or not 0 <= key_group < max_parallelism:
        raise UsageError(f"key group {key_group!r} is outside [0, {max_parallelism})")
    return key_group * parallelism // max_parallelism


@dataclass(frozen=True, slots=True)
class KeyGroupRange:
    """An inclusive range of key groups ``[start, end]``; ``end == start - 1`` is empty.

    Supports ``len()``, iteration, ``kg in r``, and :meth:`intersection`.
    """

    start: int
    end: int

    def __post_init__(self) -> None:
        owner = "KeyGroupRange"
        check_int(self.start, "start", owner, lo=0, hi=MAX_PARALLELISM_LIMIT,
                  fix="key groups are ints in [0, max_parallelism)")
        check_int(self.end, "end", owner, lo=-1, hi=MAX_PARALLELISM_LIMIT - 1,
                  fix="key groups are ints in [0, max_parallelism)")
        if self.end < self.start - 1:
            raise ConfigError("end", self.end, f">= start - 1 ({self.start - 1})", owner=owner,
                              fix="the range is inclusive: [start, end], end = start - 1 is "
                                  "empty")

    @classmethod
    def of_operator(cls, max_parallelism: int, parallelism: int, index: int) -> KeyGroupRange:
        """Flink's assignment of key groups to operator instance ``index`` of ``parallelism``."""
        owner = "KeyGroupRange.of_operator"
        _check_max_parallelism(max_parallelism, owner)
        check_int(parallelism, "parallelism", owner, lo=1, hi=max_parallelism,
                  fix="at most max_parallelism operator instances (one key group each)")
        check_int(index, "index", owner, lo=0, hi=parallelism - 1)
        start = (index * max_parallelism + parallelism - 1) // parallelism
        end = ((index + 1) * max_parallelism - 1) // parallelism
        return cls(start, end)

    def __len__(self) -> int:
        return self.end - self.start + 1

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end + 1))

    def __contains__(self, key_group: object) -> bool:
        return isinstance(key_group, int) and self.start <= key_group <= self.end

    def intersection(self, other: KeyGroupRange) -> KeyGroupRange:
        """The key groups in both ranges (possibly empty)."""
        start = max(self.start, other.start)
        end = min(self.end, other.end)
        return KeyGroupRange(start, end) if start <= end else KeyGroupRange(start, start - 1)

    def to_json_obj(self) -> list[int]:
        return [self.start, self.end]

    @classmethod
    def from_json_obj(cls, obj: object) -> KeyGroupRange:
        if (not isinstance(obj, list) or len(obj) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in obj)):
            raise UsageError(f"a key-group range must be [start, end], got {obj!r}")
        return cls(obj[0], obj[1])

    def __str__(self) -> str:
        return f"[{self.start}, {self.end}]"
