"""The executor agent's wire protocol: frames, one typed message per request and reply, and the
one error codec every side uses.

Theory of operation
-------------------
*Frames.* A frame is ``u32 length | u32 header length | header JSON | body`` (big-endian;
``length`` counts everything after itself). The header is a JSON object; the body is raw bytes
(only ``persist`` sends any: the change sets' bodies, back to back). The codec here is pure —
:func:`encode_frame` and :class:`FrameDecoder` turn values into bytes and bytes into values —
and :func:`send_frame` / :func:`recv_frame` are the two thin socket wrappers the agent, its
client and the spawner use.

*Messages.* Every request header carries ``id`` (the client's, echoed in the reply) and ``op``;
every reply header carries ``id`` and ``ok``. Each op has one request dataclass and one reply
dataclass (``PersistRequest`` / ``PersistReply``, ...): ``encode()`` gives the header fields (and
the body), ``decode()`` reads them back. A request knows its reply type
(:meth:`Request.decode_reply`), so :class:`~dstl.spark.agent.client.AgentClient` returns a typed
reply per request.

*Untrusted input.* The socket is private to the user (0700 directory, 0600 socket), and the
agent and its workers run the same DSTL version (the worker starts the agent with its own
interpreter), so a malformed frame means a bug or a foreign process on the socket — never a
case to limp on. Decoding checks every field's type and range and raises
:class:`AgentProtocolError` (a :class:`~dstl.errors.DstlError`) naming the frame, an offset and
the field, and nothing else; a frame that cannot be split from the stream (bad lengths, a header
that is not a JSON object) ends the connection, a message that is malformed inside a good frame
fails only that request. Decoding is bounded: a frame's length is checked against
``max_frame_bytes`` (:data:`MAX_FRAME_BYTES`) before it is buffered, its header against
:data:`MAX_HEADER_BYTES` before it is parsed, and the header's nesting after
(:func:`dstl.untrusted.load_json`); a persist's change-set bodies must start with the log id and
sqn their header fields name.

*Errors.* A failed request comes back as an :class:`ErrorReply` (``ok: false``): the error's
type name, message, ``key`` and plain attributes. :func:`encode_error` builds it from an
exception and :func:`decode_error` raises it again on the other side as the same
:class:`~dstl.errors.DstlError` type with the same fields — so a worker sees
``ObjectNotFoundError`` from the agent's cache exactly as from its own. Anything that is not a
DSTL error arrives as :class:`~dstl.errors.StorageError`.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from dstl import errors as dstl_errors
from dstl.errors import DstlError, StorageError, UsageError
from dstl.handle import ChangeSetRef
from dstl.options import DstlOptions
from dstl.segment import ChangeSet
from dstl.spark.agent.materializer import PartitionSpec
from dstl.spark.fields import Fields
from dstl.untrusted import load_json
from materializer.handles import SnapshotRef

__all__ = [
    "MAX_FRAME_BYTES", "MAX_HEADER_BYTES", "AgentProtocolError", "AgentUnavailableError", "CacheStatsReply",
    "CacheStatsRequest", "CommittedReply", "CommittedRequest", "ErrorReply", "FrameDecoder",
    "Header", "LeaseReply", "LeaseRequest", "MaterializationReply", "MaterializationRequest",
    "MetricsReply", "MetricsRequest", "OfferedSnapshot", "PersistReply", "PersistRequest",
    "PingReply", "PingRequest", "PrefetchCancelReply", "PrefetchCancelRequest", "PrefetchReply",
    "PrefetchRequest", "ReleaseReply", "ReleaseRequest", "Reply", "Request",
    "ShutdownReply", "ShutdownRequest", "StoreRef", "decode_error", "decode_request",
    "encode_error", "encode_frame", "recv_frame", "send_frame",
]

#: A decoded JSON header: untrusted until a message's ``decode`` has checked it.
Header = dict[str, Any]

_PREFIX = struct.Struct(">II")
#: The largest frame accepted (``length`` field): a persist carries at most the in-flight limit
#: of change-set bytes, far below this.
MAX_FRAME_BYTES = 1 << 31
#: The largest header accepted (checked before it is parsed): a header lists one small object
#: per change set of a persist.
MAX_HEADER_BYTES = 16 << 20
_U16 = struct.Struct(">H")
_U64 = struct.Struct(">Q")
_MAX_I64 = (1 << 63) - 1


class AgentUnavailableError(StorageError):
    """The executor agent is not running or died while a request was in flight (retryable:
    the task fails and Spark retries it, which starts a new agent)."""


class AgentProtocolError(UsageError):
    """A frame or message on the agent's socket is malformed.

    Attributes:
        frame: which frame (``"frame"``, ``"persist request"``, ``"lease reply"``, ...).
        detail: what is wrong with it.
        key: what the error names as its object: the frame on the agent's socket.
        offset: the byte offset of the problem in the frame (0 for a field of its header).
    """

    def __init__(self, frame: str, detail: str, offset: int = 0) -> None:
        self.frame = frame
        self.detail = detail
        self.key = f"executor agent {frame}"
        self.offset = offset
        super().__init__(f"malformed {frame} on the executor agent's socket ({self.key} at "
                         f"offset {offset}): {detail}; the agent and its workers run the same "
                         "DSTL version, so this is a bug or a foreign process on the socket "
                         "(report it; a new executor starts a new agent)")


# --------------------------------------------------------------------------- frames


def encode_frame(header: Header, body: bytes = b"") -> bytes:
    """One frame's bytes."""
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return _PREFIX.pack(4 + len(h) + len(body), len(h)) + h + body


