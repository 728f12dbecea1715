"""One-call reads for callers in one process (the CLI, tests, notebooks): plan, then read every
split in order. The Spark sources plan on the driver and read the splits on executors instead.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

from dstl.keygroups import key_group_for
from dstl.reader.catalog import CheckpointCatalog, task_states
from dstl.reader.changes import OnLost, plan_change_range, read_change_split
from dstl.reader.plan import plan_state_splits
from dstl.reader.rows import ChangeRow, StateRow
from dstl.reader.state import read_state_split
from materializer.codecs import StrOrBytesKeyCodec
from restore.leasing import LeasingCache

__all__ = ["key_bytes_of", "read_changes", "read_state"]


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
    """
    manifest = catalog.manifest(checkpoint_id)
    tasks = task_states(manifest)
    wanted = None if keys is None else key_bytes_of(keys)
    kgs = None
    if wanted is not None and tasks:
        mp = tasks[0].handle.max_parallelism
        kgs = {key_group_for(k, mp) for k in wanted}
    for split in plan_state_splits(manifest.checkpoint_id, tasks, key_groups=kgs,
                                   max_key_groups=max_key_groups):
        yield from read_state_split(catalog.store, split, cache=cache, table=table,
                                    allow_pickle=allow_pickle, keys=wanted, states=states)


def read_changes(catalog: CheckpointCatalog, start: int | None, end: int | None = None, *,
                 on_lost: OnLost = "fail", cache: LeasingCache | None = None,
                 allow_pickle: bool = False) -> Iterator[ChangeRow]:
    """Every change after checkpoint ``start`` (``None``: from the empty state) up to ``end``
    (``None``: the newest), checkpoint by checkpoint, in log order per key."""
    plan = plan_change_range(catalog, start, end, on_lost=on_lost)
    for split in plan.splits:
        yield from read_change_split(catalog.store, split, cache=cache,
                                     allow_pickle=allow_pickle)
