"""Local emulators of the other object stores, for the store contract suite: GCS
(``gcp-storage-emulator``, PyPI, run in-process) reached through gcsfs, and Azure Blob Storage
(Azurite, Microsoft's emulator, from the npm registry; ``make venv`` installs it under
``.venv/node``) reached through adlfs.

What each emulator can and cannot show (checked, see docs/stores.md "Contract runs"):

- Azurite honours ``If-None-Match: *`` on uploads, so adlfs's ``overwrite=False`` (DSTL's
  write-once put on Azure) is tested against a real server-side refusal.
- gcp-storage-emulator ignores the ``ifGenerationMatch`` precondition: a second create of the same
  object succeeds there. Real GCS refuses it with 412. The suite therefore checks, for GCS, that
  the upload DSTL sends carries ``ifGenerationMatch=0`` (through :class:`RequestLog`, a recording
  pass-through proxy between gcsfs and the emulator), and runs every other rule of the contract
  against the emulator.

gcsfs >= 2026.x wraps ``GCSFileSystem`` in an "extended" class that first asks the storage
control API (gRPC) for the bucket's layout; an emulator has no such API and every call waits for
that probe to time out. ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` (read when gcsfs is imported)
selects the plain class: tests/conftest.py sets it before anything imports gcsfs.

Fixtures are session-scoped per xdist worker (``gcs_endpoint``, ``azurite_connection``); each
test gets its own bucket / container (``gcs_bucket``, ``azure_container``).
"""

from __future__ import annotations

import http.client
import os
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

__all__ = ["AZURITE_ACCOUNT", "RequestLog", "azure_container", "azure_storage_options",
           "azurite_connection", "gcs_bucket", "gcs_endpoint", "gcs_storage_options"]

#: Azurite's built-in development account (Microsoft's documented, public default credentials:
#: they only ever open an emulator).
AZURITE_ACCOUNT = "devstoreaccount1"
_AZURITE_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
                "KBHBeksoGMGw==")
_ROOT = Path(__file__).resolve().parents[2]
#: ``make venv`` installs Azurite here; ``AZURITE_BLOB`` overrides the binary.
AZURITE_BLOB = Path(os.environ.get("AZURITE_BLOB",
                                   _ROOT / ".venv/node/node_modules/.bin/azurite-blob"))


# --------------------------------------------------------------------------- GCS


@pytest.fixture(scope="session")
def gcs_endpoint() -> Iterator[str]:
    """``http://127.0.0.1:<port>`` of an in-memory gcp-storage-emulator in this process."""
    from gcp_storage_emulator.server import create_server

    server = create_server("127.0.0.1", 0, in_memory=True)
    server.start()
    try:
        port = server._api._httpd.server_address[1]  # the emulator has no port accessor
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def gcs_storage_options(endpoint: str) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "token": "anon", "project": "dstl-test"}


@pytest.fixture
def gcs_bucket(gcs_endpoint: str) -> str:
    """A fresh bucket on the emulator (each test's own; the emulator is in memory)."""
    import gcsfs

    assert gcsfs.GCSFileSystem is gcsfs.core.GCSFileSystem, (
        "gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false was set "
        "(tests/conftest.py sets it); the extended class probes a gRPC API the emulator lacks")
    name = f"dstl-{uuid.uuid4().hex[:12]}"
    gcsfs.GCSFileSystem(**gcs_storage_options(gcs_endpoint), skip_instance_cache=True).mkdir(name)
    return name


class RequestLog:
    """A pass-through HTTP proxy on loopback that records each request line (method and
    path with its query) before forwarding it unchanged: what a client really sends."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("http://").partition(":")
        self.requests: list[tuple[str, str]] = []
        log = self.requests

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                log.append((self.command, self.path))
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items()
                               if k.lower() not in ("connection", "keep-alive")}
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    self.send_response(resp.status, resp.reason)
                    for k, v in resp.getheaders():
                        if k.lower() not in ("connection", "keep-alive", "transfer-encoding",
                                             "content-length"):
                            self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_PATCH = do_HEAD = _forward

            def log_message(self, format: str, *args: Any) -> None:
                return  # the record is ``requests``; stderr lines would be noise

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# --------------------------------------------------------------------------- Azure


@pytest.fixture(scope="session")
def azurite_connection(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A connection string for an in-memory Azurite blob service on a free loopback port."""
    if not AZURITE_BLOB.exists():
        raise RuntimeError(f"Azurite is not installed at {AZURITE_BLOB}: run `make azurite` "
                           "(it installs azurite from the npm registry; Node.js and npm needed) "
                           "or set AZURITE_BLOB to an azurite-blob binary")
    proc = subprocess.Popen(
        [str(AZURITE_BLOB), "--blobHost", "127.0.0.1", "--blobPort", "0", "--inMemoryPersistence",
         "--disableTelemetry", "--skipApiVersionCheck"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        cwd=tmp_path_factory.mktemp("azurite"))
    try:
        port = _azurite_port(proc)
        yield (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
               f"AccountKey={_AZURITE_KEY};"
               f"BlobEndpoint=http://127.0.0.1:{port}/{AZURITE_ACCOUNT};")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _azurite_port(proc: subprocess.Popen[str], timeout_s: float = 120.0) -> int:
    """The port Azurite prints once it listens (it starts in ~1-15 s, slower under load)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    seen: list[str] = []
    timer = threading.Timer(timeout_s, proc.kill)  # readline would block past the deadline
    timer.start()
    try:
        for line in proc.stdout:
            seen.append(line.rstrip())
            m = re.search(r"listens on http://127\.0\.0\.1:(\d+)", line)
            if m:
                # Azurite logs every request; an undrained pipe would block it when full
                threading.Thread(target=proc.stdout.read, daemon=True).start()
                return int(m.group(1))
            if time.monotonic() > deadline:
                break
    finally:
        timer.cancel()
    raise RuntimeError(f"Azurite did not start within {timeout_s}s; it printed: {seen[-5:]}")


def azure_storage_options(connection: str) -> dict[str, Any]:
    return {"connection_string": connection}


@pytest.fixture
def azure_container(azurite_connection: str) -> Iterator[str]:
    """A fresh container (each test's own), deleted afterwards."""
    from azure.storage.blob import BlobServiceClient

    service = BlobServiceClient.from_connection_string(azurite_connection)
    name = f"dstl-{uuid.uuid4().hex[:12]}"
    service.create_container(name)
    yield name
    service.delete_container(name)