class FrameDecoder:
    """Splits a byte stream into frames (sans-I/O: feed bytes, take frames).

    Raises (from :meth:`feed`):
        AgentProtocolError: a length prefix out of range, or a header that is not a UTF-8 JSON
            object; the stream cannot be resynchronised after that.
    """

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self._buf = bytearray()
        self._max = max_frame_bytes

    def needed(self) -> int:
        """Bytes still missing before the next frame is complete (at least 1)."""
        if len(self._buf) < _PREFIX.size:
            return _PREFIX.size - len(self._buf)
        total, _ = self._lengths()
        return max(1, _PREFIX.size - 4 + total - len(self._buf))

    def feed(self, data: bytes) -> list[tuple[Header, bytes]]:
        """Add bytes; return the frames completed by them, in order."""
        self._buf += data
        frames: list[tuple[Header, bytes]] = []
        while len(self._buf) >= _PREFIX.size:
            total, hlen = self._lengths()
            end = _PREFIX.size - 4 + total
            if len(self._buf) < end:
                break
            payload = bytes(self._buf[_PREFIX.size:end])
            del self._buf[:end]
            frames.append((_decode_header(payload[:hlen]), payload[hlen:]))
        return frames

    def _lengths(self) -> tuple[int, int]:
        total, hlen = _PREFIX.unpack_from(self._buf)
        if total < 4 or hlen > total - 4 or total > self._max or hlen > MAX_HEADER_BYTES:
            raise AgentProtocolError("frame", f"length {total}, header length {hlen} (at most "
                                              f"{self._max} and {MAX_HEADER_BYTES})")
        return total, hlen


def _decode_header(raw: bytes) -> Header:
    try:
        header = load_json(raw, key="executor agent frame", what="frame header",
                           max_bytes=MAX_HEADER_BYTES, offset=_PREFIX.size)
    except dstl_errors.CorruptObjectError as exc:
        raise AgentProtocolError("frame", f"header is not a UTF-8 JSON object ({exc.reason})",
                                 exc.offset) from exc
    if not isinstance(header, dict):
        raise AgentProtocolError("frame", f"header is a JSON {type(header).__name__}, not an "
                                          "object", _PREFIX.size)
    return header


def send_frame(sock: socket.socket, header: Header, body: bytes = b"") -> None:
    """Write one frame (the caller serialises writers of one socket)."""
    sock.sendall(encode_frame(header, body))


