"""Every relative link of README.md and docs/*.md reaches a file, and a link to a section of a
Markdown page reaches a heading of that page (GitHub's anchor rule), so a renamed heading or a
moved page cannot leave a reader at a dead link."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets ``-1``, ``-2``, ..."""
    counts: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#+ (.*)$", FENCE.sub("", page.read_text("utf-8")), re.M):
        base = anchor(heading)
        n = counts.get(base, 0)
        counts[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def test_the_anchor_rule() -> None:
    assert anchor("Spark conf: `spark.dstl.<field>` and `spark.dstl.backend.<field>`") == (
        "spark-conf-sparkdstlfield-and-sparkdstlbackendfield")
    assert anchor("G2 — prefix consistency per writer") == "g2--prefix-consistency-per-writer"


def test_every_relative_link_resolves() -> None:
    dead = []
    for page in PAGES:
        for target in LINK.findall(FENCE.sub("", page.read_text("utf-8"))):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked here
            path, _, fragment = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                dead.append(f"{page.name}: {target} (no such file)")
            elif fragment and file.suffix == ".md" and fragment not in anchors(file):
                dead.append(f"{page.name}: {target} (no heading with that anchor)")
    assert not dead, "dead links; fix the link or the heading:\n" + "\n".join(dead)
