"""One-call reads for callers in one process (the CLI, tests, notebooks): plan, then read every
split in order. The Spark sources plan on the driver and read the splits on executors instead.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator

from dstl.checks import check_bool, check_instance
from dstl.keygroups import key_group_for
from dstl.reader.catalog import CheckpointCatalog, task_states
from dstl.reader.changes import OnLost, plan_change_range, read_change_split
from dstl.reader.checks import (
    check_cache,
    check_checkpoint_id,
    check_key_group_count,
    check_keys,
    check_names,
    check_table,
)
from dstl.reader.plan import ChangeSplit, StateSplit, plan_state_splits
from dstl.reader.rows import ChangeRow, StateRow
from dstl.reader.state import read_state_split
from materializer.codecs import StrOrBytesKeyCodec
from restore.leasing import LeasingCache

__all__ = ["key_bytes_of", "plan_state_read", "read_changes", "read_state"]


def key_bytes_of(keys: Collection[str | bytes]) -> frozenset[bytes]:
    """The key-codec bytes of user keys (str as UTF-8, bytes as they are).

    Raises:
        UsageError: a key of another type.
    """
    codec = StrOrBytesKeyCodec()
    return frozenset(codec.encode(k) for k in keys)


def read_state(catalog: CheckpointCatalog, checkpoint_id: int | None = None, *,
               keys: Collection[str | bytes] | None = None,
               states: Collection[str] | None = None, cache: LeasingCache | None = None,
               table: str = "heap", allow_pickle: bool = False,
               max_key_groups: int | None = None) -> Iterator[StateRow]:
    """Every state row of a checkpoint (``None``: the newest), split by split.

    Args:
        catalog: the store's checkpoints.
        checkpoint_id: which checkpoint.
        keys: only these keys; only the key groups that can hold them are read.
        states: only these state names.
        cache, table, allow_pickle: see :func:`~dstl.reader.state.read_state_split`.
        max_key_groups: key groups per split.

    Raises:
        ConfigError: an argument of the wrong type or out of range (raised by the call, before
            anything is read).
    """
    owner = "read_state"
    check_instance(catalog, "catalog", owner, CheckpointCatalog)
    check_checkpoint_id(checkpoint_id, "checkpoint_id", owner)
    check_keys(keys, owner)
    states = check_names(states, "states", owner)
    check_table(table, owner)
    check_bool(allow_pickle, "allow_pickle", owner)
    check_key_group_count(max_key_groups, "max_key_groups", owner)
    check_cache(cache, owner)
    return _read_state(catalog, checkpoint_id, keys, states, cache, table, allow_pickle,
                       max_key_groups)


def plan_state_read(catalog: CheckpointCatalog, checkpoint_id: int | None,
                    keys: Collection[str | bytes] | None, max_key_groups: int | None
                    ) -> tuple[list[StateSplit], frozenset[bytes] | None]:
    """The splits of a whole-checkpoint read (only the key groups that can hold ``keys``) and
    the keys' bytes: the plan :func:`read_state` and
    :func:`dstl.reader.columns.read_state_table` read (arguments checked by them)."""
    manifest = catalog.manifest(checkpoint_id)
    tasks = task_states(manifest)
    wanted = None if keys is None else key_bytes_of(keys)
    kgs = None
    if wanted is not None and tasks:
        mp = tasks[0].handle.max_parallelism
        kgs = {key_group_for(k, mp) for k in wanted}
    return plan_state_splits(manifest.checkpoint_id, tasks, key_groups=kgs,
                             max_key_groups=max_key_groups), wanted


def _read_state(catalog: CheckpointCatalog, checkpoint_id: int | None,
                keys: Collection[str | bytes] | None, states: Collection[str] | None,
                cache: LeasingCache | None, table: str, allow_pickle: bool,
                max_key_groups: int | None) -> Iterator[StateRow]:
    splits, wanted = plan_state_read(catalog, checkpoint_id, keys, max_key_groups)
    for split in splits:
        yield from read_state_split(catalog.store, split, cache=cache, table=table,
                                    allow_pickle=allow_pickle, keys=wanted, states=states)


def read_changes(catalog: CheckpointCatalog, start: int | None, end: int | None = None, *,
                 on_lost: OnLost = "fail", cache: LeasingCache | None = None,
                 allow_pickle: bool = False, lost_option: str = "on_lost='oldest'"
                 ) -> Iterator[ChangeRow]:
    """Every change after checkpoint ``start`` (``None``: from the empty state) up to ``end``
    (``None``: the newest), checkpoint by checkpoint, in log order per key.

    The feed is planned by the call (so a start that fell out of retention raises
    :class:`~dstl.reader.ChangesLostError` here, naming ``lost_option`` as the way to resume
    from the oldest retained checkpoint, and a malformed argument a
    :class:`~dstl.errors.ConfigError`); the changes are read as the result is iterated."""
    check_bool(allow_pickle, "allow_pickle", "read_changes")
    check_cache(cache, "read_changes")
    plan = plan_change_range(catalog, start, end, on_lost=on_lost, lost_option=lost_option)
    return _read_changes(catalog, plan.splits, cache, allow_pickle)


def _read_changes(catalog: CheckpointCatalog, splits: Iterable[ChangeSplit],
                  cache: LeasingCache | None, allow_pickle: bool) -> Iterator[ChangeRow]:
    for split in splits:
        yield from read_change_split(catalog.store, split, cache=cache,
                                     allow_pickle=allow_pickle)
