"""Operator commands: ``dstl demo``, ``dstl inspect``, ``dstl gc`` — one module each
(:mod:`dstl.cli.demo`, :mod:`dstl.cli.inspect`, :mod:`dstl.cli.gc`), each with ``run(argv)``.

- ``dstl gc <state_uri> --job <name>`` deletes orphaned objects of a stopped job;
- ``dstl inspect <segment file or URI>`` verifies a segment object and prints its index;
- ``dstl demo`` runs the Spark demo job (:mod:`dstl.spark.demo`), or with ``--log-only`` the
  log-only demo.

:func:`main` imports a command's module only when that command runs, so ``dstl gc`` never loads
Spark and a usage error loads nothing.
"""

from __future__ import annotations

import sys

from dstl.errors import ConfigError, DstlError

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dstl`` command and ``python -m dstl``; returns the exit status:
    0 done, 2 usage error (bad arguments or configuration), 1 any other DSTL error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": "run the demo job", "inspect": "verify and list a segment object",
                "gc": "delete orphaned objects of a stopped job"}
    usage = ("usage: dstl {" + ",".join(commands) + "} [options]\n" +
             "\n".join(f"  {k:<9} {v}" for k, v in commands.items()))
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        return 0
    if not argv or argv[0] not in commands:
        print(usage, file=sys.stderr)
        return 2
    cmd, rest = argv[0], argv[1:]
    try:
        return _run(cmd, rest)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except ConfigError as exc:
        print(f"dstl {cmd}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except DstlError as exc:
        print(f"dstl {cmd}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _run(cmd: str, rest: list[str]) -> int:
    if cmd == "demo":
        from dstl.cli import demo

        return demo.run(rest)
    if cmd == "gc":
        from dstl.cli import gc

        return gc.run(rest)
    from dstl.cli import inspect

    return inspect.run(rest)
