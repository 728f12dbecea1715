"""Profile of the restore path: where a restore of N entries spends its time.

Not a benchmark table: it guides the engine work on restore speed (file-level LMDB snapshots,
bulk log replay, heap bulk load). For each table (heap, LMDB) and each phase, on the local store
with the restore cache (as under the Spark agent, minus the socket):

* **snapshot load** — one backend owning all 128 key groups, N keys materialized, empty log;
* **log replay** — the same backend with a 1-key snapshot and N changes in its log (one
  checkpoint per 200,000 changes).

The data is the restart job's (``bench/restart.py``): keys ``k%08d``, one value state holding a
small int (``SafeCodec``). Per (table, phase):

1. a plain restore, timed, with ``gc.callbacks`` timing every cyclic-GC pause (count per
   generation, total, longest) — and the same restore with ``gc.disable()`` for comparison;
2. a restore under cProfile: functions by self time, as % of the total and ns per entry;
3. (``--py-spy``) a restore in a child process sampled by ``py-spy record --native`` (attached
   after the child's imports): frames by self samples, which shows the C work (zstd, LMDB,
   syscalls, the cyclic GC) that cProfile attributes to its Python callers.

Restore times are the fastest of 3 runs (with GC, and with ``gc.disable()``, interleaved).

Run: ``.venv/bin/python bench/profile_restore.py [--quick] [--entries N] [--py-spy]``
(quick: 100 k entries, about 1 min; default 1 M entries, about 5 min on 2 cores). Writes
``bench/results/profile_restore[-quick]-<date>-<commit>.json``.
"""

from __future__ import annotations

import cProfile
import gc
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import LoadSampler, parser, write_results  # noqa: E402
from dstl import ChangelogStorage, KeyGroupRange  # noqa: E402
from dstl.stores import LocalBlobStore  # noqa: E402
from materializer import (  # noqa: E402
    BackendOptions,
    ChangelogKeyedStateBackend,
    ChangelogStateBackendHandle,
    ValueStateDescriptor,
)
from restore import LocalFileCache, RestoreStats, restore_backend  # noqa: E402

MP = 128
OPTS = BackendOptions(materialization_interval_s=None, materialize_log_ratio=None)
DESC = ValueStateDescriptor("count")
CHECKPOINT_EVERY = 200_000
PHASES = ("snapshot", "replay")
TABLES = ("heap", "lmdb")


def build(root: str, phase: str, n: int) -> ChangelogStateBackendHandle:
    """A checkpoint to restore: ``n`` keys materialized (snapshot) or logged (replay)."""
    snap_keys, log_changes = (n, 0) if phase == "snapshot" else (1, n)
    with ChangelogStorage(store=LocalBlobStore(root)) as storage:
        b = ChangelogKeyedStateBackend(storage, "count/p0", KeyGroupRange(0, MP - 1), MP,
                                       options=OPTS)
        st = b.get_state(DESC)
        for i in range(snap_keys):
            b.set_current_key(f"k{i:08d}")
            st.update(1)
        assert b.materialize_now(900) is not None
        h: ChangelogStateBackendHandle | None = None
        cp = 0
        for i in range(log_changes):
            b.set_current_key(f"k{i:08d}")
            st.update(2)
            if (i + 1) % CHECKPOINT_EVERY == 0 or i + 1 == log_changes:
                cp += 1
                h = b.snapshot(cp).result(300)
                b.notify_checkpoint_complete(cp)
        if h is None:
            h = b.snapshot(1).result(300)
            b.notify_checkpoint_complete(1)
        b.close()
    return h


