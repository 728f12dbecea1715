"""A real HDFS for tests and benchmarks: Hadoop's MiniDFSCluster in a JVM of its own.

The launcher is ``tools/minidfs`` (a pom naming ``org.apache.hadoop:hadoop-client-minicluster``
and one Java class). :func:`build` resolves its classpath with Maven into the project's ignored
``build/`` directory (the Maven repository in ``build/m2``: offline on every later run), compiles
the class with ``javac`` and unpacks the jar's ``webapps/`` next to it (Jetty would otherwise
unpack them from the 56 MB jar at every HTTP server start). The result is keyed by a hash of the
pom and the source, and built under a file lock, so two pytest workers build it once.

:class:`MiniDfs` starts the JVM (``java -cp ...``, no Maven at start), waits for its
``ready rpc=<port> http=<port>`` line and sends it fault commands on stdin (NameNode stop, start
and restart on the same ports, DataNode stop and start, safe mode). The JVM exits when its stdin
closes, so a killed test process never leaves a cluster behind.

Fixture: ``hdfs_cluster`` (session scope: one cluster per pytest worker process; registered in
``tests/conftest.py``, so every module shares it).
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
import tempfile
import threading
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["MiniDfs", "build", "hdfs_cluster", "hdfs_uri"]

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tools" / "minidfs"
MAIN_CLASS = "dstl.minidfs.MiniDfs"
#: The JVM's flags: a C1-only JIT and the serial collector halve the start-up on two cores
#: (25 s -> 14 s measured with the machine loaded); the cluster's work is I/O, not compute.
JVM_FLAGS = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC", "-Xmx1g")
#: Start-up bound: a cold JVM on a loaded two-core machine takes 15-30 s.
START_TIMEOUT_S = 180.0
#: Bound of one command (a NameNode restart replays its edit log and waits for block reports).
COMMAND_TIMEOUT_S = 120.0
#: Bound of the first build (Maven downloads ~110 MB of jars once).
BUILD_TIMEOUT_S = 900.0


def _source_hash() -> str:
    h = hashlib.sha256()
    for path in sorted([SOURCE / "pom.xml", *SOURCE.rglob("*.java")]):
        h.update(path.relative_to(SOURCE).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def build() -> tuple[str, ...]:
    """Build the launcher if needed; return the ``java`` command line up to the main class.

    Raises:
        RuntimeError: Maven or javac failed (their output is in the message).
    """
    out = ROOT / "build" / "minidfs" / _source_hash()
    classpath_file = out / "classpath"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not classpath_file.exists():
            _build_into(out)
    classpath = classpath_file.read_text().strip()
    return ("java", *JVM_FLAGS, "-cp", f"{out / 'classes'}:{out / 'webapps-root'}:{classpath}",
            MAIN_CLASS)


def _build_into(out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mvn = ["mvn", "-B", "-q", f"-Dmaven.repo.local={ROOT / 'build' / 'm2'}", "-f",
           str(SOURCE / "pom.xml"), "dependency:build-classpath",
           f"-Dmdep.outputFile={tmp / 'classpath'}"]
    # offline first: after the first run everything is in build/m2
    done = subprocess.run([*mvn[:1], "-o", *mvn[1:]], capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT_S, check=False)
    if done.returncode != 0:
        done = subprocess.run(mvn, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                              check=False)
    if done.returncode != 0:
        raise RuntimeError(f"mvn dependency:build-classpath failed:\n{done.stdout}\n{done.stderr}")
    classpath = (tmp / "classpath").read_text().strip()
    sources = [str(p) for p in SOURCE.rglob("*.java")]
    done = subprocess.run(["javac", "-d", str(tmp / "classes"), "-cp", classpath, *sources],
                          capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"javac failed:\n{done.stdout}\n{done.stderr}")
    webapps = tmp / "webapps-root"
    for jar in classpath.split(":"):
        if "hadoop-client-minicluster" in jar:
            with zipfile.ZipFile(jar) as z:
                z.extractall(webapps, [n for n in z.namelist() if n.startswith("webapps/")])
    tmp.rename(out)


class MiniDfs:
    """One running MiniDFSCluster (see the module docstring).

    Args:
        directory: the cluster's storage (created; removed by :meth:`close`).
        datanodes: DataNodes to start.
        replication: default replication of new files.
        webhdfs: serve WebHDFS on the NameNode's HTTP port (costs start-up time).
        settings: Hadoop settings of the cluster (``--conf KEY=VALUE``).

    Raises:
        RuntimeError: the build failed, or the cluster did not print its ready line in time.
    """

    def __init__(self, directory: Path, *, datanodes: int = 2, replication: int = 1,
                 webhdfs: bool = False, settings: dict[str, str] | None = None) -> None:
        command = build()
        conf = [arg for k, v in (settings or {}).items() for arg in ("--conf", f"{k}={v}")]
        self.directory = directory
        self._log = open(directory.with_name(directory.name + ".log"), "w")  # noqa: SIM115
        self._proc = subprocess.Popen(
            [*command, "--dir", str(directory), "--datanodes", str(datanodes),
             "--replication", str(replication), "--webhdfs", str(webhdfs).lower(), *conf],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            bufsize=1)
        self._lock = threading.Lock()
        line = self._read_line(START_TIMEOUT_S)
        if not line.startswith("ready "):
            self.close()
            raise RuntimeError(f"MiniDFSCluster did not start: {line!r} (log: {self._log.name})")
        self._ports(line)

    def _ports(self, line: str) -> None:
        fields = dict(word.split("=", 1) for word in line.split()[1:] if "=" in word)
        self.rpc_port = int(fields["rpc"])
        self.http_port = int(fields["http"])

    @property
    def namenode(self) -> str:
        """``host:port`` of the NameNode's RPC endpoint."""
        return f"127.0.0.1:{self.rpc_port}"

    def uri(self, path: str = "") -> str:
        """``hdfs://127.0.0.1:<rpc port>/<path>``."""
        return f"hdfs://{self.namenode}/{path.lstrip('/')}"

    def command(self, line: str, timeout_s: float = COMMAND_TIMEOUT_S) -> str:
        """Send one command; return the answer after ``ok``.

        Raises:
            RuntimeError: the launcher answered ``error ...`` or nothing in time.
        """
        with self._lock:
            assert self._proc.stdin is not None
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()
            answer = self._read_line(timeout_s)
        if not answer.startswith("ok"):
            raise RuntimeError(f"MiniDFSCluster {line!r}: {answer!r}")
        return answer[2:].strip()

    def stop_namenode(self) -> None:
        self.command("stop-namenode")

    def start_namenode(self) -> None:
        """Start the stopped NameNode on the same ports; returns once it is active."""
        self.command("start-namenode")

    def restart_namenode(self) -> None:
        self.command("restart-namenode")

    def stop_datanode_of(self, path: str) -> int:
        """Stop the DataNode holding the first replica of ``path``'s first block."""
        return int(self.command(f"stop-datanode-of {path}"))

    def start_datanodes(self) -> None:
        self.command("start-datanodes")

    def safe_mode(self, enter: bool) -> None:
        self.command(f"safemode {'enter' if enter else 'leave'}")

    def _read_line(self, timeout_s: float) -> str:
        assert self._proc.stdout is not None
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(self._proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(timeout_s)
        if reader.is_alive() or not result:
            return f"<no answer within {timeout_s} s; exit code {self._proc.poll()}>"
        return result[0].strip() or f"<exited with {self._proc.wait()}>"

    def close(self) -> None:
        """Stop the cluster (stdin closed, then killed if it lingers) and remove its storage."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            try:
                self._proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()
        shutil.rmtree(self.directory, ignore_errors=True)


@pytest.fixture(scope="session")
def hdfs_cluster() -> Iterator[MiniDfs]:
    """One MiniDFSCluster per pytest worker: 2 DataNodes, default replication 1."""
    directory = Path(tempfile.mkdtemp(prefix="dstl-minidfs-")) / "cluster"
    cluster = MiniDfs(directory)
    try:
        yield cluster
    finally:
        cluster.close()
        shutil.rmtree(directory.parent, ignore_errors=True)


def hdfs_uri(cluster: MiniDfs, name: str = "t") -> str:
    """A fresh, unique ``hdfs://`` root on ``cluster`` (tests never share a root)."""
    return cluster.uri(f"/dstl-tests/{name}-{uuid.uuid4().hex[:12]}")

