"""One error hierarchy for DSTL, shared by ``dstl``, ``materializer`` and ``restore``.

Rules (see STYLE): a message says what happened, where (object key, offset, writer, sqn),
expected vs got, and a hint naming the fix. The same facts are attributes, so callers never parse
messages. Errors that correspond to a builtin also subclass it (``ObjectNotFoundError`` is a
``FileNotFoundError``), so generic handlers keep working. Third-party errors are translated in one
place only: :func:`dstl.stores.base.translate_error`.

Hierarchy::

    DstlError
    ├── UsageError(ValueError)             the caller did something the API forbids
    │   ├── ConfigError                    an option is out of range; names field, value and fix
    │   │   └── ConfigTypeError(TypeError) an option has the wrong type
    │   ├── KeyGroupError                  key group outside the owner's range
    │   ├── OutputSchemaError              a processor's output row does not fit output_schema
    │   ├── StateTypeError(TypeError)      a value written does not fit its state's declared type
    │   └── UnsafePathError                an object key would escape the storage root
    ├── ClosedError(RuntimeError)          use after close
    ├── StorageError(OSError)              the environment failed (after retries, if any)
    │   ├── TransientStorageError          retryable I/O failure of one attempt
    │   │   └── ThrottledError             503 SlowDown / 429 / 5xx: retried after a backoff
    │   ├── ObjectNotFoundError(FileNotFoundError)
    │   ├── ObjectExistsError(FileExistsError)
    │   ├── AccessDeniedError(PermissionError)   missing or wrong credentials, missing bucket
    │   ├── StoreUnreachableError(ConnectionError)  opening: the endpoint cannot be reached at all
    │   ├── LocalDiskFullError             ENOSPC / EFBIG on local disk
    │   ├── UploadFailedError              all attempts of an upload failed
    │   └── UploadTimeoutError             back-pressure or a persist wait exceeded its deadline
    ├── CorruptObjectError                 stored bytes are wrong; names object and offset
    │   ├── MalformedHandleError(UsageError)   a checkpoint handle's JSON is malformed
    │   │   └── UnsafeHandleKeyError(UnsafePathError)
    │   ├── ChecksumMismatchError
    │   ├── TruncatedObjectError
    │   ├── UnsupportedFormatError
    │   └── CorruptValueError              a state table's stored value does not decode
    ├── WriterFailedError                  a writer is poisoned by an earlier permanent failure
    ├── BatchInterruptedError              a Spark micro-batch cut short by its query's stop()
    ├── ProcessorError                     a user's stateful processor raised; names where
    ├── StateError                         state-table / backend misuse or failure
    │   ├── StateSchemaError               a declared type cannot read the stored values
    │   ├── StateTableFullError            LMDB map full and not allowed to grow
    │   └── BackendFailedError             materialization failed too often
    └── CacheError                         restore cache
        ├── LeaseError                     double release, use after release
        └── CacheFullError                 size budget or disk exhausted
"""

from __future__ import annotations

import struct
from typing import Any

__all__ = [
    "AccessDeniedError",
    "BackendFailedError",
    "BatchInterruptedError",
    "CacheError",
    "CacheFullError",
    "ChecksumMismatchError",
    "ClosedError",
    "ConfigError",
    "ConfigTypeError",
    "CorruptObjectError",
    "CorruptValueError",
    "DstlError",
    "KeyGroupError",
    "LeaseError",
    "LocalDiskFullError",
    "MalformedHandleError",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "OutputSchemaError",
    "ProcessorError",
    "StateError",
    "StateSchemaError",
    "StateTypeError",
    "StateTableFullError",
    "StorageError",
    "StoreUnreachableError",
    "ThrottledError",
    "TransientStorageError",
    "TruncatedObjectError",
    "UnsafeHandleKeyError",
    "UnsafePathError",
    "UnsupportedFormatError",
    "UploadFailedError",
    "UploadTimeoutError",
    "UsageError",
    "WriterFailedError",
    "DECODER_BUGS",
    "located",
    "placed",
]


class DstlError(Exception):
    """Root of every error DSTL raises on purpose."""


# --------------------------------------------------------------------------- caller misuse


class UsageError(DstlError, ValueError):
    """The caller used the API in a way it forbids (wrong type, wrong order, bad argument)."""


