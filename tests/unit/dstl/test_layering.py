"""The package layering is a checked rule.

- import-linter (``[tool.importlinter]`` in pyproject.toml, also run by ``make lint``): the layers
  dstl <- materializer <- restore, the log core never importing the layers above it,
  dstl.checkpoint never importing the entry points (dstl.spark, dstl.cli, dstl.reader),
  materializer or restore, materializer and restore never importing the entry points or
  dstl.checkpoint, and dstl.spark never importing dstl.cli; all five contracts are still
  configured (none can be dropped quietly);
- the log-core contract names every log-core module (a new core module cannot escape it);
- no import cycle between modules beyond the known ones (``KNOWN_CYCLES``, empty). The
  import graph is grimp's (import-linter's own), which sees imports inside functions and under
  ``TYPE_CHECKING`` too;
- the package map of docs/architecture.md has a row for every module of the tree, and none for a
  module that is gone (a newcomer finds every component in one hop).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from collections import deque
from itertools import pairwise
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("dstl", "materializer", "restore")
#: Not log core: the layers above it, and the ``python -m dstl`` entry point.
NOT_CORE = ("dstl.spark", "dstl.cli", "dstl.reader", "dstl.checkpoint", "dstl.__main__")
LOG_CORE_CONTRACT = "the log core never imports"
#: Every contract of pyproject.toml, by the start of its name.
CONTRACTS = (
    "dstl <- materializer <- restore",
    LOG_CORE_CONTRACT,
    "dstl.checkpoint never imports dstl.spark, dstl.cli, dstl.reader, materializer or restore",
    "materializer and restore never import dstl.spark, dstl.cli, dstl.reader or dstl.checkpoint",
    "dstl.spark never imports dstl.cli",
)

#: Import cycles that exist today, each as the set of modules of one strongly connected
#: component (none today); a new cycle, or a known one that grows,
#: fails the test.
KNOWN_CYCLES: list[frozenset[str]] = []


def test_import_layers_hold() -> None:
    exe = Path(sys.executable).parent / "lint-imports"
    out = subprocess.run([str(exe)], cwd=ROOT, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in out.stdout, out.stdout


def _contracts() -> list[dict[str, object]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))
    contracts: list[dict[str, object]] = config["tool"]["importlinter"]["contracts"]
    return contracts


def test_every_contract_is_configured() -> None:
    names = [str(c["name"]) for c in _contracts()]
    missing = [p for p in CONTRACTS if not any(n.startswith(p) for n in names)]
    assert not missing, f"import contracts missing from pyproject.toml: {missing}"
    assert len(names) == len(CONTRACTS), f"a contract not listed in CONTRACTS: {names}"


def _graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES, cache_dir=None)


def _is_within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_log_core_contract_names_every_core_module() -> None:
    contracts = [c for c in _contracts() if str(c["name"]).startswith(LOG_CORE_CONTRACT)]
    assert len(contracts) == 1, "the log-core contract is missing from pyproject.toml"
    source_modules = contracts[0]["source_modules"]
    assert isinstance(source_modules, list)
    listed = set(source_modules)
    core = {m for m in _graph().modules
            if _is_within(m, "dstl") and not any(_is_within(m, p) for p in NOT_CORE)}
    assert listed == core, (f"add to the log-core contract: {sorted(core - listed)}; "
                            f"remove from it: {sorted(listed - core)}")


def _strongly_connected(adj: dict[str, set[str]]) -> list[frozenset[str]]:
    """Tarjan's algorithm, iterative; components of more than one module only."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(adj):
        if root in index:
            continue
        work = [(root, iter(sorted(adj[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(adj[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def _cycle_paths(component: frozenset[str], adj: dict[str, set[str]]) -> list[list[str]]:
    """For every import edge inside ``component``, the shortest cycle through it."""
    paths: set[tuple[str, ...]] = set()
    for a in sorted(component):
        for b in sorted(adj[a] & component):
            prev: dict[str, str | None] = {b: None}
            queue = deque([b])
            while queue and a not in prev:
                v = queue.popleft()
                for w in sorted(adj[v] & component):
                    if w not in prev:
                        prev[w] = v
                        queue.append(w)
            back: list[str] = []  # a, ..., b along the BFS tree
            cur: str | None = a
            while cur is not None:
                back.append(cur)
                cur = prev[cur]
            body = [a, *reversed(back[1:])]  # a -> b -> ... -> (back to a)
            start = body.index(min(body))  # rotated, so one cycle is listed once
            paths.add(tuple(body[start:] + body[:start]))
    return [[*p, p[0]] for p in sorted(paths)]


def test_no_import_cycles_beyond_the_known_ones() -> None:
    graph = _graph()
    adj = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    cycles = _strongly_connected(adj)
    report = []
    for component in sorted(cycles, key=sorted):
        report.append(f"cycle between {sorted(component)}:")
        for path in _cycle_paths(component, adj):
            edges = []
            for a, b in pairwise(path):
                lines = sorted(d["line_number"] for d in graph.get_import_details(
                    importer=a, imported=b))
                edges.append(f"{a} -({','.join(map(str, lines))})-> ")
            report.append("  " + "".join(edges) + path[-1])
    print("\n".join(report) or "no import cycles")
    new = [sorted(c) for c in cycles if c not in KNOWN_CYCLES]
    assert not new, ("new import cycle(s) " + str(new) + " (break them; KNOWN_CYCLES is for "
                     "cycles being removed):\n" + "\n".join(report))
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in cycles]
    assert not gone, f"cycle(s) {gone} no longer exist: remove them from KNOWN_CYCLES"


def test_the_architecture_map_lists_every_module() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text("utf-8")
    start, end = doc.index("## Package map"), doc.index("## Dependencies between packages")
    listed = set(re.findall(r"^\| `((?:dstl|materializer|restore)/[\w/]+\.py)`",
                            doc[start:end], re.M))
    tree = {p.relative_to(ROOT).as_posix() for pkg in PACKAGES
            for p in (ROOT / pkg).rglob("*.py")}
    assert listed == tree, ("docs/architecture.md, package map: add a row for "
                            f"{sorted(tree - listed)}; remove the row of {sorted(listed - tree)}")
