"""Read a store holding a forged v2 snapshot (:mod:`forged_lmdb`) along ONE path, in a fresh
process, and print the outcome as one JSON line.

Usage: ``python read_forged.py <case directory> <path>``; the directory holds ``store/`` (the
state_uri, the forged object in place, the manifest naming its size) and ``info.json``
(:func:`forged_lmdb.load_built`). ``--serve`` reads ``{"case": ..., "path": ..., "timeout": s}``
lines on stdin and runs each request in a child forked from this process once its imports are
done (a fresh process for every path, without paying the imports each time), answering
``{"returncode": ..., "line": ..., "stderr": ...}``: the child's exit status (negative: the
signal that ended it; ``null``: killed after ``timeout``), its JSON line (``null`` if it printed
none) and the end of its stderr.

Paths (:data:`PATHS`):

- ``restore-lmdb``: ``restore_backend`` of the target partition's handle onto its whole range,
  table ``lmdb`` (one snapshot, its range: the install-by-rename path);
- ``restore-heap``: the same onto the heap table;
- ``restore-rescale``: table ``lmdb`` onto a strict sub-range of the target's range (the
  range-copy path), then onto a range spanning both partitions' snapshots;
- ``reader``: ``dstl state dump`` (the column reader behind ``spark.read.format("dstl")``);
- ``verify``: ``dstl verify``; ``inspect``: ``dstl inspect --key <target>``;
- ``adopt``: after ``restore-lmdb`` in the same directory, what the adopt path of
  ``dstl.spark.slots`` would find: the target operator's table and its marker.

Restores list every entry of the table (decoded; raw and heap point lookups must return the
listed value) and every state of the model's keys through the state API; an entry the API does
not find where the table lists it (another key group, another value), or a value the API finds
that the table does not list, makes the outcome ``inconsistent``. The printed ``state`` is the
table's entries as canonical rows (:func:`forged_lmdb.canonical_row`), sorted, ``key_groups``
the ranges they cover. ``outcome``: ``ok``, ``typed`` (a ``DstlError``), ``untyped`` (any other
exception: the type is reported), ``inconsistent``; a restore path that fails says at which ``stage``: ``restore``
(``restore_backend``) or ``read`` (listing the restored backend). CLI paths run ``dstl.cli.main`` as
``python -m dstl`` does: exit 0 ``ok``; a ``DstlError`` (exit 1 or 2, one line on stderr) or a
failed ``verify`` (exit 1, ``PROBLEM`` lines) ``typed``; an exception escaping ``main`` (a
traceback) ``untyped``.

The address space is capped (``RLIMIT_AS``, 4 GiB, as ``read_crafted.py`` does): a reader that
would allocate the 8 GiB a footer declares fails here with ``MemoryError``, which is untyped.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import resource
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: `support` importable

AS_LIMIT = 4 << 30
#: where ``restore-lmdb`` restores (``adopt`` looks there)
LOCAL_LMDB = "local-restore-lmdb"
PATHS = ("restore-lmdb", "restore-heap", "restore-rescale", "reader", "verify", "inspect")


#: what a restore path was doing: ``restore`` (``restore_backend``) or ``read`` (listing the
#: restored backend)
STAGE = ["restore"]


class Inconsistent(Exception):
    """What a read returned does not hold together (lookups disagree with the listing)."""


def _preload() -> None:
    """Everything the paths import (the server's children start with it loaded)."""
    for name in ("dstl.cli", "dstl.cli.inspect", "dstl.cli.state", "dstl.cli.verify",
                 "restore.restore", "support.forged_lmdb", "pyarrow.compute", "pyarrow.parquet",
                 "dstl.reader.arrow", "dstl.reader.columns"):
        with contextlib.suppress(ImportError):   # what fails here fails again in its path
            importlib.import_module(name)


# --------------------------------------------------------------------------- restores


def _handles(case: Path) -> dict[str, Any]:
    from dstl.checkpoint.manifest import decode_manifest
    from support.forged_lmdb import load_built

    built = load_built(case)
    m = decode_manifest((built.store / built.manifest).read_bytes(), built.manifest)
    return {t.task_id: json.dumps(dict(t.state)) for t in m.tasks}


def _restored(case: Path, handles: list[Any], kgs: Any, table: str, op: str, local: str
              ) -> list[list[Any]]:
    """Restore, then list the table and look every entry up; the canonical rows."""
    from dstl import ChangelogStorage, DstlOptions
    from dstl.stores import LocalBlobStore
    from restore.restore import restore_backend
    from support import forged_lmdb as F

    store = LocalBlobStore(str(case / "store"))
    with ChangelogStorage(store=store, options=DstlOptions(persist_delay_s=0.0)) as storage:
        backend = restore_backend(handles, storage, kgs, table=table, operator_id=op,
                                  max_parallelism=F.MP, options=F.OPTIONS,
                                  local_directory=str(case / local), auto_materialize=False)
        try:
            STAGE[0] = "read"
            return _listing(backend, kgs, F.load_built(case).rows_in(kgs))
        finally:
            STAGE[0] = "restore"
            backend.close()


def _api_value(state: Any, kind: str) -> Any:
    if kind == "value":
        return state.value()
    if kind == "list":
        return state.get() or None
    return dict(state.items()) or None


def _listing(backend: Any, kgs: Any, model: list[list[Any]]) -> list[list[Any]]:
    from dstl.reader.rows import from_json, to_plain
    from support import forged_lmdb as F

    heap = backend.table_kind == "heap"
    states = {n: backend.get_state(d) for n, d in F.descriptors().items()}
    meta = backend.state_metadata()
    rows: list[list[Any]] = []
    listed: set[str] = set()
    for sid, m in sorted(meta.items()):
        name, kind = m["name"], m["kind"]
        for kg in range(kgs.start, kgs.end + 1):
            for key, ns, value in list(backend.tables.entries(sid, kg)):
                if backend.tables.get(sid, kg, key, ns) != value:
                    raise Inconsistent(f"state {name} key group {kg}: the point lookup of a "
                                       f"listed entry ({bytes(key)[:40]!r}) returns another "
                                       "value")
                k, n, v = ((key, ns, value) if heap
                           else backend.decode_entry(sid, bytes(key), bytes(ns), bytes(value)))
                backend.set_current_key(k)
                if backend.current_key_group != kg:
                    raise Inconsistent(f"state {name}: key {k!r:.60} listed in key group {kg}, "
                                       f"its lookups go to key group "
                                       f"{backend.current_key_group}")
                backend.set_current_namespace(n)
                got = _api_value(states[name], kind)
                if to_plain(got) != to_plain(v):
                    raise Inconsistent(f"state {name} key {k!r:.60} namespace {n!r}: listed "
                                       f"{to_plain(v)!r:.80}, the state API reads "
                                       f"{to_plain(got)!r:.80}")
                listed.add(json.dumps([name, to_plain(k), to_plain(n)]))
                rows += F.rows_of(kg, name, kind, k, n, v)
    kinds = {"v": "value", "l": "list", "m": "map"}
    for ident in {json.dumps(r[1:4]) for r in model} - listed:
        name, key, ns = json.loads(ident)
        backend.set_current_key(key)
        backend.set_current_namespace(from_json(json.dumps(ns)))
        got = _api_value(states[name], kinds[name])
        if got is not None:
            raise Inconsistent(f"state {name} key {key!r:.60}: the state API reads "
                               f"{to_plain(got)!r:.80}, the table lists no entry")
    backend.set_current_namespace(None)
    return F.sorted_rows(rows)


def _restore_path(case: Path, path: str) -> tuple[list[list[Any]], list[list[int]]]:
    from dstl import KeyGroupRange
    from support import forged_lmdb as F

    handles = _handles(case)
    target = F.key_groups_of(F.TARGET_PARTITION)
    own = handles[f"p{F.TARGET_PARTITION}"]
    if path == "restore-lmdb":
        return (_restored(case, [own], target, "lmdb", F.operator(F.TARGET_PARTITION),
                          LOCAL_LMDB),
                [[target.start, target.end]])
    if path == "restore-heap":
        return (_restored(case, [own], target, "heap", F.operator(F.TARGET_PARTITION),
                          "local-restore-heap"),
                [[target.start, target.end]])
    sub = KeyGroupRange(target.start, target.end - 2)
    span = KeyGroupRange(target.start - 4, target.start + 3)
    a = _restored(case, [own], sub, "lmdb", f"{F.JOB}/rescale-sub", "local-rescale-sub")
    b = _restored(case, list(handles.values()), span, "lmdb", f"{F.JOB}/rescale-span",
                  "local-rescale-span")
    both = sub.intersection(span)
    if [r for r in a if r[0] in both] != [r for r in b if r[0] in both]:
        raise Inconsistent(f"the sub-range restore ({sub}) and the spanning restore ({span}) "
                           f"read key groups {both} differently")
    rows = a + [r for r in b if r[0] not in both]
    return F.sorted_rows(rows), [[sub.start, sub.end], [span.start, span.end]]


def _adopt(case: Path) -> dict[str, Any]:
    """What a later task's adopt would find in the restore's local directory."""
    from dstl import ChangelogStorage, DstlOptions
    from dstl.layout import operator_dir
    from dstl.stores import LocalBlobStore
    from materializer.backend import ChangelogKeyedStateBackend
    from support import forged_lmdb as F

    local = case / LOCAL_LMDB
    op = F.operator(F.TARGET_PARTITION)
    env = local / operator_dir(op)
    found: dict[str, Any] = {"table": (env / "data.mdb").exists(), "marker": None,
                             "staging": sorted(p.name for p in local.glob(".dstl-stage-*"))
                             if local.exists() else []}
    if not found["table"]:
        return found
    store = LocalBlobStore(str(case / "store"))
    with ChangelogStorage(store=store, options=DstlOptions(persist_delay_s=0.0)) as storage:
        backend = ChangelogKeyedStateBackend(storage, op, F.key_groups_of(F.TARGET_PARTITION),
                                             F.MP, table="lmdb", options=F.OPTIONS,
                                             local_directory=str(local), adopt_local=True,
                                             auto_materialize=False)
        try:
            marker = backend.tables.read_marker()
        finally:
            backend.close()
    found["marker"] = None if marker is None else marker.decode("utf-8", "replace")
    return found


# --------------------------------------------------------------------------- the CLI


def _cli(argv: list[str]) -> tuple[int, str, str]:
    """``python -m dstl <argv>`` in this process: (exit code, stdout, stderr); an exception
    escaping ``main`` propagates (``python -m dstl`` would print its traceback)."""
    from dstl.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def _reader_rows(text: str) -> list[list[Any]]:
    from support import forged_lmdb as F

    rows = []
    for line in text.splitlines():
        r = json.loads(line)
        rows.append([r["key_group"], r["state"], r["key"], r["namespace"], r["user_key"],
                     r["value"]])
    return F.sorted_rows(rows)


def _cli_path(case: Path, path: str, out: dict[str, Any]) -> None:
    from support.forged_lmdb import MP, load_built

    store = str(case / "store")
    if path == "reader":
        argv = ["state", "dump", store]
    elif path == "verify":
        argv = ["verify", store, "--quiet"]
    else:
        argv = ["inspect", store, "--key", load_built(case).target]
    rc, stdout, stderr = _cli(argv)
    out["exit"] = rc
    if rc == 0:
        if path == "reader":
            out["state"] = _reader_rows(stdout)
            out["key_groups"] = [[0, MP - 1]]
        return
    problems = [line for line in stdout.splitlines() if line.startswith("PROBLEM ")]
    message = "\n".join(problems + [line for line in stderr.splitlines() if line.strip()])
    error = "verify" if problems else (stderr.split(": ", 2)[1] if stderr.count(": ") >= 2
                                        else "")
    out.update(outcome="typed", error=error, message=message[:2000])


# --------------------------------------------------------------------------- one path


def run_path(case: Path, path: str) -> dict[str, Any]:
    from dstl.errors import DstlError

    out: dict[str, Any] = {"path": path, "outcome": "ok", "error": None, "message": None,
                           "state": None, "key_groups": None}
    try:
        if path == "adopt":
            out["state"] = _adopt(case)
        elif path.startswith("restore-"):
            out["state"], out["key_groups"] = _restore_path(case, path)
        elif path in PATHS:
            _cli_path(case, path, out)
        else:
            raise SystemExit(f"unknown path {path!r}")
    except DstlError as exc:
        out.update(outcome="typed", error=type(exc).__name__, message=str(exc)[:2000])
    except Inconsistent as exc:
        out.update(outcome="inconsistent", error="Inconsistent", message=str(exc))
    except SystemExit:
        raise
    except BaseException as exc:   # reported: the test fails on it
        out.update(outcome="untyped", error=type(exc).__name__,
                   message=(str(exc)[:1000] + "\n" + traceback.format_exc()[-3000:]))
    if path.startswith("restore-") and out["outcome"] != "ok":
        out["stage"] = STAGE[0]
    return out


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


# --------------------------------------------------------------------------- the server


def _child(case: Path, path: str, result: Path, stderr: Path) -> None:
    """In the forked child: run the path, write its line to ``result``; never returns."""
    code = 0
    try:
        fd = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 2)
        os.dup2(fd, 1)
        os.close(fd)
        sys.stdout = sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        _limit()
        line = json.dumps(run_path(case, path))
        result.write_text(line + "\n")
    except BaseException:
        traceback.print_exc()
        code = 3
    finally:
        with contextlib.suppress(BaseException):
            sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    delay = 0.002
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def serve() -> None:
    for raw in sys.stdin:
        req = json.loads(raw)
        case, path = Path(req["case"]), req["path"]
        result, stderr = case / f"{path}.result", case / f"{path}.stderr"
        result.unlink(missing_ok=True)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(case, path, result, stderr)
        rc = _wait(pid, float(req.get("timeout", 300)))
        line = result.read_text().strip() if result.exists() else None
        err = stderr.read_text(errors="replace")[-4000:] if stderr.exists() else ""
        sys.stdout.write(json.dumps({"returncode": rc, "line": line, "stderr": err}) + "\n")
        sys.stdout.flush()


def ready() -> None:
    """Tell the caller the imports are done (one line)."""
    sys.stdout.write("ready\n")
    sys.stdout.flush()


def main() -> None:
    if sys.argv[1:] == ["--serve"]:
        _preload()
        ready()
        serve()
        return
    _limit()
    case, path = Path(sys.argv[1]), sys.argv[2]
    print(json.dumps(run_path(case, path)), flush=True)


if __name__ == "__main__":
    main()
