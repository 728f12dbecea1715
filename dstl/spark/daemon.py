"""A PySpark daemon that imports a DSTL task's modules once, before it forks Python workers.

Theory of operation
-------------------
An executor starts one Python daemon (``python -m <spark.python.daemon.module> <worker
module>``) when its first Python task arrives; the daemon forks one worker per task slot, and
each worker then imports pyspark's worker module and, unpickling the task, everything the task
refers to. For a DSTL task that is DSTL's worker side, the state tables, pyarrow and its compute
and IPC modules. Each worker pays those imports itself — 1-3 s of CPU on this machine class, on the first batch after every restart, on every executor, in every
worker.

``spark.python.daemon.module=dstl.spark.daemon`` (a static Spark conf: set it before the
SparkContext starts) runs :func:`main` instead of ``pyspark.daemon``: it imports those modules
(:data:`PRELOAD`, plus the worker module Spark names and the modules listed in the environment
variable :data:`PRELOAD_ENV`, e.g. the processor's own module) and then hands over to
``pyspark.daemon.manager()``, which is unchanged. Every worker it forks starts with the modules
loaded (copy-on-write pages of the daemon); what the first batch's tasks import drops to the
task's own closure.

Why it is safe to fork after these imports (pyspark's own daemon imports the worker module only
after the fork, because an import *may* start threads):

* No Python thread: none of these modules starts one at import, and :func:`preload` checks it
  (no thread that was not there before the import) and refuses to start otherwise, naming the
  threads, rather than fork a process whose other threads' locks the children would inherit
  held.
* No open resource: importing DSTL opens no LMDB environment, socket or file; starting the
  agent (below) leaves nothing open in the daemon (its output goes to a file closed at once,
  the ping's socket is closed). Storage, tables and agent connections are made in the worker, per process (:mod:`dstl.spark.runtime` builds a
  runtime only in the process that uses it and never reuses one across a fork).
* Native threads: importing pyarrow starts jemalloc's background thread, and numpy may start
  OpenBLAS threads (Spark sets ``OMP_NUM_THREADS`` to the task's cores for
  the daemon, so none with one core per task). Both libraries register fork handlers that take
  their locks across ``fork()`` and restart their threads in the child.

*The executor agent, started ahead.* Unless ``DSTL_DAEMON_AGENT=0``, the daemon also starts the
executor agent (:func:`dstl.spark.agent.spawn.spawn_agent`: detached, watching the executor
JVM, the daemon's parent) first, before its own imports, and does not wait for it: the agent's
own start-up (its imports and socket set-up, 0.3-0.5 s) then runs on another core while the
daemon imports and its workers start, instead of after them (measured: workers forked after the
daemon's imports waited 0.3 s for an agent started after those imports) or after the first
task's worker asked for it. A daemon whose preload then fails leaves that agent to exit with
the executor. Workers forked here wait for that agent (:func:`agent_starting`) rather than
start a second one, as long as it runs. It costs one idle process per executor when no operator
uses the agent (``agent=False``); it exits with the executor. ``Popen`` starts no thread, and
nothing of it stays open in the daemon but the child's pid.

*Frozen for the collector.* After its imports the daemon collects once and freezes what is
left (``gc.freeze``: the objects of the imported modules, about 90 k, move to a permanent
generation that collections skip). pyspark's daemon runs a full ``gc.collect()`` in a reused
worker after every task; over the imported modules that costs 17-24 ms of CPU per task on this
machine class, on cores the next task and the JVM need, and it writes to every page holding an
object header, so the forked workers lose the pages they share with the daemon. Frozen, a
collection walks only what the worker itself made (Python's own advice for processes that fork
without exec).

*Pyspark from its installed copy.* Spark puts its own ``pyspark.zip`` and ``py4j-*-src.zip``
first on a Python worker's path. Python cannot cache the bytecode of modules imported from a
zip, so every daemon compiles pyspark's worker module and what it imports from source: 0.55 s
against 0.13 s from the installed package on this machine class, on the critical path of every
executor's first Python task. When the same version of the package is installed on the path
(a pip-installed pyspark holds the very zips), :func:`prefer_installed` takes those zips off
the path before anything imports pyspark, so the daemon and the workers it forks run the
installed copy, whose bytecode is cached (off, not only after it: a worker's first task
invalidates the import caches, and a zipimporter on the path then re-reads its zip's directory,
20-40 ms for pyspark's). Another version, no installed copy, or :data:`PYSPARK_ENV`
``=zip`` keeps Spark's order.

*Not the driver's planner workers.* PySpark 4.3 plans a Python data source's read (``load()``,
``partitions()``) in workers on the driver that Spark always forks from ``pyspark.daemon``
(``PythonPlannerRunner`` calls ``SparkEnv.createPythonWorker`` without a daemon module, which
picks ``PythonWorkerFactory.defaultDaemonModule``), so this setting does not reach them; it does
reach the executors' read tasks of ``spark.read.format("dstl")``, which import
``pyspark.sql.worker.plan_data_source_read`` and ``dstl.spark.datasource`` when they unpickle
the read function (list them in :data:`PRELOAD_ENV` for executors that read state;
``bench/state_reader_fixed.py``).

A module that cannot be imported stops the daemon with a :class:`~dstl.errors.ConfigError`
message on its stderr (module, cause, fix), which Spark puts into the task's error.
:data:`PRELOADED` records, in the daemon and so in every worker forked from it, what was
imported and how long it took (empty in a worker of another daemon).
"""