def recv_frame(sock: socket.socket) -> tuple[Header, bytes]:
    """Read one frame.

    Raises:
        ConnectionError: the peer closed the connection.
        AgentProtocolError: a malformed frame.
    """
    decoder = FrameDecoder()
    while True:
        # never read past the frame's end: the next frame stays in the socket for the next call
        chunk = sock.recv(min(decoder.needed(), 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        frames = decoder.feed(chunk)
        if frames:
            return frames[0]


# --------------------------------------------------------------------------- field checks


def _fields(obj: Header, frame: str) -> Fields:
    """Typed reads of one untrusted header; every failure names the frame and the field."""
    return Fields(obj, frame, AgentProtocolError)


# --------------------------------------------------------------------------- shared parts


@dataclass(frozen=True, slots=True)
class StoreRef:
    """The store a request names: the agent opens one :class:`~dstl.ChangelogStorage` per
    distinct store and shares it between persists, leases and materializations."""

    uri: str
    storage_options: dict[str, Any] | None
    options: DstlOptions

    def key(self) -> str:
        """The agent's name of this store (equal stores, equal keys)."""
        f = self.to_fields()
        return json.dumps([f["uri"], f["storage_options"], f["options"]], sort_keys=True,
                          default=str)

    def to_fields(self) -> Header:
        return {"uri": self.uri, "storage_options": self.storage_options,
                "options": dataclasses.asdict(self.options)}

    @classmethod
    def from_fields(cls, f: Fields) -> StoreRef:
        uri = f.text("uri")
        storage_options = f.opt_mapping("storage_options")
        raw = f.mapping("options")
        known = {x.name for x in dataclasses.fields(DstlOptions)}
        if not set(raw) <= known:
            raise f.bad("options", f"DstlOptions fields (unknown: {sorted(set(raw) - known)})")
        try:
            options = DstlOptions(**raw)
        except (DstlError, TypeError) as exc:
            raise AgentProtocolError(f.where, f"field 'options': {exc}") from exc
        return cls(uri, storage_options, options)


@dataclass(frozen=True, slots=True)
class OfferedSnapshot:
    """A snapshot the agent took of a partition: its object and the log position it covers;
    for a delta (``ref.delta``), the pieces it follows (``chain``: a full snapshot, then
    deltas)."""

    ref: SnapshotRef
    boundary: tuple[str, int]
    chain: tuple[SnapshotRef, ...] = ()


# --------------------------------------------------------------------------- message bases

R = TypeVar("R", bound="Reply")


class Reply:
    """A successful reply (``ok: true``); subclasses are dataclasses."""

    __slots__ = ()
    op: ClassVar[str]

    def encode(self) -> Header:
        """The header fields (without ``id``)."""
        return {"ok": True, **self._fields()}

    def _fields(self) -> Header:
        return {}


class Request(Generic[R]):
    """A request to the agent; subclasses are dataclasses, one per op."""

    __slots__ = ()
    op: ClassVar[str]

    def encode(self) -> tuple[Header, bytes]:
        """The header fields (without ``id``) and the body."""
        return {"op": self.op, **self._fields()}, b""

    def _fields(self) -> Header:
        return {}

    def decode_reply(self, header: Header) -> R:
        """This request's successful reply from its (untrusted) header.

        Raises:
            AgentProtocolError: the reply is malformed.
        """
        raise NotImplementedError


def _status_fields(f: Fields) -> tuple[dict[str, float], tuple[str, ...]]:
    return f.numbers("metrics"), f.texts("log_tail")


# --------------------------------------------------------------------------- ping, shutdown


@dataclass(frozen=True, slots=True)
class PingReply(Reply):
    op = "ping"
    pid: int

    def _fields(self) -> Header:
        return {"pid": self.pid}


@dataclass(frozen=True, slots=True)
class PingRequest(Request[PingReply]):
    """Is an agent serving this socket? (The spawner asks.)"""

    op = "ping"

    def decode_reply(self, header: Header) -> PingReply:
        return PingReply(_fields(header, "ping reply").integer("pid", 1))


@dataclass(frozen=True, slots=True)
class ShutdownReply(Reply):
    op = "shutdown"


@dataclass(frozen=True, slots=True)
class ShutdownRequest(Request[ShutdownReply]):
    """Stop the agent (after this reply)."""

    op = "shutdown"

    def decode_reply(self, header: Header) -> ShutdownReply:
        return ShutdownReply()


# --------------------------------------------------------------------------- metrics, committed


@dataclass(frozen=True, slots=True)
class MetricsReply(Reply):
    """The agent's metrics (``agent.*``) and its last log lines."""

    op = "metrics"
    metrics: dict[str, float]
    log_tail: tuple[str, ...]

    def _fields(self) -> Header:
        return {"metrics": self.metrics, "log_tail": list(self.log_tail)}


@dataclass(frozen=True, slots=True)
class MetricsRequest(Request[MetricsReply]):
    op = "metrics"

    def decode_reply(self, header: Header) -> MetricsReply:
        return MetricsReply(*_status_fields(_fields(header, "metrics reply")))


@dataclass(frozen=True, slots=True)
class CommittedReply(Reply):
    """The agent's metrics and last log lines (the driver shows them with each batch)."""

    op = "committed"
    metrics: dict[str, float]
    log_tail: tuple[str, ...]

    def _fields(self) -> Header:
        return {"metrics": self.metrics, "log_tail": list(self.log_tail)}


@dataclass(frozen=True, slots=True)
class CommittedRequest(Request[CommittedReply]):
    """A task committed its partition's table: for LMDB under the agent, the partition to
    (re)schedule for materialization; ``None`` for a partition the worker materializes."""

    op = "committed"
    store: StoreRef
    partition: PartitionSpec | None

    def _fields(self) -> Header:
        return {**self.store.to_fields(), "partition": None if self.partition is None
                else self.partition.to_json_obj()}

    @classmethod
    def decode(cls, header: Header, body: bytes) -> CommittedRequest:
        f = _fields(header, "committed request")
        raw = f.opt_mapping("partition")
        try:
            spec = None if raw is None else PartitionSpec.from_json_obj(raw)
        except (KeyError, TypeError, ValueError, IndexError, DstlError) as exc:
            raise f.bad("partition", f"a partition registration ({exc!r})") from exc
        return cls(StoreRef.from_fields(f), spec)

    def decode_reply(self, header: Header) -> CommittedReply:
        return CommittedReply(*_status_fields(_fields(header, "committed reply")))


# --------------------------------------------------------------------------- persist


@dataclass(frozen=True, slots=True)
class PersistReply(Reply):
    """Where each change set of the request went, in the request's order: ``(segment key,
    offset, length)`` — sent once the segment is durable."""

    op = "persist"
    refs: tuple[tuple[str, int, int], ...]

    def _fields(self) -> Header:
        return {"refs": [list(r) for r in self.refs]}

    def change_set_refs(self, sets: tuple[ChangeSet, ...]) -> list[tuple[ChangeSet, ChangeSetRef]]:
        """The upload scheduler's success pairs for the request's change sets."""
        return [(cs, ChangeSetRef(cs.sqn, key, offset, length, cs.change_count,
                                  cs.payload_bytes, cs.kg_min, cs.kg_max))
                for cs, (key, offset, length) in zip(sets, self.refs, strict=True)]


_SET_FIELDS = ("log_id", "sqn", "size", "change_count", "payload_bytes", "kg_min", "kg_max")


@dataclass(frozen=True, slots=True)
class PersistRequest(Request[PersistReply]):
    """One writer's change sets, for the agent's batching scheduler of ``store``."""

    op = "persist"
    store: StoreRef
    change_sets: tuple[ChangeSet, ...]

    def encode(self) -> tuple[Header, bytes]:
        sets = [{"log_id": cs.log_id, "sqn": cs.sqn, "size": len(cs.body),
                 "change_count": cs.change_count, "payload_bytes": cs.payload_bytes,
                 "kg_min": cs.kg_min, "kg_max": cs.kg_max} for cs in self.change_sets]
        header = {"op": self.op, **self.store.to_fields(), "sets": sets}
        return header, b"".join(cs.body for cs in self.change_sets)

    @classmethod
    def decode(cls, header: Header, body: bytes) -> PersistRequest:
        f = _fields(header, "persist request")
        sets: list[ChangeSet] = []
        pos = 0
        for i, raw in enumerate(f.array("sets")):
            if not isinstance(raw, dict):
                raise f.bad("sets", "a list of objects")
            m = _fields(raw, f"persist request: sets[{i}]")
            n = m.integer("size", 0, len(body) - pos)
            cs = ChangeSet(m.text("log_id"), m.integer("sqn", 0, _MAX_I64), body[pos:pos + n],
                           m.integer("change_count", 0, (1 << 32) - 1),
                           m.integer("payload_bytes", 0, _MAX_I64),
                           m.integer("kg_min", -1, 0x7FFF), m.integer("kg_max", -1, 0x7FFF))
            _check_body_names(cs, m.where, pos)
            sets.append(cs)
            pos += n
        if pos != len(body):
            raise AgentProtocolError("persist request", f"the change sets' sizes add up to "
                                                        f"{pos} bytes, the body has {len(body)}")
        return cls(StoreRef.from_fields(f), tuple(sets))

    def decode_reply(self, header: Header) -> PersistReply:
        f = _fields(header, "persist reply")
        refs: list[tuple[str, int, int]] = []
        for raw in f.array("refs"):
            if not (isinstance(raw, list) and len(raw) == 3 and isinstance(raw[0], str)
                    and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                            for x in raw[1:])):
                raise f.bad("refs", "a list of [segment key, offset, length]")
            refs.append((raw[0], raw[1], raw[2]))
        if len(refs) != len(self.change_sets):
            raise f.bad("refs", f"{len(self.change_sets)} references (one per change set)")
        return PersistReply(tuple(refs))


def _check_body_names(cs: ChangeSet, frame: str, at: int) -> None:
    """A change set's body starts with the log id and sqn its header fields name."""
    lid = cs.log_id.encode("utf-8", "surrogatepass")
    head = _U16.size + len(lid) + _U64.size
    if len(cs.body) < head or _U16.unpack_from(cs.body, 0)[0] != len(lid) \
            or cs.body[_U16.size:_U16.size + len(lid)] != lid \
            or _U64.unpack_from(cs.body, _U16.size + len(lid))[0] != cs.sqn:
        raise AgentProtocolError(frame, f"the body does not start with log id {cs.log_id!r:.80} "
                                        f"and sqn {cs.sqn}", at)


# --------------------------------------------------------------------------- restore cache


@dataclass(frozen=True, slots=True)
class LeaseReply(Reply):
    """A granted lease: its id, the published file (``None``: a direct lease, read from the
    worker's own store) and the object's size."""

    op = "lease"
    lease: int
    path: str | None
    size: int

    def _fields(self) -> Header:
        return {"lease": self.lease, "path": self.path, "size": self.size}


@dataclass(frozen=True, slots=True)
class LeaseRequest(Request[LeaseReply]):
    """Lease ``key`` of ``store`` through the agent's restore cache; ``verify`` names a function
    in :data:`restore.reader.VERIFIERS` (a function cannot cross the socket)."""

    op = "lease"
    store: StoreRef
    key: str
    verify: str | None
    size_hint: int | None

    def _fields(self) -> Header:
        return {**self.store.to_fields(), "key": self.key, "verify": self.verify,
                "size_hint": self.size_hint}

    @classmethod
    def decode(cls, header: Header, body: bytes) -> LeaseRequest:
        f = _fields(header, "lease request")
        return cls(StoreRef.from_fields(f), f.text("key"), f.opt_text("verify"),
                   f.opt_integer("size_hint"))

    def decode_reply(self, header: Header) -> LeaseReply:
        f = _fields(header, "lease reply")
        return LeaseReply(f.integer("lease", 1), f.opt_text("path"), f.integer("size"))


@dataclass(frozen=True, slots=True)
class ReleaseReply(Reply):
    op = "release"


@dataclass(frozen=True, slots=True)
class ReleaseRequest(Request[ReleaseReply]):
    """Give back one lease taken on this connection."""

    op = "release"
    lease: int

    def _fields(self) -> Header:
        return {"lease": self.lease}

    @classmethod
    def decode(cls, header: Header, body: bytes) -> ReleaseRequest:
        return cls(_fields(header, "release request").integer("lease", 1))

    def decode_reply(self, header: Header) -> ReleaseReply:
        return ReleaseReply()


@dataclass(frozen=True, slots=True)
class PrefetchReply(Reply):
    op = "prefetch"


@dataclass(frozen=True, slots=True)
class PrefetchRequest(Request[PrefetchReply]):
    """Start downloading ``objects`` — ``(key, verify name, size hint)`` each, in the order the
    worker will lease them — into the agent's restore cache; ``ticket`` is the worker's id of this
    prefetch on its connection (answered at once, before any download)."""

    op = "prefetch"
    store: StoreRef
    ticket: int
    objects: tuple[tuple[str, str | None, int | None], ...]

    def _fields(self) -> Header:
        return {**self.store.to_fields(), "ticket": self.ticket,
                "objects": [list(o) for o in self.objects]}

    @classmethod
    def decode(cls, header: Header, body: bytes) -> PrefetchRequest:
        f = _fields(header, "prefetch request")
        objects: list[tuple[str, str | None, int | None]] = []
        for raw in f.array("objects"):
            if not (isinstance(raw, list) and len(raw) == 3 and isinstance(raw[0], str)
                    and (raw[1] is None or isinstance(raw[1], str))
                    and (raw[2] is None or (isinstance(raw[2], int)
                                            and not isinstance(raw[2], bool) and raw[2] >= 0))):
                raise f.bad("objects", "a list of [key, verify name or null, size hint or null]")
            objects.append((raw[0], raw[1], raw[2]))
        return cls(StoreRef.from_fields(f), f.integer("ticket", 1, _MAX_I64), tuple(objects))

    def decode_reply(self, header: Header) -> PrefetchReply:
        return PrefetchReply()


@dataclass(frozen=True, slots=True)
class PrefetchCancelReply(Reply):
    op = "prefetch_cancel"


@dataclass(frozen=True, slots=True)
class PrefetchCancelRequest(Request[PrefetchCancelReply]):
    """Drop what prefetch ``ticket`` of this connection has not started downloading."""

    op = "prefetch_cancel"
    ticket: int

    def _fields(self) -> Header:
        return {"ticket": self.ticket}

    @classmethod
    def decode(cls, header: Header, body: bytes) -> PrefetchCancelRequest:
        return cls(_fields(header, "prefetch_cancel request").integer("ticket", 1, _MAX_I64))

    def decode_reply(self, header: Header) -> PrefetchCancelReply:
        return PrefetchCancelReply()


@dataclass(frozen=True, slots=True)
class CacheStatsReply(Reply):
    """The agent cache's :meth:`~restore.cache.LocalFileCache.stats`."""

    op = "cache_stats"
    stats: dict[str, int]

    def _fields(self) -> Header:
        return {"stats": self.stats}


@dataclass(frozen=True, slots=True)
class CacheStatsRequest(Request[CacheStatsReply]):
    op = "cache_stats"

    def decode_reply(self, header: Header) -> CacheStatsReply:
        f = _fields(header, "cache_stats reply")
        stats = f.mapping("stats")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in stats.values()):
            raise f.bad("stats", "an object of integers")
        return CacheStatsReply(stats)


