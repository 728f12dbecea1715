"""dstl.spark.worker_gc: a worker's imports frozen for the cyclic collector once per process,
once more in a forked child, and what is made afterwards still collected."""

from __future__ import annotations

import subprocess
import sys

_CHILD = """
import gc, os, sys
from dstl.spark.worker_gc import freeze_imports
import pyarrow
freeze_imports()
first = gc.get_freeze_count()
assert first > 1000, first
junk = [[] for _ in range(5000)]
freeze_imports()  # once per process: the new objects are not frozen
assert gc.get_freeze_count() == first, (gc.get_freeze_count(), first)

class Cycle:
    pass

c = Cycle(); c.me = c
import weakref
gone = weakref.ref(c)
del c
gc.collect()
assert gone() is None  # made after the freeze: still collected
pid = os.fork()
if pid == 0:
    freeze_imports()  # a forked child freezes again: what the parent made since
    os._exit(0 if gc.get_freeze_count() >= first + 5000 else 3)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
print("ok")
"""


def test_imports_frozen_once_per_process_and_again_after_a_fork() -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
