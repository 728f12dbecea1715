"""The README's example runs as written: its code block (between the ``<!-- example -->``
markers), with only its ``/tmp/dstl-example`` directory moved under the test's own, on the
shared local session; the Parquet file sink then holds every key's running count of each batch,
and the state survives the query (a second query over one more file continues the counts)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from spark_support import spark  # noqa: F401

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]

README = Path(__file__).resolve().parents[3] / "README.md"
EXAMPLE_DIR = "/tmp/dstl-example"


def _example() -> str:
    text = README.read_text()
    block = re.search(r"<!-- example -->\n```python\n(.*?)```\n<!-- /example -->", text, re.S)
    assert block, "README.md: the example's code block between <!-- example --> markers"
    return block.group(1)


def test_the_example_is_about_twenty_lines() -> None:
    lines = [ln for ln in _example().splitlines() if ln.strip()]
    assert len(lines) <= 20, f"README example: {len(lines)} lines, keep it to 20"


def _run_example(spark: Any, work: Path, files: list[list[str]]) -> Any:  # noqa: F811
    (work / "in").mkdir(parents=True, exist_ok=True)
    for i, keys in enumerate(files):
        path = work / "in" / f"f{i:03d}.json"
        if not path.exists():
            path.write_text("".join(json.dumps({"key": k}) + "\n" for k in keys))
    code = _example().replace(EXAMPLE_DIR, str(work))
    assert EXAMPLE_DIR not in code
    namespace: dict[str, Any] = {"__name__": "readme_example"}
    exec(compile(code, str(README), "exec"), namespace)  # the README's own code
    query, op = namespace["query"], namespace["op"]
    try:
        query.processAllAvailable()
    finally:
        query.stop()
        op.close()
    return spark.read.parquet(str(work / "out"))


def test_the_readme_example_counts_and_keeps_its_state(spark: Any, tmp_path: Path) -> None:  # noqa: F811
    batches = [["a", "b", "a"], ["b", "c"]]
    out = _run_example(spark, tmp_path, batches)
    rows = Counter((r["key"], r["count"]) for r in out.collect())
    # one file per batch or both in one: the last count of each key is the same either way
    final = {k: max(c for kk, c in rows if kk == k) for k, _ in rows}
    assert final == {"a": 2, "b": 2, "c": 1}
    # a new query (a restart) over one more file: counts continue from the stored state
    out = _run_example(spark, tmp_path, [*batches, ["a", "c", "d"]])
    rows = Counter((r["key"], r["count"]) for r in out.collect())
    assert {("a", 3), ("c", 2), ("d", 1)} <= set(rows), sorted(rows)
    assert max(c for k, c in rows if k == "b") == 2, sorted(rows)
