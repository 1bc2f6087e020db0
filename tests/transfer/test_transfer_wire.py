"""The transfer engine's wire headers are typed structs validated on decode.

Every request and reply kind round-trips through its codec with every field set; a malformed header from a
peer (unknown op or field, a wrong type, a value out of range, the old JSON headers) is refused: the server
answers with the error and goes on serving, a client fails its transfer with TransferError.
"""
from __future__ import annotations

import json
import re
import socket
import threading

import msgspec
import pytest
import torch

from meshserve.transfer import BlockRef, TransferEngine, TransferError, TransferStatus, wire
from meshserve.transfer import tcp as tcp_mod
from meshserve.utils import cluster_auth

pytestmark = pytest.mark.timeout(60)

NUM_BLOCKS, BLOCK_SIZE, WIDTH = 4, 2, 8
LAYER = wire.RegionLayer(shape=[64, 16, 576], dtype="bfloat16")
DESCRIPTOR = wire.RegionDescriptor(engine="prefill-0", region="kv", layers=[LAYER], host_id="host-a/boot",
                                   tcp_address=("10.0.0.5", 40123),
                                   shm=[wire.ShmSegment("meshserve_kv_1_ab_0", [64, 16, 576], "bfloat16")],
                                   device="cuda", device_id="GPU-1234")

REQUESTS: dict[type, wire.Request] = {
    wire.Describe: wire.Describe(),
    wire.Read: wire.Read(region="kv", layers=[2, 0], block_ids=[5, 1], chunk_size=4096),
    wire.Probe: wire.Probe(nbytes=16),
    wire.DistLink: wire.DistLink(link="ab12", backend=wire.GroupBackend.NCCL),
    wire.DistRead: wire.DistRead(link="ab12", region="kv", layers=[1], block_ids=[3, 4], tag=17),
    wire.DistUnlink: wire.DistUnlink(link="ab12"),
    wire.StoreSet: wire.StoreSet(key="ab12/rank0", value=b"\x00addr"),
    wire.StoreGet: wire.StoreGet(key="ab12/rank0"),
    wire.StoreAdd: wire.StoreAdd(key="ab12/count", amount=-2),
    wire.StoreCompareSet: wire.StoreCompareSet(key="ab12/x", expected=b"a", desired=b"b"),
    wire.StoreDeleteKey: wire.StoreDeleteKey(key="ab12/x"),
    wire.StoreWait: wire.StoreWait(keys=["ab12/a", "ab12/b"], timeout=1.5),
    wire.StoreCheck: wire.StoreCheck(keys=["ab12/a"]),
    wire.StoreNumKeys: wire.StoreNumKeys(),
}
REPLIES: dict[type, wire.Reply] = {
    wire.Reply: wire.Reply(ok=False, error="link 'ab12' already exists"),
    wire.DescribeReply: wire.DescribeReply(ok=False, error="x", regions=[DESCRIPTOR]),
    wire.ReadReply: wire.ReadReply(ok=False, error="x", nbytes=4096),
    wire.BytesReply: wire.BytesReply(ok=False, error="x", value=b"\xff"),
    wire.IntReply: wire.IntReply(ok=False, error="x", value=7),
    wire.BoolReply: wire.BoolReply(ok=False, error="x", value=True),
}


def _subclasses(base: type) -> set[type]:
    found = set()
    for cls in base.__subclasses__():
        found |= {cls} | _subclasses(cls)
    return found


def _fields_at_default(item: msgspec.Struct) -> list[str]:
    return [f.name for f in msgspec.structs.fields(item)
            if f.default is not msgspec.NODEFAULT and getattr(item, f.name) == f.default
            or f.default_factory is not msgspec.NODEFAULT and getattr(item, f.name) == f.default_factory()]


# ---------------------------------------------------------------- codec
def test_every_request_and_reply_kind_has_a_sample():
    assert set(REQUESTS) == _subclasses(wire.Request) == set(wire.REQUESTS)
    assert set(REPLIES) == {wire.Reply} | _subclasses(wire.Reply)
    assert {r.reply for r in wire.REQUESTS} <= set(REPLIES)


@pytest.mark.parametrize("cls", list(REQUESTS), ids=lambda c: c.__name__)
def test_every_request_round_trips_with_every_field_set(cls):
    sample = REQUESTS[cls]
    assert not _fields_at_default(sample)
    decoded = wire.decode_request(wire.encode(sample))
    assert decoded == sample and type(decoded) is cls


@pytest.mark.parametrize("cls", list(REPLIES), ids=lambda c: c.__name__)
def test_every_reply_round_trips_as_the_reply_of_its_request(cls):
    sample = REPLIES[cls]
    assert not _fields_at_default(sample)
    for request in (r for r in wire.REQUESTS if r.reply is cls):
        decoded = wire.decode_reply(wire.encode(sample), request)
        assert decoded == sample and type(decoded) is cls


