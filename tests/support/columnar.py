"""The column-wise state read (dstl.reader.columns) in the row path's terms, for tests: every
split of a checkpoint read by ``read_state_batches``, each Arrow row turned back into a
:class:`~dstl.reader.StateRow` (JSON columns decoded with ``from_json``; the key as the row path
gives it: text when it is UTF-8, else its bytes)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import pyarrow as pa

from dstl.keygroups import key_group_for
from dstl.reader import (
    CheckpointCatalog,
    StateRow,
    from_json,
    key_bytes_of,
    plan_state_splits,
    read_state_split,
    task_states,
)
from dstl.reader.arrow import STATE_SCHEMA, batches
from dstl.reader.columns import read_state_batches, read_state_table, state_schema


def _splits(catalog: CheckpointCatalog, checkpoint_id: int | None,
            keys: Collection[str | bytes] | None, max_key_groups: int | None) -> list[Any]:
    manifest = catalog.manifest(checkpoint_id)
    tasks = task_states(manifest)
    kgs = None
    if keys is not None and tasks:
        kgs = {key_group_for(k, tasks[0].handle.max_parallelism) for k in key_bytes_of(keys)}
    return plan_state_splits(manifest.checkpoint_id, tasks, key_groups=kgs,
                             max_key_groups=max_key_groups)


def column_table(catalog: CheckpointCatalog, checkpoint_id: int | None = None, *,
                 keys: Collection[str | bytes] | None = None,
                 states: Collection[str] | None = None, allow_pickle: bool = False,
                 max_key_groups: int | None = None, cache: Any = None,
                 columns: list[str] | None = None,
                 typed: tuple[str, pa.DataType] | None = None) -> pa.Table:
    """Every split's record batches (column-wise path) as one table (of ``columns``)."""
    wanted = None if keys is None else key_bytes_of(keys)
    schema = state_schema(columns, typed)
    out = []
    for split in _splits(catalog, checkpoint_id, keys, max_key_groups):
        for b in read_state_batches(catalog.store, split, cache=cache,
                                    allow_pickle=allow_pickle, keys=wanted, states=states,
                                    columns=columns, typed=typed):
            assert b.schema == schema
            out.append(b)
    return pa.Table.from_batches(out, schema=schema)


def row_table(catalog: CheckpointCatalog, checkpoint_id: int | None = None, *,
              keys: Collection[str | bytes] | None = None,
              states: Collection[str] | None = None, allow_pickle: bool = False,
              max_key_groups: int | None = None, table: str = "heap",
              typed: tuple[str, pa.DataType] | None = None) -> pa.Table:
    """The same through the row path (``read_state_split`` + ``arrow.batches``)."""
    wanted = None if keys is None else key_bytes_of(keys)
    out = []
    for split in _splits(catalog, checkpoint_id, keys, max_key_groups):
        out.extend(batches(read_state_split(catalog.store, split, table=table,
                                            allow_pickle=allow_pickle, keys=wanted,
                                            states=states), STATE_SCHEMA, typed=typed))
    return pa.Table.from_batches(out, schema=state_schema(None, typed))


def sorted_rows(t: pa.Table) -> list[tuple[Any, ...]]:
    """A table's rows, in a fixed order (the two paths may order rows differently)."""
    return sorted((tuple(r.values()) for r in t.to_pylist()), key=repr)


def rows_of(t: pa.Table) -> list[StateRow]:
    """A STATE_SCHEMA table as state rows (values decoded from their JSON)."""
    rows = []
    for r in t.to_pylist():
        key = r["key"] if r["key"] is not None else r["key_bytes"]
        rows.append(StateRow(r["checkpoint"], r["partition"], r["key_group"], key,
                             r["key_bytes"], r["state"], r["kind"], from_json(r["namespace"]),
                             from_json(r["user_key"]), from_json(r["value"])))
    return rows


def read_state_columns(catalog: CheckpointCatalog, checkpoint_id: int | None = None,
                       **kw: Any) -> list[StateRow]:
    """:func:`column_table` as state rows (values decoded from their JSON)."""
    return rows_of(column_table(catalog, checkpoint_id, **kw))


def read_state_table_rows(catalog: CheckpointCatalog, checkpoint_id: int | None = None,
                          **kw: Any) -> list[StateRow]:
    """:func:`dstl.reader.columns.read_state_table` (the whole checkpoint, column-wise, as
    ``dstl state dump --format parquet`` reads it) as state rows."""
    batches = list(read_state_table(catalog, checkpoint_id, **kw))
    assert all(b.schema == STATE_SCHEMA for b in batches)
    return rows_of(pa.Table.from_batches(batches, schema=STATE_SCHEMA))
