"""Local disk and memory of LMDB state tables under a Spark-like workload, without Spark.

What it drives: the real LMDB backend the way a Spark task and the executor agent do
(``dstl.spark.task``, ``dstl.spark.agent.materializer``). A *worker* process holds one
``ChangelogKeyedStateBackend`` per partition (``table="lmdb"``, its table under
``<local>/dstl/<operator>``, polled materialization); every batch opens the partition's write
batch, writes its rows (a ``ValueState``, one value per key), installs the agent's newest
snapshot of the partition, checkpoints and writes the table marker inside the same write batch,
commits, and registers the partition with the *agent* — a second process running
``AgentMaterializer`` (the executor agent's materializer: read-only open, one read transaction,
the snapshot object uploaded) on its own timer while the worker goes on writing.

Workload (the state-size measurement of the Spark run): N keys ``user-<9 digits>``, one
256-byte value each (half random hex, half repeated text), loaded in batches of ``--load-batch``
keys in key order; then ``--rounds`` steady batches each updating ``--update-frac`` of the keys
at random (read-modify-write), paced ``--pace-s``; materialization interval
``--mat-interval-s``; then a restart: the tables removed and every partition restored from the
last checkpoint through a restore cache under the local directory, and sample keys checked.

Measured (a sampler thread every 20 ms, plus end states):

* every byte under the local directory, by kind — ``table`` (``data.mdb``/``lock.mdb``),
  ``copy`` (a materialization's temporary files and directories beside the tables: a copy, a
  packed environment), ``unlinked`` (files the worker, the agent or the restoring process hold
  open under it with no name: unnamed temporary files, removed files), ``staging`` (a
  restore's staged snapshots), ``cache`` (the restore cache), ``other`` — apparent size and
  allocated blocks (``du``), peak of the total per phase and the kinds at that moment;
* LMDB per partition, from the data file's meta page: page size, depth, branch/leaf/overflow
  pages, entries, last page, the pages neither in the tree nor the free database's own pages
  (free pages), map size; leaf fill = the leaf nodes' bytes over the leaf pages' room;
* the raw data: the sum of key and stored value bytes of every entry (what a table must hold);
* memory of the worker, the agent and the restoring process from ``/proc/<pid>/status``:
  ``RssAnon`` sampled (peak per phase, and of the worker's and agent's sum), ``VmHWM`` at the
  end, and each process's ``RssAnon`` at start.

Run: ``.venv/bin/python bench/table_footprint.py [--quick] [--deep]``. ``--baseline DIR`` also
runs every size with the DSTL of another checkout (``git worktree add DIR <commit>``), right
before the measured code, and reports both and their ratios; ``--code DIR`` measures another
checkout instead of this one (the worker, the agent and the restoring process import DSTL from
it). ``--trace``: tracemalloc's peak per restored partition too. Sizes: 200 k and 1 M keys
(``--deep``: also 4 M; ``--quick``: 20 k).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import (
    LoadSampler,
    add_render,
    load_brief,
    machine_info,
    parser,
    publish,
    render_stored,
    table,
)

MP = 128
VALUE_TEXT = "the quick brown fox jumps over the lazy dog; " * 4
SAMPLE_KEYS = 2000
_META = struct.Struct("<IIQQ" + "IHHQQQQQ" * 2 + "QQ")   # LMDB's MDB_meta after the page header

# The executor agent's materializer in a process of its own, driven over stdin/stdout.
_AGENT = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from dstl.stores import open_store
from dstl.spark.agent.materializer import AgentMaterializer, PartitionSpec
store = open_store(sys.argv[2])
m = AgentMaterializer()
print("ready", flush=True)
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    out = None
    if cmd == "register":
        m.register("s", store, PartitionSpec.from_json_obj(json.loads(arg)))
    elif cmd == "latest":
        r = m.latest("s", arg).materialization
        if r is not None:
            out = {"key": r.ref.key, "size": r.ref.size, "kg": [r.ref.key_groups.start,
                   r.ref.key_groups.end], "mat": r.ref.materialization_id,
                   "boundary": list(r.boundary), "seconds": r.duration_s}
    elif cmd == "idle":
        while True:
            x = m.metrics()
            if x["materializer.started"] <= (x["materializer.completed"]
                                             + x["materializer.skipped"]
                                             + x["materializer.failed"]):
                break
            time.sleep(0.05)
        out = m.metrics()
    elif cmd == "metrics":
        out = m.metrics()
    elif cmd == "stop":
        m.close()
        print(json.dumps(None), flush=True)
        break
    print(json.dumps(out), flush=True)
"""


