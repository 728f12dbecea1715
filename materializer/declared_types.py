"""Opening a restored state under the type now declared for it (rules 2 and 3 of
:mod:`materializer.schema`).

Recorded and declared alike: nothing to do. Recorded ``R`` and declared ``D`` compatible: every
stored value is converted to ``D`` and rewritten (logged, like any write, after the state's new
metadata record) where the conversion changed it. Nothing recorded (the state was undeclared):
every stored value is checked against ``D``. The table and the log are reached through the
backend's write path (:class:`~materializer.state_access.StateTableAccess`).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from dstl.errors import StateSchemaError
from materializer.changes import SET, SET_INTERNAL
from materializer.codecs import TTL_CODEC_PREFIX
from materializer.schema import (
    compatibility_problems,
    compile_checker,
    conform,
    read_recorded,
    type_string,
)
from materializer.state_access import TableSide
from materializer.state_registry import Registration
from materializer.states import StateShape

__all__ = ["RewriteTarget", "adopt_declared_type"]

logger = logging.getLogger(__name__)


class RewriteTarget(TableSide, Protocol):
    """What the conversion needs of the backend's write path: the table, its kind and key
    groups, the key codec, and the logged write of an entry given by its bytes. Implemented by
    :class:`~materializer.state_access.StateTableAccess`."""

    def entry_bytes(self, sid: int, key: Any, ns: Any) -> tuple[bytes, bytes]: ...

    def log_raw(self, op: int, sid: int, key_group: int, key: bytes, namespace: bytes,
                payload: bytes, table_key: Any = None, table_ns: Any = None) -> None: ...


def adopt_declared_type(access: RewriteTarget, logged: set[int], reg: Registration,
                        shape: StateShape, declared: Any, meta: dict[str, Any]) -> None:
    """Open the restored state ``reg`` under ``declared`` (its new ``shape`` and metadata
    ``meta``), converting or checking its stored values (see the module docstring); ``logged``:
    the registry's states whose metadata record is in the log.

    Raises:
        StateSchemaError: ``D`` cannot read values of ``R``, or a stored value does not fit
            ``D`` (names the state, both types, and the key).
    """
    name = str(reg.meta["name"])
    raw = reg.meta.get("schema")
    recorded = read_recorded(raw) if raw is not None else None
    if recorded == declared:
        return
    owner = f"backend {access.operator_id!r}"
    shown = type_string(recorded) if recorded is not None else None
    if recorded is not None:
        problems = compatibility_problems(recorded, declared)
        if problems:
            raise StateSchemaError(name, shown, type_string(declared), problems, owner)
    reg.meta = meta  # the rewrites below are logged after the new description
    logged.discard(reg.state_id)
    check = compile_checker(declared)
    pair = shape.codec.name.startswith(TTL_CODEC_PREFIX)
    heap = access.table_kind == "heap"
    kind = shape.kind
    sid = reg.state_id
    tables = access.tables
    rewritten = 0

    def fit(v: Any, key: Any) -> tuple[Any, bool]:
        unit = v[1] if pair else v
        new, changed = conform(unit, declared) if recorded is not None else (unit, False)
        why = check(new) if new is not None else "null"
        if why is not None:
            if not heap:
                key = access.key_codec.decode(bytes(key))
            raise StateSchemaError(name, shown, type_string(declared),
                                   [f"key {key!r:.80}: a {type(unit).__name__} ({why})"], owner)
        return ((v[0], new) if pair else new), changed

    for kg in range(access.key_groups.start, access.key_groups.end + 1):
        for key, ns, stored in list(tables.entries(sid, kg)):
            obj = stored if heap else shape.from_bytes(stored)
            if kind == "list":
                units = [fit(u, key) for u in obj]
                new_obj: Any = [u for u, _ in units]
                changed = any(c for _, c in units)
            elif kind == "map":
                entries = {k: fit(u, key) for k, u in obj.items()}
                new_obj = {k: u for k, (u, _) in entries.items()}
                changed = any(c for _, c in entries.values())
            else:
                new_obj, changed = fit(obj, key)
            if not changed:
                continue
            encoded = shape.to_bytes(new_obj)
            tables.put(sid, kg, key, ns, new_obj if heap else encoded)
            kb, nb = access.entry_bytes(sid, key, ns)
            access.log_raw(SET if kind == "value" else SET_INTERNAL, sid, kg, kb, nb,
                           encoded, key, ns)
            rewritten += 1
    logger.info("state %r of backend %r: declared type %s over recorded %s; %d values "
                "converted", name, access.operator_id, type_string(declared), shown, rewritten)
