"""A soak (capability 6): a streaming query runs ``SOAK_BATCHES`` batches (900 in
``make test-deep``; one input file per second, materialization every 5 s) and what it holds must
stay flat: the slope of a straight line fitted over the second half of the samples
(``soak_scenario.py``) is asserted against these bounds, per 100 batches:

=====================  ====================  ==============================================
figure                 bound / 100 batches   why
=====================  ====================  ==============================================
driver RSS (Python)    1 MiB                 the unbounded records grew ~5 MB / 100 batches before
                                             ``batch_stats`` was bounded; 1 MiB is 4.5 MiB
                                             over the half, above allocator noise (the
                                             bounded records fill in the first 100 batches:
                                             ~1 MiB / 100 then, so a short run cannot tell)
store objects          1 object              the store holds the retained checkpoints only;
                                             a leak of one object per batch is 100
store bytes            2 % of the mean, at   the key space is fixed (500 keys): state and
                       least 1 KiB           snapshot sizes reach a plateau in minutes
local dirs (both)      2 % of the mean, at   LMDB pages, batch-id files, the agent's cache;
                       least 1 KiB           a directory of a few KB moves by whole files
                                             (SPARK_LOCAL_DIRS without the log: ~2.5 KB)
agent log (all files)  bounded, not sloped   it rotates (64 KiB x 3 files here): a sawtooth;
                                             its total stays <= 3 x 64 KiB + a line, and it
                                             did rotate
processes              0.5                   one JVM, its Python workers, one agent: a
                                             process left per batch would be 100
=====================  ====================  ==============================================

The driver JVM's RSS and heap are reported, not asserted: they are Spark's (the file source's
list of seen files grows with the input by design). The run ends with the sink's counts equal
to a model.

Only with ``DSTL_DEEP=1`` (``make test-deep``): it takes ``SOAK_BATCHES`` seconds and more.
``DSTL_SOAK_BATCHES=60 DSTL_DEEP=1 pytest -s tests/integration/spark/test_soak.py`` is a short run
(the slopes of so few samples are only indicative).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark"),
              pytest.mark.skipif(not os.environ.get("DSTL_DEEP"),
                                 reason="DSTL_DEEP=1 (make test-deep): the soak takes 15+ min")]

HERE = Path(__file__).resolve().parent
SOAK_BATCHES = int(os.environ.get("DSTL_SOAK_BATCHES", "900"))
MIB = 1024 * 1024


def slope_per_100(samples: list[dict[str, Any]], field: str) -> float:
    """Least-squares slope of ``field`` against the batch id, per 100 batches, over the second
    half of the samples."""
    half = samples[len(samples) // 2:]
    xs = [s["batch"] for s in half]
    ys = [float(s[field]) for s in half]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return 0.0
    return 100 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var


def second_half_mean(samples: list[dict[str, Any]], field: str) -> float:
    half = samples[len(samples) // 2:]
    return sum(float(s[field]) for s in half) / len(half)


def summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures the test asserts and reports."""
    fields = ("driver_rss", "jvm_rss", "jvm_heap_used", "store_objects", "store_bytes",
              "local_bytes", "spark_local_bytes", "agent_log_bytes", "processes",
              "batch_seconds", "memory_used_bytes")
    return {f: {"slope_per_100": slope_per_100(samples, f),
                "mean_2nd_half": second_half_mean(samples, f),
                "first": samples[0][f], "last": samples[-1][f],
                "max": max(s[f] for s in samples)} for f in fields}


@pytest.mark.timeout(SOAK_BATCHES * 6 + 900)  # not the suite's 300 s per test
def test_a_long_run_stays_flat(tmp_path: Path) -> None:
    started = time.monotonic()
    log = tmp_path / "soak.log"
    with open(log, "wb") as out:
        proc = subprocess.run([sys.executable, str(HERE / "soak_scenario.py"), str(tmp_path),
                               str(SOAK_BATCHES)], stdout=out, stderr=subprocess.STDOUT,
                              timeout=SOAK_BATCHES * 6 + 600, check=False)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, text[-6000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["error"] is None, result["error"]
    assert result["latest"] == result["expected"]
    samples = [json.loads(line) for line in
               (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) >= 6, samples
    figures = summary(samples)
    report = {"batches": SOAK_BATCHES, "samples": len(samples),
              "seconds": time.monotonic() - started, "figures": figures}
    print(json.dumps(report, indent=1))  # the figures of the run (pytest -s)
    (tmp_path / "summary.json").write_text(json.dumps(report))

    def slope(f: str) -> float:
        return float(figures[f]["slope_per_100"])

    assert slope("driver_rss") <= 1 * MIB, figures["driver_rss"]
    assert slope("store_objects") <= 1.0, figures["store_objects"]
    for f in ("store_bytes", "local_bytes", "spark_local_bytes"):
        bound = max(0.02 * figures[f]["mean_2nd_half"], 1024)
        assert slope(f) <= bound, (f, figures[f])
    assert slope("processes") <= 0.5, figures["processes"]
    # the agent's log rotated and its files stay within their bound
    from soak_scenario import LOG_BACKUPS, LOG_MAX_BYTES

    if SOAK_BATCHES >= 600:  # ~40 KB per 100 batches: a short run does not reach 64 KiB
        assert max(s["agent_log_files"] for s in samples) == LOG_BACKUPS + 1, samples[-1]
    assert figures["agent_log_bytes"]["max"] <= (LOG_BACKUPS + 1) * LOG_MAX_BYTES + 4096
