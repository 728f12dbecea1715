"""DSTL against Spark's own state store in one chart, drawn from stored runs (no measuring).

Each row is one figure of one bench, DSTL's median over the peer's median measured in the same
run; the rows of a bench come from its newest full run in ``bench/results`` that holds them all. Writes
``docs/img/dstl_vs_spark.png`` and the README's table of the same figures (between its
``<!-- chart -->`` markers), each with the results file it comes from and the command that
measured it.

Run: ``python bench/chart.py`` (after any of the benches below).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._common import RESULTS, ROOT

README = ROOT / "README.md"
IMG = ROOT / "docs" / "img" / "dstl_vs_spark.png"
START, END = "<!-- chart -->", "<!-- /chart -->"


@dataclass(frozen=True)
class Row:
    """One chart row: where its two figures live in a bench's results file."""

    label: str
    bench: str
    dstl: tuple[str, ...]   # path to DSTL's {"median", "min", "max"} in ``figures``
    spark: tuple[str, ...]  # path to the peer's, same run
    peer: str
    # the bench's own ratio of paired repeats, where it reports one (else median / median)
    ratio: tuple[str, ...] | None = None


ROWS = [
    Row("steady batch: sessions with event-time timers", "tws",
        ("summary", "dstl", "trigger_s"), ("summary", "spark", "trigger_s"),
        "transformWithStateInPandas"),
    Row("steady batch: count per key", "spark_job",
        ("summary", "dstl+agent", "trigger_s"), ("summary", "spark", "trigger_s"),
        "RocksDB state store"),
    Row("restart, 1 M keys: first batch after op.warm_up", "restart",
        ("figures", "1000000", "dstl-lmdb-snap-warm-daemon", "trigger_s"),
        ("figures", "1000000", "spark-snap", "trigger_s"), "RocksDB state store",
        ("figures", "1000000", "dstl-lmdb-snap-warm-daemon", "ratio")),
    Row("restart, 1 M keys: first batch, no warm-up", "restart",
        ("figures", "1000000", "dstl-lmdb-snap-daemon", "trigger_s"),
        ("figures", "1000000", "spark-snap", "trigger_s"), "RocksDB state store",
        ("figures", "1000000", "dstl-lmdb-snap-daemon", "ratio")),
    Row("steady batch, 2-executor cluster, 500 keys per batch", "in_query",
        ("figures", "steady", "dstl", "trigger_s"), ("figures", "steady", "tws", "trigger_s"),
        "transformWithStateInPandas", ("figures", "steady", "dstl", "ratio_to_tws")),
    Row("steady batch, 2-executor cluster, 10,000 keys per batch", "in_query",
        ("figures", "steady_large", "dstl", "trigger_s"),
        ("figures", "steady_large", "tws", "trigger_s"), "transformWithStateInPandas",
        ("figures", "steady_large", "dstl", "ratio_to_tws")),
    Row("steady batch, 2-executor cluster, 500 keys per batch", "in_query",
        ("figures", "steady", "dstl", "trigger_s"), ("figures", "steady", "count", "trigger_s"),
        "Spark's JVM-only count on RocksDB"),
    Row("restart at 1 M keys, from the query's start", "in_query",
        ("figures", "restart", "dstl", "start_to_first_s"),
        ("figures", "restart", "tws", "start_to_first_s"), "transformWithStateInPandas",
        ("figures", "restart", "dstl", "ratio_to_tws")),
]


def _get(d: Any, path: tuple[str, ...]) -> dict[str, float] | None:
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d if isinstance(d, dict) and "median" in d else None


def find(rows: list[Row]) -> tuple[Path, dict[str, Any]]:
    """The newest full run of the rows' bench that holds every one of their figures (the rows
    of one bench come from one run).

    Raises:
        FileNotFoundError: no stored run holds them.
    """
    bench = rows[0].bench
    for path in sorted(RESULTS.glob(f"{bench}-2*.json"), reverse=True):
        doc = json.loads(path.read_text())
        if all(_get(doc["figures"], r.dstl) and _get(doc["figures"], r.spark) for r in rows):
            return path, doc
    raise FileNotFoundError(f"no run in {RESULTS} holds {[r.label for r in rows]}: "
                            f"run bench/{bench}.py")


def _cell(s: dict[str, float]) -> str:
    return f"{s['median']:.2f} s ({s['min']:.2f}..{s['max']:.2f})"


def main() -> int:
    runs = {bench: find([r for r in ROWS if r.bench == bench]) for bench in {r.bench for r in ROWS}}
    found = []
    for row in ROWS:
        path, doc = runs[row.bench]
        a, b = _get(doc["figures"], row.dstl), _get(doc["figures"], row.spark)
        assert a and b  # find() checked
        paired = _get(doc["figures"], row.ratio) if row.ratio else None
        r = paired or {"median": a["median"] / b["median"]}
        found.append((row, path, doc, a, b, r))
    lines = ["| figure (Spark's peer) | DSTL | Spark | DSTL / Spark (of paired repeats where "
             "the bench pairs them) | run |",
             "|---|---|---|---|---|"]
    for row, path, doc, a, b, r in found:
        spread = f" ({r['min']:.2f}..{r['max']:.2f})" if "min" in r else ""
        lines.append(f"| {row.label} ({row.peer}) | {_cell(a)} | {_cell(b)} | "
                     f"**{r['median']:.2f}x**{spread} | "
                     f"[{path.name}](bench/results/{path.name}): `{doc['command']}` |")
    table = "\n".join(lines)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.2))
    ratios = [r["median"] for *_, r in found]
    labels = [row.label for row, *_ in found]
    ys = list(range(len(found)))[::-1]
    ax.barh(ys, ratios, color=["#2b7bba" if r <= 1 else "#d95f02" for r in ratios])
    ax.axvline(1.0, color="black", linewidth=1)
    for y, ratio in zip(ys, ratios):
        ax.text(ratio + 0.03, y, f"{ratio:.2f}x", va="center", fontsize=9)
    ax.set_yticks(ys, labels, fontsize=9)
    ax.set_xlabel("DSTL time / Spark time, same run (median; < 1 = DSTL faster)")
    ax.set_xlim(0, max(2.2, max(ratios) + 0.3))
    fig.tight_layout()
    IMG.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(IMG, dpi=110)
    plt.close(fig)

    text = README.read_text()
    if START not in text or END not in text:
        print(table)
        raise SystemExit(f"README.md has no {START} ... {END} markers for the table")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    README.write_text(head + START + "\n" + table + "\n" + END + tail)
    print(table)
    print(f"wrote {IMG} and README.md's table")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
