"""Every option and constructor argument is type- and range-checked.

One table of bad values per class or function; each row must raise :class:`ConfigError` (a
``ValueError``) naming the owner and the field, showing the value, and — for a wrong type — also
be a ``TypeError``. Good values right at the bounds are accepted (the checks are not stricter
than the documented ranges), and int-like values (numpy integers) are normalised.

The rows with a comment name what such a value would do unchecked (a wait that never ends, a
timer thread killed); every row's error names the owner and the field.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.fakes import DelegatingStore

from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
from dstl.checkpoint import CheckpointCoordinator
from dstl.errors import ConfigError
from dstl.stores import MemoryBlobStore
from dstl.timer import ManualTimer
from materializer import (
    AggregatingStateDescriptor,
    BackendOptions,
    ChangelogKeyedStateBackend,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)
from restore import LocalFileCache

INF, NAN = math.inf, math.nan
TYPE = "type"  # marks a row whose error must also be a TypeError
RANGE = "range"
NO_VALUE = object()  # the value's repr is not predictable (a lambda): not looked for


def _expect(kind: str, fn: Callable[[], object], owner: str, field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        fn()
    err = info.value
    assert isinstance(err, ValueError)
    assert err.field == field, f"blamed {err.field!r}, not {field!r}: {err}"
    text = str(err)
    assert f"{owner}.{field}=" in text, text
    assert "expected" in text, text
    if kind == TYPE:
        assert isinstance(err, TypeError), f"a wrong type must also be a TypeError: {err!r}"
    shown = repr(value)
    if value is not NO_VALUE and len(shown) < 60:
        assert shown in text, f"the message must show the value {shown}: {text}"


# ----------------------------------------------------------------- DstlOptions

DSTL_BAD = [
    ("persist_delay_s", 1e9, RANGE),  # unchecked: the persist future never resolved
    ("persist_delay_s", 301.0, RANGE),
    ("persist_delay_s", -0.001, RANGE),
    ("persist_delay_s", NAN, RANGE),
    ("persist_delay_s", INF, RANGE),
    ("persist_delay_s", True, TYPE),
    ("persist_delay_s", "0.01", TYPE),
    ("persist_delay_s", None, TYPE),
    ("persist_size_threshold_bytes", 0, RANGE),
    ("persist_size_threshold_bytes", 1.5, TYPE),
    ("persist_size_threshold_bytes", True, TYPE),
    ("preemptive_persist_threshold_bytes", 0, RANGE),
    ("preemptive_persist_threshold_bytes", (1 << 30) + 1, RANGE),
    ("preemptive_persist_threshold_bytes", 1024.0, TYPE),
    ("max_in_flight_bytes", 0, RANGE),
    ("max_in_flight_bytes", 1 << 70, RANGE),
    ("max_in_flight_bytes", "100", TYPE),
    ("back_pressure_timeout_s", 0, RANGE),
    ("back_pressure_timeout_s", 1e12, RANGE),  # unchecked: (a wait that overflows)
    ("back_pressure_timeout_s", INF, RANGE),
    ("back_pressure_timeout_s", False, TYPE),
    ("upload_threads", 0, RANGE),
    ("upload_threads", 100_000, RANGE),
    ("upload_threads", 2.0, TYPE),
    ("upload_threads", True, TYPE),
    ("upload_timeout_s", 0.0, RANGE),
    ("upload_timeout_s", 1e10, RANGE),  # unchecked: killed the timer thread
    ("upload_timeout_s", NAN, RANGE),
    ("upload_max_attempts", 0, RANGE),
    ("upload_max_attempts", 256, RANGE),
    ("upload_max_attempts", True, TYPE),
    ("upload_retry_delay_s", -1.0, RANGE),
    ("upload_retry_delay_s", 1e10, RANGE),  # unchecked: killed the timer thread
    ("zstd_level", 23, RANGE),
    ("zstd_level", -8, RANGE),
    ("zstd_level", 1.0, TYPE),
    ("zstd_level", True, TYPE),
    ("discard_threads", 0, RANGE),
    ("discard_threads", 10_000, RANGE),
    ("discard_threads", True, TYPE),
]


@pytest.mark.parametrize(("field", "value", "kind"), DSTL_BAD)
def test_dstl_options_refuse(field: str, value: object, kind: str) -> None:
    _expect(kind, lambda: DstlOptions(**{field: value}), "DstlOptions", field, value)


def test_dstl_options_bounds_are_inclusive_and_values_normalised() -> None:
    o = DstlOptions(persist_delay_s=300, back_pressure_timeout_s=86_400,
                    upload_timeout_s=3600, upload_retry_delay_s=600, upload_threads=np.int64(256),
                    discard_threads=256, upload_max_attempts=255, zstd_level=-7)
    assert o.persist_delay_s == 300.0 and isinstance(o.persist_delay_s, float)
    assert o.upload_threads == 256 and type(o.upload_threads) is int
    assert DstlOptions(persist_delay_s=0, upload_retry_delay_s=0).persist_delay_s == 0.0


def test_dstl_options_from_spark_conf_refuses_bad_strings() -> None:
    with pytest.raises(ConfigError, match="persist_delay_s"):
        DstlOptions.from_mapping({"spark.dstl.persist_delay_s": "1e9"})
    with pytest.raises(ConfigError, match="persist_delay_s"):
        DstlOptions.from_mapping({"spark.dstl.persist_delay_s": "nan"})
    with pytest.raises(ConfigError, match="upload_threads"):
        DstlOptions.from_mapping({"spark.dstl.upload_threads": "2.5"})


# ----------------------------------------------------------------- BackendOptions

BACKEND_BAD = [
    ("materialization_interval_s", -1.0, RANGE),
    ("materialization_interval_s", NAN, RANGE),
    ("materialization_interval_s", INF, RANGE),
    ("materialization_interval_s", 1e10, RANGE),  # unchecked: killed the timer thread
    ("materialization_interval_s", True, TYPE),
    ("materialization_interval_s", "600", TYPE),
    ("materialize_log_ratio", 0.0, RANGE),
    ("materialize_log_ratio", NAN, RANGE),
    ("materialize_log_ratio", 1e300, RANGE),
    ("materialize_log_ratio", True, TYPE),
    ("materialize_min_log_bytes", -1, RANGE),
    ("materialize_min_log_bytes", 1.5, TYPE),
    ("max_failures", -1, RANGE),
    ("max_failures", 10 ** 9, RANGE),
    ("max_failures", True, TYPE),
    ("zstd_level", 23, RANGE),
    ("lmdb_map_size_bytes", 0, RANGE),  # unchecked: LmdbStateTable blamed its own field
    ("lmdb_map_size_bytes", 1 << 50, RANGE),  # unchecked: MemoryError at open
    ("lmdb_map_size_bytes", 2.0 ** 30, TYPE),
    ("lmdb_max_map_size_bytes", 1 << 50, RANGE),
    ("lmdb_max_map_size_bytes", 1 << 20, RANGE),  # below the default initial size
    ("lmdb_max_map_size_bytes", None, TYPE),
]


@pytest.mark.parametrize(("field", "value", "kind"), BACKEND_BAD)
def test_backend_options_refuse(field: str, value: object, kind: str) -> None:
    _expect(kind, lambda: BackendOptions(**{field: value}), "BackendOptions", field, value)


def test_backend_options_accept_none_and_bounds() -> None:
    o = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None,
                       materialize_min_log_bytes=0, max_failures=0,
                       lmdb_map_size_bytes=1 << 20, lmdb_max_map_size_bytes=1 << 46)
    assert o.materialization_interval_s is None and o.max_failures == 0
    assert BackendOptions(materialization_interval_s=7 * 86_400).materialization_interval_s \
        == 7 * 86_400.0


# ----------------------------------------------------------------- KeyGroupRange

KGR_BAD: list[tuple[tuple[Any, Any], str, str]] = [
    ((True, 3), "start", TYPE),
    ((0, True), "end", TYPE),
    (("0", 3), "start", TYPE),
    ((0.0, 3), "start", TYPE),
    ((-1, 3), "start", RANGE),
    ((0, 32768), "end", RANGE),
    ((5, 3), "end", RANGE),
    ((0, None), "end", TYPE),
]


@pytest.mark.parametrize(("args", "field", "kind"), KGR_BAD)
def test_key_group_range_refuses(args: tuple[Any, Any], field: str, kind: str) -> None:
    value = args[0] if field == "start" else args[1]
    _expect(kind, lambda: KeyGroupRange(*args), "KeyGroupRange", field, value)


@pytest.mark.parametrize(("args", "field", "kind"), [
    ((128, "2", 0), "parallelism", TYPE),  # raw TypeError before
    ((128, True, 0), "parallelism", TYPE),
    ((128, 2, True), "index", TYPE),
    ((128, 2, 2), "index", RANGE),
    ((128, 129, 0), "parallelism", RANGE),
    ((0, 1, 0), "max_parallelism", RANGE),
    ((128.0, 1, 0), "max_parallelism", TYPE),
])
def test_key_group_range_of_operator_refuses(args: tuple[Any, Any, Any], field: str,
                                             kind: str) -> None:
    value = dict(zip(("max_parallelism", "parallelism", "index"), args))[field]
    _expect(kind, lambda: KeyGroupRange.of_operator(*args), "KeyGroupRange.of_operator", field,
            value)


def test_key_group_range_keeps_its_valid_forms() -> None:
    assert len(KeyGroupRange(3, 2)) == 0 and len(KeyGroupRange(0, 32767)) == 32768
    assert KeyGroupRange(np.int64(1), np.int32(4)) == KeyGroupRange(1, 4)  # type: ignore[arg-type]


# ----------------------------------------------------------------- LocalFileCache


@pytest.mark.parametrize(("field", "kwargs", "kind"), [
    ("directory", {"directory": 5}, TYPE),  # raw TypeError before
    ("directory", {"directory": ""}, RANGE),  # unchecked: the cache took the cwd
    ("directory", {"directory": "a\0b"}, RANGE),
    ("idle_ttl_s", {"idle_ttl_s": 1e10}, RANGE),  # unchecked: killed the timer thread
    ("idle_ttl_s", {"idle_ttl_s": -1}, RANGE),
    ("idle_ttl_s", {"idle_ttl_s": NAN}, RANGE),
    ("idle_ttl_s", {"idle_ttl_s": True}, TYPE),
    ("max_bytes", {"max_bytes": 0}, RANGE),
    ("max_bytes", {"max_bytes": 1.5}, TYPE),
    ("max_bytes", {"max_bytes": True}, TYPE),
    ("on_full", {"on_full": "drop"}, RANGE),
    ("on_full", {"on_full": None}, TYPE),
    ("timer", {"timer": 5}, TYPE),  # unchecked: failed at the first eviction
])
def test_local_file_cache_refuses(tmp_path: Path, field: str, kwargs: dict[str, Any],
                                  kind: str) -> None:
    args = {"directory": str(tmp_path / "cache"), **kwargs}
    cwd_before = set(os.listdir())
    _expect(kind, lambda: LocalFileCache(**args), "LocalFileCache", field, kwargs[field])
    assert set(os.listdir()) == cwd_before  # nothing was created before the check


# ----------------------------------------------------------------- ChangelogStorage


@pytest.mark.parametrize(("field", "kwargs", "kind"), [
    ("options", {"options": 5}, TYPE),  # AttributeError before
    ("options", {"options": {}}, TYPE),  # unchecked: silently the defaults
    ("options", {"options": BackendOptions()}, TYPE),  # unchecked: (wrong class)
    ("storage_options", {"storage_options": 5}, TYPE),
    ("store", {"store": 5}, TYPE),
    ("timer", {"timer": 5}, TYPE),
    ("uploader", {"uploader": 5}, TYPE),
    ("base_uri", {"base_uri": 5, "store": None}, TYPE),
])
def test_changelog_storage_refuses(field: str, kwargs: dict[str, Any], kind: str) -> None:
    args: dict[str, Any] = {"store": MemoryBlobStore("memory://cfg"), **kwargs}
    owner = "open_store" if field == "base_uri" else "ChangelogStorage"
    # storage options may hold credentials: their values are never shown
    shown = NO_VALUE if field == "storage_options" else kwargs[field]
    _expect(kind, lambda: ChangelogStorage(**args), owner, field, shown)


def test_changelog_storage_accepts_a_path_object(tmp_path: Path) -> None:
    with ChangelogStorage(tmp_path / "root") as s:
        assert s.store.location.endswith("root")


# ----------------------------------------------------------------- keyed backend


@pytest.fixture
def storage() -> Iterator[ChangelogStorage]:
    with ChangelogStorage(store=MemoryBlobStore("memory://cfg-backend"),
                          timer=ManualTimer()) as s:
        yield s


@pytest.mark.parametrize(("field", "kwargs", "kind"), [
    ("storage", {"storage": 5}, TYPE),  # AttributeError before
    ("operator_id", {"operator_id": ""}, RANGE),
    ("operator_id", {"operator_id": 5}, TYPE),
    ("key_groups", {"key_groups": (0, 7)}, TYPE),  # AttributeError before
    ("max_parallelism", {"max_parallelism": 0}, RANGE),
    ("max_parallelism", {"max_parallelism": True}, TYPE),
    ("table", {"table": "disk"}, RANGE),
    ("options", {"options": 5}, TYPE),  # unchecked until first use
    ("options", {"options": DstlOptions()}, TYPE),
    ("key_codec", {"key_codec": 5}, TYPE),  # unchecked until the first key
    ("local_directory", {"local_directory": 5}, TYPE),
    ("timer", {"timer": 5}, TYPE),
    ("clear_local", {"clear_local": "yes"}, TYPE),
    ("auto_materialize", {"auto_materialize": 1}, TYPE),
])
def test_keyed_backend_refuses(storage: ChangelogStorage, field: str, kwargs: dict[str, Any],
                               kind: str) -> None:
    args: dict[str, Any] = {"storage": storage, "operator_id": "op",
                            "key_groups": KeyGroupRange(0, 7), "max_parallelism": 8,
                            "table": "heap", **kwargs}
    _expect(kind, lambda: ChangelogKeyedStateBackend(**args), "ChangelogKeyedStateBackend",
            field, kwargs[field])
    assert storage.metrics()["ChangelogStorage.writers"] == 0  # nothing left open


# ----------------------------------------------------------------- restore_backend


@pytest.mark.parametrize(("field", "kwargs", "kind"), [
    ("handles", {"handles": "{}"}, TYPE),  # iterated per character before
    ("handles", {"handles": b"{}"}, TYPE),
    ("handles", {"handles": 5}, TYPE),
    ("storage", {"storage": 5}, TYPE),
    ("key_groups", {"key_groups": (0, 7)}, TYPE),
    ("table", {"table": "disk"}, RANGE),
    ("cache", {"cache": 5}, TYPE),
    ("operator_id", {"operator_id": ""}, RANGE),
    ("max_parallelism", {"max_parallelism": 0}, RANGE),
    ("max_parallelism", {"max_parallelism": True}, TYPE),
    ("options", {"options": DstlOptions()}, TYPE),
    ("local_directory", {"local_directory": 5}, TYPE),
    ("timer", {"timer": 5}, TYPE),
    ("allow_pickle", {"allow_pickle": "no"}, TYPE),  # unchecked: "no" is truthy!
    ("stats", {"stats": 5}, TYPE),
    ("auto_materialize", {"auto_materialize": None}, TYPE),
])
def test_restore_backend_refuses(storage: ChangelogStorage, field: str, kwargs: dict[str, Any],
                                 kind: str) -> None:
    from restore import restore_backend

    args: dict[str, Any] = {"handles": [], "storage": storage,
                            "key_groups": KeyGroupRange(0, 7), **kwargs}
    _expect(kind, lambda: restore_backend(**args), "restore_backend", field, kwargs[field])


# ----------------------------------------------------------------- coordinator


@pytest.mark.parametrize(("field", "kwargs", "kind"), [
    ("store", {"store": 5}, TYPE),
    ("job_id", {"job_id": ""}, RANGE),
    ("job_id", {"job_id": 5}, TYPE),
    ("retained", {"retained": 0}, RANGE),
    ("retained", {"retained": True}, TYPE),
    ("retained", {"retained": "3"}, TYPE),
    ("retained", {"retained": 10 ** 7}, RANGE),
    ("clock", {"clock": 5}, TYPE),
    ("wall_clock", {"wall_clock": None}, TYPE),
    ("metrics", {"metrics": 5}, TYPE),  # AttributeError before
    ("executor", {"executor": 5}, TYPE),
    ("listeners", {"listeners": 5}, TYPE),  # raw TypeError before
])
def test_coordinator_refuses(field: str, kwargs: dict[str, Any], kind: str) -> None:
    args: dict[str, Any] = {"store": MemoryBlobStore("memory://cfg-coord"), "job_id": "job",
                            **kwargs}
    _expect(kind, lambda: CheckpointCoordinator(**args), "CheckpointCoordinator", field,
            kwargs[field])


def test_coordinator_recover_checks_before_reading() -> None:
    store = DelegatingStore()
    with pytest.raises(ConfigError, match="retained"):
        CheckpointCoordinator.recover(store, "job", retained=0)
    with pytest.raises(ConfigError, match="fallback"):
        CheckpointCoordinator.recover(store, "job", fallback="yes")  # type: ignore[arg-type]


# ----------------------------------------------------------------- state descriptors


@pytest.mark.parametrize(("owner", "field", "make", "value", "kind"), [
    ("ValueStateDescriptor", "name", lambda: ValueStateDescriptor(""), "", RANGE),
    ("ValueStateDescriptor", "name", lambda: ValueStateDescriptor(5), 5, TYPE),  # type: ignore[arg-type]
    ("ValueStateDescriptor", "name", lambda: ValueStateDescriptor("x" * 256), "x" * 256, RANGE),
    ("ValueStateDescriptor", "serializer", lambda: ValueStateDescriptor("s", 5), 5, TYPE),  # type: ignore[arg-type]
    ("ListStateDescriptor", "serializer", lambda: ListStateDescriptor("s", "json"), "json", TYPE),  # type: ignore[arg-type]
    ("MapStateDescriptor", "key_serializer",
     lambda: MapStateDescriptor("m", key_serializer=5), 5, TYPE),  # type: ignore[arg-type]
    ("ReducingStateDescriptor", "reduce_fn",
     lambda: ReducingStateDescriptor("r", None), None, TYPE),  # type: ignore[arg-type]
    ("ReducingStateDescriptor", "reduce_fn",
     lambda: ReducingStateDescriptor("r", lambda a: a), NO_VALUE, TYPE),
    ("AggregatingStateDescriptor", "agg", lambda: AggregatingStateDescriptor("a", 5), 5, TYPE),  # type: ignore[arg-type]
])
def test_descriptors_refuse(owner: str, field: str, make: Callable[[], object], value: object,
                            kind: str) -> None:
    # unchecked: every row only failed at get_state or at the first update
    _expect(kind, make, owner, field, value)


# ----------------------------------------------------------------- LmdbStateTable


@pytest.mark.parametrize(("field", "kwargs", "kind"), [
    ("directory", {"directory": ""}, RANGE),  # unchecked: the current directory
    ("directory", {"directory": 5}, TYPE),
    ("key_groups", {"key_groups": (0, 7)}, TYPE),  # AttributeError before
    ("map_size_bytes", {"map_size_bytes": 0}, RANGE),  # a UsageError before
    ("map_size_bytes", {"map_size_bytes": 1 << 50}, RANGE),  # MemoryError at open before
    ("max_map_size_bytes", {"max_map_size_bytes": 1 << 50}, RANGE),
    ("max_map_size_bytes", {"map_size_bytes": 1 << 22, "max_map_size_bytes": 1 << 21}, RANGE),
    ("sync", {"sync": "yes"}, TYPE),
    ("grow_wait_s", {"grow_wait_s": NAN}, RANGE),
    ("grow_wait_s", {"grow_wait_s": 1e10}, RANGE),
    ("readonly", {"readonly": 1}, TYPE),
])
def test_lmdb_state_table_refuses(tmp_path: Path, field: str, kwargs: dict[str, Any],
                                  kind: str) -> None:
    from materializer import LmdbStateTable

    args: dict[str, Any] = {"directory": str(tmp_path / "env"),
                            "key_groups": KeyGroupRange(0, 7), **kwargs}
    _expect(kind, lambda: LmdbStateTable(**args), "LmdbStateTable", field, kwargs[field])
    assert not (tmp_path / "env").exists()