class GcTimer:
    """Cyclic-GC pauses while armed, from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._t = 0.0
        self.armed = False
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict[str, Any]) -> None:
        if not self.armed:
            return
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.pauses.append((int(info["generation"]), time.perf_counter() - self._t))

    def report(self) -> dict[str, Any]:
        per_gen = Counter(g for g, _ in self.pauses)
        return {"collections": {str(g): per_gen.get(g, 0) for g in range(3)},
                "total_s": sum(p for _, p in self.pauses),
                "max_s": max((p for _, p in self.pauses), default=0.0),
                "gen2_s": sum(p for g, p in self.pauses if g == 2)}


def restore_once(root: str, h: ChangelogStateBackendHandle, table: str, *,
                 profile: cProfile.Profile | None = None, gc_timer: GcTimer | None = None,
                 gc_off: bool = False) -> dict[str, Any]:
    """One restore into a fresh storage, cache and local directory."""
    tmp = tempfile.mkdtemp(prefix="dstl-profile-")
    cache = LocalFileCache(os.path.join(tmp, "cache"))
    storage = ChangelogStorage(store=LocalBlobStore(root))
    st = RestoreStats()
    gc.collect()
    was = gc.isenabled()
    if gc_off:
        gc.disable()
    if gc_timer is not None:
        gc_timer.pauses.clear()
        gc_timer.armed = True
    b = None
    try:
        t0 = time.perf_counter()
        if profile is not None:
            profile.enable()
        b = restore_backend([h], storage, KeyGroupRange(0, MP - 1), table=table, cache=cache,
                            options=OPTS, local_directory=os.path.join(tmp, "local"), stats=st)
        if profile is not None:
            profile.disable()
        seconds = time.perf_counter() - t0
    finally:
        if gc_timer is not None:
            gc_timer.armed = False
        if gc_off and was:
            gc.enable()
        if b is not None:
            b.close()
        cache.close()
        storage.close()
        shutil.rmtree(tmp, ignore_errors=True)
    out = {"seconds": seconds, **dict(st)}
    if gc_timer is not None:
        out["gc"] = gc_timer.report()
    return out


def top_functions(prof: cProfile.Profile, entries: int, limit: int = 15) -> dict[str, Any]:
    st = pstats.Stats(prof)
    stats: dict[Any, Any] = st.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in stats.values())
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:limit]
    top = []
    for (file, line, func), (_cc, ncalls, tt, ct, _callers) in rows:
        where = os.path.relpath(file, ROOT) if file.startswith(str(ROOT)) else os.path.basename(
            file)
        top.append({"function": f"{func} ({where}:{line})", "calls": ncalls,
                    "self_s": tt, "cum_s": ct, "share": tt / total if total else 0.0,
                    "ns_per_entry": tt / entries * 1e9 if entries else 0.0})
    return {"total_self_s": total, "top": top}


def py_spy(root: str, handle_json: str, table: str, out_dir: Path) -> dict[str, Any]:
    """One restore in a child process, sampled by ``py-spy record --native`` attached once the
    child has imported everything (so the profile holds the restore alone); top frames."""
    exe = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if exe is None:
        return {"error": "py-spy not installed"}
    hfile = out_dir / f"handle-{table}.json"
    hfile.write_text(handle_json)
    prof = out_dir / f"spy-{table}.json"
    child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child-restore",
                              root, str(hfile), table], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    if child.stdout.readline().strip() != "ready":
        child.kill()
        return {"error": "profiled child did not start"}
    spy = subprocess.Popen([exe, "record", "--native", "-r", "200", "-f", "speedscope", "-o",
                            str(prof), "--pid", str(child.pid)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)  # py-spy gives no signal once attached; it samples within a second
    child.stdin.write("go\n")
    child.stdin.flush()
    child.wait()
    _, err = spy.communicate(timeout=120)
    if not prof.exists():
        return {"error": f"py-spy exit {spy.returncode}: {err[-500:]}"}
    return speedscope_top(json.loads(prof.read_text()))


def speedscope_top(doc: dict[str, Any], limit: int = 20) -> dict[str, Any]:
    """Self and inclusive sample shares of the main thread's frames."""
    frames = doc["shared"]["frames"]
    main = max(doc["profiles"], key=lambda p: sum(p["weights"]))
    total = sum(main["weights"]) or 1.0
    self_c: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    for sample, w in zip(main["samples"], main["weights"]):
        names = [f"{frames[i]['name']} ({os.path.basename(frames[i].get('file') or '?')})"
                 for i in sample]
        if names:
            self_c[names[-1]] += w
        for name in set(names):
            incl[name] += w
    return {"seconds": total,
            "self": [{"frame": k, "share": v / total} for k, v in self_c.most_common(limit)],
            "inclusive": [{"frame": k, "share": v / total} for k, v in incl.most_common(limit)]}


def child_restore(root: str, hfile: str, table: str) -> None:
    """The profiled child: everything imported, then one restore when told to go."""
    import lmdb  # noqa: F401 - imported before the profiler attaches, as restore would

    h = ChangelogStateBackendHandle.from_json(Path(hfile).read_text())
    print("ready", flush=True)
    sys.stdin.readline()
    restore_once(root, h, table)