from __future__ import annotations

import gc
import importlib
import importlib.machinery
import os
import re
import sys
import threading
import time
import zipfile
from collections.abc import Sequence

from dstl.errors import ConfigError, DstlError

__all__ = ["AGENT_DIR", "AGENT_ENV", "AGENT_PID", "agent_starting", "PRELOAD", "PRELOADED", "PRELOAD_ENV",
           "PYSPARK_ENV", "main", "modules_to_preload", "preload", "prefer_installed",
           "start_agent"]

#: What every DSTL task imports in a worker (measured: the modules a DSTL batch task and a
#: warm-up task leave in ``sys.modules``), in import order.
PRELOAD: tuple[str, ...] = (
    "pyspark.worker", "pyspark.sql.pandas.serializers", "pyarrow", "pyarrow.compute",
    "lmdb", "zstandard", "xxhash", "dstl.spark.task", "dstl.spark.warmup",
)
#: Comma-separated extra modules to import in the daemon (e.g. the module that defines the
#: processor class; set through ``spark.executorEnv.DSTL_DAEMON_PRELOAD``).
PRELOAD_ENV = "DSTL_DAEMON_PRELOAD"

#: ``0`` turns off starting the executor agent in the daemon.
AGENT_ENV = "DSTL_DAEMON_AGENT"

#: ``zip`` keeps Spark's order of the Python path (its ``pyspark.zip`` and py4j zip first).
PYSPARK_ENV = "DSTL_DAEMON_PYSPARK"
#: The packages Spark ships as zips on the workers' path, and the zips' names.
_ZIPPED: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("pyspark", re.compile(r"^pyspark\.zip$")),
    ("py4j", re.compile(r"^py4j-[0-9.]+-src\.zip$")),
)
_VERSION_RE = re.compile(r"""^__version__\s*(?::\s*str\s*)?=\s*["']([^"']+)["']""", re.M)

#: the agent directory whose agent the daemon this process was forked from started, and that
#: agent's pid (``None``: none was started, or not a DSTL daemon)
AGENT_DIR: str | None = None
AGENT_PID: int | None = None

#: module -> seconds its import took in the daemon this process was forked from (empty: this
#: process did not come from a DSTL daemon)
PRELOADED: dict[str, float] = {}

_FIX = ("install it into the executors' Python (PYSPARK_PYTHON), remove it from "
        f"{PRELOAD_ENV}, or unset spark.python.daemon.module to use pyspark.daemon")


def modules_to_preload(argv: Sequence[str], environ: dict[str, str] | os._Environ[str]
                       ) -> list[str]:
    """The modules to import: the worker module Spark passes as the daemon's first argument
    (``pyspark.worker`` by default), :data:`PRELOAD`, then the :data:`PRELOAD_ENV` list; each
    once, in that order."""
    worker = argv[1] if len(argv) > 1 and argv[1] else "pyspark.worker"
    extra = [m.strip() for m in environ.get(PRELOAD_ENV, "").split(",") if m.strip()]
    return list(dict.fromkeys([worker, *PRELOAD, *extra]))


def preload(modules: Sequence[str]) -> dict[str, float]:
    """Import ``modules`` in order; seconds per module.

    Raises:
        ConfigError: a module cannot be imported, or its import
            started a Python thread (forking then would copy that thread's held locks).
    """
    took: dict[str, float] = {}
    before = set(threading.enumerate())  # in the daemon: the main thread alone
    for name in modules:
        started = time.perf_counter()
        try:
            importlib.import_module(name)
        except Exception as exc:
            raise ConfigError(PRELOAD_ENV if name not in PRELOAD else "spark.python.daemon.module",
                              name, f"a module the executors' Python can import (got "
                              f"{type(exc).__name__}: {exc})", owner="dstl.spark.daemon",
                              fix=_FIX) from exc
        took[name] = time.perf_counter() - started
        threads = sorted(t.name for t in set(threading.enumerate()) - before)
        if threads:
            raise ConfigError("preloaded module", name,
                              f"an import that starts no thread (it started {threads})",
                              owner="dstl.spark.daemon",
                              fix=f"remove it from {PRELOAD_ENV}: the daemon forks workers "
                                  "and must hold no thread when it does")
    return took


