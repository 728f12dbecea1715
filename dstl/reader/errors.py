"""The reader's typed errors (all in the :mod:`dstl.errors` hierarchy).

A reader meets three situations a caller must tell apart: it asked for a checkpoint the store does
not hold (:class:`CheckpointNotFoundError`, the caller's to fix), a checkpoint it was reading was
deleted by the running job's retention meanwhile (:class:`CheckpointDeletedError`, read a newer
one), and a change feed whose start fell out of retention (:class:`ChangesLostError`, which names
the checkpoints whose changes are gone). Damaged objects keep their
:class:`~dstl.errors.CorruptObjectError` types, and a missing object whose checkpoint still exists
is an :class:`~dstl.errors.ObjectNotFoundError` naming both. A ``typed_value`` type that a
stored value does not convert to is the caller's to fix (:class:`ValueTypeError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dstl.errors import DstlError, ObjectNotFoundError, UsageError

__all__ = ["ChangesLostError", "CheckpointDeletedError", "CheckpointNotFoundError",
           "NoStoreError", "ValueTypeError"]


def _ids(ids: Sequence[int]) -> str:
    if not ids:
        return "none"
    if len(ids) > 6:
        return f"{ids[0]}..{ids[-1]} ({len(ids)} checkpoints)"
    return ", ".join(str(i) for i in ids)


class CheckpointNotFoundError(UsageError):
    """The store holds no checkpoint with this id (or none at all).

    Attributes:
        checkpoint_id: the id asked for (``None``: the newest, and there is none).
        location: the store.
        available: the checkpoint ids the store holds.
    """

    def __init__(self, checkpoint_id: int | None, location: str, available: Sequence[int]):
        self.checkpoint_id = checkpoint_id
        self.location = location
        self.available = tuple(available)
        what = "no checkpoint" if checkpoint_id is None else f"no checkpoint {checkpoint_id}"
        super().__init__(f"{location} holds {what} (checkpoints there: {_ids(available)}); "
                         "pick one of those, or omit the checkpoint for the newest")


class NoStoreError(UsageError):
    """The root the reader was pointed at is not a DSTL store (see
    :func:`dstl.reader.store.require_store` for what is one).

    Attributes:
        location: the root.
        found: what is there instead (``"it is empty"``, ``"it holds a Spark checkpoint ..."``).
    """

    def __init__(self, location: str, found: str, fix: str):
        self.location = location
        self.found = found
        super().__init__(f"no DSTL store at {location}: {found}; {fix}")


class CheckpointDeletedError(ObjectNotFoundError):
    """A checkpoint being read was deleted meanwhile (the job's retention subsumed it).

    Attributes:
        checkpoint_id: the checkpoint.
        key: the object that was found missing.
    """

    def __init__(self, checkpoint_id: int, key: str, location: str):
        self.checkpoint_id = checkpoint_id
        super().__init__(f"checkpoint {checkpoint_id} of {location} was deleted while it was "
                         f"being read ({key} is gone, and so is its manifest): the running job's "
                         "retention subsumed it; read a newer checkpoint, or run the job with a "
                         "larger retained=", key=key)


class ChangesLostError(DstlError):
    """A change feed starts at a checkpoint the store no longer retains: the changes after it up
    to the oldest retained checkpoint are gone.

    Attributes:
        start: the feed's start (exclusive).
        oldest: the oldest checkpoint still retained (``None``: none is).
        lost: ``(start, oldest)``: the changes of checkpoints in ``(start, oldest]`` cannot be
            read.
    """

    def __init__(self, start: int, oldest: int | None, location: str, option: str):
        self.start = start
        self.oldest = oldest
        self.lost = (start, oldest)
        gone = (f"the changes of checkpoints {start + 1}..{oldest}" if oldest is not None
                else f"every change after checkpoint {start}")
        super().__init__(f"change feed of {location} from checkpoint {start}: checkpoint {start} "
                         f"is no longer retained (oldest retained: "
                         f"{'none' if oldest is None else oldest}), so {gone} are lost; the "
                         "consumer fell behind the job's retention. Resume from the oldest "
                         f"retained checkpoint with {option} (those changes stay lost: re-read "
                         "the state to rebuild), or run the job with a larger retained=")


class ValueTypeError(UsageError):
    """A value does not convert to the type asked for the ``typed_value`` column (the Spark
    sources' ``valueType`` option or a user-specified schema's ``typed_value``).

    Attributes:
        state: the state whose value it is.
        key: the entry's key (decoded).
        value: the value (decoded by the state's codec).
        type: the Arrow type asked for.
    """

    def __init__(self, state: str, key: Any, value: Any, type_: Any, reason: str):
        self.state = state
        self.key = key
        self.value = value
        self.type = type_
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        super().__init__(f"state {state!r}, key {key!r}: value {shown} ({type(value).__name__}) "
                         f"does not convert to typed_value {type_} ({reason}); ask for a type "
                         "every value of the state converts to (valueType, or typed_value in the "
                         "schema), narrow the read to states of that type (.option(\"state\", "
                         "name)), or read the JSON text column value instead")
