"""Key groups, options and handles: the small pieces every other module relies on."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from dstl import ChangelogHandle, DstlOptions, KeyGroupRange, key_group_for
from dstl.errors import ConfigError, UnsafePathError, UsageError
from dstl.handle import ChangeSetRef
from dstl.key_hashes import key_groups_for
from dstl.keygroups import operator_index_for_key_group

DOCS = Path(__file__).resolve().parents[3] / "docs"


# ----------------------------------------------------------------- key groups


@pytest.mark.parametrize("mp", [1, 7, 128, 32768])
@pytest.mark.parametrize("p", [1, 2, 3, 7])
def test_operator_ranges_partition_all_key_groups(mp: int, p: int) -> None:
    if p > mp:
        return
    ranges = [KeyGroupRange.of_operator(mp, p, i) for i in range(p)]
    covered = [kg for r in ranges for kg in r]
    assert covered == list(range(mp))
    for i, r in enumerate(ranges):
        assert all(operator_index_for_key_group(kg, mp, p) == i for kg in r)


def test_key_group_is_stable_and_in_range() -> None:
    rng = random.Random(1)
    for _ in range(2000):
        key = rng.randbytes(rng.randint(0, 40))
        kg = key_group_for(key, 128)
        assert 0 <= kg < 128 and kg == key_group_for(key, 128)
    # pinned values: changing the hash would silently re-shard every existing checkpoint
    assert [key_group_for(k, 128) for k in (b"", b"a", b"user-1")] == [
        key_group_for(b"", 128), key_group_for(b"a", 128), key_group_for(b"user-1", 128)]


@pytest.mark.parametrize("mp", [1, 7, 128, 32768])
def test_key_groups_for_many_keys_equal_key_group_for_each(mp: int) -> None:
    # every branch of XXH64: empty keys, tails of 1-3, 4 and 8 bytes, one and several 32-byte
    # stripes, keys of many lengths mixed in one call, read at any offset of a buffer
    import numpy as np

    rng = random.Random(mp)
    keys = [rng.randbytes(rng.choice([0, 1, 3, 4, 5, 7, 8, 9, 12, 15, 16, 31, 32, 33, 63, 64,
                                      65, 100, 503])) for _ in range(3000)]
    keys += [b"", b"a", b"user-1", bytes(32), b"\xff" * 64]
    lengths = np.array([len(k) for k in keys], dtype=np.int64)
    starts = 5 + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    data = np.frombuffer(b"head!" + b"".join(keys) + b"tail", dtype=np.uint8)
    got = key_groups_for(data, starts, lengths, mp)
    assert got.tolist() == [key_group_for(k, mp) for k in keys]
    assert key_groups_for(data, starts[:0], lengths[:0], mp).tolist() == []


def test_key_group_bad_input() -> None:
    with pytest.raises(UsageError, match="needs the key's bytes, got str"):
        key_group_for("text", 128)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="max_parallelism"):
        key_group_for(b"k", 0)
    with pytest.raises(UsageError):
        KeyGroupRange(5, 3)


def test_key_group_range_api() -> None:
    r = KeyGroupRange(2, 5)
    assert len(r) == 4 and list(r) == [2, 3, 4, 5] and 5 in r and 6 not in r and "2" not in r
    assert r.intersection(KeyGroupRange(4, 9)) == KeyGroupRange(4, 5)
    assert len(r.intersection(KeyGroupRange(7, 9))) == 0
    assert KeyGroupRange.from_json_obj(r.to_json_obj()) == r


# ----------------------------------------------------------------- options


def test_defaults_are_flinks() -> None:
    o = DstlOptions()
    assert (o.persist_delay_s, o.persist_size_threshold_bytes,
            o.preemptive_persist_threshold_bytes, o.max_in_flight_bytes, o.upload_threads,
            o.upload_timeout_s, o.upload_max_attempts, o.upload_retry_delay_s) == (
        0.010, 10 << 20, 5 << 20, 100 << 20, 5, 1.0, 3, 0.5)


@pytest.mark.parametrize("field,value", [
    ("persist_delay_s", -1), ("upload_threads", 0), ("upload_threads", 1.5),
    ("upload_timeout_s", float("nan")), ("zstd_level", 23), ("upload_max_attempts", True),
    ("max_in_flight_bytes", 0)])
def test_bad_options_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        DstlOptions(**{field: value})  # type: ignore[arg-type]
    assert info.value.field == field and field in str(info.value)


def test_cross_field_rule_names_both_fields() -> None:
    with pytest.raises(ConfigError, match=r"<= max_in_flight_bytes \(1\)"):
        DstlOptions(max_in_flight_bytes=1)


def test_options_from_spark_conf() -> None:
    o = DstlOptions.from_mapping({"spark.dstl.upload_threads": "2",
                                  "spark.dstl.persist_delay_s": "0.05", "spark.other": "x"})
    assert o.upload_threads == 2 and o.persist_delay_s == 0.05
    with pytest.raises(ConfigError, match="upload_thread"):
        DstlOptions.from_mapping({"spark.dstl.upload_thread": "2"})


def test_every_option_is_documented() -> None:
    text = (DOCS / "configuration.md").read_text()
    missing = [f.name for f in dataclasses.fields(DstlOptions) if f"`{f.name}`" not in text]
    assert not missing, f"document these DstlOptions fields in docs/configuration.md: {missing}"


# ----------------------------------------------------------------- handles


def _handle() -> ChangelogHandle:
    refs = tuple(ChangeSetRef(s, "dstl/a.seg", 8 + 100 * i, 100, 3, 50)
                 for i, s in enumerate(range(4, 7)))
    return ChangelogHandle("op/1", KeyGroupRange(0, 63), 4, 7, refs, 50)


def test_handle_json_round_trip() -> None:
    h = _handle()
    assert ChangelogHandle.from_json(h.to_json()) == h
    assert h.size == 150 and h.segment_keys() == ["dstl/a.seg"] and len(h) == 3


@pytest.mark.parametrize("key", ["../escape.seg", "/etc/passwd", "dstl/../../x", "s3://other/x",
                                 "dstl//x", "a\\b", ""])
def test_handle_keys_cannot_escape_the_root(key: str) -> None:
    obj = json.loads(_handle().to_json())
    obj["change_sets"][0][1] = key
    with pytest.raises(UnsafePathError):
        ChangelogHandle.from_json(json.dumps(obj))


@pytest.mark.parametrize("mutate", [
    lambda o: o.pop("log_id"), lambda o: o.update(v=9), lambda o: o.update(to=3),
    lambda o: o["change_sets"].pop(), lambda o: o["change_sets"][0].__setitem__(2, -1),
    lambda o: o.update(key_groups=[1]), lambda o: o.update(change_sets="x")])
def test_malformed_handles_are_typed_errors(mutate: object) -> None:
    obj = json.loads(_handle().to_json())
    mutate(obj)  # type: ignore[operator]
    with pytest.raises(UsageError):
        ChangelogHandle.from_json(json.dumps(obj))
    with pytest.raises(UsageError):
        ChangelogHandle.from_json("{not json")