def prefer_installed(path: list[str], environ: dict[str, str] | os._Environ[str]
                     ) -> list[str]:
    """Take Spark's zips of pyspark and py4j off ``path`` (``sys.path``) when an installed
    copy of the same version is on the rest of ``path`` (see the module docstring); what was
    taken off, as ``"<package> <version>"``. Nothing is taken off when :data:`PYSPARK_ENV` is ``zip``,
    when the package is imported already, or when the versions differ or cannot be read."""
    if environ.get(PYSPARK_ENV, "").strip().lower() == "zip":
        return []
    taken: list[str] = []
    for package, zip_name in _ZIPPED:
        zips = [p for p in path if zip_name.match(os.path.basename(p))]
        if not zips or package in sys.modules:
            continue
        version = _zip_version(zips[0], package)
        others = [p for p in path if p not in zips]
        spec = importlib.machinery.PathFinder.find_spec(package, others)
        if (version is None or spec is None or not spec.submodule_search_locations
                or _installed_version(spec.submodule_search_locations[0]) != version):
            continue
        path[:] = others
        taken.append(f"{package} {version}")
    if taken:
        importlib.invalidate_caches()
    return taken


def _zip_version(zip_path: str, package: str) -> str | None:
    try:
        with zipfile.ZipFile(zip_path) as z:
            text = z.read(f"{package}/version.py").decode("utf-8", "replace")
    except (OSError, KeyError, zipfile.BadZipFile):
        return None
    m = _VERSION_RE.search(text)
    return m.group(1) if m else None


def _installed_version(package_dir: str) -> str | None:
    try:
        with open(os.path.join(package_dir, "version.py"), encoding="utf-8",
                  errors="replace") as f:
            m = _VERSION_RE.search(f.read())
    except OSError:
        return None
    return m.group(1) if m else None


def start_agent(environ: dict[str, str] | os._Environ[str]) -> tuple[str, int] | None:
    """Start the executor agent without waiting (see the module docstring): its directory and
    pid, or ``None`` when turned off (:data:`AGENT_ENV` ``=0``) or one answers already."""
    if environ.get(AGENT_ENV, "1").strip() == "0":
        return None
    from dstl.spark.agent.spawn import agent_answers, agent_dir, spawn_agent

    directory = agent_dir()
    if agent_answers(directory):  # another daemon of this executor started it
        return None
    return directory, spawn_agent(directory, os.getppid())  # the daemon's parent: the JVM


def agent_starting(directory: str) -> bool:
    """Whether the daemon this worker was forked from started the agent of ``directory`` and
    that process still runs (so waiting for it beats starting another). After that agent died
    (a worker rebuilds its runtime then), ``False``: the worker starts one at once."""
    if directory != AGENT_DIR or AGENT_PID is None:
        return False
    try:
        with open(f"/proc/{AGENT_PID}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie is a dead agent not reaped yet


def main() -> None:
    """``python -m dstl.spark.daemon [worker module]``: start the agent, preload, then run
    pyspark's daemon."""
    installed = prefer_installed(sys.path, os.environ)
    _start_agent_ahead()  # first: its start-up overlaps the imports below
    try:
        took = preload(modules_to_preload(sys.argv, os.environ))
    except ConfigError as exc:
        # the daemon's stdout is Spark's channel (the port); stderr ends up in the task error
        print(f"dstl.spark.daemon: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    PRELOADED.update(took)
    gc.collect()  # what the imports left as garbage is freed, not frozen
    gc.freeze()
    # one line into the executor's log (Spark copies the daemon's stderr there)
    print(f"dstl.spark.daemon: imported {len(took)} modules in {sum(took.values()):.2f}s before "
          "forking workers: " + ", ".join(f"{m} {s:.2f}s" for m, s in took.items())
          + (f"; executor agent started ahead (pid {AGENT_PID})" if AGENT_PID else "")
          + (f"; installed {', '.join(installed)} used instead of Spark's zips" if installed
             else "") + f"; {gc.get_freeze_count()} objects frozen",
          file=sys.stderr, flush=True)
    from pyspark import daemon

    daemon.manager()


def _start_agent_ahead() -> None:
    global AGENT_DIR, AGENT_PID
    try:
        started = start_agent(os.environ)
    except (OSError, DstlError) as exc:
        # not fatal: the first worker that needs the agent starts it (and reports what fails)
        print(f"dstl.spark.daemon: the executor agent was not started ahead ({type(exc).__name__}"
              f": {exc}); the workers start it", file=sys.stderr, flush=True)
        return
    if started is not None:
        AGENT_DIR, AGENT_PID = started


if __name__ == "__main__":
    # run as ``-m``, this file is ``__main__``; the workers read PRELOADED of the module by its
    # own name, so run main() there
    from dstl.spark.daemon import main as _main

    _main()