# --------------------------------------------------------------------------- materialization


@dataclass(frozen=True, slots=True)
class MaterializationReply(Reply):
    """A partition's newest snapshot in the agent (``None``: none yet), and ``failed``: the last
    error once the partition's materializations failed more than ``max_failures`` times in a
    row."""

    op = "materialization"
    snapshot: OfferedSnapshot | None
    failed: str | None

    def _fields(self) -> Header:
        s = self.snapshot
        return {"materialization": None if s is None else {
                    "ref": s.ref.to_json_obj(), "boundary": list(s.boundary),
                    "chain": [p.to_json_obj() for p in s.chain]},
                "failed": self.failed}


@dataclass(frozen=True, slots=True)
class MaterializationRequest(Request[MaterializationReply]):
    """The newest snapshot the agent took of partition ``log_id`` of ``store``."""

    op = "materialization"
    store: StoreRef
    log_id: str

    def _fields(self) -> Header:
        return {**self.store.to_fields(), "log_id": self.log_id}

    @classmethod
    def decode(cls, header: Header, body: bytes) -> MaterializationRequest:
        f = _fields(header, "materialization request")
        return cls(StoreRef.from_fields(f), f.text("log_id"))

    def decode_reply(self, header: Header) -> MaterializationReply:
        f = _fields(header, "materialization reply")
        failed = f.opt_text("failed")
        if f.get("materialization") is None:
            return MaterializationReply(None, failed)
        m = f.sub("materialization", "materialization")
        boundary = m.array("boundary")
        if not (len(boundary) == 2 and isinstance(boundary[0], str)
                and isinstance(boundary[1], int) and not isinstance(boundary[1], bool)):
            raise m.bad("boundary", "[segment key, offset]")
        try:
            ref = SnapshotRef.from_json_obj(m.get("ref"))
        except DstlError as exc:
            raise m.bad("ref", f"a snapshot reference ({exc})") from exc
        raw_chain = m.obj.get("chain", [])
        if not isinstance(raw_chain, list):
            raise m.bad("chain", "a list of snapshot references")
        try:
            chain = tuple(SnapshotRef.from_json_obj(p) for p in raw_chain)
        except DstlError as exc:
            raise m.bad("chain", f"a list of snapshot references ({exc})") from exc
        if ref.delta != bool(chain):
            raise m.bad("chain", "the pieces a delta follows (and none for a full snapshot)")
        return MaterializationReply(OfferedSnapshot(ref, (boundary[0], boundary[1]), chain),
                                    failed)


