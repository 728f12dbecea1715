"""``dstl inspect <segment file or URI>``: verify a segment object end to end and print its index
(which writers and sqns it holds, key-group ranges, offsets) — the first thing to run when a
restore reports a corrupt or unexpected object.
"""

from __future__ import annotations

import argparse

from dstl.segment import decode_segment
from dstl.stores import open_store

__all__ = ["run"]


def run(argv: list[str]) -> int:
    """Run ``dstl inspect`` with ``argv`` (the arguments after the command name)."""
    p = argparse.ArgumentParser(prog="dstl inspect", description="verify and list a segment")
    p.add_argument("path", help="a local segment file, or <base_uri> with --key")
    p.add_argument("--key", help="object key below the base URI (e.g. dstl/...seg)")
    args = p.parse_args(argv)
    if args.key:
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
