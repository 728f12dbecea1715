"""The executor agent's wire protocol without sockets: every message round-trips, frames split
from a stream fed byte by byte, malformed frames and messages raise AgentProtocolError naming
the frame and the field, the error codec keeps type and fields, and arbitrary bytes or headers
never raise anything else."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dstl import DstlOptions, KeyGroupRange
from dstl.errors import (
    ClosedError,
    CorruptObjectError,
    LeaseError,
    ObjectNotFoundError,
    StorageError,
    UsageError,
)
from dstl.segment import ChangeSet
from dstl.spark.agent import PartitionSpec
from dstl.spark.agent.protocol import (
    AgentProtocolError,
    AgentUnavailableError,
    CacheStatsReply,
    CacheStatsRequest,
    CommittedReply,
    CommittedRequest,
    ErrorReply,
    FrameDecoder,
    LeaseReply,
    LeaseRequest,
    MaterializationReply,
    MaterializationRequest,
    MetricsReply,
    MetricsRequest,
    OfferedSnapshot,
    PersistReply,
    PersistRequest,
    PingReply,
    PingRequest,
    PrefetchCancelReply,
    PrefetchCancelRequest,
    PrefetchReply,
    PrefetchRequest,
    ReleaseReply,
    ReleaseRequest,
    Reply,
    Request,
    ShutdownReply,
    ShutdownRequest,
    StoreRef,
    decode_error,
    decode_request,
    encode_error,
    encode_frame,
)
from materializer.handles import SnapshotRef

STORE = StoreRef("s3://bucket/app", {"key": "k", "client_kwargs": {"region_name": "x"}},
                 DstlOptions(persist_delay_s=0.5, upload_threads=2))
KGS = KeyGroupRange(0, 7)


def _change_set(log_id: str, sqn: int, tail: bytes, *fields: int) -> ChangeSet:
    """A change set whose body starts as every body does (log id, sqn), then ``tail``."""
    lid = log_id.encode()
    return ChangeSet(log_id, sqn, struct.pack(">H", len(lid)) + lid + struct.pack(">Q", sqn)
                     + tail, *fields)


SETS = (_change_set("op/p0", 3, b"abc", 2, 5, 0, 3), _change_set("op/p1", 0, b"", 0, 0, -1, -1),
        _change_set("op/p1", 1, b"\x00" * 10, 1, 9, 4, 4))
BODY0 = SETS[0].body
SPEC = PartitionSpec("op/p0", "/local/op/p0", KGS, 60.0, 2.0, 1024, 3, 2, ("dstl/seg", 17), 5, 6)
SNAP = SnapshotRef("dstl/snap/x", 123, KGS, 4)

#: One example of every op: the request and a successful reply to it.
EXAMPLES: list[tuple[Request[Any], Reply]] = [
    (PingRequest(), PingReply(4242)),
    (ShutdownRequest(), ShutdownReply()),
    (MetricsRequest(), MetricsReply({"agent.pid": 1.0, "agent.requests": 3.0}, ("a", "b"))),
    (PersistRequest(STORE, SETS), PersistReply((("dstl/s1", 0, 18), ("dstl/s1", 18, 15),
                                                ("dstl/s1", 33, 25)))),
    (LeaseRequest(STORE, "dstl/s1", "segment", 100), LeaseReply(7, "/agent/cache/x.obj", 100)),
    (LeaseRequest(STORE, "dstl/s1", None, None), LeaseReply(8, None, 5)),
    (ReleaseRequest(7), ReleaseReply()),
    (PrefetchRequest(STORE, 3, (("snapshots/a", "snapshot", 4096), ("dstl/s1", "segment", None),
                                ("dstl/s2", None, None))), PrefetchReply()),
    (PrefetchRequest(STORE, 1, ()), PrefetchReply()),
    (PrefetchCancelRequest(3), PrefetchCancelReply()),
    (CacheStatsRequest(), CacheStatsReply({"downloads": 1, "hits": 2})),
    (CommittedRequest(STORE, SPEC), CommittedReply({"agent.pid": 1.0}, ())),
    (CommittedRequest(STORE, None), CommittedReply({}, ("line",))),
    (MaterializationRequest(STORE, "op/p0"),
     MaterializationReply(OfferedSnapshot(SNAP, ("dstl/seg", 17)), None)),
    (MaterializationRequest(STORE, "op/p0"), MaterializationReply(None, "CorruptObjectError: x")),
]


def _wire(header: dict[str, Any], body: bytes = b"") -> tuple[dict[str, Any], bytes]:
    """Through real frame bytes and back."""
    frames = FrameDecoder().feed(encode_frame(header, body))
    assert len(frames) == 1
    return frames[0]


@pytest.mark.parametrize(("request_", "reply"), EXAMPLES,
                         ids=[f"{r.op}-{i}" for i, (r, _) in enumerate(EXAMPLES)])
def test_every_message_round_trips(request_: Request[Any], reply: Reply) -> None:
    header, body = request_.encode()
    assert header["op"] == request_.op == reply.op
    got_header, got_body = _wire({"id": 9, **header}, body)
    assert decode_request(got_header, got_body) == request_
    reply_header, _ = _wire({"id": 9, **reply.encode()})
    assert reply_header["ok"] is True
    assert request_.decode_reply(reply_header) == reply


def test_persist_reply_pairs_each_change_set_with_its_reference() -> None:
    header, _ = _wire(PersistReply((("dstl/s", 0, 3), ("dstl/s", 3, 0), ("dstl/s", 3, 10)))
                      .encode())
    pairs = PersistRequest(STORE, SETS).decode_reply(header).change_set_refs(SETS)
    assert [(cs.sqn, r.sqn, r.key, r.offset, r.length, r.change_count, r.payload_bytes)
            for cs, r in pairs] == [(3, 3, "dstl/s", 0, 3, 2, 5), (0, 0, "dstl/s", 3, 0, 0, 0),
                                    (1, 1, "dstl/s", 3, 10, 1, 9)]


def test_the_store_key_names_equal_stores_equally() -> None:
    same = StoreRef(STORE.uri, dict(STORE.storage_options or {}),
                    DstlOptions(persist_delay_s=0.5, upload_threads=2))
    assert same.key() == STORE.key()
    assert StoreRef(STORE.uri, None, STORE.options).key() != STORE.key()
    assert StoreRef(STORE.uri, STORE.storage_options, DstlOptions()).key() != STORE.key()


# --------------------------------------------------------------------------- frames


def test_frames_split_from_a_stream_fed_byte_by_byte() -> None:
    frames = [({"id": 1, "op": "ping"}, b""), ({"id": 2, "x": [1, "é"]}, b"\x00\xffbody"),
              ({}, b"")]
    stream = b"".join(encode_frame(h, b) for h, b in frames)
    decoder = FrameDecoder()
    got: list[tuple[dict[str, Any], bytes]] = []
    for i in range(len(stream)):
        assert decoder.needed() >= 1
        got += decoder.feed(stream[i:i + 1])
    assert got == frames
    assert FrameDecoder().feed(stream) == frames  # all at once


def test_needed_never_reads_past_a_frame() -> None:
    raw = encode_frame({"id": 1}, b"12345")
    decoder = FrameDecoder()
    assert decoder.needed() == 8
    assert decoder.feed(raw[:8]) == []
    assert decoder.needed() == len(raw) - 8
    assert decoder.feed(raw[8:]) == [({"id": 1}, b"12345")]
    assert decoder.needed() == 8


@pytest.mark.parametrize(("raw", "match"), [
    (struct.pack(">II", 3, 0), "length 3"),
    (struct.pack(">II", 10, 7), "header length 7"),
    (struct.pack(">II", (1 << 31) + 1, 0), "length"),
    (struct.pack(">II", 6, 2) + b"[]", "JSON list, not an object"),
    (struct.pack(">II", 7, 3) + b"{x}", "not a UTF-8 JSON object"),
    (struct.pack(">II", 6, 2) + b"\xff\xfe", "not a UTF-8 JSON object"),
    (struct.pack(">II", 4 + 200, 200) + b"[" * 100 + b"]" * 100, "deeper than 64"),
])
def test_malformed_frames_are_protocol_errors(raw: bytes, match: str) -> None:
    with pytest.raises(AgentProtocolError, match=match) as err:
        FrameDecoder().feed(raw)
    assert err.value.frame == "frame"
    assert isinstance(err.value, UsageError)


# --------------------------------------------------------------------------- messages


def _persist_header(**changes: Any) -> dict[str, Any]:
    header, _ = PersistRequest(STORE, SETS[:1]).encode()
    header.update(changes)
    return header


@pytest.mark.parametrize(("header", "body", "frame", "match"), [
    ({"op": "frobnicate"}, b"", "request", "unknown op 'frobnicate'"),
    ({"id": 1}, b"", "request", "unknown op None"),
    (_persist_header(), BODY0[:-1], "persist request: sets[0]",
     rf"'size' is {len(BODY0)}, expected an integer in \[0, {len(BODY0) - 1}\]"),
    (_persist_header(), BODY0 + b"d", "persist request",
     f"add up to {len(BODY0)} bytes, the body has {len(BODY0) + 1}"),
    (_persist_header(), BODY0.replace(b"op/p0", b"op/p9"), "persist request: sets[0]",
     "does not start with log id 'op/p0' and sqn 3"),
    (_persist_header(sets=[{**_persist_header()["sets"][0], "sqn": 4}]), BODY0,
     "persist request: sets[0]", "does not start with log id 'op/p0' and sqn 4"),
    (_persist_header(sets={"a": 1}), b"", "persist request", "'sets'.*expected a list"),
    (_persist_header(sets=[7]), b"", "persist request", "a list of objects"),
    (_persist_header(sets=[{**_persist_header()["sets"][0], "sqn": True}]), BODY0,
     "persist request: sets[0]", r"'sqn' is True, expected an integer in \[0, "),
    (_persist_header(sets=[{**_persist_header()["sets"][0], "sqn": 1 << 64}]), BODY0,
     "persist request: sets[0]", r"'sqn' is 18446744073709551616, expected an integer in"),
    (_persist_header(sets=[{**_persist_header()["sets"][0], "kg_min": -2}]), BODY0,
     "persist request: sets[0]", r"'kg_min' is -2, expected an integer in \[-1, 32767\]"),
    (_persist_header(uri=None), BODY0, "persist request", "'uri' is None, expected a string"),
    (_persist_header(options={"bogus": 1}), BODY0, "persist request", r"unknown: \['bogus'\]"),
    (_persist_header(options={"upload_threads": 0}), BODY0, "persist request", "'options'"),
    ({k: v for k, v in _persist_header().items() if k != "storage_options"}, BODY0,
     "persist request", "'storage_options' is missing"),
    ({"op": "release", "lease": 0}, b"", "release request", "'lease' is 0, expected an integer"),
    ({"op": "release", "lease": "3"}, b"", "release request", "'lease'"),
    ({"op": "lease", **STORE.to_fields(), "key": 5, "verify": None, "size_hint": None}, b"",
     "lease request", "'key' is 5"),
    ({"op": "lease", **STORE.to_fields(), "key": "k", "verify": None, "size_hint": -1}, b"",
     "lease request", "'size_hint' is -1"),
    ({"op": "prefetch", **STORE.to_fields(), "ticket": 0, "objects": []}, b"",
     "prefetch request", "'ticket' is 0"),
    ({"op": "prefetch", **STORE.to_fields(), "ticket": 1, "objects": [["k", None]]}, b"",
     "prefetch request", "key, verify name or null, size hint or null"),
    ({"op": "prefetch", **STORE.to_fields(), "ticket": 1, "objects": [["k", 5, None]]}, b"",
     "prefetch request", "'objects'"),
    ({"op": "prefetch", **STORE.to_fields(), "ticket": 1, "objects": [["k", None, -1]]}, b"",
     "prefetch request", "'objects'"),
    ({"op": "prefetch", **STORE.to_fields(), "ticket": 1, "objects": [["k", None, True]]}, b"",
     "prefetch request", "'objects'"),
    ({"op": "prefetch", **STORE.to_fields(), "ticket": 1, "objects": {"k": 1}}, b"",
     "prefetch request", "'objects'"),
    ({"op": "prefetch_cancel", "ticket": "1"}, b"", "prefetch_cancel request", "'ticket'"),
    ({"op": "committed", **STORE.to_fields(), "partition": {"log_id": "x"}}, b"",
     "committed request", "a partition registration"),
    ({"op": "materialization", **STORE.to_fields()}, b"", "materialization request",
     "'log_id' is missing"),
])
def test_malformed_requests_name_the_frame_and_the_field(header: dict[str, Any], body: bytes,
                                                         frame: str, match: str) -> None:
    with pytest.raises(AgentProtocolError, match=match) as err:
        decode_request(header, body)
    assert err.value.frame == frame
    assert frame in str(err.value) and "same DSTL version" in str(err.value)


@pytest.mark.parametrize(("request_", "header", "frame", "match"), [
    (PersistRequest(STORE, SETS), {"ok": True, "refs": [["k", 0, 1]]}, "persist reply",
     "3 references"),
    (PersistRequest(STORE, SETS[:1]), {"ok": True, "refs": [["k", -1, 1]]}, "persist reply",
     "segment key, offset, length"),
    (PingRequest(), {"ok": True}, "ping reply", "'pid' is missing"),
    (LeaseRequest(STORE, "k", None, None), {"ok": True, "lease": 1, "path": 3, "size": 1},
     "lease reply", "'path' is 3"),
    (MetricsRequest(), {"ok": True, "metrics": {"a": "x"}, "log_tail": []}, "metrics reply",
     "an object of numbers"),
    (MetricsRequest(), {"ok": True, "metrics": {}, "log_tail": [1]}, "metrics reply",
     "a list of strings"),
    (CacheStatsRequest(), {"ok": True, "stats": {"hits": 1.5}}, "cache_stats reply",
     "an object of integers"),
    (MaterializationRequest(STORE, "p"),
     {"ok": True, "failed": None, "materialization": {"ref": SNAP.to_json_obj(),
                                                      "boundary": ["k"]}},
     "materialization reply: materialization", "'boundary'"),
    (MaterializationRequest(STORE, "p"),
     {"ok": True, "failed": None, "materialization": {"ref": {"key": 1},
                                                      "boundary": ["k", 1]}},
     "materialization reply: materialization", "a snapshot reference"),
])
def test_malformed_replies_name_the_frame_and_the_field(request_: Request[Any],
                                                        header: dict[str, Any], frame: str,
                                                        match: str) -> None:
    with pytest.raises(AgentProtocolError, match=match) as err:
        request_.decode_reply(header)
    assert err.value.frame == frame


# --------------------------------------------------------------------------- errors


def _through_the_wire(exc: BaseException) -> BaseException:
    header, _ = _wire(encode_error(exc).encode())
    assert header["ok"] is False
    return decode_error(ErrorReply.decode(header))


def test_errors_keep_their_type_message_and_fields() -> None:
    nf = _through_the_wire(ObjectNotFoundError("no such object", key="dstl/x"))
    assert type(nf) is ObjectNotFoundError and nf.key == "dstl/x"
    assert str(nf).startswith("executor agent: ") and "no such object" in str(nf)
    corrupt = _through_the_wire(CorruptObjectError("dstl/y", 42, "bad crc"))
    assert type(corrupt) is CorruptObjectError
    assert (corrupt.key, corrupt.offset, corrupt.reason) == ("dstl/y", 42, "bad crc")
    closed = _through_the_wire(ClosedError("the cache", "retry"))
    assert type(closed) is ClosedError and "the cache" in str(closed)
    lease = _through_the_wire(LeaseError("lease 3 is not held"))
    assert type(lease) is LeaseError and "lease 3" in str(lease)
    own = _through_the_wire(AgentProtocolError("lease request", "field 'key'"))
    assert type(own) is AgentProtocolError and own.frame == "lease request"
    gone = _through_the_wire(AgentUnavailableError("agent gone", key="k"))
    assert type(gone) is AgentUnavailableError and gone.key == "k"


def test_foreign_and_unknown_errors_arrive_as_storage_errors() -> None:
    foreign = _through_the_wire(KeyError("boom"))
    assert type(foreign) is StorageError and "KeyError" in str(foreign)
    unknown = decode_error(ErrorReply("NoSuchError", "what", None, {}))
    assert type(unknown) is StorageError and "what" in str(unknown)
    not_dstl = decode_error(ErrorReply("ValueError", "x", None, {}))
    assert type(not_dstl) is StorageError


def test_malformed_error_replies_are_protocol_errors() -> None:
    with pytest.raises(AgentProtocolError, match="'message'") as err:
        ErrorReply.decode({"ok": False, "error_type": "UsageError", "key": None})
    assert err.value.frame == "error reply"


# --------------------------------------------------------------------------- fuzz

_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                     | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def _protocol_error_or(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or ``None`` if it raised AgentProtocolError (any other error fails)."""
    try:
        return fn(*args)
    except AgentProtocolError:
        return None


