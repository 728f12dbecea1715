"""What the next incremental materialization writes: a delta, a merged delta, or a full snapshot.

Pure: sizes in, a decision out (no I/O). Used by the executor agent's materializer
(:mod:`materializer.external`); docs/architecture.md says why these rules.

Rules
-----
A chain is a full snapshot ``F`` followed by deltas (format v3). Given the sizes of ``F`` and of
the deltas after it, and the settings ``max_deltas`` (``BackendOptions.max_snapshot_deltas``)
and ``max_ratio`` (``BackendOptions.max_delta_ratio``):

1. **Full** when the deltas add up to more than ``max_ratio`` x ``F``'s bytes: what changed since
   ``F`` is a large share of it, so rewriting the base costs about what the next merge would.
2. **Merge** when ``max_deltas`` deltas follow ``F`` (and rule 1 does not apply): one delta that
   follows ``F`` directly and holds every entry changed since ``F`` (the union of the deltas'
   entries and the changes since the last cut, with their values at this cut). It replaces the
   deltas in the chain, so a restore reads at most ``1 + max_deltas`` pieces, and it costs the
   deltas' bytes, not the table's.
3. **Delta** otherwise: the entries changed since the previous cut.

Bytes, not counts, decide the rewrite of the base: at 1 % updates of a large table the deltas stay
small, and a count alone rewrites the whole table every ``max_deltas`` materializations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Literal

__all__ = ["DELTA", "FULL", "MERGE", "PieceKind", "next_piece"]

PieceKind = Literal["delta", "merge", "full"]
DELTA: Final = "delta"
MERGE: Final = "merge"
FULL: Final = "full"


def next_piece(full_bytes: int, delta_bytes: Sequence[int], max_deltas: int,
               max_ratio: float) -> PieceKind:
    """The kind of the next piece of a chain (rules in the module docstring).

    Args:
        full_bytes: the size of the chain's full snapshot.
        delta_bytes: the sizes of the deltas after it, in order (a merged delta first, if any).
        max_deltas: the most deltas that follow a full snapshot (>= 1).
        max_ratio: the share of the full snapshot's bytes the deltas may reach (> 0).
    """
    if sum(delta_bytes) > max_ratio * full_bytes:
        return FULL
    if len(delta_bytes) >= max_deltas:
        return MERGE
    return DELTA
