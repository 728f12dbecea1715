"""The state side: heap and LMDB state tables, their snapshot format, and the facade over both.

See ``docs/state_tables.md``. Modules:

- :mod:`materializer.cow_map` — ``CopyOnWriteStateMap`` (one key group, Flink's COW hash map);
- :mod:`materializer.cow_table` — ``CopyOnWriteStateTable`` (one state, a map per key group);
- :mod:`materializer.lmdb_table` — ``LmdbStateTable`` (all states, one LMDB environment);
- :mod:`materializer.state_tables` — the ``StateTables`` facade, ``HeapStateTables``, snapshot
  write-out and ``SnapshotReader``;
- :mod:`materializer.snapshot_format` — the snapshot object format v1 (pure codec);
- :mod:`materializer.backend` — ``ChangelogKeyedStateBackend`` (table + log + checkpoints), a
  facade over its jobs: :mod:`materializer.state_registry`, :mod:`materializer.state_access`
  (the write path), :mod:`materializer.declared_types`, :mod:`materializer.snapshot_writers`,
  :mod:`materializer.checkpoint_book`, :mod:`materializer.restore_target`,
  :mod:`materializer.base_installs`;
- :mod:`materializer.policy` — ``MaterializationPolicy``: when a materialization is due (pure);
  :mod:`materializer.manager` — ``MaterializationManager``: the runtime around it (timer,
  guards, materializer thread, the materialized base);
- :mod:`materializer.states` — descriptors and state objects; :mod:`materializer.changes` — the
  change payload format; :mod:`materializer.codecs` — key/value codecs (safe by default);
- :mod:`materializer.handles` — ``ChangelogStateBackendHandle``; :mod:`materializer.options`;
- :mod:`materializer.table_marker` — what an on-disk table reflects, stored in it;
  :mod:`materializer.external` — materializing an on-disk table from another process.
"""

from materializer.backend import ChangelogKeyedStateBackend
from materializer.codecs import BytesCodec, PickleCodec, SafeCodec
from materializer.cow_map import CopyOnWriteStateMap, CopyOnWriteStateMapSnapshot, is_immutable
from materializer.cow_table import CopyOnWriteStateTable, CopyOnWriteStateTableSnapshot
from materializer.external import ExternalMaterialization, materialize_table_directory
from materializer.handles import ChangelogStateBackendHandle, SnapshotRef
from materializer.lmdb_table import ForkedTableError, LmdbStateTable, LmdbTableSnapshot
from materializer.options import BackendOptions
from materializer.snapshot_format import (
    SnapshotContents,
    SnapshotEncoder,
    SnapshotIndex,
    decode_block,
    decode_footer,
    decode_index,
    decode_snapshot,
    encode_snapshot,
)
from materializer.state_tables import (
    BlobRangeSource,
    BytesSource,
    HeapStateTables,
    HeapTablesSnapshot,
    SnapshotReader,
    SnapshotWriteStats,
    StateTables,
    TablesSnapshot,
)
from materializer.states import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    ValueStateDescriptor,
)
from materializer.table_marker import TableMarker

__all__ = [
    "AggregatingStateDescriptor",
    "BackendOptions",
    "BytesCodec",
    "ChangelogKeyedStateBackend",
    "ChangelogStateBackendHandle",
    "ListStateDescriptor",
    "MapStateDescriptor",
    "PickleCodec",
    "ReducingStateDescriptor",
    "SafeCodec",
    "SnapshotRef",
    "ValueStateDescriptor",
    "BlobRangeSource",
    "BytesSource",
    "CopyOnWriteStateMap",
    "CopyOnWriteStateMapSnapshot",
    "CopyOnWriteStateTable",
    "CopyOnWriteStateTableSnapshot",
    "ForkedTableError",
    "HeapStateTables",
    "HeapTablesSnapshot",
    "LmdbStateTable",
    "LmdbTableSnapshot",
    "SnapshotContents",
    "SnapshotEncoder",
    "SnapshotIndex",
    "SnapshotReader",
    "SnapshotWriteStats",
    "StateTables",
    "TablesSnapshot",
    "decode_block",
    "decode_footer",
    "decode_index",
    "decode_snapshot",
    "encode_snapshot",
    "is_immutable",
    "ExternalMaterialization",
    "TableMarker",
    "materialize_table_directory",
]
