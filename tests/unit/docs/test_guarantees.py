"""Every test docs/guarantees.md names as proof exists: its file, and the test function or
class where one is named."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_every_named_test_exists() -> None:
    text = (ROOT / "docs" / "guarantees.md").read_text()
    missing = []
    last_file = None
    for ref in re.findall(r"`((?:[a-z]+/)+test_\w+\.py|::\w+)(?:::(\w+))?`", text):
        path, name = ref
        if path.startswith("::"):
            path, name = last_file or "", path[2:]
        path = path.removeprefix("tests/")
        last_file = path
        file = ROOT / "tests" / path
        if not file.exists():
            missing.append(path)
        elif name and not re.search(rf"^\s*(def|class) {name}\b|^{name} = ", file.read_text(), re.M):
            missing.append(f"{path}::{name}")
    assert not missing, f"docs/guarantees.md names tests that do not exist: {missing}"
    assert last_file is not None
