"""What every ``dstl`` command shares: ``--storage-option k=v`` (S3 endpoint, credentials, ...),
opening a store read-only, a progress line on stderr, and the exit-code rules.

Exit codes: 0 success (and ``--help``), 1 a :class:`~dstl.errors.DstlError` or a failed check
(the message names the object and the fix), 2 a usage error (argparse's rule).

``--storage-option`` takes ``key=value`` and may repeat. The value is JSON when it parses as JSON
(``anon=true``, ``config_kwargs.retries={"max_attempts": 3}``), a string otherwise; a dotted key
nests (``client_kwargs.endpoint_url=http://localhost:9000`` becomes
``{"client_kwargs": {"endpoint_url": ...}}``; :func:`dstl.stores.parse_storage_options`). They
are passed to fsspec as ``storage_options`` (:func:`dstl.stores.open_store`) and never printed.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, TextIO

from dstl.errors import ConfigError
from dstl.stores import parse_storage_options

__all__ = ["Progress", "add_storage_options", "storage_options"]


def add_storage_options(parser: argparse.ArgumentParser) -> None:
    """Add the repeatable ``--storage-option key=value`` flag."""
    parser.add_argument("--storage-option", action="append", metavar="KEY=VALUE",
                        dest="storage_option",
                        help="fsspec storage option for the store, repeatable (S3: key=..., "
                             "secret=..., client_kwargs.endpoint_url=http://host:port); JSON "
                             "values are parsed, dotted keys nest")


def storage_options(parser: argparse.ArgumentParser, args: argparse.Namespace
                    ) -> dict[str, Any] | None:
    """The parsed ``--storage-option`` values (a malformed one is a usage error: exit 2)."""
    try:
        return parse_storage_options(args.storage_option or ())
    except ConfigError as exc:
        parser.error(str(exc))


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, a line every few seconds
    otherwise (logs stay readable)."""

    def __init__(self, label: str, stream: TextIO | None = None, width: int = 30,
                 every_s: float = 5.0) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.every_s = every_s
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last = 0.0

    def update(self, done: int, total: int, nbytes: int) -> None:
        now = time.monotonic()
        final = done >= total
        if not final and now - self._last < (0.1 if self._tty else self.every_s):
            return
        self._last = now
        filled = self.width * done // max(total, 1)
        line = (f"{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} "
                f"objects, {nbytes / 1e6:.1f} MB")
        if self._tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
