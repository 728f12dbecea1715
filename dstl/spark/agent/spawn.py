"""Finding and starting the executor agent: its socket path, its locks, and the spawn.

Theory of operation
-------------------
*Where.* The agent of an executor lives in an executor-local directory (``<SPARK_LOCAL_DIRS>/
dstl-agent``: it goes away with the executor). Its Unix socket cannot live there — socket paths
are limited to 107 bytes and executor directories (YARN appcache, ``blockmgr-<uuid>/...``) are
often longer — so it is ``/tmp/dstl-<uid>/<hash of the directory>.sock``, in a directory that
must belong to the user with mode 0700 (the socket is private to the application's user).

*Who starts it.* A worker that finds no agent answering a ``ping`` takes ``<dir>/spawn.lock``
(``flock``; the others wait on it, then find the agent) and starts ``python -m
dstl.spark.agent --dir DIR --watch-pid PID`` with ``start_new_session=True`` — detached, so
Spark SIGKILLing the worker does not take the agent down. Start-up failures land in
``<dir>/agent.err`` and in the raised error.

*Started ahead.* :mod:`dstl.spark.daemon` (the optional Python daemon) starts the agent with
:func:`spawn_agent` before it forks any worker, without waiting for it; its workers pass
``started_elsewhere=True`` and wait for that agent to answer (up to ``_ELSEWHERE_WAIT_S``)
before they would start one themselves — a second agent would only find ``agent.lock`` taken
and exit, after paying its imports on the cores the first batch needs.

*One at a time.* The agent holds ``<dir>/agent.lock`` for its whole life
(:func:`hold_agent_lock`); a second agent started by accident exits at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import IO

from dstl.spark.agent.protocol import (
    AgentProtocolError,
    AgentUnavailableError,
    PingRequest,
    recv_frame,
    send_frame,
)

__all__ = ["SOCKET_ROOT", "agent_dir", "ensure_agent", "executor_pid", "hold_agent_lock", "socket_path",
           "agent_answers", "spawn_agent"]

#: Where the per-user socket directory lives (short: see the module docstring).
SOCKET_ROOT = "/tmp"
#: How long a ping may take before the agent is taken as not answering.
_PING_TIMEOUT_S = 2.0
#: How long a worker waits for an agent that its daemon started before it starts one itself:
#: the agent's own start-up (imports, socket) took 0.8-1.1 s at load ~10 (``bench/restart.py``);
#: an agent that crashed at start costs the worker at most this much.
_ELSEWHERE_WAIT_S = 15.0


def agent_dir(executor_dir: str | None = None) -> str:
    """The executor agent's directory: ``<executor dir>/dstl-agent``, the executor dir being
    the first ``SPARK_LOCAL_DIRS`` entry (else the temp dir), so it goes away with the
    executor."""
    if executor_dir is None:
        executor_dir = (os.environ.get("SPARK_LOCAL_DIRS") or tempfile.gettempdir()).split(",")[0]
    return os.path.join(executor_dir, "dstl-agent")


def socket_path(directory: str) -> str:
    """The agent socket of an agent directory: ``/tmp/dstl-<uid>/<hash>.sock`` (dir 0700).

    Raises:
        AgentUnavailableError: the socket directory belongs to someone else or is not 0700.
    """
    root = os.path.join(SOCKET_ROOT, f"dstl-{os.getuid()}")
    os.makedirs(root, mode=0o700, exist_ok=True)
    st = os.stat(root)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise AgentUnavailableError(f"{root} must belong to this user with mode 0700 (it holds "
                                    "the executor agent's socket); fix or remove it")
    digest = hashlib.sha256(os.path.realpath(directory).encode()).hexdigest()[:24]
    return os.path.join(root, f"{digest}.sock")


def executor_pid() -> int | None:
    """The executor JVM's pid seen from a Python worker (worker -> daemon -> JVM)."""
    try:
        with open(f"/proc/{os.getppid()}/stat") as f:
            daemon_parent = int(f.read().rsplit(")", 1)[1].split()[1])
        return daemon_parent if daemon_parent > 1 else None
    except (OSError, ValueError, IndexError):
        return None


def hold_agent_lock(directory: str) -> IO[str] | None:
    """Take ``<directory>/agent.lock`` for the life of this process (keep the returned file
    open); ``None``: another agent holds it."""
    lock = open(os.path.join(directory, "agent.lock"), "w")  # noqa: SIM115 - held for life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.close()
        return None
    return lock


def ensure_agent(directory: str, watch_pid: int | None, timeout_s: float = 30.0,
                 started_elsewhere: bool = False) -> str:
    """Return the agent's socket path, starting the agent if none answers.

    Args:
        started_elsewhere: an agent of this directory was started without waiting (by the
            Python daemon, :func:`spawn_agent`): wait up to ``_ELSEWHERE_WAIT_S`` for it to
            answer before starting one.

    Raises:
        AgentUnavailableError: no agent could be started within ``timeout_s``.
    """
    _prepare(directory)
    path = socket_path(directory)
    if _ping(path) or (started_elsewhere and _wait_for(path, _ELSEWHERE_WAIT_S)):
        return path
    with open(os.path.join(directory, "spawn.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one spawner; the others wait here, then find it
        try:
            if _ping(path) or _spawn_and_wait(directory, path, watch_pid, timeout_s):
                return path
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    tail = ""
    with contextlib.suppress(OSError), open(os.path.join(directory, "agent.err"), "rb") as f:
        tail = f.read()[-800:].decode("utf-8", "replace").strip()
    raise AgentUnavailableError(f"the executor agent did not start within {timeout_s}s (see "
                                f"{directory}/agent.log and agent.err){': ' + tail if tail else ''}")


def spawn_agent(directory: str, watch_pid: int | None) -> int:
    """Start a detached agent of ``directory`` and return its pid at once (no waiting: the
    caller may be a process that must not block, the Python daemon). Starts no thread."""
    _prepare(directory)
    cmd = [sys.executable, "-m", "dstl.spark.agent", "--dir", directory]
    if watch_pid is not None:
        cmd += ["--watch-pid", str(watch_pid)]
    with open(os.path.join(directory, "agent.err"), "ab") as err:  # start-up failures land here
        proc = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL,
                                stdout=err, stderr=err, close_fds=True)
    return proc.pid


def agent_answers(directory: str) -> bool:
    """Whether the agent of ``directory`` answers a ping now."""
    return _ping(socket_path(directory))


def _prepare(directory: str) -> None:
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)


def _spawn_and_wait(directory: str, path: str, watch_pid: int | None, timeout_s: float) -> bool:
    """Start a detached agent; whether it answers within ``timeout_s``."""
    spawn_agent(directory, watch_pid)
    return _wait_for(path, timeout_s)


def _wait_for(path: str, timeout_s: float) -> bool:
    """Whether an agent answers on ``path`` within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _ping(path):
            return True
        time.sleep(0.05)  # polling a process started elsewhere; no event to wait on
    return False


def _ping(path: str) -> bool:
    """Whether an agent answers on ``path``."""
    request = PingRequest()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(_PING_TIMEOUT_S)
            s.connect(path)
            header, body = request.encode()
            send_frame(s, {"id": 0, **header}, body)
            reply, _ = recv_frame(s)
            if reply.get("ok") is not True:
                return False
            request.decode_reply(reply)
            return True
    except (OSError, AgentProtocolError):
        return False