def test_a_refusal_decodes_as_the_reply_of_any_request():
    refusal = wire.encode(wire.Reply(ok=False, error="no region 'kv'"))
    for request in wire.REQUESTS:
        reply = wire.decode_reply(refusal, request)
        assert (type(reply), reply.ok, reply.error) == (request.reply, False, "no region 'kv'")


def test_region_descriptor_keeps_its_dict_form():
    as_dict = DESCRIPTOR.to_dict()
    assert as_dict == {"engine": "prefill-0", "region": "kv", "layers": [{"shape": [64, 16, 576], "dtype": "bfloat16"}],
                       "host_id": "host-a/boot", "tcp_address": ["10.0.0.5", 40123],
                       "shm": [{"shm_name": "meshserve_kv_1_ab_0", "shape": [64, 16, 576], "dtype": "bfloat16"}],
                       "device": "cuda", "device_id": "GPU-1234"}
    assert wire.RegionDescriptor.from_dict(json.loads(json.dumps(as_dict))) == DESCRIPTOR
    for bad in ({**as_dict, "layers": [{"shape": "64"}]}, {**as_dict, "extra": 1}, {k: v for k, v in as_dict.items()
                                                                                   if k != "engine"}):
        with pytest.raises(ValueError, match="malformed region descriptor"):
            wire.RegionDescriptor.from_dict(bad)


UNTYPED_HINT = re.compile(r"\bAny\b|\bobject\b|\b(?:list|dict|tuple|set|frozenset)\b(?!\[)")