@given(st.binary(max_size=64))
def test_arbitrary_bytes_are_frames_or_protocol_errors(data: bytes) -> None:
    for header, body in _protocol_error_or(FrameDecoder().feed, data) or []:
        assert isinstance(header, dict) and isinstance(body, bytes)


@given(st.sampled_from(sorted({r.op for r, _ in EXAMPLES})),
       st.dictionaries(st.sampled_from(["uri", "storage_options", "options", "sets", "key",
                                        "verify", "size_hint", "lease", "partition", "log_id"]),
                       _JSON, max_size=6),
       st.binary(max_size=16))
def test_arbitrary_headers_are_requests_or_protocol_errors(op: str, fields: dict[str, Any],
                                                           body: bytes) -> None:
    header = json.loads(json.dumps({"op": op, **fields}))
    request = _protocol_error_or(decode_request, header, body)
    assert request is None or request.op == op


@given(st.sampled_from(EXAMPLES),
       st.dictionaries(st.sampled_from(["pid", "metrics", "log_tail", "refs", "lease", "path",
                                        "size", "stats", "materialization", "failed"]),
                       _JSON, max_size=6))
def test_arbitrary_replies_are_replies_or_protocol_errors(example: tuple[Request[Any], Reply],
                                                          header: dict[str, Any]) -> None:
    reply = _protocol_error_or(example[0].decode_reply, {"ok": True, **header})
    assert reply is None or reply.op == example[0].op