# --------------------------------------------------------------------------- requests by op


_NO_FIELDS: dict[str, type[Request[Any]]] = {
    "ping": PingRequest, "shutdown": ShutdownRequest, "metrics": MetricsRequest,
    "cache_stats": CacheStatsRequest}
_WITH_FIELDS: dict[str, Callable[[Header, bytes], Request[Any]]] = {
    "persist": PersistRequest.decode, "lease": LeaseRequest.decode,
    "release": ReleaseRequest.decode, "committed": CommittedRequest.decode,
    "prefetch": PrefetchRequest.decode, "prefetch_cancel": PrefetchCancelRequest.decode,
    "materialization": MaterializationRequest.decode}


def decode_request(header: Header, body: bytes) -> Request[Any]:
    """The request in a frame received by the agent.

    Raises:
        AgentProtocolError: unknown op, or a malformed request.
    """
    op = header.get("op")
    plain = _NO_FIELDS.get(op) if isinstance(op, str) else None
    if plain is not None:
        return plain()
    decode = _WITH_FIELDS.get(op) if isinstance(op, str) else None
    if decode is None:
        raise AgentProtocolError("request", f"unknown op {op!r} (known: "
                                            f"{sorted({*_NO_FIELDS, *_WITH_FIELDS})})")
    request: Request[Any] = decode(header, body)
    return request


