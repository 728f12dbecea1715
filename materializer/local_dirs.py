"""A backend's local directories: its LMDB environment, and the temporary directory it owns.

Theory of operation
-------------------
*The environment.* An LMDB table lives in ``<local_directory>/<operator dir>``. A directory that
already holds one belongs to a process that is gone (killed, or closed without cleaning up) or
to another worker of the same executor (Spark). A new backend never takes over those rows
silently: its state is what it restores, so by default it removes the old environment first
(:func:`prepare_environment`, with a warning when there was one). Only ``adopt=True`` opens it as
it is — the Spark task's adopt path, after the table marker proved the rows are exactly the
checkpoint it restores.

*Own temporary directories.* A backend without a ``local_directory`` creates one under the
system temporary directory and removes it on close. A process that is killed cannot, so the
name carries the owner's pid (``dstl-lmdb-<pid>-<random>``) and the owner holds an exclusive
``flock`` on ``owner.lock`` inside it for its lifetime. Creating a new one first removes those
whose owner is gone: pid not alive and lock free (the lock covers a pid reused by another
process, and pid namespaces that share the directory). Unstamped directories of older versions
are left alone. The state reader's directories are swept the same way, under the executor's
local directory, as own directories: its per-process caches (``dstl-reader-cache-<pid>-
<random>``) and the v2 snapshots it decompresses (``dstl-reader-snapshot-<pid>-<random>``). A Python worker ends with ``os._exit`` (no ``atexit``), and one killed while it
reads (SIGKILL: a task killed, the OOM killer, a lost executor) runs no ``finally``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Final

from dstl.errors import StateError
from dstl.stores.local import pid_alive

__all__ = ["OwnDirectory", "executor_local_dir", "prepare_environment",
           "remove_stale_own_directories"]

logger = logging.getLogger(__name__)

PREFIX: Final = "dstl-lmdb-"
_LOCK: Final = "owner.lock"


def prepare_environment(env_dir: str, *, adopt: bool, expected: bool, owner: str) -> None:
    """Make ``env_dir`` hold no table unless ``adopt`` (then leave it as it is); warn about a
    table found there unless ``expected`` (a restore clears on purpose).

    Raises:
        StateError: an old environment cannot be removed (the message names it).
    """
    if adopt or not os.path.lexists(env_dir):
        return
    if not expected:
        logger.warning("backend %s: removing the table a previous backend left in %s (a new "
                       "backend starts empty; adopt_local=True keeps it)", owner, env_dir)
    try:
        if os.path.isdir(env_dir) and not os.path.islink(env_dir):
            shutil.rmtree(env_dir)
        else:
            os.unlink(env_dir)
    except FileNotFoundError:
        return  # removed meanwhile
    except OSError as exc:
        raise StateError(f"backend {owner}: cannot remove the old table in {env_dir} ({exc}); "
                         "remove it by hand or use another local_directory") from exc


@dataclass
class OwnDirectory:
    """A temporary directory a backend owns (see the module docstring); :meth:`remove` on
    close."""

    path: str
    _lock_fd: int

    @classmethod
    def create(cls, prefix: str = PREFIX, root: str | None = None) -> OwnDirectory:
        """Remove stale ones (of ``prefix`` under ``root``, default the temp dir), then make a
        new one and lock it."""
        root = root or tempfile.gettempdir()
        remove_stale_own_directories(root, prefix)
        path = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=root)
        try:
            fd = os.open(os.path.join(path, _LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        return cls(path, fd)

    def remove(self) -> None:
        """Delete the directory and release its lock. Idempotent."""
        if self._lock_fd < 0:
            return
        shutil.rmtree(self.path, onerror=_log_removal_error)
        os.close(self._lock_fd)
        self._lock_fd = -1


def executor_local_dir() -> str:
    """A Spark executor's local directory: the first ``SPARK_LOCAL_DIRS`` entry (Spark sets it
    for its Python workers and removes it when the executor stops), else the temp dir."""
    return (os.environ.get("SPARK_LOCAL_DIRS") or tempfile.gettempdir()).split(",")[0]


def remove_stale_own_directories(root: str, prefix: str = PREFIX) -> int:
    """Remove the own directories ``<prefix><pid>-<random>`` under ``root`` whose owner is gone
    (pid not alive, lock not held); return how many."""
    own = re.compile(rf"^{re.escape(prefix)}(?P<pid>[0-9]+)-[A-Za-z0-9_]+$")
    removed = 0
    try:
        entries = list(os.scandir(root))
    except OSError as exc:
        logger.debug("cannot list %s for stale directories %s*: %s", root, prefix, exc)
        return 0
    for entry in entries:
        m = own.match(entry.name)
        if m is None or not entry.is_dir(follow_symlinks=False) or pid_alive(int(m["pid"])):
            continue
        if _remove_if_unlocked(entry.path):
            removed += 1
    if removed:
        logger.info("removed %d directories %s* of processes that are gone from %s", removed,
                    prefix, root)
    return removed


def _remove_if_unlocked(path: str) -> bool:
    """Remove ``path`` unless a live process holds its lock."""
    try:
        fd = os.open(os.path.join(path, _LOCK), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = -1  # killed between creating the directory and its lock
    except OSError as exc:
        logger.debug("cannot open the lock of %s: %s", path, exc)
        return False
    try:
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # alive (another pid namespace, or the pid was reused)
        shutil.rmtree(path, onerror=_log_removal_error)
        return not os.path.lexists(path)
    finally:
        if fd >= 0:
            os.close(fd)



def _log_removal_error(func: object, path: str, exc_info: object) -> None:
    # a leftover file is reported, not fatal: the next sweep tries again
    logger.warning("could not remove %s: %s", path, exc_info)
