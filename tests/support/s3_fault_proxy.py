"""An S3 fault proxy: a separate HTTP proxy process in front of an S3 endpoint (moto in tests).

Why a proxy and not a wrapper: a filesystem wrapper raises the exception a test author imagined;
the proxy makes botocore, aiohttp and s3fs see the bytes a misbehaving service sends, so their
parsing, timeouts and error types are the real ones, and DSTL's translation and retries are
tested against them.

Theory of operation
-------------------
``python s3_fault_proxy.py --upstream http://127.0.0.1:PORT`` listens on ``127.0.0.1:0`` (a
``ThreadingHTTPServer``: one thread per client connection, HTTP/1.1 keep-alive) and prints
``PORT <n>`` on its first stdout line. Every S3 request is classified into an *operation*:

==============  ===========================================================================
``put``         PUT of an object (also multipart: POST ``?uploads``/``?uploadId``)
``get``         GET of an object without a ``Range`` header
``ranged_get``  GET of an object with a ``Range`` header
``list``        GET of a bucket (ListObjectsV2)
``delete``      DELETE of an object, POST ``?delete`` (DeleteObjects)
``head``        HEAD (of an object or a bucket)
``other``       anything else (bucket creation, ...)
==============  ===========================================================================

and matched against the *rules* (first match wins). A rule names an operation, an optional
substring of the request path, how many matching requests to let through first (``skip``), how
many to break (``count``; ``None`` = every one: a permanent fault) and a probability. Fault kinds:

- ``internal_error`` — 500 ``InternalError`` (S3's XML error body); nothing reaches upstream.
- ``slowdown`` — 503 ``SlowDown``; nothing reaches upstream.
- ``reset`` — the request is read, then the connection is reset (TCP RST); nothing reaches
  upstream.
- ``truncate`` — a request with a body (a PUT, a DeleteObjects POST) is cut: upstream gets the
  headers and half of the body, then the connection drops (a connection dying mid-upload), and
  the client's connection is reset. Any other request is forwarded and its response body cut:
  the full ``Content-Length`` is announced, half the bytes are sent, then the connection closes.
- ``stall`` — the request is held for ``stall_s`` seconds (longer than the client's read
  timeout), THEN forwarded, so a write lands after the client gave up on it; the response goes
  to whoever is still listening (usually nobody).
- ``lost_response`` — the request is forwarded and applied, the response is dropped and the
  connection reset: the client sees a failure of a write that landed (a "ghost success").

Control: ``PUT /__faults__/rules`` (a JSON list of rules, replacing the current ones),
``DELETE /__faults__/rules``, ``GET /__faults__/stats`` (requests per operation, injected faults,
stalls still in flight), ``DELETE /__faults__/stats``. Bucket names cannot contain ``_``, so the control path never collides
with S3. The process exits when its parent process is gone (``--parent-pid``).

:class:`FaultProxy` (the client half, imported by tests) starts the process, sets rules and reads
the stats. The server half uses the standard library only.
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["KINDS", "OPERATIONS", "FaultProxy", "Rule", "classify"]

#: Fault kinds the proxy injects.
KINDS = ("internal_error", "slowdown", "reset", "truncate", "stall", "lost_response")
#: The operations a rule can target (``head`` and ``other`` too, outside the test matrix).
OPERATIONS = ("put", "get", "ranged_get", "list", "delete", "head", "other")

_CONTROL = "/__faults__/"
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te",
               "trailer", "upgrade", "content-length", "expect"}
_ERROR_BODIES = {
    "internal_error": (500, "Internal Server Error", "InternalError",
                       "We encountered an internal error. Please try again."),
    "slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
}


@dataclass
class Rule:
    """One fault rule (see the module docstring)."""

    op: str
    kind: str
    count: int | None = 1
    skip: int = 0
    path_contains: str = ""
    probability: float = 1.0
    stall_s: float = 2.0
    seen: int = field(default=0, compare=False)
    injected: int = field(default=0, compare=False)

    def __post_init__(self) -> None:
        if self.op not in OPERATIONS:
            raise ValueError(f"unknown operation {self.op!r}; one of {OPERATIONS}")
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; one of {KINDS}")

    def to_json_obj(self) -> dict[str, Any]:
        out = asdict(self)
        del out["seen"], out["injected"]
        return out


def classify(method: str, path: str, headers: Any) -> str:
    """The operation of an S3 request (path-style addressing: ``/bucket[/key][?query]``)."""
    parts = urllib.parse.urlsplit(path)
    query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
    segments = [s for s in parts.path.split("/") if s]
    has_key = len(segments) >= 2
    if method == "HEAD":
        return "head"
    if method == "GET":
        if not has_key:
            return "list"
        return "ranged_get" if headers.get("Range") else "get"
    if method == "PUT":
        return "put" if has_key else "other"
    if method == "DELETE":
        return "delete" if has_key else "other"
    if method == "POST":
        if "delete" in query:
            return "delete"
        if has_key and ("uploads" in query or "uploadId" in query):
            return "put"
    return "other"


# --------------------------------------------------------------------------- the server half


class _State:
    """Rules and counters, shared by the handler threads (one lock)."""

    def __init__(self, seed: int) -> None:
        self.lock = threading.Lock()
        self.rules: list[Rule] = []
        self.requests: dict[str, int] = {}
        self.injected: list[dict[str, Any]] = []
        self.in_flight = 0
        self.rng = random.Random(seed)

    def match(self, op: str, path: str) -> Rule | None:
        with self.lock:
            self.requests[op] = self.requests.get(op, 0) + 1
            for rule in self.rules:
                if rule.op != op or rule.path_contains not in path:
                    continue
                if rule.count is not None and rule.injected >= rule.count:
                    continue
                rule.seen += 1
                if rule.seen <= rule.skip or self.rng.random() >= rule.probability:
                    continue
                rule.injected += 1
                self.injected.append({"op": op, "kind": rule.kind, "path": path,
                                      "t": time.time()})
                return rule
        return None


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, upstream: str, seed: int) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        up = urllib.parse.urlsplit(upstream)
        self.upstream = (up.hostname or "127.0.0.1", up.port or 80)
        self.state = _State(seed)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        # headers and body go out in separate writes: without this, Nagle's algorithm and the
        # client's delayed ACK add 40 ms to every response with a body
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the tests read the stats, not an access log."""

    def do_GET(self) -> None:
        self._dispatch()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    # ------------------------------------------------------------------ dispatch

    def _dispatch(self) -> None:
        body = self._read_body()
        if self.path.startswith(_CONTROL):
            self._control(body)
            return
        op = classify(self.command, self.path, self.headers)
        rule = self.server.state.match(op, self.path)
        try:
            if rule is None:
                self._relay(self._forward(body))
            else:
                self._inject(rule, body)
        except (BrokenPipeError, ConnectionResetError, TimeoutError, OSError):
            self.close_connection = True  # the client went away (after a stall, usually)

    def _inject(self, rule: Rule, body: bytes) -> None:
        kind = rule.kind
        if kind in _ERROR_BODIES:
            self._error_response(*_ERROR_BODIES[kind])
        elif kind == "reset":
            self._reset()
        elif kind == "truncate" and body:
            self._forward_cut(body)
            self._reset()
        elif kind == "truncate":
            self._relay(self._forward(body), cut=True)
        elif kind == "stall":
            st = self.server.state
            with st.lock:
                st.in_flight += 1
            try:
                time.sleep(rule.stall_s)
                response = self._forward(body)
            finally:
                with st.lock:
                    st.in_flight -= 1
            self._relay(response)
        elif kind == "lost_response":
            self._forward(body)
            self._reset()

    # ------------------------------------------------------------------ upstream

    def _read_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is not None:
            return self.rfile.read(int(length))
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return b""

    def _request_headers(self, length: int) -> list[tuple[str, str]]:
        out = [(k, v) for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP]
        if length or self.command in ("PUT", "POST"):
            out.append(("Content-Length", str(length)))
        return out

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.server.upstream, timeout=120)
        try:
            conn.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for k, v in self._request_headers(len(body)):
                conn.putheader(k, v)
            conn.endheaders(body or None)
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, resp.reason, resp.getheaders(), data
        finally:
            conn.close()

    def _forward_cut(self, body: bytes) -> None:
        """Send the headers and half of the body upstream, then drop the connection."""
        sock = socket.create_connection(self.server.upstream, timeout=30)
        try:
            lines = [f"{self.command} {self.path} HTTP/1.1"]
            lines += [f"{k}: {v}" for k, v in self._request_headers(len(body))]
            sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            sock.sendall(body[: len(body) // 2])
            time.sleep(0.05)  # let upstream start reading before the connection dies
        finally:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()

    # ------------------------------------------------------------------ responses

    def _relay(self, response: tuple[int, str, list[tuple[str, str]], bytes], *,
               cut: bool = False) -> None:
        status, reason, headers, data = response
        self.send_response_only(status, reason)
        for k, v in headers:
            if k.lower() not in _HOP_BY_HOP:
                self.send_header(k, v)
        if self.command == "HEAD":
            length = next((v for k, v in headers if k.lower() == "content-length"), "0")
            self.send_header("Content-Length", length)
            self.end_headers()
            return
        if cut and not data:
            data = b"<?xml version='1.0' encoding='UTF-8'?>\n<Truncated>" + b"x" * 64
        self.send_header("Content-Length", str(len(data)))
        if cut:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data[: len(data) // 2] if cut else data)
        if cut:
            self.wfile.flush()
            self.close_connection = True

    def _error_response(self, status: int, reason: str, code: str, message: str) -> None:
        body = ("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
                f"<Error><Code>{code}</Code><Message>{message}</Message>"
                f"<RequestId>fault-proxy</RequestId></Error>").encode()
        self.send_response_only(status, reason)
        self.send_header("Content-Type", "application/xml")
        if self.command == "HEAD":
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _reset(self) -> None:
        """Close the client connection with a TCP reset (SO_LINGER 0)."""
        self.close_connection = True
        sock = self.connection
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        finally:
            # Closing the file objects drops their references to the socket, so close() really
            # closes it now (and sends the RST); the stand-ins keep the base class's final
            # flush and close harmless.
            self.rfile.close()
            self.wfile.close()
            sock.close()
            self.rfile = io.BytesIO()
            self.wfile = io.BytesIO()

    # ------------------------------------------------------------------ control

    def _control(self, body: bytes) -> None:
        st = self.server.state
        name = self.path[len(_CONTROL):]
        if name == "rules" and self.command == "PUT":
            rules = [Rule(**r) for r in json.loads(body or b"[]")]
            with st.lock:
                st.rules = rules
            out: Any = {"ok": True}
        elif name == "rules" and self.command == "DELETE":
            with st.lock:
                st.rules = []
            out = {"ok": True}
        elif name == "stats" and self.command == "DELETE":
            with st.lock:
                st.requests.clear()
                st.injected.clear()
            out = {"ok": True}
        elif name == "stats" and self.command == "GET":
            with st.lock:
                out = {"requests": dict(st.requests), "injected": list(st.injected),
                       "in_flight": st.in_flight}
        else:
            self.send_error(404, f"unknown control request {self.command} {self.path}")
            return
        data = json.dumps(out).encode()
        self.send_response_only(200, "OK")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)  # the test process is gone: never outlive it
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="S3 fault proxy (tests)")
    parser.add_argument("--upstream", required=True, help="S3 endpoint, http://host:port")
    parser.add_argument("--seed", type=int, default=0, help="seed of the probability draws")
    parser.add_argument("--parent-pid", type=int, default=os.getppid())
    args = parser.parse_args(argv)
    server = _Server(args.upstream, args.seed)
    threading.Thread(target=_watch_parent, args=(args.parent_pid,), daemon=True,
                     name="fault-proxy-watch").start()
    print(f"PORT {server.server_address[1]}", flush=True)
    server.serve_forever(poll_interval=0.2)


# --------------------------------------------------------------------------- the client half


class FaultProxy:
    """A running proxy process (see the module docstring); use :meth:`start`."""

    def __init__(self, proc: subprocess.Popen[str], port: int) -> None:
        self._proc = proc
        self.port = port
        self.endpoint = f"http://127.0.0.1:{port}"

    @classmethod
    def start(cls, upstream: str, *, seed: int = 0, timeout_s: float = 30.0) -> FaultProxy:
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--upstream", upstream,
             "--seed", str(seed), "--parent-pid", str(os.getpid())],
            stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        line = proc.stdout.readline()
        if not line.startswith("PORT ") or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"fault proxy did not start (got {line!r})")
        return cls(proc, int(line.split()[1]))

    def _call(self, method: str, name: str, body: Any = None) -> Any:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, _CONTROL + name, body=data,
                         headers={"Content-Length": str(len(data or b""))})
            resp = conn.getresponse()
            out = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"fault proxy control {method} {name}: {resp.status} {out!r}")
            return json.loads(out)
        finally:
            conn.close()

    def set_rules(self, *rules: Rule) -> None:
        """Replace the rules (counters restart)."""
        self._call("PUT", "rules", [r.to_json_obj() for r in rules])

    def clear(self) -> None:
        """Drop the rules (the statistics stay)."""
        self._call("DELETE", "rules")

    def reset(self) -> None:
        """Drop the rules and the statistics (a new test)."""
        self.clear()
        self._call("DELETE", "stats")

    def stats(self) -> dict[str, Any]:
        return self._call("GET", "stats")  # type: ignore[no-any-return]

    def injected(self, op: str | None = None, kind: str | None = None) -> int:
        """Faults injected so far (of one operation / kind, if given)."""
        return sum(1 for f in self.stats()["injected"]
                   if (op is None or f["op"] == op) and (kind is None or f["kind"] == kind))

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Wait until no stalled request is still held (its write may land at the end)."""
        deadline = time.monotonic() + timeout_s
        while self.stats()["in_flight"]:
            if time.monotonic() > deadline:
                raise TimeoutError("stalled requests still held by the fault proxy")
            time.sleep(0.05)

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)
        if self._proc.stdout is not None:
            self._proc.stdout.close()


if __name__ == "__main__":
    main()
