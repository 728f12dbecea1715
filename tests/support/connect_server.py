"""A Spark Connect server on loopback for the tests: ``SparkConnectServer`` started from the
installed pyspark (``bin/spark-submit``, as its ``sbin/start-connect-server.sh`` does, in the
foreground), on a free port, its Python workers running this interpreter."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

READY = "Spark Connect server started"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def connect_server(log_dir: Path, timeout_s: float = 180.0) -> Iterator[str]:
    """Start a server (``local[2]``) and yield its ``sc://`` URL; stop it (its process group)
    on exit."""
    import pyspark

    home = os.path.dirname(pyspark.__file__)
    tests = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "SPARK_HOME": home, "PYSPARK_PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join([tests, os.path.join(tests, "integration", "spark"),
                                          os.environ.get("PYTHONPATH", "")])}
    port = _free_port()
    log = log_dir / "connect-server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [os.path.join(home, "bin", "spark-submit"), "--class",
             "org.apache.spark.sql.connect.service.SparkConnectServer", "--master", "local[2]",
             "--conf", f"spark.connect.grpc.binding.port={port}",
             "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
             "--conf", "spark.ui.enabled=false", "--conf", "spark.sql.shuffle.partitions=4",
             "--conf", "spark.python.authenticate.socketTimeout=120s"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while READY not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Spark Connect server did not start (exit {proc.poll()}); "
                                   f"log: {log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
        yield f"sc://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
