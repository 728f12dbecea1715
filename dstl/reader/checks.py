"""Argument checks of the state reader: its functions' arguments and the Spark sources' options.

Theory of operation
-------------------
The reader is called two ways, and both get :mod:`dstl.checks`' rules and message shape
(``owner.field=value is invalid: expected ...``; a wrong type is a
:class:`~dstl.errors.ConfigTypeError`, a value out of range a :class:`~dstl.errors.ConfigError`):

- **Python callers** (the CLI, notebooks, tests) pass typed values: a checkpoint id is an int
  (not a bool, not a float) in range; ``keys`` and ``states`` are collections of strings — a bare
  string is refused, since it is a collection of its characters and a read of ``states="clicks"``
  would silently look for states named ``c``, ``l``, ...; ``table`` and ``on_lost`` are one of
  their choices.
- **Spark's options** are strings (Spark stringifies ``.option("checkpoint", 3)``) and their keys
  are case-insensitive. :func:`source_int` and :func:`source_bool` parse them with the same
  ranges; :func:`check_source_keys` refuses an option neither source knows — a misspelt
  ``checkpiont`` would otherwise read the newest checkpoint instead of the one asked for — and
  options that the chosen mode ignores (``startCheckpoint`` without ``readChangeFeed``).

Every range has an upper bound: checkpoint ids fit a signed 64-bit value (Spark's offsets are
JSON longs), key-group counts :data:`~dstl.keygroups.MAX_PARALLELISM_LIMIT`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any, Final

from dstl.checks import (
    MAX_INT64,
    check_bool,
    check_choice,
    check_int,
    check_protocol,
    check_str,
)
from dstl.errors import ConfigError, ConfigTypeError
from dstl.keygroups import MAX_PARALLELISM_LIMIT

__all__ = ["SOURCE_OPTIONS", "TABLES", "check_cache", "check_checkpoint_id", "check_key_group_count",
           "check_key_bytes", "check_keys", "check_names", "check_source_keys", "check_table", "source_bool",
           "source_choice", "source_int"]

#: What ``table=`` may be: how a split's state is held while it is read.
TABLES: Final = ("heap", "lmdb")

#: Every option of the ``dstl`` and ``dstl_changes`` sources, lower case (Spark's keys are
#: case-insensitive), besides ``path`` and ``storage.<key>``.
_SPELLED: Final = (
    "operator", "checkpoint", "readChangeFeed", "startCheckpoint", "endCheckpoint",
    "keyGroupsPerSplit", "table", "allowPickle", "cache", "valueType", "state", "onLostChanges",
    "startingCheckpoint", "maxCheckpointsPerTrigger", "storageOptions", "internalStates")
SOURCE_OPTIONS: Final = frozenset(n.lower() for n in _SPELLED)
_SHOWN: Final = {n.lower(): n for n in _SPELLED}

#: Options that only some modes use: the stream, the batch change feed, any change feed, a
#: state read.
_STREAM_ONLY: Final = ("startingcheckpoint", "maxcheckpointspertrigger")
_BATCH_FEED_ONLY: Final = ("startcheckpoint", "endcheckpoint")
_FEED_ONLY: Final = ("onlostchanges",)
_STATE_ONLY: Final = ("checkpoint", "keygroupspersplit", "table")


def check_checkpoint_id(value: Any, field: str, owner: str, *, lo: int = 0,
                        optional: bool = True) -> int | None:
    """``None`` (when ``optional``) or a checkpoint id: an int in ``[lo, 2**63-1]`` (``lo=-1``
    where ``-1`` means the empty state before the first checkpoint)."""
    if value is None and optional:
        return None
    return check_int(value, field, owner, lo=lo, hi=MAX_INT64,
                     fix="" if lo >= 0 else "-1 (or None) is the empty state")


def check_key_group_count(value: Any, field: str, owner: str) -> int | None:
    """``None`` or a number of key groups in ``[1, MAX_PARALLELISM_LIMIT]``."""
    if value is None:
        return None
    return check_int(value, field, owner, lo=1, hi=MAX_PARALLELISM_LIMIT)


def check_cache(value: Any, owner: str) -> Any:
    """``None`` or a restore cache (a :class:`~restore.leasing.LeasingCache`: ``lease``)."""
    if value is None:
        return None
    return check_protocol(value, "cache", owner, ("lease",), "None or a LeasingCache "
                          "(restore.LocalFileCache)")


def check_table(value: Any, owner: str) -> str:
    """``table``: ``"heap"`` or ``"lmdb"``."""
    return check_choice(value, "table", owner, TABLES)


def _collection(value: Any, field: str, owner: str, expected: str) -> Collection[Any]:
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Collection):
        raise ConfigTypeError(field, value, expected, owner=owner,
                              fix=f"pass a list, e.g. {field}=[{value!r:.40}]"
                              if isinstance(value, (str, bytes)) else "")
    return value


def check_keys(value: Any, owner: str) -> Collection[str | bytes] | None:
    """``None`` or a collection of keys, each a ``str`` or ``bytes`` (the key codec's types)."""
    if value is None:
        return None
    expected = "None or a collection (list, set) of str or bytes keys"
    keys = _collection(value, "keys", owner, expected)
    for k in keys:
        if not isinstance(k, (str, bytes)):
            raise ConfigTypeError("keys", k, expected, owner=owner,
                                  fix="a key is the str or bytes the job keyed its state by")
    return keys


def check_key_bytes(value: Any, owner: str) -> Collection[bytes] | None:
    """``None`` or a collection of keys' bytes (what the key codec made of them)."""
    if value is None:
        return None
    expected = "None or a collection (set, list) of bytes (keys as the key codec stores them)"
    keys = _collection(value, "keys", owner, expected)
    for k in keys:
        if not isinstance(k, bytes):
            raise ConfigTypeError("keys", k, expected, owner=owner,
                                  fix="dstl.reader.key_bytes_of(keys) makes them")
    return keys


def check_names(value: Any, field: str, owner: str) -> frozenset[str] | None:
    """``None`` (every one) or a collection of names (state names, task ids); an empty one
    matches nothing (a pushed-down ``state = 'a' AND state = 'b'`` is one)."""
    if value is None:
        return None
    expected = "None or a collection (list, set) of names"
    names = _collection(value, field, owner, expected)
    return frozenset(check_str(n, field, owner) for n in names)


# --------------------------------------------------------------------------- Spark options


def source_int(options: Mapping[str, Any], name: str, shown: str, owner: str, *, lo: int,
               hi: int = MAX_INT64) -> int | None:
    """The integer option ``name`` (lower case; ``shown`` is how docs spell it) in ``[lo, hi]``,
    or ``None`` when absent. Spark passes option values as strings."""
    raw = options.get(name)
    if raw is None:
        return None
    expected = f"an integer in [{lo}, {hi}]"
    text = str(raw).strip()
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(shown, raw, expected, owner=owner) from None
    if not lo <= value <= hi or text != str(raw):
        raise ConfigError(shown, raw, expected, owner=owner)
    return value


def source_bool(options: Mapping[str, Any], name: str, shown: str, owner: str,
                default: bool) -> bool:
    """The boolean option ``name``: ``true``/``false`` (any case; Spark stringifies Python's
    ``True`` as ``true``), or ``default`` when absent."""
    raw = options.get(name)
    if raw is None:
        return default
    if isinstance(raw, bool):
        return check_bool(raw, shown, owner)
    text = str(raw).lower()
    if text in ("true", "false"):
        return text == "true"
    raise ConfigError(shown, raw, "true or false", owner=owner)


def source_choice(options: Mapping[str, Any], name: str, shown: str, owner: str,
                  choices: Iterable[str]) -> str:
    """The option ``name``, one of ``choices`` (matched in any case; the first is the
    default)."""
    options_ = tuple(choices)
    raw = options.get(name)
    if raw is None:
        return options_[0]
    for c in options_:
        if str(raw).lower() == c.lower():
            return c
    raise ConfigError(shown, raw, "one of " + ", ".join(repr(c) for c in options_), owner=owner)


def check_source_keys(options: Mapping[str, Any], owner: str, *, stream: bool | None,
                      change_feed: bool) -> None:
    """Refuse an option the source does not know, or one its mode would ignore.

    Args:
        options: Spark's options, keys lower case.
        owner: the source, for messages.
        stream: a ``readStream`` (``startingCheckpoint``, ``maxCheckpointsPerTrigger`` apply);
            ``None``: not known yet (Spark asks for the schema first), only names are checked.
        change_feed: a change feed (batch or stream): ``startCheckpoint`` and friends apply, a
            state read's options do not.
    """
    for key in options:
        if key == "path" or key.startswith("storage.") or key in SOURCE_OPTIONS:
            continue
        raise ConfigError(key, options[key], "an option of the dstl sources", owner=owner,
                          fix="see docs/spark.md, 'Reading state' (option names are "
                              "case-insensitive; storage options go in storage.<key>)")
    if stream is None:
        return
    ignored = [k for k in options if (k in _STREAM_ONLY and not stream)
               or (k in _BATCH_FEED_ONLY and (stream or not change_feed))
               or (k in _FEED_ONLY and not change_feed)
               or (k in _STATE_ONLY and change_feed)]
    if ignored:
        k = ignored[0]
        mode = ("a streaming change feed" if stream else
                "a change feed (readChangeFeed=true)" if change_feed else "a state read")
        raise ConfigError(_SHOWN[k], options[k], f"an option of {mode}, which has no "
                          f"{_SHOWN[k]}", owner=owner,
                          fix="startCheckpoint/endCheckpoint are options of the batch change "
                              "feed, startingCheckpoint/maxCheckpointsPerTrigger of the "
                              "stream, onLostChanges of both, checkpoint/keyGroupsPerSplit/"
                              "table of a state read (docs/spark.md)")
