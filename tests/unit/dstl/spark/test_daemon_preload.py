"""dstl.spark.daemon without Spark: which modules it imports, the errors it gives (a module that
cannot be imported, one that starts a thread), and the hand-over to pyspark's daemon, driven
through its real entry point (``python -m dstl.spark.daemon``) speaking Spark's side of the pipe."""

from __future__ import annotations

import contextlib
import json
import os
import struct
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dstl.errors import ConfigError
from dstl.spark import daemon

ROOT = Path(__file__).resolve().parents[4]


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
    for name in ("dstl.spark.task", "dstl.spark.warmup", "pyarrow", "lmdb",
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


def _daemon(env_extra: dict[str, str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, daemon.AGENT_ENV: "0", **env_extra}
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
        for lib in ("lmdb", "libarrow", "zstandard"):
            assert lib in maps, f"{lib} not loaded in the daemon"
        assert "pandas/_libs" not in maps  # a task builds its Arrow rows without pandas
        assert proc.poll() is None  # serving: pyspark's manager loop
        proc.stdin.close()  # Spark's way to stop its daemon (pyspark's manager exits 1 then)
        proc.wait(30)
        err = proc.stderr.read().decode() if proc.stderr else ""
        line = next(x for x in err.splitlines() if x.startswith("dstl.spark.daemon: imported"))
        for name in ("dstl.spark.task", "dstl.spark.warmup", "pyarrow.compute"):
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


def _agents_of(directory: Path) -> list[int]:
    """Pids of the processes running ``python -m dstl.spark.agent --dir <directory>``."""
    out = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"dstl.spark.agent" in argv and str(directory).encode() in argv:
            out.append(pid)
    return out


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _stop(pids: list[int]) -> None:
    import signal

    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _serving(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdout is not None
    raw = proc.stdout.read(4)
    assert len(raw) == 4, proc.stderr.read().decode() if proc.stderr else ""


def test_the_daemon_starts_the_executor_agent_before_it_serves(tmp_path: Path) -> None:
    from dstl.spark.agent.spawn import agent_answers

    local = tmp_path / "executor"
    local.mkdir()
    proc = _daemon({daemon.AGENT_ENV: "1", "SPARK_LOCAL_DIRS": f"{local},{tmp_path}/other"})
    agents: list[int] = []
    try:
        _serving(proc)  # the agent is spawned before the port is written
        agents = _agents_of(local / "dstl-agent")
        assert len(agents) == 1
        assert _parent_of(agents[0]) == proc.pid
        with open(f"/proc/{agents[0]}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        # it watches the executor JVM: the daemon's parent (here, this test process)
        assert argv[argv.index(b"--watch-pid") + 1] == str(os.getpid()).encode()
        deadline = time.monotonic() + 60
        while not agent_answers(str(local / "dstl-agent")):
            assert time.monotonic() < deadline, "the agent did not answer within 60 s"
            time.sleep(0.1)  # a process starting up; nothing to wait on
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(30)
        _stop(agents)
    err = proc.stderr.read().decode() if proc.stderr else ""
    assert f"executor agent started ahead (pid {agents[0]})" in err


def test_no_agent_is_started_with_dstl_daemon_agent_0(tmp_path: Path) -> None:
    proc = _daemon({daemon.AGENT_ENV: "0", "SPARK_LOCAL_DIRS": str(tmp_path)})
    try:
        _serving(proc)
        assert _agents_of(tmp_path / "dstl-agent") == []
        assert not (tmp_path / "dstl-agent").exists()
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(30)


def test_a_worker_waits_only_for_a_living_agent_of_its_own_directory(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(daemon, "AGENT_DIR", str(tmp_path))
    monkeypatch.setattr(daemon, "AGENT_PID", os.getpid())
    assert daemon.agent_starting(str(tmp_path))
    assert not daemon.agent_starting(str(tmp_path / "other"))
    child = os.fork()
    if child == 0:
        os._exit(0)
    deadline = time.monotonic() + 30
    while not _is_zombie(child):  # exited, not reaped yet: a dead agent
        assert time.monotonic() < deadline
        time.sleep(0.01)  # waiting for the kernel to mark the child; no event to wait on
    monkeypatch.setattr(daemon, "AGENT_PID", child)
    try:
        assert not daemon.agent_starting(str(tmp_path))
    finally:
        os.waitpid(child, 0)
    assert not daemon.agent_starting(str(tmp_path))  # reaped: gone
    monkeypatch.setattr(daemon, "AGENT_PID", None)
    assert not daemon.agent_starting(str(tmp_path))


def _is_zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_an_agent_said_to_start_elsewhere_that_never_answers_is_started_after_the_wait(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from dstl.spark.agent import spawn

    monkeypatch.setattr(spawn, "_ELSEWHERE_WAIT_S", 0.3)
    directory = tmp_path / "agent"
    started = time.monotonic()
    path = spawn.ensure_agent(str(directory), watch_pid=os.getpid(), started_elsewhere=True)
    try:
        assert time.monotonic() - started >= 0.3  # it waited for the other one first
        assert spawn.agent_answers(str(directory)) and path == spawn.socket_path(str(directory))
        assert len(_agents_of(directory)) == 1
    finally:
        _stop(_agents_of(directory))


# prefer_installed in a fresh interpreter (this one imported pyspark long ago): a fake package
# ``fakespark`` stands for pyspark, its zip named as Spark names pyspark's
_PREFER = """
import json, sys
from dstl.spark import daemon
daemon._ZIPPED = (("fakespark", daemon._ZIPPED[0][1]),)
sys.path[:] = json.loads(sys.argv[1])
taken = daemon.prefer_installed(sys.path, {"DSTL_DAEMON_PYSPARK": sys.argv[2]})
try:
    import fakespark
    where = fakespark.__file__
except ImportError:
    where = None
print(json.dumps({"taken": taken, "path": sys.path, "file": where}))
"""


def _prefer(case: Path, zip_version: str | None, installed: str | None, env: str = "",
            zip_body: bytes | None = None) -> dict[str, Any]:
    (case / "lib").mkdir(parents=True)
    zip_path, site = case / "lib" / "pyspark.zip", case / "site"
    if zip_body is not None:
        zip_path.write_bytes(zip_body)
    else:
        with zipfile.ZipFile(zip_path, "w") as z:
            z.writestr("fakespark/__init__.py", "")
            if zip_version is not None:
                z.writestr("fakespark/version.py", f"__version__: str = '{zip_version}'\n")
    if installed is not None:
        (site / "fakespark").mkdir(parents=True)
        (site / "fakespark" / "__init__.py").write_text("")
        (site / "fakespark" / "version.py").write_text(f'__version__ = "{installed}"\n')
    path = [str(zip_path), str(ROOT), str(site), *[p for p in sys.path if "site-packages" in p]]
    out = subprocess.run([sys.executable, "-c", _PREFER, json.dumps(path), env],
                         capture_output=True, text=True, cwd=str(case), timeout=120,
                         env={**os.environ, "PYTHONPATH": ""})
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout)
    return {**result, "zip": str(zip_path), "site": str(site), "given": path}


@pytest.mark.parametrize(("zip_version", "installed", "env", "taken"), [
    ("4.3.0", "4.3.0", "", True),        # the same version: the installed copy, bytecode cached
    ("4.3.0", "4.3.0", " ZIP ", False),  # DSTL_DAEMON_PYSPARK=zip keeps Spark's order
    ("4.3.0", "4.2.1", "", False),       # another version: Spark's own zip
    ("4.3.0", None, "", False),          # nothing installed
    (None, "4.3.0", "", False),          # a zip without a version
])
def test_sparks_zip_gives_way_to_an_installed_copy_of_the_same_version_only(
        tmp_path: Path, zip_version: str | None, installed: str | None, env: str,
        taken: bool) -> None:
    r = _prefer(tmp_path, zip_version, installed, env)
    assert r["taken"] == ([f"fakespark {zip_version}"] if taken else []), r
    assert r["file"].startswith(r["site"] if taken else r["zip"]), r
    # taken off the path, nothing else changed; or the path as it was
    assert r["path"] == ([p for p in r["given"] if p != r["zip"]] if taken else r["given"]), r


def test_a_damaged_zip_is_left_on_the_path_and_raises_nothing(tmp_path: Path) -> None:
    r = _prefer(tmp_path, None, "4.3.0", zip_body=b"PK\x03\x04 not a zip at all")
    assert r["taken"] == [] and r["path"] == r["given"], r
