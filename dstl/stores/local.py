"""Durable local-disk blob store.

Theory of operation: an object is a regular file ``<root>/<key>``. ``put`` writes the bytes to a
temp file in the destination directory (``.<basename>.<pid>.<random hex>.tmp``), fsyncs it, and
publishes it with ``os.link(tmp, final)``: a hard link is atomic and, unlike ``rename``, refuses to
replace an existing name, which gives write-once for free (``ObjectExistsError``). The temp name is
then unlinked and the directory fsynced, so the new entry survives a power loss; directories the
put had to create get their parents fsynced as well. Any failure removes the temp file, so a
reader never sees a partial object and a failed put leaves nothing behind.

A writer that crashes between creating and removing its temp file leaves ``*.tmp`` behind. Temp
names carry the writer's pid; opening the store removes the temp files of pids that are no longer
alive and keeps those of live ones (a concurrent writer in another process). Temp files are never
listed. Limits: the root must be on a filesystem with hard links (every POSIX local filesystem), and
must not be shared between hosts or pid namespaces (the liveness check sees local pids only).

Deleting objects leaves empty directories behind on purpose: pruning them would race with a
concurrent ``put`` that has just created the same directory.

All ``OSError`` s are translated by :func:`dstl.stores.base.translate_error` (``ENOSPC``/``EFBIG`` ->
:class:`~dstl.errors.LocalDiskFullError`, not retried).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import stat
import threading
from collections.abc import Iterable, Iterator

from dstl.errors import (
    AccessDeniedError,
    ClosedError,
    ConfigError,
    LocalDiskFullError,
    ObjectNotFoundError,
    UnsafePathError,
    UsageError,
)
from dstl.stores.base import ObjectInfo, check_key, translate_error

__all__ = ["LocalBlobStore"]

_log = logging.getLogger(__name__)

#: ``.<basename>.<pid>.<16 hex>.tmp`` — the pid lets a later open tell crashed writers from live ones.
_TMP_RE = re.compile(r"^\..+\.(?P<pid>[0-9]+)\.[0-9a-f]{16}\.tmp$")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new_file_durably(path: str, data: bytes, mode: int) -> None:
    """Create ``path`` (it must not exist), write all of ``data``, fsync, close.

    The one place DSTL writes a local file it will publish (the local store and the restore
    cache); callers publish it with link/rename and fsync the directory.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalBlobStore:
    """A :class:`~dstl.stores.base.BlobStore` on local disk (see the module docstring).

    Thread-safe: operations share no mutable state besides the closed flag.

    Args:
        root: directory holding the objects; created if missing.

    Raises:
        AccessDeniedError: the root cannot be created or read for lack of permissions.
        ConfigError: the root cannot be a directory (e.g. a path component is a file).
        LocalDiskFullError: no space to create the root.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self._root = os.path.abspath(os.fspath(root))
        self.location = self._root
        self._closed = threading.Event()
        try:
            _make_dirs(self._root)
            removed = self._remove_stale_temp_files()
        except OSError as exc:
            raise self._root_error(exc, "open") from exc
        _log.info("opened local blob store %s (removed %d stale temp files)", self._root,
                  removed)

    def __repr__(self) -> str:
        return f"LocalBlobStore({self._root!r})"

    # ------------------------------------------------------------------ BlobStore

    def put(self, key: str, data: bytes) -> None:
        """Write a new object durably; fail if ``key`` exists.

        Raises:
            ObjectExistsError: the key exists (its content is unchanged).
            LocalDiskFullError: ENOSPC/EFBIG/EDQUOT; nothing is left behind.
            UnsafePathError: the key is not allowed.
        """
        path = self._path(key)
        directory, base = os.path.split(path)
        tmp = os.path.join(directory, f".{base}.{os.getpid()}.{secrets.token_hex(8)}.tmp")
        try:
            _make_dirs(directory)
            try:
                write_new_file_durably(tmp, data, 0o644)
                # link() publishes atomically and, unlike rename(), never replaces a name.
                os.link(tmp, path)
            finally:
                with contextlib.suppress(FileNotFoundError):  # never created if open failed
                    os.unlink(tmp)
            _fsync_dir(directory)
        except OSError as exc:
            raise translate_error(exc, op="put", key=key, location=self.location) from exc

    def get(self, key: str) -> bytes:
        """Return the whole object.

        Raises:
            ObjectNotFoundError: no such object (also a ``FileNotFoundError``).
        """
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                return f.read()
        except (IsADirectoryError, NotADirectoryError) as exc:
            raise self._not_found("get", key) from exc
        except OSError as exc:
            raise translate_error(exc, op="get", key=key, location=self.location) from exc

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """Return up to ``length`` bytes from ``offset``; fewer at the end of the object.

        Raises:
            ObjectNotFoundError: no such object.
            UsageError: negative offset or length.
        """
        if offset < 0 or length < 0:
            raise UsageError(f"get_range {self.location}/{key}: bad range offset={offset} "
                             f"length={length} (both must be >= 0)")
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read(length)
        except (IsADirectoryError, NotADirectoryError) as exc:
            raise self._not_found("get_range", key) from exc
        except OSError as exc:
            raise translate_error(exc, op="get_range", key=key, location=self.location) from exc

    def head(self, key: str) -> ObjectInfo | None:
        """Return the object's size, or ``None`` if there is no object at ``key``."""
        path = self._path(key)
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise translate_error(exc, op="head", key=key, location=self.location) from exc
        return ObjectInfo(key, st.st_size) if stat.S_ISREG(st.st_mode) else None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Objects whose key starts with ``prefix`` (a string prefix, not a directory), sorted."""
        self._check_open()
        dir_part = prefix.rpartition("/")[0]
        if dir_part:
            check_key(dir_part)
        start = os.path.join(self._root, *dir_part.split("/")) if dir_part else self._root
        rel = dir_part + "/" if dir_part else ""
        try:
            found = [info for info in self._walk(start, rel) if info.key.startswith(prefix)]
        except OSError as exc:
            raise translate_error(exc, op="list", key=prefix or None,
                                  location=self.location) from exc
        found.sort(key=lambda info: info.key)
        return iter(found)

    def delete(self, keys: Iterable[str]) -> None:
        """Remove objects; missing keys are fine. Every key is validated before any removal."""
        paths = [(key, self._path(key)) for key in keys]
        dirs: set[str] = set()
        for key, path in paths:
            try:
                os.unlink(path)
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                continue  # no object at this key: deleting is idempotent
            except OSError as exc:
                raise translate_error(exc, op="delete", key=key, location=self.location) from exc
            dirs.add(os.path.dirname(path))
        for directory in sorted(dirs):
            try:
                _fsync_dir(directory)
            except OSError as exc:
                raise translate_error(exc, op="delete", key=None,
                                      location=directory) from exc

    def close(self) -> None:
        """Mark the store closed; it holds no open files between calls."""
        self._closed.set()

    # ------------------------------------------------------------------ extras

    def validate(self) -> None:
        """Check that the root is a writable directory by creating and removing a temp file.

        Raises:
            AccessDeniedError: the directory is not writable.
            ConfigError: the root is not a usable directory.
            LocalDiskFullError: no space left.
        """
        self._check_open()
        probe = os.path.join(self._root, f"..probe.{os.getpid()}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise self._root_error(exc, "validate") from exc

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise ClosedError(repr(self))

    def _path(self, key: str) -> str:
        self._check_open()
        check_key(key)
        if _TMP_RE.match(key.rpartition("/")[2]):
            raise UnsafePathError(key, "the name is reserved for LocalBlobStore temp files")
        return os.path.join(self._root, *key.split("/"))

    def _not_found(self, op: str, key: str) -> ObjectNotFoundError:
        return ObjectNotFoundError(f"{op} {self.location}/{key}: object not found", key=key)

    def _root_error(self, exc: OSError, op: str) -> Exception:
        err = translate_error(exc, op=op, key=None, location=self.location)
        if isinstance(err, LocalDiskFullError):
            return err
        if isinstance(err, AccessDeniedError):
            return AccessDeniedError(
                f"{op} {self._root}: the directory cannot be created or written ({exc}); "
                "choose a base_uri on a writable local disk or fix its permissions")
        return ConfigError("root", self._root, f"a path where a directory can be created and "
                           f"written (failed: {exc})", owner="LocalBlobStore")

    def _walk(self, directory: str, rel: str) -> Iterator[ObjectInfo]:
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return  # nothing stored below this prefix
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                yield from self._walk(entry.path, rel + entry.name + "/")
            elif entry.is_file(follow_symlinks=False) and not _TMP_RE.match(entry.name):
                try:
                    size = entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue  # deleted while we listed
                yield ObjectInfo(rel + entry.name, size)

    def _remove_stale_temp_files(self) -> int:
        removed = 0
        for dirpath, _dirnames, filenames in os.walk(self._root, onerror=_raise):
            for name in filenames:
                m = _TMP_RE.match(name)
                if m is None or _pid_alive(int(m.group("pid"))):
                    continue
                try:
                    os.unlink(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue  # another process cleaned it up concurrently
                removed += 1
                _log.debug("removed stale temp file %s/%s of dead pid %s", dirpath, name,
                           m.group("pid"))
        return removed


def _raise(exc: OSError) -> None:
    raise exc


def _make_dirs(directory: str) -> None:
    """Create ``directory`` and missing parents, fsyncing each new entry's parent (durability)."""
    missing: list[str] = []
    cur = directory
    while not os.path.isdir(cur):
        missing.append(cur)
        parent = os.path.dirname(cur)
        if parent == cur:
            break
        cur = parent
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            # A concurrent put may have created it; its parent is fsynced below anyway, as that
            # put may not have done so yet when ours is acknowledged.
            if not os.path.isdir(d):
                raise
    for d in missing:
        _fsync_dir(os.path.dirname(d))
