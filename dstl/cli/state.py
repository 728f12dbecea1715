"""``dstl state dump|changes <state_uri>``: a checkpoint's state, or the changes between two
checkpoints, as JSON lines or Parquet — the state reader (:mod:`dstl.reader`) without Spark.

``dump`` restores each partition read-only and prints every entry (map states: one line per map
entry); ``--key`` reads only the key groups that can hold the keys. ``changes`` prints every
change after ``--start`` (exclusive; omit it to start from the empty state) up to ``--end``, in
log order per key. JSON lines carry values as JSON (bytes, tuples and non-string map keys
tagged, see :mod:`dstl.reader.rows`); Parquet files have the Spark sources' columns.

``dump`` with the heap table (the default) is read column-wise, split by split, the way the
Spark source reads it (:func:`dstl.reader.columns.read_state_table`: snapshot entries and
integer values without Python per row); Parquet takes the batches as they are, JSON lines are
put together column by column (:func:`dstl.reader.arrow.state_json_lines`). Either writes what
the row path writes (the same rows, the same line bytes: the tests compare them), possibly in
another order within a partition. ``--table lmdb`` (a partition restored into a temporary LMDB
directory, for state larger than memory), ``changes``, and JSON lines without pyarrow use the
row path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

from dstl.cli.common import add_storage_options, storage_options
from dstl.errors import ConfigError
from dstl.reader import (
    ChangeRow,
    CheckpointCatalog,
    StateRow,
    open_read_only,
    read_changes,
    read_state,
    require_store,
    to_plain,
)

__all__ = ["run"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dstl state",
                                description="dump a checkpoint's state or the changes between "
                                            "checkpoints")
    sub = p.add_subparsers(dest="action", metavar="{dump,changes}")
    sub.required = True
    dump = sub.add_parser("dump", help="every entry of a checkpoint's state",
                          description="every entry of a checkpoint's state")
    dump.add_argument("--checkpoint", type=int, help="checkpoint id (default: the newest)")
    dump.add_argument("--key", action="append", help="only this key (repeatable)")
    dump.add_argument("--state", action="append", help="only this state name (repeatable)")
    dump.add_argument("--table", choices=("heap", "lmdb"), default="heap",
                      help="where a partition is restored while it is read (lmdb: a temporary "
                           "directory, for partitions larger than memory)")
    changes = sub.add_parser("changes", help="the changes between two checkpoints",
                             description="the changes after --start up to --end")
    changes.add_argument("--start", type=int,
                         help="exclusive; default: from the empty state")
    changes.add_argument("--end", type=int, help="inclusive; default: the newest")
    changes.add_argument("--on-lost", choices=("fail", "oldest"), default="fail",
                         help="when --start is no longer retained: fail (default), or start "
                              "after the oldest retained checkpoint")
    for s in (dump, changes):
        s.add_argument("state_uri", help="the job's state_uri (a path, file://, s3://...)")
        s.add_argument("--job", help="check that the checkpoints belong to this job / operator")
        s.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
        s.add_argument("--output", "-o", help="output file (default: stdout; required for "
                                              "parquet)")
        s.add_argument("--allow-pickle", action="store_true",
                       help="decode states whose codec is pickle (runs code from the store: "
                            "trusted stores only)")
        add_storage_options(s)
    return p


def run(argv: list[str]) -> int:
    """Run ``dstl state`` with ``argv`` (the arguments after the command name)."""
    p = _parser()
    args = p.parse_args(argv)
    if args.format == "parquet" and not args.output:
        p.error("--format parquet needs --output FILE")
    with open_read_only(args.state_uri, storage_options(p, args)) as store:
        require_store(store)
        catalog = CheckpointCatalog(store, job_id=args.job)
        rows: Iterable[StateRow] | Iterable[ChangeRow]
        if args.action == "dump" and args.format == "parquet" and args.table == "heap":
            n = _parquet_columns(catalog, args)
        elif args.action == "dump" and args.table == "heap" and _has_pyarrow():
            n = _jsonl_columns(catalog, args)
        elif args.action == "dump":
            rows = read_state(catalog, args.checkpoint, keys=args.key, states=args.state,
                              table=args.table, allow_pickle=args.allow_pickle)
            n = _write(rows, args)
        else:
            rows = read_changes(catalog, args.start, args.end, on_lost=args.on_lost,
                                allow_pickle=args.allow_pickle, lost_option="--on-lost oldest")
            n = _write(rows, args)
    print(f"{n} rows", file=sys.stderr)
    return 0


def _write(rows: Iterable[StateRow] | Iterable[ChangeRow], args: argparse.Namespace) -> int:
    if args.format == "parquet":
        return _parquet(rows, args.output, args.action)
    return _jsonl(rows, args.output)


def _record(row: StateRow | ChangeRow) -> dict[str, Any]:
    d = row._asdict()
    d["key"] = to_plain(d["key"])
    del d["key_bytes"]  # the key says it (bytes keys are tagged)
    for f in ("namespace", "user_key", "value"):
        d[f] = to_plain(d[f])
    return d


@contextlib.contextmanager
def _text_out(path: str | None) -> Iterator[TextIO]:
    if path is None:
        yield sys.stdout
        return
    with open(path, "w", encoding="utf-8") as f:
        yield f


def _jsonl(rows: Iterable[StateRow] | Iterable[ChangeRow], path: str | None) -> int:
    n = 0
    with _text_out(path) as out:
        for row in rows:
            out.write(json.dumps(_record(row), separators=(",", ":")) + "\n")
            n += 1
    return n


def _has_pyarrow() -> bool:
    try:
        import pyarrow.compute  # noqa: F401
    except ImportError:
        return False
    return True


def _jsonl_columns(catalog: CheckpointCatalog, args: argparse.Namespace) -> int:
    """``dump`` as JSON lines (heap table) column-wise: the row path's lines (the same bytes),
    put together from the columns (:func:`dstl.reader.arrow.state_json_lines`)."""
    from dstl.reader.arrow import state_json_lines
    from dstl.reader.columns import read_state_table

    n = 0
    with _text_out(args.output) as out:
        for batch in read_state_table(catalog, args.checkpoint, keys=args.key,
                                      states=args.state, allow_pickle=args.allow_pickle):
            out.write(state_json_lines(batch))
            n += batch.num_rows
    return n


def _need_pyarrow() -> None:
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError as exc:
        raise ConfigError("--format", "parquet", "jsonl, or install pyarrow (pip install "
                          "'dstl[spark]')", owner="dstl state") from exc


def _parquet(rows: Iterable[StateRow] | Iterable[ChangeRow], path: str, action: str) -> int:
    _need_pyarrow()
    from dstl.reader.arrow import CHANGE_SCHEMA, STATE_SCHEMA, batches

    schema = STATE_SCHEMA if action == "dump" else CHANGE_SCHEMA
    return _write_batches(batches(rows, schema), schema, path)


def _parquet_columns(catalog: CheckpointCatalog, args: argparse.Namespace) -> int:
    """``dump --format parquet`` (heap table) column-wise: the same rows as the row path,
    without Python per row (:mod:`dstl.reader.columns`)."""
    _need_pyarrow()
    from dstl.reader.arrow import STATE_SCHEMA
    from dstl.reader.columns import read_state_table

    return _write_batches(read_state_table(catalog, args.checkpoint, keys=args.key,
                                           states=args.state, allow_pickle=args.allow_pickle),
                          STATE_SCHEMA, args.output)


def _write_batches(batches: Iterable[Any], schema: Any, path: str) -> int:
    import pyarrow.parquet as pq

    n = 0
    with pq.ParquetWriter(path, schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
            n += batch.num_rows
    return n
