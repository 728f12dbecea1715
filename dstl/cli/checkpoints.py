"""``dstl checkpoints list|show <state_uri>``: the checkpoints of a store, and one in detail.

``list`` prints one line per checkpoint the store holds — id, attempt, commit time, partitions
(tasks), bytes of the whole state and of this checkpoint's upload, objects referenced; ``show``
prints one checkpoint's manifest: per task its key groups, snapshots and log handles. Both read
manifests only (no segment or snapshot is fetched) and write nothing; ``--json`` prints the same
as JSON. A damaged manifest is reported in its row (exit 1).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from typing import Any

from dstl.checkpoint.manifest import Manifest
from dstl.cli.common import add_storage_options, storage_options
from dstl.errors import CorruptObjectError
from dstl.reader import CheckpointCatalog, open_read_only, require_store, task_states

__all__ = ["run"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dstl checkpoints",
                                description="list the checkpoints of a store, or show one")
    sub = p.add_subparsers(dest="action", metavar="{list,show}")
    sub.required = True
    for name, text in (("list", "one line per checkpoint"),
                       ("show", "one checkpoint's manifest in detail")):
        s = sub.add_parser(name, help=text, description=text)
        s.add_argument("state_uri", help="the job's state_uri (a path, file://, s3://...)")
        s.add_argument("--job", help="check that the checkpoints belong to this job / operator")
        s.add_argument("--json", action="store_true", help="print JSON")
        add_storage_options(s)
        if name == "show":
            s.add_argument("--checkpoint", type=int, help="checkpoint id (default: the newest)")
    return p


def run(argv: list[str]) -> int:
    """Run ``dstl checkpoints`` with ``argv`` (the arguments after the command name)."""
    p = _parser()
    args = p.parse_args(argv)
    with open_read_only(args.state_uri, storage_options(p, args)) as store:
        require_store(store)
        catalog = CheckpointCatalog(store, job_id=args.job)
        if args.action == "list":
            return _list(catalog, args.json)
        return _show(catalog.manifest(args.checkpoint), args.json)


def _time(ms: int) -> str:
    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).strftime(
        "%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def summary(m: Manifest) -> dict[str, Any]:
    """One checkpoint's line (also ``--json``'s record)."""
    return {"checkpoint": m.checkpoint_id, "attempt": m.attempt, "job": m.job_id,
            "time": _time(m.created_ms), "partitions": len(m.tasks),
            "bytes": m.stats.full_size, "incremental_bytes": m.stats.incremental_size,
            "objects": len(m.referenced_keys)}


def _list(catalog: CheckpointCatalog, as_json: bool) -> int:
    stored = catalog.checkpoints()
    failed = 0
    if not as_json:
        print(f"{'checkpoint':>10} {'attempt':>7}  {'time (UTC)':<24} {'partitions':>10} "
              f"{'bytes':>14} {'incremental':>12} {'objects':>8}")
    for c in stored:
        try:
            row = summary(catalog.load(c))
        except CorruptObjectError as exc:
            failed += 1
            row = {"checkpoint": c.checkpoint_id, "attempt": c.attempt, "error": str(exc)}
        if as_json:
            print(json.dumps(row))
        elif "error" in row:
            print(f"{c.checkpoint_id:>10} {c.attempt:>7}  DAMAGED: {row['error']}")
        else:
            print(f"{row['checkpoint']:>10} {row['attempt']:>7}  {row['time']:<24} "
                  f"{row['partitions']:>10} {row['bytes']:>14,} {row['incremental_bytes']:>12,} "
                  f"{row['objects']:>8}")
    if not as_json:
        print(f"{len(stored)} checkpoints in {catalog.location}", file=sys.stderr)
    return 1 if failed else 0


def detail(m: Manifest) -> dict[str, Any]:
    """One checkpoint in detail (``show --json``)."""
    tasks = []
    for t, entry in zip(task_states(m), m.tasks):
        h = t.handle
        tasks.append({
            "task": t.task_id, "operator_id": h.operator_id,
            "key_groups": h.key_groups.to_json_obj(), "max_parallelism": h.max_parallelism,
            "materialization_id": h.materialization_id,
            "snapshots": [s.to_json_obj() for s in h.materialized],
            "logs": [{"log_id": n.log_id, "key_groups": n.key_groups.to_json_obj(),
                      "from": n.from_sqn, "to": n.to_sqn, "change_sets": len(n.change_sets),
                      "bytes": n.stored_bytes, "segments": sorted(n.segment_keys())}
                     for n in h.non_materialized],
            "bytes": entry.full_size, "incremental_bytes": entry.incremental_size,
            "objects": len(entry.referenced_keys)})
    return {**summary(m), "key": m.key, "duration_ms": m.stats.duration_ms, "tasks": tasks}


def _show(m: Manifest, as_json: bool) -> int:
    d = detail(m)
    if as_json:
        print(json.dumps(d, indent=2))
        return 0
    print(f"checkpoint {d['checkpoint']} (attempt {d['attempt']}) of job {d['job']!r}: "
          f"{d['key']}")
    print(f"  committed {d['time']} after {d['duration_ms']:.1f} ms; {d['partitions']} "
          f"partitions, {d['bytes']:,} bytes ({d['incremental_bytes']:,} uploaded for it), "
          f"{d['objects']} objects")
    for t in d["tasks"]:
        kg = t["key_groups"]
        print(f"  {t['task']}: {t['operator_id']}, key groups {kg[0]}..{kg[1]} of "
              f"{t['max_parallelism']}, materialization {t['materialization_id']}, "
              f"{t['bytes']:,} bytes")
        for s in t["snapshots"]:
            skg = s["key_groups"]
            print(f"    snapshot {s['key']} ({s['size']:,} bytes, key groups "
                  f"{skg[0]}..{skg[1]})")
        for n in t["logs"]:
            print(f"    log {n['log_id']} sqn {n['from']}..{n['to']}: {n['change_sets']} "
                  f"change sets, {n['bytes']:,} bytes in {len(n['segments'])} segments")
    return 0
