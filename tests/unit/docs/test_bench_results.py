"""docs/benchmarks.md holds one section per bench, each replaced by the bench's next run, and
bench/results names every run by bench, date and commit (bench/_common.py ``write_results``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench import _common

ROOT = Path(__file__).resolve().parents[3]
# Benches that write their results file only, no docs section (their call passes no_doc=True).
NO_SECTION = {"profile_restore"}
# References known to be stale (none): the check fails once such a page is fixed, so an entry
# here is dropped with the fix.
STALE: set[str] = set()
RESULT_NAME = re.compile(r"^(?P<bench>[a-z_]+(-[a-z]+)?)(-quick)?-\d{8}T\d{6}Z-([0-9a-f]{7,}|nocommit)\.json$")


def _section_names_written_by_scripts() -> set[str]:
    """Every first argument of ``write_results(...)``, ``publish(...)`` or
    ``render_stored(...)`` in bench/*.py (literal or a NAME constant)."""
    names = set()
    for script in (ROOT / "bench").glob("*.py"):
        text = script.read_text()
        consts = dict(re.findall(r'^([A-Z_]+) = "([a-z_-]+)"', text, re.M))
        for arg in re.findall(r"(?:write_results|publish|render_stored)\(\s*([^,\s]+)", text):
            if arg.startswith('"'):
                names.add(arg.strip('"'))
            elif arg in consts:
                names.add(consts[arg])
    names.discard("name")  # write_results's own definition
    for name in NO_SECTION:
        assert "no_doc=True" in (ROOT / "bench" / f"{name}.py").read_text(), name
    return names - NO_SECTION


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **kw: object) -> Path:
    monkeypatch.setattr(_common, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(_common, "DOC", tmp_path / "benchmarks.md")
    return _common.write_results("demo_bench", {"x": 1}, "| a |\n|---|\n| 1 |", quick=False,
                                 command="python bench/demo_bench.py", **kw)  # type: ignore[arg-type]


def test_a_second_run_replaces_the_section_and_a_tag_names_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "benchmarks.md").write_text("# Benchmarks\n\n## Demo\n\nGoal: kept.\n")
    first = _run(tmp_path, monkeypatch, machine={**_common.machine_info(),
                                                 "time": "2026-01-01T00:00:00Z"})
    second = _run(tmp_path, monkeypatch, tag="before")
    doc = (tmp_path / "benchmarks.md").read_text()
    assert doc.count("<!-- bench:demo_bench -->") == 1, doc
    assert "## `bench/demo_bench.py`\n\n**Goal:**" in doc  # a new section gets a title
    assert doc.count("<!-- /bench:demo_bench -->") == 1
    assert "Goal: kept." in doc  # the hand-written text around the markers stays
    assert "before" not in doc and "--tag" not in doc
    assert first != second and first.exists() and second.exists()
    for p in (first, second):
        assert RESULT_NAME.match(p.name), p.name
        assert "before" not in p.name
    assert json.loads(second.read_text())["label"] == "before"
    assert _common.latest_result("demo_bench") == second


def test_a_published_run_and_a_render_of_its_file_write_the_same_section(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_common, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(_common, "DOC", tmp_path / "benchmarks.md")

    def render(figures: dict[str, object]) -> str:
        return f"| x |\n|---|\n| {figures['x']} |"

    out = _common.publish("demo_bench", {"x": 7}, render, quick=False,
                          command="python bench/demo_bench.py")
    first = (tmp_path / "benchmarks.md").read_text()
    stored = out.read_bytes()
    assert "| 7 |" in first
    assert f"](../bench/results/{out.name})" in first  # the section links its file
    (tmp_path / "benchmarks.md").write_text(first.replace("| 7 |", "| stale |"))
    assert _common.render_stored("demo_bench", out, render) == 0
    assert (tmp_path / "benchmarks.md").read_text() == first
    assert out.read_bytes() == stored  # a render rewrites the section only


def test_a_doc_with_a_duplicated_section_is_refused() -> None:
    text = "<!-- bench:x -->a<!-- /bench:x -->\n<!-- bench:x -->b<!-- /bench:x -->\n"
    with pytest.raises(ValueError, match="keep one"):
        _common.replace_section(text, "x", "<!-- bench:x -->c<!-- /bench:x -->")


def test_benchmarks_md_has_one_section_per_bench_and_each_has_its_writer() -> None:
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    sections = re.findall(r"<!-- bench:([^ ]+) -->", doc)
    assert len(sections) == len(set(sections)), sorted(sections)
    written = _section_names_written_by_scripts()
    # a new bench adds its section at its first run; a section no script writes is stale
    assert set(sections) <= written, f"sections no script writes: {sorted(set(sections) - written)}"
    for name in sections:
        start = doc.index(f"<!-- bench:{name} -->")
        before = doc[:start].rsplit("## ", 1)[-1]
        assert "**Goal:**" in before and "**Latest:**" in before, f"section {name}: goal and ratio"


def test_every_results_file_is_named_by_bench_date_and_commit() -> None:
    bad = [p.name for p in (ROOT / "bench" / "results").iterdir()
           if not RESULT_NAME.match(p.name)]
    assert not bad, f"rename to <bench>[-quick]-<YYYYMMDDTHHMMSSZ>-<commit>.json: {bad}"


def test_every_results_file_and_image_a_doc_names_exists() -> None:
    texts = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    missing = []
    for path in texts:
        text = path.read_text()
        for ref in re.findall(r"bench/results/[A-Za-z0-9_.-]+\.json", text):
            if not (ROOT / ref).exists():
                missing.append(f"{path.name}: {ref}")
        for ref in re.findall(r"\]\(((?:docs/)?img/[A-Za-z0-9_.-]+\.png)\)", text):
            base = ROOT if ref.startswith("docs/") else path.parent
            if not (base / ref).exists():
                missing.append(f"{path.name}: {ref}")
    assert set(missing) == STALE, (
        f"missing: {sorted(set(missing) - STALE)}; fixed, drop from STALE: {sorted(STALE - set(missing))}")
