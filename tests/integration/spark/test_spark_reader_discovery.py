"""spark.read.format("dstl") and spark.readStream.format("dstl_changes") in a fresh SparkSession
that never called dstl.spark.register: PySpark finds both sources itself (the installed packages
pyspark_dstl and pyspark_dstl_changes), without the filter-pushdown conf register sets, and
DSTL's own states (the timer service's $timers) stay out of the rows unless internalStates is on.

The state is tests/support/state_job.py's MiniJob with timers on some keys; the session runs in
a subprocess (a fresh JVM: no registration of an earlier test leaks in) whose driver imports no
DSTL module, from a directory outside the project and without PYTHONPATH (the sources are found
where the installation put them). Filters pushed down with internal states run on the readers
themselves (no Spark); register after the static sources, with the pushdown it turns on, is
what tests/integration/spark/test_spark_state_reader.py does in every test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from support.state_job import MiniJob, replay, state_of

from dstl.reader import from_json
from dstl.reader.rows import CHANGE_DDL, STATE_DDL
from dstl.spark.datasource import DstlChangesDataSource, DstlStateDataSource
from dstl.stores import open_store
from materializer.timers import TIMERS_STATE, TimerService

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]

HERE = Path(__file__).resolve().parent

#: Spark's own lookup of static Python data sources, run in a fresh interpreter: the names it
#: registers, and whether importing the packages imported any of DSTL
_LOOKUP = r"""
import io, json, pickle, sys
from pyspark.serializers import read_int
from pyspark.sql.worker.lookup_data_sources import _main
out = io.BytesIO()
_main(io.BytesIO(), out)
out.seek(0)
found = {}
for _ in range(read_int(out)):
    name = out.read(read_int(out)).decode("utf-8")
    found[name] = pickle.loads(out.read(read_int(out))).__module__
print(json.dumps({"found": found, "dstl_imported": sorted(
    m for m in sys.modules if m == "dstl" or m.startswith("dstl."))}))
"""

#: A fresh session reading the state, never registering (one core: one executor worker to
#: start, and each new Python worker of a read imports DSTL)
_SESSION = r"""
import json, os, sys
# tests/integration/spark (spark_support) and tests/ (the support package it uses)
sys.path[:0] = [sys.argv[1], os.path.dirname(os.path.dirname(sys.argv[1]))]
from spark_support import new_session

root, out = sys.argv[2], sys.argv[3]
spark = new_session("dstl-discovery", master="local[1]")
res = {}

def rows(df):
    return [{k: v for k, v in r.asDict().items() if k != "key_bytes"} for r in df.collect()]

def state(**options):
    reader = spark.read.format("dstl").option("operator", "job")
    for k, v in options.items():
        reader = reader.option(k, v)
    return reader.load(root)

res["pushdown_conf"] = spark.conf.get("spark.sql.python.filterPushdown.enabled")
res["state"] = rows(state())
res["internal"] = rows(state(internalStates="true"))
try:
    state(state="$timers").collect()
except Exception as exc:
    res["state_option_error"] = str(exc)
k7 = state().filter("key = 'k7'")
res["k7"], res["k7_splits"] = rows(k7), k7.rdd.getNumPartitions()
query = (spark.readStream.format("dstl_changes").option("startingCheckpoint", "earliest")
         .load(root).writeStream.format("memory").queryName("changes")
         .trigger(availableNow=True).start())
query.awaitTermination()
res["stream"] = rows(spark.table("changes"))
res["dstl_imported"] = sorted(m for m in sys.modules if m == "dstl" or m.startswith("dstl."))
spark.stop()
with open(out, "w") as f:
    json.dump(res, f)
"""


def _fresh_env() -> dict[str, str]:
    """This interpreter for the child and its Spark workers, and no PYTHONPATH: the sources
    must be found where the installation put them."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYSPARK_PYTHON"] = sys.executable
    return env


def _rows(raw: list[dict[str, Any]]) -> list[SimpleNamespace]:
    out = []
    for d in raw:
        for f in ("namespace", "user_key", "value"):
            if f in d:
                d[f] = from_json(d[f])
        out.append(SimpleNamespace(**d))
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory
        ) -> tuple[str, dict[tuple[str, str, Any], Any], dict[tuple[str, str, Any], Any]]:
    """A job's state with timers: its root, the model at its newest checkpoint without DSTL's
    own states, and the ``$timers`` state there."""
    root = str(tmp_path_factory.mktemp("discovery") / "state")
    store = open_store(root)
    job = MiniJob(store, partitions=2, max_parallelism=16, table="heap", seed=7, retained=5)
    services = [TimerService(b) for b in job.backends]
    timers: dict[tuple[str, str, Any], Any] = {}

    def timer(key: str, ts: int, delete: bool = False) -> None:
        p = job.partition_of(key)
        job.backends[p].set_current_key(key)
        job.backends[p].set_current_namespace(None)
        if delete:
            services[p].delete(ts)
            timers[(TIMERS_STATE, key, None)].remove(ts)
            if not timers[(TIMERS_STATE, key, None)]:
                del timers[(TIMERS_STATE, key, None)]
        else:
            services[p].register(ts, key)
            timers.setdefault((TIMERS_STATE, key, None), []).append(ts)

    job.run(120)
    for i in range(8):
        timer(f"k{i}", 1000 + i)
    job.checkpoint()
    job.run(60)
    timer("k1", 5000)
    timer("k2", 1002, delete=True)
    cid = job.checkpoint()
    job.close()
    store.close()
    return root, job.checkpoint_models[cid], timers