# The restart: a fresh process restores every partition through a restore cache in the local
# directory (a new executor's agent cache) and checks the sample keys.
_RESTORE = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
p = json.load(open(sys.argv[2]))
from dstl import ChangelogStorage, DstlOptions, KeyGroupRange, key_group_for
from materializer import BackendOptions, ValueStateDescriptor
from restore import LocalFileCache, restore_backend
if p.get("trace"):
    import tracemalloc
    tracemalloc.start()
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
storage = ChangelogStorage(p["store"], options=DstlOptions(persist_delay_s=0.0))
cache = LocalFileCache(p["cache"])
opts = BackendOptions(materialization_interval_s=p["mat_interval_s"])
print("ready", flush=True)
sys.stdin.readline()
t = time.monotonic()
ranges = [KeyGroupRange(*r) for r in p["ranges"]]
backends, steps = [], []
for h, r in zip(p["handles"], ranges):
    if p.get("trace"):
        tracemalloc.reset_peak()
    backends.append(restore_backend([h], storage, r, table="lmdb", cache=cache, options=opts,
                                    local_directory=p["op_dir"], auto_materialize=False))
    traced = tracemalloc.get_traced_memory() if p.get("trace") else (None, None)
    steps.append({"anon": anon(), "traced": traced[0], "traced_peak": traced[1]})
seconds = time.monotonic() - t
wrong = 0
desc = ValueStateDescriptor("v")
for k, v in p["samples"].items():
    kg = key_group_for(k.encode(), p["mp"])
    b = next(b for b, r in zip(backends, ranges) if kg in r)
    b.set_current_key(k)
    wrong += b.get_state(desc).value() != v
print(json.dumps({"seconds": seconds, "wrong": wrong, "steps": steps,
                  "tables": [b.tables.path for b in backends]}), flush=True)
sys.stdin.readline()
for b in backends:
    b.close()