@pytest.mark.parametrize("cls", sorted(_subclasses(wire.Header), key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_no_header_field_is_untyped(cls):
    hints = {}
    for klass in reversed(cls.__mro__):
        hints.update(getattr(klass, "__annotations__", {}))
    untyped = {name: hint for name, hint in hints.items() if UNTYPED_HINT.search(str(hint))}
    assert not untyped, f"{cls.__name__} has untyped fields: {untyped}"


MALFORMED_REQUESTS = {
    "unknown op": {"op": "format_disk"},
    "no op": {"region": "kv", "layers": [0], "block_ids": [0]},
    "unknown field": {"op": "describe", "verbose": True},
    "missing field": {"op": "read", "region": "kv", "layers": [0]},
    "wrong type": {"op": "read", "region": "kv", "layers": "0", "block_ids": [0]},
    "negative block id": {"op": "read", "region": "kv", "layers": [0], "block_ids": [-1]},
    "chunk size 0": {"op": "read", "region": "kv", "layers": [0], "block_ids": [0], "chunk_size": 0},
    "chunk size too big": {"op": "read", "region": "kv", "layers": [0], "block_ids": [0],
                           "chunk_size": wire.MAX_CHUNK_BYTES + 1},
    "link id not alphanumeric": {"op": "dist_link", "link": "../etc", "backend": "gloo"},
    "link id too long": {"op": "dist_link", "link": "a" * (wire.MAX_LINK_ID + 1), "backend": "gloo"},
    "unknown group backend": {"op": "dist_link", "link": "ab", "backend": "mpi"},
    "negative tag": {"op": "dist_read", "link": "ab", "region": "kv", "layers": [0], "block_ids": [0], "tag": -1},
    "store value not bytes": {"op": "store.set", "key": "ab/x", "value": 3},
    "negative wait": {"op": "store.wait", "keys": ["ab/x"], "timeout": -1.0},
}


@pytest.mark.parametrize("header", MALFORMED_REQUESTS.values(), ids=MALFORMED_REQUESTS.keys())
def test_a_malformed_request_is_refused_on_decode(header):
    with pytest.raises(wire.HeaderError, match="malformed request"):
        wire.decode_request(msgspec.msgpack.encode(header))


@pytest.mark.parametrize("data", [json.dumps({"op": "describe"}).encode(), b"\xc1", b""], ids=["json", "bad", "empty"])
def test_bytes_that_are_no_msgpack_header_are_refused(data):
    with pytest.raises(wire.HeaderError):
        wire.decode_request(data)


def test_a_malformed_reply_is_refused_on_decode():
    with pytest.raises(wire.HeaderError, match="malformed read reply"):
        wire.decode_reply(msgspec.msgpack.encode({"ok": True, "nbytes": -4}), wire.Read)
    with pytest.raises(wire.HeaderError, match="malformed describe reply"):
        wire.decode_reply(msgspec.msgpack.encode({"ok": True, "regions": [{"engine": "x"}]}), wire.Describe)


# ---------------------------------------------------------------- a live server
@pytest.fixture
def source(monkeypatch):
    """An engine serving one KV region, keyed by the cluster's secret."""
    monkeypatch.setenv(cluster_auth.ENV_SECRET, "the-cluster-secret")
    engine = TransferEngine("source", io_timeout=2.0)
    layers = [torch.arange(NUM_BLOCKS * BLOCK_SIZE * WIDTH, dtype=torch.float32).reshape(NUM_BLOCKS, BLOCK_SIZE, WIDTH)
              + 1000 * layer for layer in range(2)]
    engine.register("kv", layers)
    yield engine, layers
    engine.close()


def _send_raw(address: tuple[str, int], frame: bytes) -> bytes:
    """Handshake, send one length-prefixed frame as it is, and read everything the server sends back."""
    with tcp_mod._connect(address, 2.0) as sock:
        sock.sendall(frame)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _framed(data: bytes) -> bytes:
    return tcp_mod._LEN.pack(len(data)) + data


def _read_works(engine: TransferEngine, layers) -> None:
    got = tcp_mod.read_blocks(engine.tcp_address, "kv", [1], [2], BLOCK_SIZE * WIDTH * 4, timeout=2.0)
    assert torch.equal(torch.frombuffer(got, dtype=torch.float32).view(BLOCK_SIZE, WIDTH), layers[1][2])


@pytest.mark.parametrize("name", ["unknown op", "unknown field", "negative block id", "chunk size 0",
                                  "link id not alphanumeric"])
def test_the_server_refuses_a_malformed_request_and_goes_on_serving(source, name):
    engine, layers = source
    answer = _send_raw(engine.tcp_address, _framed(msgspec.msgpack.encode(MALFORMED_REQUESTS[name])))
    (n,) = tcp_mod._LEN.unpack(answer[:4])
    assert len(answer) == 4 + n  # one refusal, then the server closed the connection
    reply = wire.decode_reply(answer[4:], wire.Read)
    assert not reply.ok and reply.error.startswith("malformed request:") and reply.nbytes == 0
    _read_works(engine, layers)


def test_the_server_refuses_the_old_json_headers(source):
    engine, layers = source
    old = json.dumps({"op": "read", "region": "kv", "layers": [0], "block_ids": [0]}).encode()
    reply = wire.decode_reply(_send_raw(engine.tcp_address, _framed(old))[4:], wire.Read)
    assert not reply.ok and "malformed request" in reply.error
    _read_works(engine, layers)


def test_an_oversized_header_drops_the_connection(source):
    engine, layers = source
    assert _send_raw(engine.tcp_address, tcp_mod._LEN.pack(tcp_mod.MAX_HEADER_BYTES + 1)) == b""
    _read_works(engine, layers)


def test_a_request_the_server_does_not_serve_is_refused(monkeypatch):
    monkeypatch.setenv(cluster_auth.ENV_SECRET, "the-cluster-secret")
    server = tcp_mod.TcpBlockServer(lambda name: [], lambda: [], io_timeout=2.0)  # no dist ops added
    try:
        reply = tcp_mod.request(server.address, wire.DistUnlink(link="ab12"), 2.0)
        assert not reply.ok and reply.error == "op 'dist_unlink' is not served here"
    finally:
        server.stop()


def test_semantic_refusals_keep_their_messages(source):
    engine, _ = source
    with pytest.raises(TransferError, match="refused read of region 'nope'.*no region 'nope'"):
        tcp_mod.read_blocks(engine.tcp_address, "nope", [0], [0], 4, timeout=2.0)
    with pytest.raises(TransferError, match=r"block ids \[9\] out of range"):
        tcp_mod.read_blocks(engine.tcp_address, "kv", [0], [9], 4, timeout=2.0)


# ---------------------------------------------------------------- a malformed peer
@pytest.fixture
def lying_peer(monkeypatch):
    """A peer holding the secret that answers every request with a header of the wrong shape."""
    monkeypatch.setenv(cluster_auth.ENV_SECRET, "the-cluster-secret")
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                conn.settimeout(2.0)
                if cluster_auth.handshake_server(conn, cluster_auth.cluster_secret()):
                    tcp_mod.recv_frame(conn, "request")
                    conn.sendall(_framed(msgspec.msgpack.encode({"ok": True, "nbytes": "lots", "regions": 3})))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[:2]
    stop.set()
    thread.join(timeout=5)
    listener.close()


def test_a_malformed_reply_fails_the_client_with_transfer_error(lying_peer):
    with pytest.raises(TransferError, match="sent a malformed describe reply"):
        tcp_mod.describe_remote(lying_peer, timeout=2.0)
    with pytest.raises(TransferError, match="sent a malformed read reply"):
        tcp_mod.read_blocks(lying_peer, "kv", [0], [0], 4, timeout=2.0)


def test_a_malformed_reply_fails_the_transfer_not_the_engine(lying_peer):
    puller = TransferEngine("puller", serve_tcp=False, force_tcp=True, io_timeout=2.0)
    try:
        puller.register("kv", [torch.zeros(NUM_BLOCKS, BLOCK_SIZE, WIDTH)])
        peer = msgspec.structs.replace(puller.descriptor("kv"), engine="liar", host_id="elsewhere",
                                       tcp_address=tuple(lying_peer))
        assert puller.link("liar", peer) == "tcp"
        done = puller.wait(puller.transfer(BlockRef("kv", (1,), "liar"), BlockRef("kv", (0,))), 10.0)
        assert done.status is TransferStatus.FAILED and "malformed read reply" in done.error
    finally:
        puller.close()
