"""``dstl gc <state_uri> --job <name>``: delete what no retained checkpoint needs — manifests the
job no longer retains, then orphans: objects under ``dstl/`` and ``snapshots/`` that no retained
checkpoint references and that are older than ``--min-age`` (a grace period for uploads not yet
acknowledged). Run it while the job is stopped, or with a grace period longer than a few
checkpoint intervals.

Theory of operation
-------------------
gc can never delete a checkpoint the job retains. Every manifest records the job's retention
(``body.retained``: how many checkpoints its coordinator keeps), and gc reads the newest one:

- ``--retained`` omitted: gc keeps exactly what the job keeps (the recorded retention);
- ``--retained N`` with N below the recorded retention: refused (exit 2), nothing is read
  further or deleted; N above it keeps more than the job does (allowed);
- retention unknown (the newest manifest predates format version 2): gc is conservative — it
  keeps every valid checkpoint of the job, deletes no manifest but superseded attempts and
  damaged ones, and ``--retained`` is ignored; it says so.

The decision itself is :meth:`CheckpointCoordinator.collect_orphans` on a coordinator recovered
with that retention (recovery only reads); ``--dry-run`` asks the same question with
``dry_run=True`` and prints the answer, deleting nothing.

``--storage-option key=value`` (repeatable) is passed to the store like ``storage_options``, as
every ``dstl`` command does (:mod:`dstl.cli.common`): the value is parsed as JSON when it parses
(``retries=3``, ``client_kwargs={"endpoint_url": ...}``), else taken as a string
(``key=AKIA...``); a dotted key nests. Values are never printed.

Exit status: 0 done; 2 usage error (bad arguments, ``--retained`` below the job's retention, a
malformed URI or storage option); 1 any other DSTL error (the store, a damaged newest manifest,
another job's store).
"""

from __future__ import annotations

import argparse
import math
import sys

from dstl.checkpoint import CheckpointCoordinator
from dstl.checkpoint.manifest import MAX_RETAINED
from dstl.cli.common import add_storage_options, storage_options
from dstl.errors import UsageError
from dstl.layout import MANIFEST_PREFIX, parse_manifest_key
from dstl.stores import BlobStore, open_store

__all__ = ["run"]

#: The exit status of a usage error (argparse's too).
USAGE = 2


class _Refused(Exception):
    """A usage error found after parsing (exit status 2)."""


def run(argv: list[str]) -> int:
    """Run ``dstl gc`` with ``argv`` (the arguments after the command name); the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)  # exits 0 for --help, 2 for a usage error
    options = storage_options(parser, args)  # a malformed one: exit 2
    store = open_store(args.state_uri, options)
    try:
        retained, note = _retention(store, args.job, args.retained)
    except _Refused as exc:
        store.close()
        print(f"dstl gc: {exc}", file=sys.stderr)
        return USAGE
    try:
        _collect(store, args, retained, note)
    finally:
        store.close()
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dstl gc", description="delete manifests the job no longer retains and objects "
        "no retained checkpoint references (orphans); never a retained checkpoint")
    p.add_argument("state_uri", help="the job's store: a path, file://, s3://bucket/prefix, ...")
    p.add_argument("--job", required=True, help="the job / operator name (manifests' job id)")
    p.add_argument("--min-age", type=_seconds, default=3600.0, metavar="SECONDS",
                   help="only objects older than this (default 3600): uploads not yet "
                        "acknowledged by a checkpoint must be younger")
    p.add_argument("--retained", type=_retained, default=None, metavar="N",
                   help="checkpoints to keep (default: the job's retention, recorded in its "
                        "manifests); smaller than the job's is refused")
    p.add_argument("--dry-run", action="store_true",
                   help="print what would be deleted; delete nothing")
    add_storage_options(p)
    return p


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number of seconds >= 0")
    return value


def _retained(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 1 <= value <= MAX_RETAINED:
        raise argparse.ArgumentTypeError(f"{value} is not in [1, {MAX_RETAINED}]")
    return value


def _retention(store: BlobStore, job: str, asked: int | None) -> tuple[int, str]:
    """How many checkpoints gc keeps, and a line saying why (see the module docstring).

    Raises:
        _Refused: ``asked`` is below the job's recorded retention.
    """
    probe = CheckpointCoordinator.recover(store, job, retained=1)  # reads the newest only
    latest = probe.latest()
    probe.close()
    if latest is None:
        return asked or 1, f"job {job!r} has no checkpoint in this store"
    recorded = latest.retained
    if recorded is None:
        ids = {p[0] for p in (parse_manifest_key(i.key) for i in store.list(MANIFEST_PREFIX))
               if p is not None}
        if len(ids) > MAX_RETAINED:
            raise UsageError(f"{len(ids)} checkpoints of job {job!r} in {store.location} and "
                             "the newest manifest predates format version 2 (no recorded "
                             "retention): gc cannot tell which the job retains and deletes "
                             "nothing; let the job commit one checkpoint first")
        keep = len(ids)
        ignored = f"; --retained {asked} is ignored" if asked is not None else ""
        return keep, (f"the newest manifest ({latest.key}) predates format version 2 and does "
                      f"not record job {job!r}'s retention: keeping all {keep} checkpoints and "
                      f"deleting only superseded attempts, damaged manifests and objects none "
                      f"of them references{ignored}")
    if asked is not None and asked < recorded:
        raise _Refused(f"--retained {asked} is smaller than job {job!r}'s retention "
                       f"({recorded}, recorded in {latest.key}); gc never deletes a checkpoint "
                       f"the job retains: pass --retained {recorded} or more, or leave it out")
    keep = asked if asked is not None else recorded
    return keep, f"keeping the newest {keep} checkpoints of job {job!r} (the job retains " \
                 f"{recorded})"


def _collect(store: BlobStore, args: argparse.Namespace, retained: int, note: str) -> None:
    coord = CheckpointCoordinator.recover(store, args.job, retained=retained)
    try:
        kept = [m.checkpoint_id for m in coord.manifests()]
        keys = coord.collect_orphans(args.min_age, dry_run=args.dry_run)
    finally:
        coord.close()
    print(f"{note}: {kept}")
    verb = "would delete" if args.dry_run else "deleted"
    for key in keys:
        print(f"{verb} {key}")
    if args.dry_run:
        print(f"{len(keys)} objects would be deleted from {args.state_uri} (dry run: nothing "
              "was deleted)")
    else:
        print(f"{len(keys)} objects deleted from {args.state_uri}")
