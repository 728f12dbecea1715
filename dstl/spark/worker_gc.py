"""The cyclic collector in a Spark Python worker: what the worker had imported, frozen once.

Theory of operation
-------------------
pyspark's daemon runs a full ``gc.collect()`` in a reused Python worker after every task. Over
what a DSTL task imports (pyspark's worker, pyarrow, pandas, DSTL: about 90 k tracked objects)
one such collection costs 17-24 ms of CPU on this machine class, after every task, on cores the
next task and the JVM need; the automatic full collections walk them too. They never become
garbage: they are the imported modules.

So the first DSTL task in a worker process (an operator task: :func:`dstl.spark.runtime.
runtime_for`; a read of ``format("dstl")``/``format("dstl_changes")``) calls
:func:`freeze_imports` before it builds anything of its own: ``gc.freeze()`` moves every object
tracked at that moment to the permanent generation, which collections skip. Python's own advice
for processes that fork without exec does the same in the parent (:mod:`dstl.spark.daemon`
freezes after its preload; a worker forked there freezes only what it made since).

The price: a reference *cycle* among the objects frozen here that later becomes garbage is never
collected (reference counting still frees everything else). At the first task's start that is
at most the task's own closure and input (its processor class, if defined in a closure) — once
per process, a few kilobytes. Nothing DSTL builds for the task (runtime, backends, tables,
caches) exists yet, so none of it is frozen.
"""

from __future__ import annotations

import gc
import os

__all__ = ["freeze_imports"]

_FROZEN_IN: int | None = None


def freeze_imports() -> None:
    """``gc.freeze()`` once per process (after a fork: once more in the child)."""
    global _FROZEN_IN
    pid = os.getpid()
    if pid != _FROZEN_IN:
        _FROZEN_IN = pid
        gc.freeze()