cache.close()
storage.close()
"""


# --------------------------------------------------------------------------- measuring


def proc_status(pid: int) -> dict[str, int]:
    """``VmHWM``, ``VmRSS``, ``RssAnon``, ``RssFile`` of a process, bytes (empty if gone)."""
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[name] = int(rest.split()[0]) * 1024
    except OSError:  # the process ended meanwhile: what was read
        return out
    return out


def kind_of(rel: str) -> str:
    """The kind of a file under the local directory (see the module docstring)."""
    parts = rel.split(os.sep)
    name = parts[-1]
    if any(p.startswith(".dstl-stage-") for p in parts):
        return "staging"
    if "cache" in parts[:-1] or any(p.startswith("cache-") for p in parts[:-1]):
        return "cache"
    if any(p.startswith(".dstl-") for p in parts):
        return "copy"
    if name in ("data.mdb", "lock.mdb"):
        return "table"
    return "other"


def disk_usage(root: str) -> dict[str, dict[str, int]]:
    """Apparent and allocated bytes under ``root`` by kind (files that vanish are skipped)."""
    out: dict[str, dict[str, int]] = {}
    stack = [root]
    while stack:
        d = stack.pop()
        try:
            it = list(os.scandir(d))
        except OSError:
            continue
        for e in it:
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                    continue
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            k = out.setdefault(kind_of(os.path.relpath(e.path, root)),
                               {"apparent": 0, "allocated": 0, "files": 0})
            k["apparent"] += st.st_size
            k["allocated"] += st.st_blocks * 512
            k["files"] += 1
    return out


def unlinked_open_files(root: str, pids: list[int]) -> dict[str, int]:
    """Files under ``root`` that ``pids`` hold open although they have no name any more
    (unnamed temporary files, removed files still open): a directory walk cannot see them."""
    seen: set[tuple[int, int]] = set()
    out = {"apparent": 0, "allocated": 0, "files": 0}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            path = f"/proc/{pid}/fd/{fd}"
            try:
                target = os.readlink(path)
                if not (target.startswith(root) and target.endswith(" (deleted)")):
                    continue
                st = os.stat(path)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            out["apparent"] += st.st_size
            out["allocated"] += st.st_blocks * 512
            out["files"] += 1
    return out


def _total(usage: dict[str, dict[str, int]], field: str = "allocated") -> int:
    return sum(v[field] for v in usage.values())


class Sampler:
    """Disk under ``root`` and ``RssAnon`` of ``pids``, every ``interval_s``, peaks per phase."""

    def __init__(self, root: str, pids: dict[str, int], interval_s: float = 0.02) -> None:
        self.root, self.pids, self.interval_s = root, pids, interval_s
        self.phase = "start"
        self.phases: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)
        self._thread.start()

    def set_phase(self, phase: str) -> None:
        self.sample()
        with self._lock:
            self.phase = phase
        self.sample()

    def sample(self) -> None:
        usage = disk_usage(self.root)
        unlinked = unlinked_open_files(self.root, list(self.pids.values()))
        if unlinked["files"]:
            usage["unlinked"] = unlinked
        anon = {name: proc_status(pid).get("RssAnon", 0) for name, pid in self.pids.items()}
        with self._lock:
            p = self.phases.setdefault(self.phase, {
                "disk_peak": 0, "disk_peak_kinds": {}, "kind_peak": {},
                "anon_peak": {n: 0 for n in self.pids}, "anon_sum_peak": 0, "samples": 0})
            p["samples"] += 1
            total = _total(usage)
            if total > p["disk_peak"]:
                p["disk_peak"] = total
                p["disk_peak_kinds"] = {k: v["allocated"] for k, v in usage.items()}
            for k, v in usage.items():
                p["kind_peak"][k] = max(p["kind_peak"].get(k, 0), v["allocated"])
            for n, a in anon.items():
                p["anon_peak"][n] = max(p["anon_peak"].get(n, 0), a)
            p["anon_sum_peak"] = max(p["anon_sum_peak"], sum(anon.values()))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def lmdb_meta(path: str) -> dict[str, int]:
    """The current meta page of an LMDB data file: page size, the main tree's and the free
    database's page counts, entries, last page, map size."""
    with open(path, "rb") as f:
        head = f.read(16 + _META.size)
        psize = _META.unpack_from(head, 16)[4]
        f.seek(psize)
        second = f.read(16 + _META.size)
    metas = [_META.unpack_from(head, 16), _META.unpack_from(second, 16)]
    m = max(metas, key=lambda x: x[21])
    free_tree = m[7] + m[8] + m[9]
    main = {"depth": m[14], "branch_pages": m[15], "leaf_pages": m[16], "overflow_pages": m[17],
            "entries": m[18]}
    pages = m[20] + 1
    return {"psize": psize, "map_size": m[3], "last_pgno": m[20], "txnid": m[21], **main,
            "freedb_pages": free_tree, "freedb_entries": m[10],
            "free_pages": pages - 2 - free_tree - main["branch_pages"] - main["leaf_pages"]
            - main["overflow_pages"]}


# --------------------------------------------------------------------------- the workload


def key_of(i: int) -> str:
    return f"user-{i:09d}"


def value_of(rng: random.Random) -> str:
    return f"{rng.getrandbits(512):0128x}" + VALUE_TEXT[:128]


