"""A fault-injecting fsspec filesystem: the seam through which tests break storage.

``FaultyFileSystem`` wraps a real fsspec filesystem (memory, local, s3fs on moto) and is handed to
production code exactly like any other filesystem (``open_store(root, filesystem=faulty)`` or
``FsspecBlobStore(faulty, root)``), so the code under test runs unchanged. It

- counts calls per operation and per (operation, path), so tests can assert "each object was read
  once";
- adds ``latency_s`` to every operation (benchmarks: moto + 20 ms);
- injects write faults by schedule, numbered by ``pipe_file`` attempt (1-based, in call order):
  fail before writing (retryable or permanent error), fail after the write landed ("ghost
  success"), disk full (ENOSPC), or hang until released / for a duration;
- injects read faults on chosen paths (``cat_file``/``info``/``find``).

Everything is guarded by one lock; hangs wait outside it. Instances are never cached by fsspec
(``cachable = False``), so faults cannot leak from one test into another.
"""

from __future__ import annotations

import errno
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import fsspec

__all__ = [
    "FaultyFileSystem",
    "Hang",
    "disk_full_error",
    "permanent_error",
    "retryable_error",
]

ErrorFactory = Callable[[], BaseException]

#: Safety net for a hang nobody releases: long enough for any test, short enough not to wedge CI.
_MAX_HANG_S = 60.0


def retryable_error() -> BaseException:
    """What a dropped connection looks like to fsspec callers (translated as transient)."""
    return ConnectionResetError(errno.ECONNRESET, "injected: connection reset by peer")


def permanent_error() -> BaseException:
    """A failure that retrying cannot fix (translated as access denied)."""
    return PermissionError(errno.EACCES, "injected: permission denied")


def disk_full_error() -> BaseException:
    """ENOSPC, as a local or network filesystem reports a full disk."""
    return OSError(errno.ENOSPC, "injected: no space left on device")


@dataclass
class Hang:
    """A scheduled hang of chosen write attempts.

    ``entered`` is set each time an attempt starts hanging; ``release()`` lets every hanging
    (and future) attempt of this hang continue. Without ``release`` an attempt waits
    ``duration_s`` (or the safety net).
    """

    attempts: frozenset[int]
    duration_s: float | None = None
    then_fail: ErrorFactory | None = None
    entered: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    hung: list[int] = field(default_factory=list)

    def release(self) -> None:
        self.released.set()


@dataclass
class _WriteRule:
    count: int | None  # None: until cleared
    error: ErrorFactory
    after_write: bool


@dataclass
class _ReadRule:
    paths: frozenset[str] | None  # None: every path
    ops: frozenset[str]
    count: int | None
    error: ErrorFactory


