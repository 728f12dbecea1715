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

**No symbolic link inside the root is ever followed** (a checkpoint directory is untrusted input:
a planted link must not make a restore read, a writer write, or retention delete anything outside
the root). Every operation walks from the root one component at a time with
``open(component, O_DIRECTORY | O_NOFOLLOW, dir_fd=parent)`` and acts on the last component with
``dir_fd`` calls that do not follow it either (``O_NOFOLLOW`` reads, ``O_EXCL`` temp files,
``linkat`` without ``AT_SYMLINK_FOLLOW``, ``fstatat``/``unlinkat``). A link met on the way is
:class:`~dstl.errors.UnsafePathError` naming the key; ``list`` neither reports links nor descends
into linked directories. Only regular files are objects: a FIFO or device at a key is refused
(opened non-blocking, so it cannot hang a reader), a directory is no object. The root itself may be
a link (it is the operator's configuration, not stored data).

All ``OSError`` s are translated by :func:`dstl.stores.base.translate_error` (``ENOSPC``/``EFBIG`` ->
:class:`~dstl.errors.LocalDiskFullError`, not retried).
"""

from __future__ import annotations

import contextlib
import errno
import io
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
)
from dstl.stores.base import ObjectInfo, check_key, check_range, translate_error

__all__ = ["LocalBlobStore", "pid_alive"]

#: A key's path components (a name: ``list`` is a method of the store class).
_Parts = list[str]

_log = logging.getLogger(__name__)

#: ``.<basename>.<pid>.<16 hex>.tmp`` — the pid lets a later open tell crashed writers from live ones.
_TMP_RE = re.compile(r"^\..+\.(?P<pid>[0-9]+)\.[0-9a-f]{16}\.tmp$")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (this process included; one owned by another user counts):
    what tells a crashed owner's leftovers (temp files, directories) from a live one's."""
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


def write_new_file_durably(path: str, data: bytes, mode: int, *,
                           dir_fd: int | None = None) -> None:
    """Create ``path`` (it must not exist), write all of ``data``, fsync, close.

    The one place DSTL writes a local file it will publish (the local store and the restore
    cache); callers publish it with link/rename and fsync the directory. ``O_EXCL`` also means a
    symbolic link at ``path`` is never followed (the open fails instead). ``path`` is relative to
    ``dir_fd`` when one is given.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode, dir_fd=dir_fd)
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
            UnsafePathError: the key is not allowed, or a component of it is a symbolic link.
        """
        parts = self._parts(key)
        name = parts[-1]
        tmp = f".{name}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
        try:
            dfd = self._open_dir(key, parts[:-1], create=True)
            assert dfd is not None  # create=True never gives up on a missing directory
            try:
                try:
                    write_new_file_durably(tmp, data, 0o644, dir_fd=dfd)
                    # link() publishes atomically and, unlike rename(), never replaces a name;
                    # without AT_SYMLINK_FOLLOW it never follows one either.
                    os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                except FileExistsError:
                    self._refuse_link(dfd, name, key)
                    raise
                finally:
                    with contextlib.suppress(FileNotFoundError):  # never created if open failed
                        os.unlink(tmp, dir_fd=dfd)
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as exc:
            raise translate_error(exc, op="put", key=key, location=self.location) from exc

    def get(self, key: str) -> bytes:
        """Return the whole object.

        Raises:
            ObjectNotFoundError: no such object (also a ``FileNotFoundError``).
            UnsafePathError: a component of the key is a symbolic link, or the key names
                something other than a regular file.
        """
        with self._open_object("get", key) as f:
            try:
                return f.read()
            except OSError as exc:
                raise translate_error(exc, op="get", key=key, location=self.location) from exc

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """Return up to ``length`` bytes from ``offset``; fewer at the end of the object.

        Raises:
            ObjectNotFoundError: no such object.
            UnsafePathError: as for :meth:`get`.
            UsageError: negative offset or length.
        """
        check_range(self.location, key, offset, length)
        with self._open_object("get_range", key) as f:
            try:
                # Never ask for more than the file holds: a length from a crafted handle must
                # not become an allocation.
                size = os.fstat(f.fileno()).st_size
                if offset >= size:
                    return b""
                f.seek(offset)
                return f.read(min(length, size - offset))
            except OSError as exc:
                raise translate_error(exc, op="get_range", key=key,
                                      location=self.location) from exc

    def head(self, key: str) -> ObjectInfo | None:
        """Return the object's size, or ``None`` if there is no object at ``key``.

        Raises:
            UnsafePathError: a component of the key is a symbolic link.
        """
        parts = self._parts(key)
        try:
            dfd = self._open_dir(key, parts[:-1], create=False)
            if dfd is None:
                return None
            try:
                st = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
            finally:
                os.close(dfd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise translate_error(exc, op="head", key=key, location=self.location) from exc
        if stat.S_ISLNK(st.st_mode):
            raise UnsafePathError(key, "it is a symbolic link (links inside a store are never "
                                       "followed)")
        return ObjectInfo(key, st.st_size) if stat.S_ISREG(st.st_mode) else None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Objects whose key starts with ``prefix`` (a string prefix, not a directory), sorted.

        Symbolic links are neither reported nor descended into (logged once per listing).
        """
        self._check_open()
        dir_part = prefix.rpartition("/")[0]
        if dir_part:
            check_key(dir_part)
        components = dir_part.split("/") if dir_part else []
        links: _Parts = []
        try:
            found = [info for info in self._walk(components, links)
                     if info.key.startswith(prefix)]
        except OSError as exc:
            raise translate_error(exc, op="list", key=prefix or None,
                                  location=self.location) from exc
        if links:
            _log.warning("list %s/%s: skipped %d symbolic links (never followed): %s",
                         self.location, prefix, len(links), sorted(links)[:10])
        found.sort(key=lambda info: info.key)
        return iter(found)

    def delete(self, keys: Iterable[str]) -> None:
        """Remove objects; missing keys are fine.

        Every key is validated (its string, and that no component of it is a symbolic link)
        before any removal; a link is refused, never removed or followed.

        Raises:
            UnsafePathError: a key is not allowed or names a symbolic link (nothing removed).
        """
        todo = [(key, self._parts(key)) for key in keys]
        for key, parts in todo:  # the links check for every key before the first removal
            self._delete_one(key, parts, remove=False)
        for key, parts in todo:
            self._delete_one(key, parts, remove=True)

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

    def _parts(self, key: str) -> _Parts:
        """The key's path components, after the string checks."""
        self._check_open()
        check_key(key)
        if _TMP_RE.match(key.rpartition("/")[2]):
            raise UnsafePathError(key, "the name is reserved for LocalBlobStore temp files")
        return key.split("/")

    def _open_dir(self, key: str, components: _Parts, *, create: bool) -> int | None:
        """A descriptor of ``root/components`` reached without following any link, or ``None``
        when a component is missing (``create=False``) or is not a directory.

        Raises:
            UnsafePathError: a component is a symbolic link.
            OSError: anything else (the caller translates it).
        """
        fd = os.open(self._root, _ROOT_FLAGS)
        for depth, name in enumerate(components):
            try:
                child = self._open_child_dir(fd, name, create)
            except _LinkFound:
                os.close(fd)
                raise UnsafePathError(key, f"its directory {'/'.join(components[:depth + 1])!r} "
                                           "is a symbolic link (links inside a store are never "
                                           "followed)") from None
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
            if child is None:
                return None
            fd = child
        return fd

    @staticmethod
    def _open_child_dir(fd: int, name: str, create: bool) -> int | None:
        for _ in range(2):
            try:
                return os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    return None
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                except FileExistsError:
                    continue  # a concurrent put made it (or planted something: checked next)
                os.fsync(fd)  # the new directory's entry survives a power loss
            except OSError as exc:
                # Linux reports a link opened with O_DIRECTORY | O_NOFOLLOW as ENOTDIR.
                if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise
                if stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    raise _LinkFound from None
                if create:
                    raise  # a file where a directory must be: the put cannot succeed
                return None
        return os.open(name, _DIR_FLAGS, dir_fd=fd)

    def _refuse_link(self, dfd: int, name: str, key: str) -> None:
        """Raise UnsafePathError if ``name`` in ``dfd`` is a symbolic link."""
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            raise UnsafePathError(key, "it is a symbolic link (links inside a store are never "
                                       "followed)")

    @contextlib.contextmanager
    def _open_object(self, op: str, key: str) -> Iterator[io.BufferedReader]:
        """The object's file, opened without following a link; never a FIFO or device."""
        parts = self._parts(key)
        try:
            dfd = self._open_dir(key, parts[:-1], create=False)
            if dfd is None:
                raise self._not_found(op, key)
            try:
                fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=dfd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    self._refuse_link(dfd, parts[-1], key)
                raise
            finally:
                os.close(dfd)
        except (IsADirectoryError, NotADirectoryError) as exc:
            raise self._not_found(op, key) from exc
        except OSError as exc:
            raise translate_error(exc, op=op, key=key, location=self.location) from exc
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                raise self._not_found(op, key)
            if not stat.S_ISREG(mode):
                raise UnsafePathError(key, "not a regular file (a FIFO, socket or device is "
                                           "never an object)")
            yield f

    def _delete_one(self, key: str, parts: _Parts, *, remove: bool) -> None:
        try:
            dfd = self._open_dir(key, parts[:-1], create=False)
            if dfd is None:
                return  # no directory, so no object: deleting is idempotent
            try:
                try:
                    mode = os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False).st_mode
                except FileNotFoundError:
                    return
                if stat.S_ISLNK(mode):
                    raise UnsafePathError(key, "it is a symbolic link (links inside a store are "
                                               "never followed or removed)")
                if stat.S_ISDIR(mode) or not remove:
                    return
                try:
                    os.unlink(parts[-1], dir_fd=dfd)
                except FileNotFoundError:
                    return
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as exc:
            raise translate_error(exc, op="delete", key=key, location=self.location) from exc

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

    def _walk(self, start: _Parts, links: _Parts) -> Iterator[ObjectInfo]:
        """Every regular file below ``root/start`` (iterative: a crafted deep tree cannot
        exhaust the stack); links are recorded in ``links``, never followed."""
        stack = [start]
        while stack:
            components = stack.pop()
            rel = "".join(c + "/" for c in components)
            try:
                dfd = self._open_dir(rel or "<root>", components, create=False)
            except UnsafePathError:
                links.append(rel.rstrip("/"))
                continue
            if dfd is None:
                continue  # nothing stored below this prefix (or deleted while we listed)
            try:
                with os.scandir(dfd) as it:
                    entries = [(e.name, e.is_symlink(), e.is_dir(follow_symlinks=False),
                                e.is_file(follow_symlinks=False)) for e in it]
                for name, is_link, is_dir, is_file in entries:
                    if is_link:
                        links.append(rel + name)
                    elif is_dir:
                        stack.append([*components, name])
                    elif is_file and not _TMP_RE.match(name):
                        try:
                            size = os.stat(name, dir_fd=dfd, follow_symlinks=False).st_size
                        except FileNotFoundError:
                            continue  # deleted while we listed
                        yield ObjectInfo(rel + name, size)
            finally:
                os.close(dfd)

    def _remove_stale_temp_files(self) -> int:
        removed = 0
        for dirpath, _dirnames, filenames in os.walk(self._root, onerror=_raise):
            for name in filenames:
                m = _TMP_RE.match(name)
                if m is None or pid_alive(int(m.group("pid"))):
                    continue
                try:
                    os.unlink(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue  # another process cleaned it up concurrently
                removed += 1
                _log.debug("removed stale temp file %s/%s of dead pid %s", dirpath, name,
                           m.group("pid"))
        return removed


class _LinkFound(Exception):
    """A path component is a symbolic link (turned into UnsafePathError naming the key)."""


#: The root may be a link (configuration); everything below it is opened without following one.
_ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: O_NONBLOCK: opening a FIFO planted at a key must not block (it is refused right after).
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


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