class Agent:
    """The agent process (``_AGENT``), one JSON reply per command."""

    def __init__(self, code: str, store_uri: str) -> None:
        env = dict(os.environ, PYTHONPATH=code)
        self.proc = subprocess.Popen([sys.executable, "-c", _AGENT, code, store_uri],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the agent process did not start")

    def call(self, cmd: str, arg: str = "") -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{cmd} {arg}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stop(self) -> None:
        self.call("stop")
        self.proc.wait(60)


def worker(params: dict[str, Any]) -> dict[str, Any]:
    """One size, in this process (the worker); returns its figures."""
    code = params["code"]
    sys.path.insert(0, code)   # the DSTL measured (a baseline's checkout, or this one)
    from dstl import ChangelogStorage, DstlOptions, KeyGroupRange, key_group_for
    from materializer import (
        BackendOptions,
        ChangelogKeyedStateBackend,
        ValueStateDescriptor,
    )
    from materializer.handles import SnapshotRef

    n, parts = params["keys"], params["partitions"]
    tmp = tempfile.mkdtemp(prefix="dstl-bench-footprint-", dir=params.get("dir"))
    local = os.path.join(tmp, "local")
    store_uri = os.path.join(tmp, "store")
    op_dir = os.path.join(local, "dstl", "footprint")
    os.makedirs(op_dir)
    opts = BackendOptions(materialization_interval_s=params["mat_interval_s"])
    storage = ChangelogStorage(store_uri, options=DstlOptions(persist_delay_s=0.0))
    agent = Agent(code, store_uri)
    ranges = [KeyGroupRange.of_operator(MP, parts, i) for i in range(parts)]
    part_of = [next(i for i, r in enumerate(ranges) if kg in r) for kg in range(MP)]
    desc = ValueStateDescriptor("v")
    backends = [ChangelogKeyedStateBackend(storage, f"footprint-p{i}", r, MP, table="lmdb",
                                           options=opts, local_directory=op_dir,
                                           auto_materialize=False)
                for i, r in enumerate(ranges)]
    states = [b.get_state(desc) for b in backends]
    start_status = {"worker": proc_status(os.getpid()), "agent": proc_status(agent.proc.pid)}
    sampler = Sampler(local, {"worker": os.getpid(), "agent": agent.proc.pid})
    rng = random.Random(params["seed"])
    sample_rng = random.Random(params["seed"] + 1)
    samples = {key_of(i): "" for i in sample_rng.sample(range(n), min(SAMPLE_KEYS, n))}
    handles: list[Any] = [None] * parts
    cp = 0
    installed = 0
    mat_seen: list[dict[str, Any]] = []

    def batch(indexes: list[int], *, read: bool) -> None:
        nonlocal cp, installed
        cp += 1
        by_part: list[list[int]] = [[] for _ in range(parts)]
        for i in indexes:
            by_part[part_of[key_group_for(key_of(i).encode(), MP)]].append(i)
        for p, b in enumerate(backends):
            st = states[p]
            with b.write_batch():
                for i in by_part[p]:
                    k = key_of(i)
                    b.set_current_key(k)
                    if read:
                        st.value()
                    v = value_of(rng)
                    st.update(v)
                    if k in samples:
                        samples[k] = v
                latest = agent.call("latest", b.operator_id)
                if latest is not None:
                    ref = SnapshotRef(latest["key"], latest["size"],
                                      KeyGroupRange(*latest["kg"]), latest["mat"])
                    if b.install_materialization(ref, tuple(latest["boundary"])) is not None:
                        installed += 1
                        mat_seen.append({"size": latest["size"], "seconds": latest["seconds"]})
                h = b.snapshot(cp).result(600)
                b.write_table_marker(h)
            b.notify_checkpoint_complete(cp)
            if cp > 1:
                b.notify_checkpoint_subsumed(cp - 1)
            handles[p] = h
            marker = b.table_marker(h)
            spec = {"log_id": b.operator_id, "env_path": b.tables.path,
                    "key_groups": b.key_groups.to_json_obj(),
                    "interval_s": params["mat_interval_s"],
                    "log_ratio": opts.materialize_log_ratio,
                    "min_log_bytes": opts.materialize_min_log_bytes,
                    "zstd_level": opts.zstd_level, "max_failures": opts.max_failures,
                    "boundary": list(marker.boundary) if marker.boundary else None,
                    "log_bytes": marker.log_bytes, "snapshot_bytes": marker.snapshot_bytes}
            agent.call("register", json.dumps(spec))

    t0 = time.monotonic()
    sampler.set_phase("load")
    for start in range(0, n, params["load_batch"]):
        batch(list(range(start, min(n, start + params["load_batch"]))), read=False)
    load_s = time.monotonic() - t0
    after_load = [lmdb_meta(os.path.join(b.tables.path, "data.mdb")) for b in backends]
    sampler.set_phase("steady")
    per_round = max(1, int(n * params["update_frac"]))
    round_s = []
    for _ in range(params["rounds"]):
        r0 = time.monotonic()
        batch([rng.randrange(n) for _ in range(per_round)], read=True)
        round_s.append(time.monotonic() - r0)
        time.sleep(max(0.0, params["pace_s"] - (time.monotonic() - r0)))
    agent_metrics = agent.call("idle")
    sampler.set_phase("end of steady")
    end_usage = disk_usage(local)
    tables = []
    raw = records = 0
    for b in backends:
        m: dict[str, Any] = dict(lmdb_meta(os.path.join(b.tables.path, "data.mdb")))
        snap = b.tables.snapshot()
        try:
            kraw = krec = 0
            for kg in b.key_groups:
                for _sid, k, ns, v in snap.entries(kg):
                    kraw += len(k) + len(v)
                    krec += 8 + len(k) + len(ns) + len(v)
        finally:
            snap.release()
        # a leaf node: 8-byte node header, key, value, 2-byte pointer; room: page minus header
        room = max(1, m["leaf_pages"] * (m["psize"] - 16))
        m["leaf_fill"] = round((krec + 10 * m["entries"]) / room, 4)
        m["raw_bytes"], m["record_bytes"] = kraw, krec
        st = os.stat(os.path.join(b.tables.path, "data.mdb"))
        m["file_apparent"], m["file_allocated"] = st.st_size, st.st_blocks * 512
        tables.append(m)
        raw += kraw
        records += krec
    store_bytes = sum(f.stat().st_size for f in Path(store_uri).rglob("*") if f.is_file())
    snapshot_bytes = sum(f.stat().st_size for f in Path(store_uri, "snapshots").rglob("*")
                         if f.is_file())

    # the restart: tables removed, every partition restored in a fresh process
    for b in backends:
        b.close()
    hwm = {"worker": proc_status(os.getpid()), "agent": proc_status(agent.proc.pid)}
    agent.stop()
    shutil.rmtree(op_dir)
    os.makedirs(op_dir)
    job = os.path.join(tmp, "restore.json")
    with open(job, "w") as f:
        json.dump({"store": store_uri, "cache": os.path.join(local, "dstl-agent", "cache"),
                   "mat_interval_s": params["mat_interval_s"], "op_dir": op_dir, "mp": MP,
                   "ranges": [[r.start, r.end] for r in ranges],
                   "handles": [h.to_json() for h in handles], "samples": samples,
                   "trace": params.get("trace", False)}, f)
    restorer = subprocess.Popen([sys.executable, "-c", _RESTORE, code, job],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env=dict(os.environ, PYTHONPATH=code))
    assert restorer.stdin is not None and restorer.stdout is not None
    if restorer.stdout.readline().strip() != "ready":
        raise RuntimeError("the restoring process did not start")
    sampler.pids = {"restorer": restorer.pid}
    hwm["restorer_start"] = proc_status(restorer.pid)
    sampler.set_phase("restore")
    restorer.stdin.write("go\n")
    restorer.stdin.flush()
    result = json.loads(restorer.stdout.readline())
    sampler.set_phase("after restore")
    after_restore = disk_usage(local)
    restored_tables = [lmdb_meta(os.path.join(t, "data.mdb")) for t in result["tables"]]
    sampler.stop()
    hwm["restorer"] = proc_status(restorer.pid)
    restorer.stdin.write("end\n")
    restorer.stdin.flush()
    restorer.wait(120)
    restore_s = result["seconds"]
    storage.close()
    shutil.rmtree(tmp, ignore_errors=True)
    if result["wrong"]:
        raise RuntimeError(f"{result['wrong']} of {len(samples)} sample keys restored wrong")
    return {"keys": n, "partitions": parts, "raw_bytes": raw, "record_bytes": records,
            "load_s": load_s, "steady_round_s": round_s, "restore_s": restore_s,
            "phases": sampler.phases, "end_usage": end_usage, "after_restore_usage": after_restore,
            "tables": tables, "tables_after_load": after_load,
            "restored_tables": restored_tables, "store_bytes": store_bytes,
            "snapshot_store_bytes": snapshot_bytes, "agent_metrics": agent_metrics,
            "installed": installed, "materializations": mat_seen, "start_status": start_status,
            "end_status": hwm, "samples_checked": len(samples),
            "restore_steps": result["steps"]}


# --------------------------------------------------------------------------- report


def _mb(x: float) -> str:
    return f"{x / 1e6:,.1f}"


def _x(part: float, whole: float) -> str:
    return f"{_mb(part)} ({part / whole:.2f}x)"


def _figures(r: dict[str, Any]) -> dict[str, float]:
    """The figures of one run that the table shows."""
    t = r["tables"]
    ph = r["phases"]
    work = [ph[p] for p in ("load", "steady") if p in ph]
    after = r["after_restore_usage"]
    return {
        "raw": r["raw_bytes"],
        "table": sum(x["file_allocated"] for x in t),
        "fill": sum(x["leaf_fill"] * x["leaf_pages"] for x in t) / max(
            1, sum(x["leaf_pages"] for x in t)),
        "free": sum(x["free_pages"] for x in t) / max(1, sum(x["last_pgno"] + 1 for x in t)),
        "peak": max(p["disk_peak"] for p in work),
        "temp": max(p["kind_peak"].get("copy", 0) + p["kind_peak"].get("unlinked", 0)
                    for p in work),
        "restore_peak": ph["restore"]["disk_peak"],
        "restored": after.get("table", {}).get("allocated", 0),
        "cache": after.get("cache", {}).get("allocated", 0),
        "worker": max(p["anon_peak"]["worker"] for p in work),
        "agent": max(p["anon_peak"]["agent"] for p in work),
        "restorer": ph["restore"]["anon_peak"].get("restorer", 0),
        "objects": r["agent_metrics"]["materializer.bytes"],
        "materializations": r["agent_metrics"]["materializer.completed"],
    }


def markdown(figures: dict[str, Any]) -> str:
    """The docs section of a run, from its stored figures."""
    runs, baseline_runs, params = figures["runs"], figures["baseline_runs"], figures["params"]
    base = {b["keys"]: b for b in baseline_runs}
    rows = []
    for r in runs:
        f = _figures(r)
        raw = f["raw"]
        row = [f"{r['keys']:,}", _mb(raw), _x(f["table"], raw), _x(f["restored"], raw),
               _x(f["peak"], raw), _x(f["restore_peak"], raw),
               f"{_mb(f['worker'])} / {_mb(f['agent'])} / {_mb(f['restorer'])}"]
        if baseline_runs:
            b = base.get(r["keys"])
            row.append(f"{f['restore_peak'] / max(1.0, _figures(b)['restore_peak']):.2f}x / "
                       f"{f['worker'] / max(1.0, _figures(b)['worker']):.2f}x" if b else "-")
        rows.append(row)
    header = ["keys", "raw MB", "tables after the steady batches, MB (x raw)",
              "tables installed by a restore",
              "peak disk, load + steady", "peak disk, restore",
              "anon memory peak MB: worker / agent / restoring process"]
    if baseline_runs:
        header.append(f"restore peak / worker anon vs {baseline_runs[0]['sha']} (same run)")
    return "\n".join([
        table(header, rows), "",
        f"N keys of {params['value_bytes']} B, {params['partitions']} partitions, "
        f"{params['rounds']} batches updating {params['update_frac']:.0%}, then a restore in a "
        "fresh process; disk = allocated blocks, memory = peak `RssAnon`. Leaf pages left two "
        "thirds full and freed pages kept for reuse make about twice the raw bytes; "
        f"{load_brief(figures.get('load'))}.",
    ])


def _sha(code: str) -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=code, capture_output=True,
                          text=True, check=False).stdout.strip() or "?"