class FaultyFileSystem(fsspec.AbstractFileSystem):  # type: ignore[misc]
    """Delegates to ``inner``; injects faults and counts calls (see the module docstring).

    Args:
        inner: the real filesystem.
        latency_s: added to every operation.
    """

    protocol = "faulty"
    cachable = False

    def __init__(self, inner: fsspec.AbstractFileSystem, *, latency_s: float = 0.0,
                 **kwargs: Any) -> None:
        kwargs.setdefault("skip_instance_cache", True)
        super().__init__(**kwargs)
        self.inner = inner
        self.latency_s = latency_s
        # Paths are in the inner filesystem's syntax (memory://x -> /x, s3://b/k -> b/k).
        self._strip_protocol = inner._strip_protocol
        self._lock = threading.Lock()
        self._calls: Counter[str] = Counter()
        self._path_calls: Counter[tuple[str, str]] = Counter()
        self._write_attempts = 0
        self._write_rules: list[_WriteRule] = []
        self._read_rules: list[_ReadRule] = []
        self._hangs: list[Hang] = []
        self.injected = 0

    # ------------------------------------------------------------------ configuration

    def fail_writes(self, count: int | None = 1, error: ErrorFactory = retryable_error) -> None:
        """Fail the next ``count`` write attempts (None: all) before anything is written."""
        with self._lock:
            self._write_rules.append(_WriteRule(count, error, after_write=False))

    def fail_writes_after_landing(self, count: int | None = 1,
                                  error: ErrorFactory = retryable_error) -> None:
        """Let the next ``count`` writes land in the inner filesystem, then raise (ghost success)."""
        with self._lock:
            self._write_rules.append(_WriteRule(count, error, after_write=True))

    def fill_disk(self, count: int | None = None) -> None:
        """Fail the next ``count`` writes (None: all, until cleared) with ENOSPC."""
        self.fail_writes(count, disk_full_error)

    def hang_writes(self, attempts: Iterable[int], *, duration_s: float | None = None,
                    until: threading.Event | None = None,
                    then_fail: ErrorFactory | None = None) -> Hang:
        """Hang the given write attempts (1-based ``pipe_file`` call numbers).

        A hanging attempt waits until ``Hang.release()`` (or ``until`` is set) or ``duration_s``
        passes; then it writes, or raises ``then_fail()`` if given.
        """
        hang = Hang(frozenset(attempts), duration_s, then_fail)
        if until is not None:
            hang.released = until
        with self._lock:
            self._hangs.append(hang)
        return hang

    def fail_reads(self, paths: Iterable[str] | None = None, *, count: int | None = None,
                   ops: Iterable[str] = ("cat_file", "info", "find"),
                   error: ErrorFactory = retryable_error) -> None:
        """Fail reads of ``paths`` (inner syntax; None: all) ``count`` times (None: always)."""
        norm = None if paths is None else frozenset(self._strip_protocol(p) for p in paths)
        with self._lock:
            self._read_rules.append(_ReadRule(norm, frozenset(ops), count, error))

    def clear_faults(self) -> None:
        """Drop every scheduled fault and release every hang (counters stay)."""
        with self._lock:
            self._write_rules.clear()
            self._read_rules.clear()
            hangs, self._hangs = self._hangs, []
        for hang in hangs:
            hang.release()

    # ------------------------------------------------------------------ observation

    def calls(self, op: str, path: str | None = None) -> int:
        """How often ``op`` was called (on ``path``, in the inner syntax, if given)."""
        with self._lock:
            if path is None:
                return self._calls[op]
            return self._path_calls[(op, self._strip_protocol(path))]

    @property
    def write_attempts(self) -> int:
        with self._lock:
            return self._write_attempts

    # ------------------------------------------------------------------ machinery

    def _enter(self, op: str, path: Any) -> None:
        with self._lock:
            self._calls[op] += 1
            if isinstance(path, str):
                self._path_calls[(op, self._strip_protocol(path))] += 1
            elif isinstance(path, list):
                for p in path:
                    self._path_calls[(op, self._strip_protocol(p))] += 1
        if self.latency_s > 0:
            time.sleep(self.latency_s)

    def _read_fault(self, op: str, path: str) -> None:
        norm = self._strip_protocol(path)
        with self._lock:
            for rule in self._read_rules:
                if op in rule.ops and (rule.paths is None or norm in rule.paths) \
                        and (rule.count is None or rule.count > 0):
                    if rule.count is not None:
                        rule.count -= 1
                    self.injected += 1
                    raise rule.error()

    def _next_write_rule(self) -> tuple[int, _WriteRule | None, Hang | None]:
        with self._lock:
            self._write_attempts += 1
            n = self._write_attempts
            hang = next((h for h in self._hangs if n in h.attempts), None)
            rule = next((r for r in self._write_rules if r.count is None or r.count > 0), None)
            if rule is not None:
                if rule.count is not None:
                    rule.count -= 1
                self.injected += 1
            return n, rule, hang

    # ------------------------------------------------------------------ writes

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        self._enter("pipe_file", path)
        n, rule, hang = self._next_write_rule()
        if hang is not None:
            hang.hung.append(n)
            hang.entered.set()
            hang.released.wait(hang.duration_s if hang.duration_s is not None else _MAX_HANG_S)
            if hang.then_fail is not None:
                raise hang.then_fail()
        if rule is not None and not rule.after_write:
            raise rule.error()
        self.inner.pipe_file(path, value, mode=mode, **kwargs)
        if rule is not None:
            raise rule.error()

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._enter("makedirs", path)
        self.inner.makedirs(path, exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self._enter("mkdir", path)
        self.inner.mkdir(path, create_parents=create_parents, **kwargs)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        self._enter("rm", path)
        self.inner.rm(path, recursive=recursive, maxdepth=maxdepth)

    def rm_file(self, path: str) -> None:
        self._enter("rm_file", path)
        self.inner.rm_file(path)

    # ------------------------------------------------------------------ reads

    def cat_file(self, path: str, start: int | None = None, end: int | None = None,
                 **kwargs: Any) -> bytes:
        self._enter("cat_file", path)
        self._read_fault("cat_file", path)
        data: bytes = self.inner.cat_file(path, start=start, end=end, **kwargs)
        return data

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        self._enter("info", path)
        self._read_fault("info", path)
        out: dict[str, Any] = self.inner.info(path, **kwargs)
        return out

    def find(self, path: str, maxdepth: int | None = None, withdirs: bool = False,
             detail: bool = False, **kwargs: Any) -> Any:
        self._enter("find", path)
        self._read_fault("find", path)
        return self.inner.find(path, maxdepth=maxdepth, withdirs=withdirs, detail=detail,
                               **kwargs)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        self._enter("ls", path)
        self._read_fault("ls", path)
        return self.inner.ls(path, detail=detail, **kwargs)

    def exists(self, path: str, **kwargs: Any) -> bool:
        self._enter("exists", path)
        return bool(self.inner.exists(path, **kwargs))

    def _open(self, path: str, mode: str = "rb", block_size: Any = None,
              autocommit: bool = True, cache_options: Any = None, **kwargs: Any) -> Any:
        self._enter("open", path)
        if "r" in mode:
            self._read_fault("open", path)
        return self.inner.open(path, mode=mode, block_size=block_size, autocommit=autocommit,
                               cache_options=cache_options, **kwargs)
