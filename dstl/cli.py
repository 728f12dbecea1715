"""Operator commands: ``dstl demo``, ``dstl inspect``, ``dstl gc``.

``dstl gc <state_uri> --job <name>`` deletes orphans: objects under ``dstl/`` and ``snapshots/``
that no retained checkpoint references and that are older than ``--min-age`` (a grace period for
uploads not yet acknowledged), plus manifests that are no longer retained. Run it while the job is
stopped, or with a grace period longer than a few checkpoint intervals.

``dstl inspect <segment file or URI>`` verifies a segment object end to end and prints its index
(which writers and sqns it holds, key-group ranges, offsets) — the first thing to run when a
restore reports a corrupt or unexpected object.
"""

from __future__ import annotations

import argparse
import sys

from dstl.errors import DstlError

__all__ = ["main"]


def _inspect(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dstl inspect", description="verify and list a segment")
    p.add_argument("path", help="a local segment file, or <base_uri> with --key")
    p.add_argument("--key", help="object key below the base URI (e.g. dstl/...seg)")
    args = p.parse_args(argv)
    from dstl.segment import decode_segment

    if args.key:
        from dstl.stores import open_store

        store = open_store(args.path)
        data = store.get(args.key)
        name = f"{store.location}/{args.key}"
    else:
        with open(args.path, "rb") as f:
            data = f.read()
        name = args.path
    seg = decode_segment(data, name)
    print(f"{name}: {seg.size} bytes, {len(seg.entries)} change sets, checksums OK")
    print(f"{'log id':<32}{'sqn':>8}{'key groups':>14}{'offset':>10}{'length':>9}{'changes':>9}")
    for e in seg.entries:
        print(f"{e.log_id:<32}{e.sqn:>8}{f'{e.kg_min}..{e.kg_max}':>14}{e.offset:>10}"
              f"{e.length:>9}{e.change_count:>9}")
    return 0


def _gc(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dstl gc", description="delete unreferenced objects")
    p.add_argument("state_uri")
    p.add_argument("--job", required=True, help="the job / operator name (manifests' job id)")
    p.add_argument("--min-age", type=float, default=3600.0,
                   help="only objects older than this many seconds (default 3600)")
    p.add_argument("--retained", type=int, default=3)
    args = p.parse_args(argv)
    from dstl.coordinator import CheckpointCoordinator
    from dstl.stores import open_store

    store = open_store(args.state_uri)
    coord = CheckpointCoordinator.recover(store, args.job, retained=args.retained)
    try:
        deleted = coord.collect_orphans(args.min_age)
    finally:
        coord.close()
        store.close()
    for key in deleted:
        print(f"deleted {key}")
    print(f"{len(deleted)} objects deleted from {args.state_uri}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dstl`` command and ``python -m dstl``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": "run the demo job", "inspect": "verify and list a segment object",
                "gc": "delete orphaned objects of a stopped job"}
    if not argv or argv[0] not in commands:
        print("usage: dstl {" + ",".join(commands) + "} [options]\n" +
              "\n".join(f"  {k:<9} {v}" for k, v in commands.items()), file=sys.stderr)
        return 2
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd == "demo":
            from dstl.demo import run

            return run(rest)
        if cmd == "gc":
            return _gc(rest)
        return _inspect(rest)
    except DstlError as exc:
        print(f"dstl {cmd}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
