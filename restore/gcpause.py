"""The cyclic garbage collector during restores: off while they run, restored objects frozen.

Theory of operation
-------------------
A heap restore creates one map entry (and its key, namespace and state objects) per restored
key: millions of objects the collector tracks. With the collector on, every generation-2
collection during the restore walks all of them again (profiled: a third of a 1 M
key heap restore, single pauses of 0.9-1.9 s), and so does every later generation-2 collection
of the worker for as long as the state lives.

:func:`collector_paused` switches the collector off while any restore of the process runs (a
count shared by threads: parallel restores re-enable it only when the last one ends, and only if
it was on before the first began) and, after a successful heap restore, calls ``gc.freeze()``:
every object tracked at that moment — the restored state included — moves to the permanent
generation, which later collections do not walk.

Effect on the worker: frozen objects are still freed by reference counting as soon as they are
unreferenced (a state overwritten or removed is released at once, as before); only a reference
*cycle* among frozen objects is never collected (``gc.unfreeze()`` would hand them back). The
state tables hold no cycles, and ``backend.close()`` drops them, so a closed backend's state is
freed by reference counting although the backend object itself (a cycle with its
materialization manager, and whatever else of the process was alive and cyclic at the freeze)
stays: a few kilobytes per restored-then-closed backend, never its state
(``tests/unit/materializer/test_fast_paths.py``). Objects created after the freeze are collected
as usual. Nothing the restore allocates needs the collector: its garbage is acyclic.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["collector_paused"]

_lock = threading.Lock()
_active = 0
_was_enabled = False


@contextlib.contextmanager
def collector_paused(*, freeze: bool = False) -> Iterator[None]:
    """Run the block with the cyclic collector off; with ``freeze``, ``gc.freeze()`` after the
    block succeeded (see the module docstring)."""
    global _active, _was_enabled
    with _lock:
        if _active == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _active += 1
    ok = False
    try:
        yield
        ok = True
    finally:
        with _lock:
            _active -= 1
            if ok and freeze:
                gc.freeze()
            if _active == 0 and _was_enabled:
                gc.enable()
