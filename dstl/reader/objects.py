"""Which kind of DSTL object some bytes are: a segment, a snapshot or a manifest.

Segments and snapshots share the envelope header (``DSTL``, then the kind byte: 1 segment, 2
snapshot); a manifest is a canonical JSON document, so it starts with ``{"body":``. Only the
header is looked at here — the decoders (``dstl inspect`` runs them) check the rest.
"""

from __future__ import annotations

from typing import Literal

from dstl.envelope import KIND_SEGMENT, KIND_SNAPSHOT, MAGIC
from dstl.errors import UnsupportedFormatError

__all__ = ["ObjectKind", "identify_object"]

ObjectKind = Literal["segment", "snapshot", "manifest"]

_MANIFEST_START = b'{"body":'


def identify_object(data: bytes, key: str) -> ObjectKind:
    """The kind of object ``data`` is.

    Raises:
        UnsupportedFormatError: none of the three (names ``key`` and what was found).
    """
    head = bytes(data[:8])
    if head[:4] == MAGIC and len(head) > 4:
        if head[4] == KIND_SEGMENT:
            return "segment"
        if head[4] == KIND_SNAPSHOT:
            return "snapshot"
        raise UnsupportedFormatError(key, 4, f"object kind {head[4]}",
                                     "kind 1 (segment) or 2 (snapshot)")
    if head == _MANIFEST_START:
        return "manifest"
    raise UnsupportedFormatError(key, 0, repr(head[:8]),
                                 "a DSTL segment or snapshot (DSTL header) or a manifest "
                                 "(canonical JSON)")
