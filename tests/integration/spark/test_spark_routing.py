"""The JVM computes DSTL's key groups: Spark SQL's pmod(xxhash64(key), max_parallelism) equals
dstl.key_group_for for a large random sample, so rows are routed without a Python UDF."""

from __future__ import annotations

import random
import string
from typing import Any

import pytest
from spark_support import spark  # noqa: F401

from dstl import KeyGroupRange, key_group_for
from dstl.keygroups import operator_index_for_key_group

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]


def test_jvm_key_groups_equal_key_group_for(spark: Any) -> None:  # noqa: F811
    rng = random.Random(20261122)
    print("seed=20261122")
    alphabet = string.printable + "äöüßéñ中文日本語🙂"
    keys = ["", "a", "user-1"] + ["".join(rng.choices(alphabet, k=rng.randint(0, 48)))
                                  for _ in range(20_000)]
    df = spark.createDataFrame([(k, k.encode("utf-8")) for k in keys], "k string, b binary")
    for mp in (1, 7, 128, 32768):
        rows = df.selectExpr("k", f"pmod(xxhash64(k), {mp}) AS s", f"pmod(xxhash64(b), {mp}) AS b"
                             ).collect()
        bad = [(r.k, r.s, r.b) for r in rows
               if not r.s == r.b == key_group_for(r.k.encode("utf-8"), mp)]
        assert not bad, f"max_parallelism {mp}: {bad[:5]}"


def test_jvm_partition_equals_flinks_operator_index(spark: Any) -> None:  # noqa: F811
    mp, p = 128, 5
    keys = [f"user-{i}" for i in range(2000)]
    df = spark.createDataFrame([(k,) for k in keys], "k string")
    rows = df.selectExpr("k", f"cast((pmod(xxhash64(k), {mp}) * {p}) div {mp} as int) AS pid"
                         ).collect()
    for r in rows:
        kg = key_group_for(r.k.encode(), mp)
        assert r.pid == operator_index_for_key_group(kg, mp, p)
        assert kg in KeyGroupRange.of_operator(mp, p, r.pid)
