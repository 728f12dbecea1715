"""``dstl gc <state_uri> --job <name>``: delete orphans — objects under ``dstl/`` and
``snapshots/`` that no retained checkpoint references and that are older than ``--min-age`` (a
grace period for uploads not yet acknowledged), plus manifests that are no longer retained. Run it
while the job is stopped, or with a grace period longer than a few checkpoint intervals.
"""

from __future__ import annotations

import argparse

from dstl.checkpoint import CheckpointCoordinator
from dstl.stores import open_store

__all__ = ["run"]


def run(argv: list[str]) -> int:
    """Run ``dstl gc`` with ``argv`` (the arguments after the command name)."""
    p = argparse.ArgumentParser(prog="dstl gc", description="delete unreferenced objects")
    p.add_argument("state_uri")
    p.add_argument("--job", required=True, help="the job / operator name (manifests' job id)")
    p.add_argument("--min-age", type=float, default=3600.0,
                   help="only objects older than this many seconds (default 3600)")
    p.add_argument("--retained", type=int, default=3)
    args = p.parse_args(argv)
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