class ConfigError(UsageError):
    """An option or constructor argument has a value outside its allowed range.

    Attributes:
        field: the option's name.
        value: the rejected value.
        expected: what would have been accepted (type and range).
        owner: the class or function the option belongs to.
        fix: how to correct it (may be empty).
    """

    def __init__(self, field: str, value: Any, expected: str, *, owner: str = "DstlOptions",
                 fix: str = ""):
        self.field = field
        self.value = value
        self.expected = expected
        self.owner = owner
        self.fix = fix
        shown = _short_repr(value)
        super().__init__(f"{owner}.{field}={shown} is invalid: expected {expected}"
                         + (f"; {fix}" if fix else ""))


class ConfigTypeError(ConfigError, TypeError):
    """An option or constructor argument has the wrong type (also a :class:`TypeError`, so
    generic handlers of wrong types keep working)."""


def _short_repr(value: Any, limit: int = 120) -> str:
    """``repr(value)``, cut to ``limit`` characters (a huge or hostile value must not flood a
    message); a ``repr`` that raises is replaced by the type name."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - any broken __repr__: the type still identifies it
        return f"<{type(value).__name__} object>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


class OutputSchemaError(UsageError):
    """A stateful processor yielded a row that does not match the operator's output schema
    (the message names the processor, the key and the field)."""


class StateTypeError(UsageError, TypeError):
    """A value written to a state does not fit the state's declared type.

    Attributes:
        state: the state's name.
        key: the current key.
        value_type: the written value's Python type name.
        declared: the declared type (Spark DDL).
        detail: what does not fit.
    """

    def __init__(self, state: str, key: Any, value: Any, declared: str, detail: str):
        self.state = state
        self.key = key
        self.value_type = type(value).__name__
        self.declared = declared
        self.detail = detail
        super().__init__(
            f"state {state!r}, key {_short_repr(key, 80)}: a value of type {self.value_type} "
            f"does not fit the declared type {declared} ({detail}); write a value of that type, "
            "or change the declared type (docs/guide.md, declared state types: the changes a "
            "restore accepts)")


class KeyGroupError(UsageError):
    """A key group is outside the range its owner is responsible for."""

    def __init__(self, key_group: int, owner: str, key_groups: object, hint: str = ""):
        self.key_group = key_group
        self.owner = owner
        self.key_groups = key_groups
        msg = f"key group {key_group} is outside {owner}'s range {key_groups}"
        super().__init__(msg + (f" ({hint})" if hint else ""))


class UnsafePathError(UsageError):
    """An object key (e.g. read from an untrusted handle or manifest) would escape the root."""

    def __init__(self, key: str, reason: str):
        self.key = key
        self.reason = reason
        super().__init__(
            f"object key {key!r} is not allowed: {reason} "
            "(keys in handles and manifests must be relative paths below the storage root)"
        )


class ClosedError(DstlError, RuntimeError):
    """An object was used after ``close()``."""

    def __init__(self, what: str, hint: str = "create a new one"):
        self.what = what
        super().__init__(f"{what} is closed ({hint})")


# --------------------------------------------------------------------------- environment


class StorageError(DstlError, OSError):
    """The storage environment failed.

    Attributes:
        key: the object key (or path) concerned, when known.
    """

    def __init__(self, message: str, *, key: str | None = None):
        self.key = key
        super().__init__(message)

    def __str__(self) -> str:  # OSError's __str__ would format errno/strerror instead
        return str(self.args[0]) if self.args else ""


class TransientStorageError(StorageError):
    """One I/O attempt failed in a way that a retry may fix (timeouts, 5xx, resets)."""


class ThrottledError(TransientStorageError):
    """The store asked to slow down or failed internally (503 ``SlowDown``, 429, 500
    ``InternalError``, 502/504): retried only after an exponentially growing, jittered backoff,
    as S3 advises for all of them (see :mod:`dstl.retry`)."""


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """An object that must exist does not."""


class ObjectExistsError(StorageError, FileExistsError):
    """A write-once object already exists."""


class AccessDeniedError(StorageError, PermissionError):
    """Credentials are missing or wrong, or the bucket/container does not exist."""


class StoreUnreachableError(StorageError, ConnectionError):
    """Opening a store, no connection to its endpoint could be made at all: the host name does
    not resolve, the port refuses connections, or nothing answers within the connect timeout.
    Nothing has worked yet, so this is the configuration (URI, ``endpoint_url``, network), not
    a passing fault, and it is not retried; the same failure while a store is in use is a
    :class:`TransientStorageError`.

    Attributes:
        location: the store's URI.
        endpoint: the endpoint that was tried (``host:port``).
    """

    def __init__(self, message: str, *, location: str, endpoint: str):
        super().__init__(message)
        self.location = location
        self.endpoint = endpoint


class LocalDiskFullError(StorageError):
    """Local disk is full (ENOSPC) or a file-size limit was hit (EFBIG)."""

    def __init__(self, message: str, *, key: str | None = None, path: str | None = None):
        self.path = path
        super().__init__(message, key=key)


class UploadFailedError(StorageError):
    """Every attempt of one segment upload failed.

    Attributes:
        attempts: attempts started (including concurrent ones after timeouts).
        elapsed_s: time from the first attempt to giving up.
    """

    def __init__(self, message: str, *, key: str | None = None, attempts: int = 0,
                 elapsed_s: float = 0.0):
        self.attempts = attempts
        self.elapsed_s = elapsed_s
        super().__init__(message, key=key)


class UploadTimeoutError(StorageError, TimeoutError):
    """Waiting for upload capacity (back-pressure) or a persist result exceeded its deadline."""


# --------------------------------------------------------------------------- bad data


class CorruptObjectError(DstlError):
    """Stored bytes do not decode. Names the object and the byte offset.

    Attributes:
        key: object key (or a description such as ``"<bytes>"``).
        offset: byte offset in the object where the problem was found.
        reason: what was wrong.
    """

    def __init__(self, key: str, offset: int, reason: str,
                 hint: str = "the object is damaged; restore from an earlier checkpoint"):
        self.key = key
        self.offset = offset
        self.reason = reason
        self.hint = hint
        super().__init__(f"{key} at offset {offset}: {reason} ({hint})")


class MalformedHandleError(CorruptObjectError, UsageError):
    """A checkpoint handle (untrusted JSON read from a manifest or passed to a restore) is
    malformed. Both a :class:`CorruptObjectError` (the stored handle is bad) and a
    :class:`UsageError` (a caller passed it).

    Attributes:
        key: where the handle was read from (a manifest and task, or ``<backend handle>``).
        offset: the position of a JSON syntax error in it; 0 for a field error.
        field: the offending field, as a path (``non_materialized[0].change_sets[3][2]``).
    """

    def __init__(self, key: str, offset: int, field: str, reason: str):
        self.field = field
        CorruptObjectError.__init__(self, key, offset, f"handle field {field}: {reason}",
                                    hint="the checkpoint's handle is damaged or was not written "
                                         "by DSTL; restore from an earlier checkpoint")


class UnsafeHandleKeyError(MalformedHandleError, UnsafePathError):
    """A handle names an object key that could escape the storage root.

    Attributes:
        key: where the handle was read from.
        object_key: the refused key.
        field: where in the handle.
        reason: why it is refused.
    """

    def __init__(self, key: str, field: str, object_key: str, reason: str):
        # Not cooperative: the bases' constructors take different arguments.
        self.key, self.offset, self.field = key, 0, field
        self.object_key = object_key
        self.reason = f"handle field {field}: object key {object_key!r:.200} is not allowed: " \
                      f"{reason}"
        self.hint = "handles may only name keys below the storage root; do not restore from it"
        Exception.__init__(self, f"{key} at offset 0: {self.reason} ({self.hint})")


class ChecksumMismatchError(CorruptObjectError):
    """A checksum did not match. ``expected``/``got`` are hex strings."""

    def __init__(self, key: str, offset: int, what: str, expected: int, got: int):
        self.expected = f"{expected:08x}"
        self.got = f"{got:08x}"
        super().__init__(key, offset, f"{what} checksum mismatch: expected {self.expected}, "
                                       f"got {self.got}")


class TruncatedObjectError(CorruptObjectError):
    """The object ended early: it is shorter than what it holds says (``offset``: where its
    bytes ran out, or where the short part starts)."""

    def __init__(self, key: str, offset: int, expected_len: int, got_len: int, what: str = "data"):
        self.expected_len = expected_len
        self.got_len = got_len
        super().__init__(
            key, offset, f"the object ends early: its {what} needed {expected_len} bytes, "
                         f"{got_len} were there",
            hint="it is shorter than when it was written: an interrupted copy or upload, or a "
                 "damaged store. Copy it again from where it came from, or restore from an "
                 "earlier checkpoint that does not use it (`dstl verify <state_uri> "
                 "--checkpoint N` says whether one restores)")


class UnsupportedFormatError(CorruptObjectError):
    """Magic or version unknown to this build."""

    def __init__(self, key: str, offset: int, found: str, supported: str):
        self.found = found
        self.supported = supported
        super().__init__(key, offset, f"unsupported format {found} (this build reads {supported})",
                         hint="was it written by a newer DSTL, or is it not a DSTL object?")


class CorruptValueError(CorruptObjectError):
    """A value of a state table (its framing, its dictionary, its zstd frame) does not decode.

    Attributes:
        entry_key: the table key of the entry (or dictionary record) whose value is wrong.
        detail: what is wrong with the value (``reason`` without the entry).
    """

    def __init__(self, key: str, offset: int, entry_key: bytes, reason: str):
        self.entry_key = entry_key
        self.detail = reason
        super().__init__(key, offset, f"value of table key {entry_key[:48]!r}: {reason}")


# --------------------------------------------------------------------------- poisoned components


class WriterFailedError(DstlError):
    """A writer hit a permanent failure earlier; its log is no longer usable past that point.

    The original failure is chained as ``__cause__``.
    """

    def __init__(self, log_id: str, sqn: int, hint: str = "restore the backend from its last "
                                                           "completed checkpoint"):
        self.log_id = log_id
        self.sqn = sqn
        super().__init__(f"writer {log_id!r}: change set sqn={sqn} failed to upload earlier "
                         f"({hint})")


class ProcessorError(DstlError):
    """A stateful processor (user code) raised while DSTL called it; the original exception is
    the ``__cause__`` and its type and message are in this one's message.

    Attributes:
        operator: the operator's name.
        partition: the partition (Spark task) the processor ran for.
        batch_id: the micro-batch.
        key: the key whose call raised (``None`` if the message was all that survived pickling).
        method: the processor method that raised (``handle_input_rows``, ...).
    """

    def __init__(self, message: str, *, operator: str = "", partition: int = -1,
                 batch_id: int = -1, key: Any = None, method: str = ""):
        self.operator = operator
        self.partition = partition
        self.batch_id = batch_id
        self.key = key
        self.method = method
        super().__init__(message)

    @classmethod
    def of(cls, exc: BaseException, *, processor: str, operator: str, method: str, key: Any,
           partition: int, batch_id: int) -> ProcessorError:
        """The error for ``exc`` raised by ``processor``'s ``method`` for ``key`` (raise it
        ``from exc``)."""
        return cls(f"processor {processor} of operator {operator!r} raised "
                   f"{type(exc).__name__} in {method} for key {_short_repr(key, 60)} "
                   f"(partition {partition}, batch {batch_id}): {exc}",
                   operator=operator, partition=partition, batch_id=batch_id, key=key,
                   method=method)


class BatchInterruptedError(DstlError):
    """A Spark micro-batch stopped part-way because its streaming query is stopping
    (``query.stop()`` cancels the batch's jobs and interrupts the query's thread).

    Spark's commit log does not have the batch, so the next start runs it again; its DSTL state
    is exactly-once all the same (the re-run starts from the checkpoint before it). The message
    ends with the interrupted call in the form Spark looks for to tell a stop from a failure
    (``StreamExecution.PROXY_ERROR``), and nothing long after it: see
    :func:`dstl.spark.operator.stop_interruption`.
    """

    def __init__(self, operator: str, batch_id: int, interrupted_call: str):
        self.operator = operator
        self.batch_id = batch_id
        self.interrupted_call = interrupted_call
        super().__init__(f"operator {operator!r}, batch {batch_id}: interrupted because its "
                         "streaming query is stopping; the next start runs the batch again "
                         "from the checkpoint before it (nothing is lost or counted twice). "
                         f"Interrupted call: {interrupted_call}")


class StateError(DstlError):
    """A state table or keyed backend failed or was misused."""


class StateSchemaError(StateError):
    """A state's declared type cannot read the values stored under its recorded type (an
    incompatible change), or a stored value does not fit the type declared for it.

    Attributes:
        state: the state's name.
        recorded: the type recorded in the store (Spark DDL; ``None``: none was recorded).
        declared: the type the processor declares now (Spark DDL).
        problems: what does not fit, one phrase each.
    """

    def __init__(self, state: str, recorded: str | None, declared: str, problems: list[str],
                 owner: str = ""):
        self.state = state
        self.recorded = recorded
        self.declared = declared
        self.problems = list(problems)
        where = f" of {owner}" if owner else ""
        if recorded is None:
            what = (f"state {state!r}{where} is declared {declared} but holds values written "
                     f"without a declared type that do not fit it: {'; '.join(problems)}")
        else:
            what = (f"state {state!r}{where} was written with the type {recorded} and is "
                    f"declared {declared} now, which cannot read its values: "
                    f"{'; '.join(problems)}")
        super().__init__(
            what + ". Declare a compatible type (fields may be added as nullable, removed or "
            "moved; integral types widened, to double too), or keep the old declaration, or "
            "give the new type a new state name (delete the old one with "
            "handle.delete_if_exists)")


class StateTableFullError(StateError):
    """An LMDB environment reached its map size and may not grow further."""

    def __init__(self, path: str, map_size_bytes: int, setting: str = "lmdb_max_map_size_bytes"):
        self.path = path
        self.map_size_bytes = map_size_bytes
        self.setting = setting
        super().__init__(f"LMDB environment {path} is full at map size {map_size_bytes} bytes "
                         f"(raise {setting})")


class BackendFailedError(StateError):
    """A keyed backend stopped after too many consecutive materialization failures."""


class CacheError(DstlError):
    """The local restore cache failed or was misused."""


class LeaseError(CacheError):
    """A cache lease was released twice or used after release."""


class CacheFullError(CacheError):
    """The cache cannot hold an object (size budget or local disk)."""


# --------------------------------------------------------------------------- placing an error


def located(exc: DstlError, key: str, offset: int, context: str) -> DstlError:
    """The same error, placed in the stored object it came from.

    Decoders of parts of an object (a change payload, a state value, a metadata record) do not
    know the object they were cut from and name a placeholder (``<change>``, ``<state value>``);
    the reader that does know re-raises their errors through this function, so every error of a
    stored object names the object's key and an offset in it. The result has the same type and
    attributes, ``key`` and ``offset`` set to the object's, and ``context`` (what was being
    decoded: which change of which change set) in its message. A
    :class:`CorruptObjectError` that already names a real object is returned as it is.
    """
    out = type(exc).__new__(type(exc))
    out.__dict__.update(exc.__dict__)
    out.__traceback__ = exc.__traceback__
    if isinstance(exc, CorruptObjectError):
        if not exc.key.startswith("<"):
            return exc
        inner = f" (at offset {exc.offset} of it)" if exc.offset else ""
        CorruptObjectError.__init__(out, key, offset,  # type: ignore[arg-type]
                                    f"{context}{inner}: {exc.reason}",
                                    getattr(exc, "hint", "the object is damaged; restore from "
                                                         "an earlier checkpoint"))
        return out
    Exception.__init__(out, f"{key} at offset {offset}: {context}: {exc}")
    out.key = key  # type: ignore[attr-defined]
    out.offset = offset  # type: ignore[attr-defined]
    return out


#: Builtin exceptions a decoder bug could let escape on crafted input; readers of stored objects
#: turn them into CorruptObjectError naming the object (their cause chained), never let them out.
DECODER_BUGS = (
    TypeError, ValueError, KeyError, IndexError, AttributeError, AssertionError, RecursionError,
    MemoryError, OverflowError, UnicodeError, struct.error)


def placed(exc: BaseException, key: str, offset: int, context: str) -> DstlError:
    """``exc`` (raised while decoding or applying part of object ``key``) as a DSTL error that
    names the object and the offset: :func:`located` for a DSTL error (a
    :class:`StorageError` is the environment's, not the object's, and stays as it is), a
    :class:`CorruptObjectError` for one of :data:`DECODER_BUGS`."""
    if isinstance(exc, DstlError):
        if isinstance(exc, StorageError):
            return exc
        return located(exc, key, offset, context)
    return CorruptObjectError(key, offset, f"{context}: {type(exc).__name__}: {exc!s:.300}",
                              hint="the object is damaged or crafted, or a decoder has a bug "
                                   "(see the chained cause); restore from an earlier checkpoint")
