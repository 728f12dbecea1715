"""Operator commands: ``dstl demo`` and ``dstl inspect``.

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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dstl`` command and ``python -m dstl``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": "run the demo job", "inspect": "verify and list a segment object"}
    if not argv or argv[0] not in commands:
        print("usage: dstl {" + ",".join(commands) + "} [options]\n" +
              "\n".join(f"  {k:<9} {v}" for k, v in commands.items()), file=sys.stderr)
        return 2
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd == "demo":
            from dstl.demo import run

            return run(rest)
        return _inspect(rest)
    except DstlError as exc:
        print(f"dstl {cmd}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
