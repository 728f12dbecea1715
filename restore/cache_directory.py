"""The directory of a :class:`~restore.cache.LocalFileCache`: its names, its lock, its sweep.

Theory of operation
-------------------
One cache owns one directory for its lifetime, and only these files are its own:

- ``.dstl-cache.lock``: held with ``flock`` while the cache is open, so no two caches (in this
  or another process) share a directory. A symbolic link there is refused, never followed.
- published files ``<sanitised basename>.<16 hex digest of location+key>.<8 hex token>.obj``
  (:func:`published_name`): unique per download, so unlinking an evicted file never removes a
  newer download of the same object;
- temp files ``.<published name>.<pid>.<16 hex>.tmp`` (:func:`temp_name`; the pid tells whose
  it was).

:meth:`CacheDirectory.open` creates the directory if needed, takes the lock (again if a previous
owner unlinked the lock file between our open and ``flock``), and removes every temp file (with
the lock held no live cache writes here: each is left over from a crash) and every published
file of a previous process (a file nobody verified in this process is not trusted).
:meth:`CacheDirectory.close` removes the lock file, releases the lock, and removes the directory
if it created it and it is empty.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import secrets

from dstl.errors import CacheError

__all__ = ["CacheDirectory", "published_name", "temp_name", "unlink"]

_LOCK_NAME = ".dstl-cache.lock"
#: Published files: ``<sanitised basename>.<16 hex digest of location+key>.<8 hex token>.obj``.
_OBJ_RE = re.compile(r"^[A-Za-z0-9_.-]{0,64}\.[0-9a-f]{16}\.[0-9a-f]{8}\.obj$")
#: Temp files: ``.<published name>.<pid>.<16 hex>.tmp`` (the pid tells whose it was).
_TMP_RE = re.compile(r"^\.(?P<name>.+\.obj)\.(?P<pid>[0-9]+)\.[0-9a-f]{16}\.tmp$")
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9_.-]")


def published_name(location: str, key: str) -> str:
    """A new published file name for ``location``'s ``key`` (unique per call)."""
    digest = hashlib.blake2b(f"{location}\0{key}".encode(), digest_size=8).hexdigest()
    base = _UNSAFE_CHARS.sub("_", key.rpartition("/")[2])[:64]
    return f"{base}.{digest}.{secrets.token_hex(4)}.obj"


def temp_name(name: str) -> str:
    """The name of this process's temp file for the published file ``name``."""
    return f".{name}.{os.getpid()}.{secrets.token_hex(8)}.tmp"


def unlink(path: str) -> int:
    """Remove a file; 1 if removed, 0 if it was already gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return 0
    return 1


class CacheDirectory:
    """The locked directory of one cache (see the module docstring).

    Args:
        directory: the path (created if missing).
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._created_dir = False
        self._lock_fd = -1

    def open(self) -> tuple[list[int], int]:
        """Lock the directory and sweep it; returns the pids of the removed temp files and how
        many published files of a previous process were removed.

        Raises:
            CacheError: another cache holds the directory, or the lock file is a link.
            OSError: the directory cannot be created, locked or listed (the lock is released).
        """
        try:
            return self._open()
        except BaseException:
            self.unlock()
            raise

    def close(self) -> None:
        """Remove the lock file, release the lock, and remove the directory if this created it
        (and nothing else is left in it)."""
        self.unlock(remove=True)
        if self._created_dir:
            with contextlib.suppress(OSError):  # not empty (someone else's files) or gone
                os.rmdir(self.directory)

    def unlock(self, remove: bool = False) -> None:
        """Release the lock (idempotent); ``remove`` also removes the lock file."""
        fd, self._lock_fd = self._lock_fd, -1
        if fd < 0:
            return
        if remove:
            unlink(os.path.join(self.directory, _LOCK_NAME))
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def _open(self) -> tuple[list[int], int]:
        if not os.path.isdir(self.directory):
            os.makedirs(self.directory, exist_ok=True)
            self._created_dir = True
        lock_path = os.path.join(self.directory, _LOCK_NAME)
        while True:
            fd = self._open_lock_file(lock_path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise CacheError(f"restore cache directory {self.directory} is in use by another "
                                 "LocalFileCache (in this or another process); give each cache "
                                 "a directory of its own") from None
            except BaseException:
                os.close(fd)
                raise
            # A previous owner may have unlinked the lock file between our open and flock:
            # then we locked an orphan inode; try again with the current file.
            try:
                same = os.fstat(fd).st_ino == os.stat(lock_path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._lock_fd = fd
                break
            os.close(fd)
        temps: list[int] = []
        previous = 0
        for name in os.listdir(self.directory):
            m = _TMP_RE.match(name)
            if m is not None:
                # We hold the directory lock, so no live cache writes here: every temp file is
                # left over from a crash (usually of a dead pid; a live one is a reused pid).
                temps.append(int(m.group("pid")))
                unlink(os.path.join(self.directory, name))
            elif _OBJ_RE.match(name):
                previous += unlink(os.path.join(self.directory, name))
        return temps, previous

    def _open_lock_file(self, lock_path: str) -> int:
        """Open (create) the lock file; a symbolic link there is refused, never followed (it
        could make the cache create or lock a file outside its directory)."""
        try:
            return os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                           0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CacheError(f"restore cache lock file {lock_path} is a symbolic link; the "
                                 "cache never follows links in its directory (remove it, or give "
                                 "the cache a directory of its own)") from exc
            raise
