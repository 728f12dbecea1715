"""``dstl verify <state_uri> [--checkpoint N]``: does a checkpoint hold?

Fetches every object the checkpoint needs and verifies it with its own decoder (object CRC,
every record or block), checks that the handles' references agree with the objects
(:mod:`dstl.reader.verify`), and prints every problem it found with the typed error that
describes it. A progress bar goes to stderr. Exit 0: the checkpoint holds; 1: it does not.
"""

from __future__ import annotations

import argparse

from dstl.cli.common import Progress, add_storage_options, storage_options
from dstl.reader import CheckpointCatalog, open_read_only, require_store, verify_checkpoint

__all__ = ["run"]


def run(argv: list[str]) -> int:
    """Run ``dstl verify`` with ``argv`` (the arguments after the command name)."""
    p = argparse.ArgumentParser(prog="dstl verify",
                                description="check that every object a checkpoint needs exists "
                                            "and every checksum holds")
    p.add_argument("state_uri", help="the job's state_uri (a path, file://, s3://...)")
    p.add_argument("--checkpoint", type=int, help="checkpoint id (default: the newest)")
    p.add_argument("--job", help="check that the checkpoint belongs to this job / operator")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_storage_options(p)
    args = p.parse_args(argv)
    with open_read_only(args.state_uri, storage_options(p, args)) as store:
        require_store(store)
        catalog = CheckpointCatalog(store, job_id=args.job)
        stored = catalog.find(args.checkpoint)
        bar = None if args.quiet else Progress(f"verify checkpoint {stored.checkpoint_id}")
        report = verify_checkpoint(catalog, stored.checkpoint_id,
                                   progress=bar.update if bar is not None else None)
    for problem in report.problems:
        print(f"PROBLEM {problem.key}: {type(problem.error).__name__}: {problem.error}")
    verdict = "OK" if report.ok else f"FAILED ({len(report.problems)} problems)"
    print(f"checkpoint {report.checkpoint_id} ({report.manifest_key}): {report.objects} objects, "
          f"{report.bytes:,} bytes verified: {verdict}")
    return 0 if report.ok else 1
