"""Shared plumbing for the bench scripts: repeats, medians with spread, machine info, output.

Every script measures ``repeats`` times (>= 5), reports median and spread (min..max), writes
``bench/results/<name>[-quick]-<date>-<commit>.json`` (figures + machine info + git sha; one
file per run, never overwritten) and replaces its one section of ``docs/benchmarks.md`` between
``<!-- bench:<name> -->`` markers, so scripts never overwrite each other's tables and a bench
has one section: its latest run. ``latest_result(name)`` finds the newest results file of a
bench.

A section is short: the measured-at line (reproduce command, link to the results file), a
headline table (figure, DSTL, the peer measured in the same run, ratio, goal), a plot where the
bench draws one and the few lines of method a reader needs; the detail tables stay in the
results file. A script's renderer reads only the stored figures (``publish`` renders from the
file it has just written), so ``--render RESULTS.json`` (``add_render``, ``render_stored``)
rebuilds the section of any stored run without measuring.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "benchmarks.md"

# The processes a bench starts (Spark's JVM and through it the Python daemon, workers and the
# executor agent) run DSTL as an installed package runs: with its bytecode cached (pip compiles
# it at install). A shell that sets PYTHONDONTWRITEBYTECODE, as some sandboxes do, would make
# each of them compile DSTL from source at start, 0.1 s of CPU per process on this machine
# class (`import dstl.spark.task, dstl.spark.agent.server`: 0.26 s against 0.15 s); the results
# record whether it was set (``machine.bytecode_env_dropped``).
BYTECODE_ENV_DROPPED = os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="small sizes, for CI smoke runs")
    p.add_argument("--repeats", type=int, default=5, help="repeats per figure (>= 5 for reports)")
    p.add_argument("--no-doc", action="store_true", help="do not touch docs/benchmarks.md")
    p.add_argument("--tag", default=None,
                   help="a label recorded in the results file (e.g. 'before' for a baseline; "
                        "with --no-doc the benchmarks.md section keeps the previous run); "
                        "it names neither the file nor the section")
    return p


def machine_info() -> dict[str, Any]:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, check=False).stdout.strip()
    except OSError:
        sha = "?"
    try:
        load = os.getloadavg()
    except OSError:
        load = (0.0, 0.0, 0.0)
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = "unknown (no /proc/cpuinfo)"
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "git_sha": sha,
        "bytecode_env_dropped": BYTECODE_ENV_DROPPED,
        "loadavg_at_start": load,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def summary(samples: Sequence[float]) -> dict[str, float]:
    """Median and spread of repeated measurements."""
    xs = sorted(samples)
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "n": len(xs)}


def repeat(fn: Callable[[], float], repeats: int) -> dict[str, float]:
    """Run ``fn`` (which returns one measurement) ``repeats`` times; summarise."""
    return summary([fn() for _ in range(repeats)])


def fmt(s: dict[str, float], unit: str = "", scale: float = 1.0, digits: int = 2) -> str:
    """``median (min..max) unit`` for a table cell."""
    m, lo, hi = s["median"] * scale, s["min"] * scale, s["max"] * scale
    return f"{m:,.{digits}f} ({lo:,.{digits}f}..{hi:,.{digits}f}){(' ' + unit) if unit else ''}"


def percentile(xs: Sequence[float], p: float) -> float:
    ys = sorted(xs)
    if not ys:
        return float("nan")
    k = min(len(ys) - 1, max(0, round(p / 100.0 * (len(ys) - 1))))
    return ys[k]


class LoadSampler:
    """The 1-minute load average, sampled on a daemon thread while a bench runs: the machine is
    shared, and a figure measured under load says so next to it."""

    def __init__(self, interval_s: float = 5.0) -> None:
        self.samples = [os.getloadavg()[0]]
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> dict[str, Any]:
        """Stop sampling; the summary (also kept as ``self.summary``)."""
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])
        xs = self.samples
        cores = os.cpu_count() or 1
        self.summary: dict[str, Any] = {
            "start": xs[0], "end": xs[-1], "median": statistics.median(xs), "max": max(xs),
            "samples": len(xs), "cores": cores,
            # a bench keeps about one core busy per core here; much more means a neighbour
            "noisy": max(xs) > cores + 1}
        return self.summary

    def note(self) -> str:
        s = self.summary
        return (f"Load average (1 min) during the run: median {s['median']:.1f}, max "
                f"{s['max']:.1f} (start {s['start']:.1f}, end {s['end']:.1f}) on {s['cores']} "
                "cores" + (" — **noisy: other jobs shared the machine, absolute figures are "
                           "pessimistic; same-run ratios and baselines hold better**"
                           if s["noisy"] else " — quiet"))


def other_jvms() -> int:
    """Java processes that are not descendants of this one (another engineer's Spark job)."""
    me, n = os.getpid(), 0
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if (d / "comm").read_text().strip() != "java":
                continue
            pid = int(d.name)
            while pid > 1 and pid != me:
                pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        n += pid != me
    return n


def tree_cpu_s() -> float:
    """CPU seconds (user + system, reaped children's included) used so far by this process and
    every live descendant (a Spark bench: the driver JVM, Spark's Python workers, DSTL's
    executor agents): the cost of the work done between two calls, which other jobs on a shared
    machine inflate far less than they inflate wall time."""
    me, tick = os.getpid(), os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
            parent[int(d.name)] = int(f[1])
            ticks[int(d.name)] = sum(int(x) for x in f[11:15])  # utime stime cutime cstime
        except (OSError, ValueError, IndexError):
            continue  # a process that ended meanwhile
    total = 0
    for pid, t in ticks.items():
        p = pid
        while p > 1 and p != me:
            p = parent.get(p, 0)
        total += t if p == me else 0
    return total / tick


def results_path(name: str, info: dict[str, Any], *, quick: bool) -> Path:
    """``bench/results/<name>[-quick]-<YYYYMMDDTHHMMSSZ>-<commit>.json`` for a run whose machine
    info is ``info``: named by bench, date and commit, so runs never overwrite each other and
    lexical order within a bench is time order."""
    stamp = str(info.get("time", "")).replace("-", "").replace(":", "") or "undated"
    sha = str(info.get("git_sha") or "").split()[0:1]
    commit = sha[0] if sha and all(c in "0123456789abcdef" for c in sha[0]) else "nocommit"
    return RESULTS / f"{name}{'-quick' if quick else ''}-{stamp}-{commit}.json"


def latest_result(name: str, *, quick: bool = False) -> Path:
    """The newest results file of bench ``name`` (full runs unless ``quick``).

    Raises:
        FileNotFoundError: no run of that bench is stored.
    """
    prefix = f"{name}{'-quick' if quick else ''}-"
    runs = sorted(p for p in RESULTS.glob(f"{prefix}2*.json")
                  if p.name[len(prefix):len(prefix) + 1].isdigit())
    if not runs:
        raise FileNotFoundError(f"no results of bench {name!r} in {RESULTS} "
                                f"(run `python bench/{name.split('-')[0]}.py` first)")
    return runs[-1]


def replace_section(text: str, name: str, section: str) -> str:
    """``text`` with the section of bench ``name`` (markers included) replaced by ``section``,
    or ``section`` appended under a title of its own when the bench has none yet (its goal and
    latest ratio are then written by hand above it). Exactly one section per bench."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    if text.count(start) > 1:
        raise ValueError(f"docs/benchmarks.md holds {text.count(start)} sections {start}; "
                         "keep one")
    if start in text and end in text:
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        return head + section + tail
    script = name.split("-")[0]
    return (text.rstrip() + f"\n\n## `bench/{script}.py`\n\n**Goal:** as the script's docstring "
            "states it. **Latest:** the run below.\n\n" + section + "\n")


def load_brief(load: dict[str, Any] | None) -> str:
    """The load of a run in a few words (``LoadSampler.stop()``'s summary), for a method line."""
    if not load:
        return "load not recorded"
    return (f"load {load['median']:.1f} (max {load['max']:.1f}) on {load['cores']} cores: "
            + ("noisy" if load.get("noisy") else "quiet"))


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def section(name: str, markdown: str, record: dict[str, Any], results_file: Path) -> str:
    """The docs section of a run: measured-at line, ``markdown``, link to its results file."""
    info = record["machine"]
    return (f"<!-- bench:{name} -->\n"
            f"_Measured {info['time']} at git {info['git_sha']} on {info['cores']} cores "
            f"({info['cpu']}){', quick mode' if record['quick'] else ''}; reproduce: "
            f"`{record['command']}`; [all figures](../bench/results/{results_file.name})._\n\n"
            f"{markdown.strip()}\n<!-- /bench:{name} -->")


def write_section(name: str, markdown: str, record: dict[str, Any], results_file: Path) -> None:
    """Replace the section of bench ``name`` in docs/benchmarks.md."""
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    DOC.write_text(replace_section(text, name, section(name, markdown, record, results_file)))


def add_render(p: argparse.ArgumentParser) -> None:
    """``--render RESULTS.json``: rebuild the docs section of a stored run, measuring nothing."""
    p.add_argument("--render", default=None, metavar="RESULTS.json",
                   help="rebuild the docs/benchmarks.md section from a stored results file "
                        "(e.g. the newest of bench/results/), measuring nothing")


def render_stored(name: str, path: Path, render: Callable[[dict[str, Any]], str]) -> int:
    """Rebuild bench ``name``'s section from the stored results file ``path`` (not rewritten):
    ``render`` maps the file's ``figures`` to the section's Markdown."""
    record = json.loads(path.read_text())
    md = render(record["figures"])
    write_section(name, md, record, path)
    print(md)
    return 0


def publish(name: str, figures: dict[str, Any], render: Callable[[dict[str, Any]], str], *,
            quick: bool, command: str, no_doc: bool = False, tag: str | None = None,
            machine: dict[str, Any] | None = None) -> Path:
    """``write_results`` with the section rendered from the file just written, so a run and a
    later ``--render`` of its file produce the same section."""
    out = write_results(name, figures, "", quick=quick, command=command, no_doc=True, tag=tag,
                        machine=machine)
    if not no_doc:
        render_stored(name, out, render)
    return out


def write_results(name: str, figures: dict[str, Any], markdown: str, *, quick: bool,
                  command: str, no_doc: bool = False, tag: str | None = None,
                  machine: dict[str, Any] | None = None) -> Path:
    """Write this run's results file and replace the bench's one section of
    docs/benchmarks.md (unless ``no_doc``).

    Args:
        name: the bench's section name (``<!-- bench:<name> -->``).
        tag: a label kept in the results file only.
        machine: the machine info of a run being re-rendered from its JSON (default: now).
    """
    RESULTS.mkdir(parents=True, exist_ok=True)
    info = machine or machine_info()
    out = results_path(name, info, quick=quick)
    record: dict[str, Any] = {"name": name, "quick": quick, "command": command, "machine": info,
                              "figures": figures}
    if tag:
        record["label"] = tag
    out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    if not no_doc:
        write_section(name, markdown, record, out)
    print(f"wrote {out}")
    return out