def test_the_sources_are_found_by_sparks_lookup_and_import_nothing_of_dstl(
        tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", _LOOKUP], cwd=tmp_path, env=_fresh_env(),
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["found"].get("dstl") == "pyspark_dstl", got
    assert got["found"].get("dstl_changes") == "pyspark_dstl_changes", got
    assert got["dstl_imported"] == [], "the lookup of every Spark application imports these"


def test_the_static_sources_carry_the_sources_names() -> None:
    import pyspark_dstl
    import pyspark_dstl_changes

    assert pyspark_dstl.DefaultSource.name() == DstlStateDataSource.name()
    assert pyspark_dstl_changes.DefaultSource.name() == DstlChangesDataSource.name()


def test_a_fresh_session_reads_state_and_changes_without_registration(
        tmp_path: Path, job: tuple[str, dict[Any, Any], dict[Any, Any]]) -> None:
    root, model, timers = job
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-c", _SESSION, str(HERE), root, str(out)],
                          cwd=tmp_path, env=_fresh_env(), capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    res = json.loads(out.read_text())
    assert res["dstl_imported"] == []  # the driver registered nothing
    assert res["pushdown_conf"] == "false"  # Spark's default: the source works without it

    # DSTL's own states are left out (every path: the tests below)
    assert timers, "the job has timers"
    assert state_of(_rows(res["state"])) == model
    assert state_of(_rows(res["internal"])) == {**model, **timers}
    assert "ConfigError" in res["state_option_error"]
    assert "internalStates" in res["state_option_error"]

    # without the conf Spark applies the filter itself: every split is read (with it, which
    # register sets, only the key's: tests/integration/spark/test_spark_state_reader.py)
    k7 = {i: v for i, v in model.items() if i[1] == "k7"}
    assert k7 and state_of(_rows(res["k7"])) == k7
    assert res["k7_splits"] == 2

    # the stream from the empty state replays to the state, without the timers
    changes = sorted(_rows(res["stream"]), key=lambda r: (r.checkpoint, r.partition, r.seq))
    assert TIMERS_STATE not in {r.state for r in changes}
    assert replay(changes) == model


def _schema(ddl: str) -> Any:
    """The source's own schema, as Spark hands it to ``reader``."""
    from pyspark.sql.types import (
        BinaryType,
        IntegerType,
        LongType,
        StringType,
        StructField,
        StructType,
    )

    types = {"bigint": LongType(), "int": IntegerType(), "binary": BinaryType(),
             "string": StringType()}
    return StructType([StructField(n, types[t])
                       for n, t in (p.split(" ") for p in ddl.split(", "))])


def _read_all(reader: Any) -> list[SimpleNamespace]:
    import pyarrow as pa

    batches = [b for part in reader.partitions() for b in reader.read(part)]
    return _rows(pa.Table.from_batches(batches).to_pylist() if batches else [])


def _changes(reader: Any) -> list[SimpleNamespace]:
    return sorted(_read_all(reader), key=lambda r: (r.checkpoint, r.partition, r.seq))


# The readers below are made and used as Spark's pushdown step makes and uses them, without
# Spark: made outside Spark's plan step, they take filters.


@pytest.mark.parametrize("table", ["heap", "lmdb"])
def test_dstls_own_states_are_read_only_with_the_option(
        job: tuple[str, dict[Any, Any], dict[Any, Any]], table: str) -> None:
    from pyspark.sql.datasource import EqualTo

    root, model, timers = job
    for internal, everything, own in (("false", model, {}), ("true", {**model, **timers}, timers)):
        options = {"path": root, "operator": "job", "internalStates": internal, "table": table}
        assert state_of(_read_all(DstlStateDataSource(options).reader(_schema(STATE_DDL)))
                        ) == everything, internal
        # a filter naming the internal state, pushed down
        reader = DstlStateDataSource(options).reader(_schema(STATE_DDL))
        assert list(reader.pushFilters([EqualTo(("state",), TIMERS_STATE)])) == []
        assert state_of(_read_all(reader)) == own, internal
        # a schema without the state column: the rows are told by it all the same
        narrow = DstlStateDataSource(options).reader(_schema("key string, value string"))
        rows = [(r.key, r.value) for r in _read_all(narrow)]
        assert sorted(map(repr, rows)) == sorted(
            repr((r.key, r.value)) for r in _read_all(
                DstlStateDataSource(options).reader(_schema(STATE_DDL)))), internal


def test_the_change_feed_leaves_dstls_own_states_out_without_the_option(
        job: tuple[str, dict[Any, Any], dict[Any, Any]]) -> None:
    from pyspark.sql.datasource import EqualTo

    root, model, timers = job
    for internal, everything, own in (("false", model, {}), ("true", {**model, **timers}, timers)):
        options = {"path": root, "internalStates": internal}
        assert replay(_changes(DstlChangesDataSource(options).reader(_schema(CHANGE_DDL)))
                      ) == everything, internal
        reader = DstlChangesDataSource(options).reader(_schema(CHANGE_DDL))
        assert list(reader.pushFilters([EqualTo(("state",), TIMERS_STATE)])) == []
        assert replay(_changes(reader)) == own, internal
