"""Operator commands, one module per command group, each with ``run(argv)``:

- ``dstl checkpoints list|show`` (:mod:`dstl.cli.checkpoints`): the checkpoints of a store; one
  in detail;
- ``dstl verify`` (:mod:`dstl.cli.verify`): every object a checkpoint needs exists and every
  checksum holds (progress bar);
- ``dstl state dump|changes`` (:mod:`dstl.cli.state`): a checkpoint's state / the changes
  between checkpoints, as JSON lines or Parquet;
- ``dstl inspect`` (:mod:`dstl.cli.inspect`): verify and describe a segment, snapshot or
  manifest;
- ``dstl gc`` (:mod:`dstl.cli.gc`): delete orphaned objects of a stopped job;
- ``dstl demo`` (:mod:`dstl.cli.demo`): the Spark demo job (``--log-only``: the log demo).

Every command takes ``--help`` (exit 0) and ``--storage-option key=value`` for S3 and other
fsspec stores (:mod:`dstl.cli.common`). Exit codes: 0 done; 2 the command line must change —
bad arguments, a :class:`~dstl.errors.ConfigError` (a malformed URI or storage option, an
argument out of range, a ``state_uri`` directory or ``inspect`` file that does not exist), a
``state_uri`` that is not a DSTL store (:class:`~dstl.reader.errors.NoStoreError`: empty, a
mistyped prefix, a Spark checkpoint directory; see :func:`dstl.reader.store.require_store`), a
checkpoint the store does not hold (:class:`~dstl.reader.CheckpointNotFoundError`, also for a
store with no checkpoint), or an :class:`~dstl.errors.AccessDeniedError` (credentials refused, a
bucket that does not exist); 1 any other :class:`~dstl.errors.DstlError` with its message — a
damaged or missing object, a checkpoint deleted while read, a storage failure that outlasted its
retries, a state gc or the reader refuses, a failed ``verify``.
:func:`main` imports a command's module only
when that command runs, so ``dstl gc`` never loads Spark and a usage error loads nothing.
"""

from __future__ import annotations

import importlib
import os
import sys

from dstl.errors import AccessDeniedError, ConfigError, DstlError

__all__ = ["COMMANDS", "main"]

#: command -> (module, one-line description)
COMMANDS: dict[str, tuple[str, str]] = {
    "checkpoints": ("checkpoints", "list the checkpoints of a store, or show one"),
    "verify": ("verify", "check every object and checksum of a checkpoint"),
    "state": ("state", "dump a checkpoint's state, or the changes between checkpoints"),
    "inspect": ("inspect", "verify and describe a segment, snapshot or manifest"),
    "gc": ("gc", "delete orphaned objects of a stopped job"),
    "demo": ("demo", "run the demo job"),
}


def _usage() -> str:
    return ("usage: dstl {" + ",".join(COMMANDS) + "} [options]   (dstl <command> --help)\n" +
            "\n".join(f"  {k:<12} {v}" for k, (_, v) in COMMANDS.items()))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dstl`` command and ``python -m dstl``; returns the exit status:
    0 done, 2 the command line must change (bad arguments or configuration, a store or checkpoint
    that is not there, access denied), 1 any other DSTL error (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        if argv:
            print(f"dstl: unknown command {argv[0]!r}", file=sys.stderr)
        print(_usage(), file=sys.stderr)
        return 2
    cmd, rest = argv[0], argv[1:]
    try:
        module = importlib.import_module(f"dstl.cli.{COMMANDS[cmd][0]}")
        return int(module.run(rest))
    except SystemExit as exc:  # argparse: --help (0) and usage errors (2)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except DstlError as exc:
        print(f"dstl {cmd}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2 if _fixed_by_the_command_line(exc) else 1
    except BrokenPipeError:
        # the reader of stdout went away (| head): stop quietly, and keep Python's own flush at
        # exit from raising again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _fixed_by_the_command_line(exc: DstlError) -> bool:
    """Whether ``exc`` is fixed by changing the command line: its arguments, its store or its
    credentials (exit 2; see the module docstring)."""
    # imported here: a command that fails before reading (gc, a usage error) loads no reader
    from dstl.reader.errors import CheckpointNotFoundError, NoStoreError

    return isinstance(exc, (ConfigError, CheckpointNotFoundError, NoStoreError,
                            AccessDeniedError))
