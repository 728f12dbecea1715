"""dstl.spark.daemon without Spark: which modules it imports, the errors it gives (a module that
cannot be imported, one that starts a thread), and the hand-over to pyspark's daemon, driven
through its real entry point (``python -m dstl.spark.daemon``) speaking Spark's side of the pipe."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from dstl.errors import ConfigError
from dstl.spark import daemon

ROOT = Path(__file__).resolve().parents[2]


def test_the_worker_module_first_then_dstl_then_the_extra_modules_each_once() -> None:
    mods = daemon.modules_to_preload(["daemon.py", "pyspark.worker"],
                                     {daemon.PRELOAD_ENV: " json, ,pyarrow,my.processors "})
    assert mods[0] == "pyspark.worker"
    assert mods[1:len(daemon.PRELOAD)] == [m for m in daemon.PRELOAD if m != "pyspark.worker"]
    assert mods[-2:] == ["json", "my.processors"]
    assert len(mods) == len(set(mods))
    # another worker module (spark.python.worker.module) is what gets imported first
    assert daemon.modules_to_preload(["d", "pyspark.custom_worker"], {})[0] \
        == "pyspark.custom_worker"
    assert daemon.modules_to_preload(["d"], {})[0] == "pyspark.worker"


def test_the_preload_covers_what_a_dstl_task_imports() -> None:
    for name in ("dstl.spark.task", "dstl.spark.warmup", "pyarrow", "pandas", "lmdb",
                 "zstandard", "pyspark.worker"):
        assert name in daemon.PRELOAD


@pytest.fixture
def module_dir(tmp_path: Path) -> Iterator[Path]:
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith("r2_")]:
            del sys.modules[name]


def test_a_module_that_cannot_be_imported_is_named_with_the_fix(module_dir: Path) -> None:
    (module_dir / "r2_broken.py").write_text("import r2_not_there\n")
    with pytest.raises(ConfigError) as e:
        daemon.preload(["json", "r2_broken"])
    msg = str(e.value)
    assert "r2_broken" in msg and "r2_not_there" in msg and "ModuleNotFoundError" in msg
    assert "unset spark.python.daemon.module" in msg and daemon.PRELOAD_ENV in msg
    assert e.value.value == "r2_broken" and e.value.field == daemon.PRELOAD_ENV
    assert isinstance(e.value.__cause__, ModuleNotFoundError)
    with pytest.raises(ConfigError, match=r"r2_syntax.*SyntaxError"):
        (module_dir / "r2_syntax.py").write_text("def (:\n")
        daemon.preload(["r2_syntax"])


def test_a_module_whose_import_starts_a_thread_is_refused(module_dir: Path) -> None:
    (module_dir / "r2_threads.py").write_text(textwrap.dedent("""
        import threading
        stop = threading.Event()
        t = threading.Thread(target=stop.wait, name="r2-poller", daemon=True)
        t.start()
    """))
    try:
        with pytest.raises(ConfigError, match=r"r2_threads.*r2-poller.*must hold no thread"):
            daemon.preload(["json", "r2_threads"])
    finally:
        mod = sys.modules.get("r2_threads")
        if mod is not None:
            mod.stop.set()
            mod.t.join(5)


def test_a_missing_optional_module_is_skipped_and_a_present_one_imported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemon, "OPTIONAL", frozenset({"r2_absent_optional", "json"}))
    took = daemon.preload(["r2_absent_optional", "json", "zstandard"])
    assert list(took) == ["json", "zstandard"]
    with pytest.raises(ConfigError, match="r2_absent_required"):
        daemon.preload(["r2_absent_required"])


def _daemon(env_extra: dict[str, str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, **env_extra}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.Popen([sys.executable, "-m", "dstl.spark.daemon", "pyspark.worker"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, cwd=str(ROOT))


def test_the_daemon_preloads_then_serves_as_pyspark_daemon_and_exits_when_spark_closes_stdin(
        ) -> None:
    proc = _daemon({"SPARK_REUSE_WORKER": "1"})
    try:
        assert proc.stdout is not None and proc.stdin is not None
        raw = proc.stdout.read(4)  # pyspark.daemon: the port, one big-endian int
        assert len(raw) == 4, proc.stderr.read().decode() if proc.stderr else ""
        port = struct.unpack("!i", raw)[0]
        assert 0 < port < 65536
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            assert b"dstl.spark.daemon" in f.read()
        maps = Path(f"/proc/{proc.pid}/maps").read_text()  # extension modules are mapped
        for lib in ("lmdb", "libarrow", "pandas/_libs", "zstandard"):
            assert lib in maps, f"{lib} not loaded in the daemon"
        assert proc.poll() is None  # serving: pyspark's manager loop
        proc.stdin.close()  # Spark's way to stop its daemon (pyspark's manager exits 1 then)
        proc.wait(30)
        err = proc.stderr.read().decode() if proc.stderr else ""
        line = next(x for x in err.splitlines() if x.startswith("dstl.spark.daemon: imported"))
        for name in ("dstl.spark.task", "dstl.spark.warmup", "pandas", "pyarrow.compute"):
            assert name in line
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_bad_preload_stops_the_daemon_before_it_writes_to_sparks_pipe() -> None:
    proc = _daemon({daemon.PRELOAD_ENV: "r2_no_such_module"})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert out == b""  # nothing Spark could take for a port
    text = err.decode()
    assert "dstl.spark.daemon" in text and "r2_no_such_module" in text
    assert "unset spark.python.daemon.module" in text


def test_no_python_thread_runs_in_this_process_after_the_default_preload() -> None:
    # the same imports as the daemon, in a clean interpreter: no thread but the main one
    code = ("import threading, sys; from dstl.spark import daemon; "
            "daemon.preload(daemon.modules_to_preload(['d'], {})); "
            "print(threading.active_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=str(ROOT), timeout=120)
    assert out.stdout.strip() == "1"
    assert threading.active_count() >= 1
