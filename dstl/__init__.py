"""DSTL — the log: an append-only changelog of state changes, batched per process into
checksummed zstd segments on any fsspec store (after Flink's Durable Short-Term Log).

Public API (see docs/architecture.md)::

    from dstl import ChangelogStorage, DstlOptions, KeyGroupRange, ChangelogHandle
    storage = ChangelogStorage("s3://bucket/app", options=DstlOptions(), storage_options={...})
    writer = storage.create_writer("op-1/0", KeyGroupRange(0, 63))
    writer.append(key_group, payload); fut = writer.persist(from_sqn, checkpoint_id)
"""

from dstl.errors import DstlError
from dstl.handle import ChangelogHandle, ChangeSetRef
from dstl.keygroups import META_KEY_GROUP, KeyGroupRange, key_group_for
from dstl.options import DstlOptions
from dstl.storage import ChangelogStorage
from dstl.writer import ChangelogWriter

__all__ = [
    "META_KEY_GROUP",
    "ChangeSetRef",
    "ChangelogHandle",
    "ChangelogStorage",
    "ChangelogWriter",
    "DstlError",
    "DstlOptions",
    "KeyGroupRange",
    "key_group_for",
]

__version__ = "0.1.0"