def _one(code: str, params: dict[str, Any], n: int) -> dict[str, Any]:
    """One size with the DSTL of ``code``, in a worker process of its own."""
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(
        {**params, "code": code, "keys": n})], env=dict(os.environ, PYTHONPATH=code),
        check=True, stdout=subprocess.PIPE, text=True).stdout
    run: dict[str, Any] = json.loads(next(
        line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    run["code"], run["sha"] = code, _sha(code)
    return run


def main() -> int:
    p = parser(__doc__ or "")
    p.add_argument("--deep", action="store_true", help="also 4 M keys")
    p.add_argument("--keys", type=int, nargs="*", help="sizes (overrides the defaults)")
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--update-frac", type=float, default=0.01)
    p.add_argument("--pace-s", type=float, default=None)
    p.add_argument("--mat-interval-s", type=float, default=None)
    p.add_argument("--load-batch", type=int, default=None)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--dir", default=None, help="where the local directory and store go")
    p.add_argument("--code", default=None,
                   help="import DSTL from this checkout instead of this one")
    p.add_argument("--baseline", default=None,
                   help="also run every size with the DSTL of this checkout (e.g. `git worktree "
                        "add DIR <commit>`), alternating with the measured code, and report "
                        "both with their ratios")
    p.add_argument("--trace", action="store_true",
                   help="the restoring process also records tracemalloc's peak per partition")
    add_render(p)
    p.add_argument("--worker", default=None, help=argparse_hidden())
    args = p.parse_args()
    if args.worker is not None:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return 0
    if args.render is not None:
        return render_stored("table_footprint", Path(args.render), markdown)
    root = str(Path(__file__).resolve().parent.parent)
    code = os.path.abspath(args.code) if args.code else root
    baseline = os.path.abspath(args.baseline) if args.baseline else None
    sizes = args.keys or ([20_000] if args.quick else
                          [200_000, 1_000_000] + ([4_000_000] if args.deep else []))
    params = {"partitions": args.partitions, "update_frac": args.update_frac,
              "rounds": args.rounds if args.rounds is not None else (3 if args.quick else 12),
              "pace_s": args.pace_s if args.pace_s is not None else (0.5 if args.quick else 5.0),
              "mat_interval_s": args.mat_interval_s if args.mat_interval_s is not None
              else (1.0 if args.quick else 10.0),
              "load_batch": args.load_batch or (10_000 if args.quick else 500_000),
              "value_bytes": 256, "seed": args.seed, "dir": args.dir, "trace": args.trace}
    load = LoadSampler()
    runs, baseline_runs = [], []
    for n in sizes:
        if baseline is not None:
            print(f"{n:,} keys, baseline {baseline} ...", flush=True)
            baseline_runs.append(_one(baseline, params, n))
        print(f"{n:,} keys ...", flush=True)
        runs.append(_one(code, params, n))
    load.stop()
    machine = machine_info()
    machine["git_sha"] = _sha(code)
    command = "python bench/table_footprint.py" + (" --quick" if args.quick else "") + (
        " --deep" if args.deep else "") + (f" --code {args.code}" if args.code else "") + (
        f" --baseline {args.baseline}" if args.baseline else "")
    publish("table_footprint", {"params": params, "runs": runs, "baseline_runs": baseline_runs,
                                "load": load.summary, "load_note": load.note()},
            markdown, quick=args.quick, command=command, no_doc=args.no_doc, tag=args.tag,
            machine=machine)
    return 0


def argparse_hidden() -> str:
    import argparse
    return argparse.SUPPRESS


if __name__ == "__main__":
    raise SystemExit(main())