# --------------------------------------------------------------------------- errors

#: Errors of this package that cross the socket by name (besides those of :mod:`dstl.errors`).
_OWN_ERRORS: dict[str, type[DstlError]] = {"AgentUnavailableError": AgentUnavailableError,
                                           "AgentProtocolError": AgentProtocolError}
_Plain = str | int | float | bool | None


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """A failed request (``ok: false``); see :func:`encode_error` and :func:`decode_error`."""

    error_type: str
    message: str
    key: str | None
    attrs: dict[str, _Plain]

    def encode(self) -> Header:
        return {"ok": False, "error_type": self.error_type, "message": self.message,
                "key": self.key, "attrs": self.attrs}

    @classmethod
    def decode(cls, header: Header) -> ErrorReply:
        """Raises: AgentProtocolError: malformed."""
        f = _fields(header, "error reply")
        attrs = f.mapping("attrs") if header.get("attrs") is not None else {}
        plain = {k: v for k, v in attrs.items() if v is None or isinstance(v, (str, int, float))}
        return cls(f.text("error_type"), f.text("message"), f.opt_text("key"), plain)


def encode_error(exc: BaseException) -> ErrorReply:
    """A failure as a reply that :func:`decode_error` raises again as the same type, with its
    message and its plain attributes (key, offset, reason, ...)."""
    if not isinstance(exc, DstlError):
        return ErrorReply("StorageError", f"{type(exc).__name__}: {exc}", None, {})
    attrs: dict[str, _Plain] = {k: v for k, v in vars(exc).items()
                                if v is None or isinstance(v, (str, int, float, bool))}
    key = getattr(exc, "key", None)
    return ErrorReply(type(exc).__name__, str(exc), key if isinstance(key, str) else None, attrs)


def decode_error(reply: ErrorReply) -> DstlError:
    """The error an :class:`ErrorReply` stands for: the same DSTL type (a type this version does
    not know: ``StorageError``), the agent's message prefixed with ``executor agent:``, and the
    attributes it sent."""
    found = _OWN_ERRORS.get(reply.error_type) or getattr(dstl_errors, reply.error_type, None)
    msg = f"executor agent: {reply.message}"
    if not (isinstance(found, type) and issubclass(found, DstlError)):
        return StorageError(msg)
    exc: DstlError
    if issubclass(found, StorageError):
        exc = found(msg, key=reply.key)
    elif issubclass(found, dstl_errors.ClosedError):
        exc = found(msg)
    else:
        # constructors differ (CorruptObjectError takes key, offset, reason): build the error
        # with the agent's message and the attributes it sent, so callers keep type and fields
        exc = found.__new__(found)
        DstlError.__init__(exc, msg)
        if isinstance(exc, dstl_errors.CorruptObjectError):
            exc.key, exc.offset, exc.reason = reply.key or "?", 0, msg
    exc.__dict__.update(reply.attrs)
    return exc
