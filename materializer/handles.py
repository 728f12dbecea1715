"""``ChangelogStateBackendHandle``: what one backend contributes to a checkpoint.

= the materialized snapshot objects (usually one; several after a rescaling restore) + the
changelog handles after them (the restored non-materialized handles, kept until the first
materialization after a restore, then this checkpoint's delta). It travels through manifests
(untrusted input): ``from_json`` validates every field and every object key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dstl.errors import UsageError
from dstl.handle import ChangelogHandle
from dstl.keygroups import KeyGroupRange
from dstl.stores.base import check_key

__all__ = ["ChangelogStateBackendHandle", "SnapshotRef"]


def _int(obj: dict[str, Any], name: str, minimum: int = 0) -> int:
    v = obj.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise UsageError(f"malformed backend handle: {name}={v!r}")
    return v


@dataclass(frozen=True, slots=True)
class SnapshotRef:
    """A materialized snapshot object."""

    key: str
    size: int
    key_groups: KeyGroupRange
    materialization_id: int

    def to_json_obj(self) -> dict[str, Any]:
        return {"key": self.key, "size": self.size, "key_groups": self.key_groups.to_json_obj(),
                "materialization_id": self.materialization_id}

    @classmethod
    def from_json_obj(cls, obj: Any) -> SnapshotRef:
        if not isinstance(obj, dict):
            raise UsageError(f"malformed snapshot reference {obj!r}")
        return cls(check_key(obj.get("key")), _int(obj, "size"),
                   KeyGroupRange.from_json_obj(obj.get("key_groups")),
                   _int(obj, "materialization_id"))


@dataclass(frozen=True, slots=True)
class ChangelogStateBackendHandle:
    """One backend's part of a checkpoint.

    Attributes:
        operator_id: the backend's operator id (also its log id).
        key_groups: its key-group range.
        checkpoint_id: the checkpoint.
        materialization_id: id of the newest materialization in ``materialized``.
        materialized: snapshot objects.
        non_materialized: changelog handles to replay after the snapshots, in order.
        incremental_size: bytes newly uploaded for this checkpoint.
        max_parallelism: the job's number of key groups (a restore needs it).
    """

    operator_id: str
    key_groups: KeyGroupRange
    checkpoint_id: int
    materialization_id: int
    materialized: tuple[SnapshotRef, ...]
    non_materialized: tuple[ChangelogHandle, ...]
    incremental_size: int
    max_parallelism: int = 128

    @property
    def materialized_size(self) -> int:
        return sum(s.size for s in self.materialized)

    @property
    def non_materialized_size(self) -> int:
        return sum(h.stored_bytes for h in self.non_materialized)

    @property
    def full_size(self) -> int:
        """Bytes a restore reads (snapshots + log records)."""
        return self.materialized_size + self.non_materialized_size

    def referenced_keys(self) -> list[str]:
        """Every object this handle needs (for the coordinator's registry)."""
        keys = [s.key for s in self.materialized]
        for h in self.non_materialized:
            keys.extend(h.segment_keys())
        return list(dict.fromkeys(keys))

    def to_json_obj(self) -> dict[str, Any]:
        return {"v": 1, "operator_id": self.operator_id,
                "key_groups": self.key_groups.to_json_obj(),
                "checkpoint_id": self.checkpoint_id,
                "materialization_id": self.materialization_id,
                "materialized": [s.to_json_obj() for s in self.materialized],
                "non_materialized": [h.to_json_obj() for h in self.non_materialized],
                "incremental_size": self.incremental_size,
                "max_parallelism": self.max_parallelism}

    def to_json(self) -> str:
        return json.dumps(self.to_json_obj(), separators=(",", ":"))

    @classmethod
    def from_json_obj(cls, obj: Any) -> ChangelogStateBackendHandle:
        if not isinstance(obj, dict) or obj.get("v") != 1:
            raise UsageError("malformed backend handle: expected an object with v=1")
        op = obj.get("operator_id")
        if not isinstance(op, str) or not op:
            raise UsageError(f"malformed backend handle: operator_id={op!r}")
        mats = obj.get("materialized")
        nons = obj.get("non_materialized")
        if not isinstance(mats, list) or not isinstance(nons, list):
            raise UsageError("malformed backend handle: materialized/non_materialized must be "
                             "lists")
        return cls(op, KeyGroupRange.from_json_obj(obj.get("key_groups")),
                   _int(obj, "checkpoint_id", -1), _int(obj, "materialization_id"),
                   tuple(SnapshotRef.from_json_obj(s) for s in mats),
                   tuple(ChangelogHandle.from_json_obj(h) for h in nons),
                   _int(obj, "incremental_size"), _int(obj, "max_parallelism", 1))

    @classmethod
    def from_json(cls, s: str | bytes) -> ChangelogStateBackendHandle:
        """Parse and validate (untrusted input)."""
        try:
            obj = json.loads(s)
        except (ValueError, TypeError) as exc:
            raise UsageError(f"backend handle is not valid JSON: {exc}") from exc
        return cls.from_json_obj(obj)
