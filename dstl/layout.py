"""The store layout: the one module that names (and parses the names of) every object DSTL stores.

Pure: no I/O, no clock, no randomness — callers pass the creation time and any random part, so
every name here is a function of its arguments.

Store layout (keys are relative to the storage root, see :mod:`dstl.stores`)
---------------------------------------------------------------------------------

==========================================================================  =====================
key                                                                         written by
==========================================================================  =====================
``dstl/{created_ms:011x}-{storage_id}-{upload_no:08x}-{attempt:02x}.seg``   upload scheduler
                                                                            (:func:`segment_key`)
``snapshots/{operator_dir}/{created_ms:011x}-{mat_id:08x}-{nonce}.snap``    materializer
                                                                            (:func:`snapshot_key`)
``checkpoints/{checkpoint_id:016x}-{attempt:04x}.manifest``                 checkpoint coordinator
                                                                            (:func:`manifest_key`)
==========================================================================  =====================

Rules every name follows:

- **Fixed-width lowercase hex** for every number, so lexical order (what ``list`` returns) is
  numeric order: segments and snapshots sort by creation time, manifests by checkpoint id then
  attempt (:data:`MAX_CHECKPOINT_ID`, :data:`MAX_ATTEMPT` are the widths' limits).
- **Write-once, never reused**: a segment name carries the writing process's random
  ``storage_id`` and the upload attempt; a snapshot name a random ``nonce``; a manifest name the
  attempt number. A retried write therefore always writes a new name.
- **Creation time first**: segment and snapshot base names start with ``{created_ms:011x}-``, which
  :func:`created_ms_of` reads back; orphan collection uses it as the object's age.
- **Referenceable prefixes**: checkpoints may name (and so retention may delete) only objects
  below :data:`REFERENCE_PREFIXES` (``dstl/`` and ``snapshots/``), never a manifest or a foreign
  file in the same root.
- **Operator directories** are sanitised by :func:`operator_dir` (no ``/``, no ``..``); the same
  rule names the executor-local directories of an operator (LMDB environments, caches), which are
  local-disk names and not part of the store layout.

This module lives in the log core (not in :mod:`dstl.checkpoint`) because the core's upload
scheduler names segments and the core never imports the checkpoint layer.
"""

from __future__ import annotations

import re

from dstl.errors import UsageError

__all__ = [
    "MANIFEST_PREFIX",
    "MAX_ATTEMPT",
    "MAX_CHECKPOINT_ID",
    "REFERENCE_PREFIXES",
    "SEGMENT_PREFIX",
    "SNAPSHOT_PREFIX",
    "created_ms_of",
    "manifest_key",
    "operator_dir",
    "parse_manifest_key",
    "segment_key",
    "snapshot_key",
]

#: Where segments (the log) live.
SEGMENT_PREFIX = "dstl/"
#: Where materialized snapshots live, one directory per operator.
SNAPSHOT_PREFIX = "snapshots/"
#: Where checkpoint manifests live.
MANIFEST_PREFIX = "checkpoints/"
#: Objects a checkpoint may reference: segments and materialized snapshots. Nothing else in the
#: root (manifests, other applications' files) can be named, and so deleted.
REFERENCE_PREFIXES: tuple[str, ...] = (SEGMENT_PREFIX, SNAPSHOT_PREFIX)
#: 16 hex digits in a manifest name.
MAX_CHECKPOINT_ID = 16**16 - 1
#: 4 hex digits in a manifest name; attempts start at 1.
MAX_ATTEMPT = 16**4 - 1

_MANIFEST_NAME = re.compile(r"checkpoints/([0-9a-f]{16})-([0-9a-f]{4})\.manifest")
#: Segment and snapshot base names start with the creation time in epoch ms, 11 hex digits.
_CREATED_PREFIX = re.compile(r"([0-9a-f]{11})-")


def segment_key(created_ms: int, storage_id: str, upload_no: int, attempt: int) -> str:
    """Object key of one segment upload attempt; fixed width, so lexical order is creation order.

    Args:
        created_ms: when the segment was cut, epoch ms.
        storage_id: the writing process's random id (``ChangelogStorage.storage_id``).
        upload_no: the process's segment counter.
        attempt: the upload attempt (a retry writes a new name).
    """
    return f"{SEGMENT_PREFIX}{created_ms:011x}-{storage_id}-{upload_no:08x}-{attempt:02x}.seg"


def snapshot_key(operator_id: str, materialization_id: int, created_ms: int, nonce: str) -> str:
    """Object key of one materialized snapshot of ``operator_id``; creation-ordered.

    Args:
        operator_id: the operator; sanitised into a directory name (:func:`operator_dir`).
        materialization_id: the backend's materialization counter.
        created_ms: when the snapshot was written, epoch ms.
        nonce: a random hex string (the caller's), so two writers never share a name.
    """
    return (f"{SNAPSHOT_PREFIX}{operator_dir(operator_id)}/"
            f"{created_ms:011x}-{materialization_id:08x}-{nonce}.snap")


def operator_dir(operator_id: str) -> str:
    """A directory/object-name component for an operator id (no ``/``, no ``..``)."""
    out = "".join(c if c.isalnum() or c in "-_." else "_" for c in operator_id)
    return out.strip(".") or "op"


def manifest_key(checkpoint_id: int, attempt: int) -> str:
    """The object key of one manifest attempt.

    Raises:
        UsageError: the id or attempt does not fit the fixed-width name.
    """
    _check_width(checkpoint_id, 0, MAX_CHECKPOINT_ID, "checkpoint_id")
    _check_width(attempt, 1, MAX_ATTEMPT, "attempt")
    return f"{MANIFEST_PREFIX}{checkpoint_id:016x}-{attempt:04x}.manifest"


def parse_manifest_key(key: str) -> tuple[int, int] | None:
    """``(checkpoint_id, attempt)`` of a manifest key, or ``None`` if ``key`` is not one."""
    match = _MANIFEST_NAME.fullmatch(key)
    if match is None:
        return None
    attempt = int(match.group(2), 16)
    return (int(match.group(1), 16), attempt) if attempt >= 1 else None


def created_ms_of(key: str) -> int | None:
    """Creation time (epoch ms) encoded at the start of an object's base name, or ``None``.

    Segments (:func:`segment_key`) and snapshots (:func:`snapshot_key`) both start their base name
    with ``{created_ms:011x}-``.
    """
    match = _CREATED_PREFIX.match(key.rpartition("/")[2])
    return None if match is None else int(match.group(1), 16)


def _check_width(v: object, lo: int, hi: int, field: str) -> None:
    if not isinstance(v, int) or isinstance(v, bool):
        raise UsageError(f"checkpoint manifest field {field}: expected an integer, got "
                         f"{type(v).__name__}")
    if not lo <= v <= hi:
        raise UsageError(f"checkpoint manifest field {field}: {v} is out of range [{lo}, {hi}]")