def profile_case(root: str, phase: str, table: str, n: int, h: ChangelogStateBackendHandle,
                 spy: bool, spy_dir: Path) -> dict[str, Any]:
    gc_timer = GcTimer()
    plain, no_gc = [], []
    for _ in range(3):  # interleaved: the machine is shared, so compare like with like
        plain.append(restore_once(root, h, table, gc_timer=gc_timer))
        no_gc.append(restore_once(root, h, table, gc_off=True))
    best = min(plain, key=lambda r: r["seconds"])
    prof = cProfile.Profile()
    profiled = restore_once(root, h, table, profile=prof)
    entries = n
    out = {"phase": phase, "table": table, "entries": entries, "plain": best,
           "plain_runs_s": [r["seconds"] for r in plain],
           "ns_per_entry": best["seconds"] / entries * 1e9,
           "gc_off_seconds": min(r["seconds"] for r in no_gc),
           "gc_off_runs_s": [r["seconds"] for r in no_gc],
           "cprofile_seconds": profiled["seconds"],
           "cprofile": top_functions(prof, entries)}
    if spy:
        out["py_spy"] = py_spy(root, h.to_json(), table, spy_dir)
    return out


def markdown(cases: list[dict[str, Any]]) -> str:
    lines = ["| phase | table | entries | restore s | ns/entry | load / replay s | GC pauses "
             "(gen0/1/2) | GC total s (gen2) | longest pause ms | restore s with gc off |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        p, g = c["plain"], c["plain"]["gc"]
        lines.append(f"| {c['phase']} | {c['table']} | {c['entries']:,} | {p['seconds']:.2f} | "
                     f"{c['ns_per_entry']:,.0f} | {p.get('snapshot_seconds', 0):.2f} / "
                     f"{p.get('replay_seconds', 0):.2f} | {g['collections']['0']}/"
                     f"{g['collections']['1']}/{g['collections']['2']} | {g['total_s']:.2f} "
                     f"({g['gen2_s']:.2f}) | {g['max_s'] * 1e3:.0f} | "
                     f"{c['gc_off_seconds']:.2f} |")
    for c in cases:
        lines += ["", f"cProfile, {c['phase']} into {c['table']} ({c['cprofile_seconds']:.2f} s "
                  "under the profiler): self time", "",
                  "| function | calls | self s | share | ns/entry |", "|---|---|---|---|---|"]
        lines += [f"| `{t['function']}` | {t['calls']:,} | {t['self_s']:.3f} | "
                  f"{t['share'] * 100:.1f} % | {t['ns_per_entry']:,.0f} |"
                  for t in c["cprofile"]["top"]]
        spy = c.get("py_spy")
        if spy and "self" in spy:
            lines += ["", f"py-spy --native, {c['phase']} into {c['table']}: self samples", ""]
            lines += [f"- {s['share'] * 100:.1f} % `{s['frame']}`" for s in spy["self"][:15]]
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--child-restore":
        child_restore(*sys.argv[2:])
        return 0
    p = parser(__doc__.split("\n", 1)[0])
    p.add_argument("--entries", type=int, default=None)
    p.add_argument("--py-spy", action="store_true", help="also profile with py-spy --native")
    args = p.parse_args()
    n = args.entries or (100_000 if args.quick else 1_000_000)
    work = Path(tempfile.mkdtemp(prefix="dstl-profile-restore-"))
    cases = []
    t0 = time.monotonic()
    load = LoadSampler()
    try:
        for phase in PHASES:
            root = str(work / phase)
            tb = time.monotonic()
            h = build(root, phase, n)
            print(f"built {phase} ({n:,}) in {time.monotonic() - tb:.1f}s", flush=True)
            for table in TABLES:
                c = profile_case(root, phase, table, n, h, args.py_spy, work)
                cases.append(c)
                print(f"{phase} {table}: {c['plain']['seconds']:.2f}s "
                      f"({c['ns_per_entry']:,.0f} ns/entry), gc {c['plain']['gc']}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load.stop()
    md = load.note() + ".\n\n" + markdown(cases)
    write_results("profile_restore", {"entries": n, "cases": cases, "load": load.summary,
                                      "total_s": time.monotonic() - t0},
                  md, quick=args.quick, command=".venv/bin/python bench/profile_restore.py"
                  + (" --quick" if args.quick else ""), no_doc=True, tag=args.tag)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
