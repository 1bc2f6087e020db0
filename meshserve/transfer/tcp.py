"""Block reads over TCP: a server thread per engine and a pulling client.

Wire format (all integers big-endian), one request per connection:
  request : u32 length + a msgpack header, one of `wire.Request`'s kinds: `Read` (blocks of a region),
            `Describe` (the server's region descriptors), `Probe` (a few dummy bytes back: link probing, on
            a connection and thread of its own, so pulls in flight never delay it), or an op its owner added
            (`extra_ops`); the
            transfer engine adds the torch.distributed backend's store calls, `DistLink`, `DistRead` and
            `DistUnlink` (see `dist.py`)
  reply   : u32 length + a msgpack header, the request type's `reply` (`ok`, `error`, its own fields)
  payload : for a read, chunks of u32 length + u32 zlib.crc32 + bytes, until `nbytes` have come;
            each layer's selected blocks are sent in order, a chunk never spans two layers.
A header that does not decode into its struct is refused (`wire.py`): the server answers with an error and
closes the connection, the client fails its transfer.
Every socket has a timeout, so a dead or stalled peer fails the read instead of hanging it.
Every connection opens with the cluster-secret handshake (`cluster_auth.handshake_server` /
`handshake_client`, one round trip): a peer that does not hold the secret is logged, counted and
disconnected before it can send a request; the block data after it costs nothing extra.
"""
from __future__ import annotations

import logging
import socket
import struct
import threading
import zlib
from collections.abc import Callable

import torch

from meshserve.transfer import wire
from meshserve.transfer.wire import DEFAULT_CHUNK_BYTES
from meshserve.utils import cluster_auth

logger = logging.getLogger(__name__)

_LEN = struct.Struct("!I")
_CHUNK = struct.Struct("!II")
MAX_HEADER_BYTES = 16 << 20

# (chunk_index, payload) -> payload actually sent; a test hook to corrupt or stall the stream.
ChunkFaultHook = Callable[[int, bytes], bytes]
# (connection, request) -> None: serves one request of its type, replying on the connection itself.
OpHandler = Callable[[socket.socket, wire.Request], None]


class TransferError(RuntimeError):
    """A block read failed: peer refused, connection broke, timed out, or a checksum mismatched."""


def _recv_exact_into(sock: socket.socket, view: memoryview, what: str) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise TransferError(f"connection closed by peer while reading {what} ({got} of {len(view)} bytes)")
        got += n


def _recv_exact(sock: socket.socket, n: int, what: str) -> bytes:
    buf = bytearray(n)
    _recv_exact_into(sock, memoryview(buf), what)
    return bytes(buf)


def send_header(sock: socket.socket, header: wire.Header) -> None:
    data = wire.encode(header)
    sock.sendall(_LEN.pack(len(data)) + data)


def refuse(sock: socket.socket, error: str) -> None:
    send_header(sock, wire.Reply(ok=False, error=error))


def recv_frame(sock: socket.socket, what: str) -> bytes:
    """One length-prefixed header, still encoded."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, what))
    if n > MAX_HEADER_BYTES:
        raise TransferError(f"{what} of {n} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
    return _recv_exact(sock, n, what)


def recv_reply(sock: socket.socket, request: type[wire.Request], where: str) -> wire.Reply:
    """The reply to a request of type `request`; TransferError if the peer's header is malformed."""
    data = recv_frame(sock, f"{wire.op_of(request)} reply")
    try:
        return wire.decode_reply(data, request)
    except wire.HeaderError as e:
        raise TransferError(f"peer {where} sent a {e}") from e


def _as_bytes_view(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


class TcpBlockServer:
    """Serves block reads of an engine's registered regions on one listening socket.

    `regions(name)` returns the layer tensors of a region (KeyError if unknown);
    `describe()` returns the region descriptors a peer may link to;
    `extra_ops` maps further request types to their handlers.
    """

    def __init__(
        self,
        regions: Callable[[str], list[torch.Tensor]],
        describe: Callable[[], list[wire.RegionDescriptor]],
        host: str = "127.0.0.1",
        port: int = 0,
        io_timeout: float = 10.0,
        extra_ops: dict[type[wire.Request], OpHandler] | None = None,
    ):
        self._regions = regions
        self._describe = describe
        self._handlers: dict[type[wire.Request], OpHandler] = {
            wire.Describe: self._serve_describe, wire.Read: self._serve_read, wire.Probe: self._serve_probe,
            **(extra_ops or {})}
        self._secret = cluster_auth.cluster_secret()  # read once: a bad secret fails the engine's start
        self.io_timeout = io_timeout
        self.fault_hook: ChunkFaultHook | None = None
        self._listener = socket.create_server((host, port))
        self._listener.settimeout(0.1)  # lets the accept loop notice stop()
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name=f"tcp-block-server:{self.address[1]}",
                                        daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            conn.settimeout(self.io_timeout)
            with self._conns_lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if not cluster_auth.handshake_server(conn, self._secret):
                return
            self._dispatch(conn, recv_frame(conn, "request"))
        except (OSError, TransferError, ValueError):
            pass  # the client sees the broken connection and fails its transfer
        except Exception as exc:  # noqa: BLE001 - a malformed request ends its connection, not the server
            logger.warning("dropped a malformed transfer request: %s: %s", type(exc).__name__, exc)
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    def _dispatch(self, conn: socket.socket, data: bytes) -> None:
        try:
            request = wire.decode_request(data)
        except wire.HeaderError as e:  # a peer holding the secret sent a header this version does not take
            logger.warning("refused a transfer request from %s: %s", _peer_name(conn), e)
            refuse(conn, str(e))
            return
        handler = self._handlers.get(type(request))
        if handler is None:
            refuse(conn, f"op {wire.op_of(type(request))!r} is not served here")
            return
        handler(conn, request)

    def _serve_describe(self, conn: socket.socket, request: wire.Describe) -> None:
        send_header(conn, wire.DescribeReply(regions=self._describe()))

    def _serve_probe(self, conn: socket.socket, request: wire.Probe) -> None:
        send_header(conn, wire.BytesReply(value=bytes(request.nbytes)))

    def _serve_read(self, conn: socket.socket, request: wire.Read) -> None:
        try:
            layers_data = self._select(request)
        except (KeyError, ValueError, IndexError, TypeError) as e:
            refuse(conn, str(e.args[0]) if e.args else repr(e))
            return
        send_header(conn, wire.ReadReply(nbytes=sum(len(v) for v in layers_data)))
        chunk_index = 0
        for view in layers_data:
            for off in range(0, len(view), request.chunk_size):
                payload = view[off : off + request.chunk_size]
                header = _CHUNK.pack(len(payload), zlib.crc32(payload))
                hook = self.fault_hook
                if hook is not None:
                    payload = hook(chunk_index, bytes(payload))
                conn.sendall(header)
                conn.sendall(payload)
                chunk_index += 1

    def _select(self, request: wire.Read) -> list[memoryview]:
        return [_as_bytes_view(blocks) for blocks in select_blocks(self._regions, request)]

    def stop(self) -> None:
        self._stop.set()
        self._listener.close()
        self._thread.join(timeout=5.0)
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def select_blocks(regions: Callable[[str], list[torch.Tensor]],
                  request: wire.Read | wire.DistRead) -> list[torch.Tensor]:
    """Per requested layer, the requested blocks of `request.region` (a copy, on the region's device).

    Raises KeyError or IndexError on an unknown region or a layer or block id out of range.
    """
    tensors = regions(request.region)
    out = []
    for layer in request.layers:
        if not 0 <= layer < len(tensors):
            raise IndexError(f"layer {layer} out of range for region {request.region!r} with {len(tensors)} layers")
        t = tensors[layer]
        bad = [b for b in request.block_ids if not 0 <= b < t.shape[0]]
        if bad:
            raise IndexError(f"block ids {bad} out of range for region {request.region!r} with {t.shape[0]} blocks")
        index = torch.tensor(request.block_ids, dtype=torch.long, device=t.device)
        out.append(t.index_select(0, index))
    return out


def _peer_name(conn: socket.socket) -> str:
    try:
        host, port = conn.getpeername()[:2]
    except OSError:
        return "a closed connection"
    return f"{host}:{port}"


def _connect(address: tuple[str, int], timeout: float) -> socket.socket:
    try:
        sock = socket.create_connection(tuple(address), timeout=timeout)
    except OSError as e:
        raise TransferError(f"cannot connect to {address[0]}:{address[1]}: {e}") from e
    sock.settimeout(timeout)
    try:
        cluster_auth.handshake_client(sock)
    except (OSError, cluster_auth.ClusterAuthError) as e:
        sock.close()
        raise TransferError(f"{address[0]}:{address[1]}: {e}") from e
    return sock


def request(address: tuple[str, int], message: wire.Request, timeout: float = 10.0) -> wire.Reply:
    """One request and its reply (`type(message).reply`, not checked for `ok`); TransferError if the exchange
    fails or the reply is malformed."""
    with _connect(address, timeout) as sock:
        try:
            send_header(sock, message)
            return recv_reply(sock, type(message), f"{address[0]}:{address[1]}")
        except TimeoutError as e:
            raise TransferError(f"timed out after {timeout}s waiting for {address[0]}:{address[1]}") from e
        except OSError as e:
            raise TransferError(f"connection to {address[0]}:{address[1]} failed: {e}") from e


def describe_remote(address: tuple[str, int], timeout: float = 10.0) -> list[wire.RegionDescriptor]:
    """The region descriptors a remote engine's server publishes."""
    reply = request(address, wire.Describe(), timeout)
    if not reply.ok:
        raise TransferError(f"peer refused describe: {reply.error}")
    return reply.regions


def probe(address: tuple[str, int], nbytes: int, timeout: float) -> None:
    """One link probe: `nbytes` of dummy payload back from the block server; TransferError if the exchange fails,
    outlasts `timeout` (connecting included) or brings the wrong payload."""
    reply = request(address, wire.Probe(nbytes=nbytes), timeout)
    if not reply.ok:
        raise TransferError(f"peer {address[0]}:{address[1]} refused a probe: {reply.error}")
    if len(reply.value) != nbytes:
        raise TransferError(f"peer {address[0]}:{address[1]} answered a probe with {len(reply.value)} bytes, "
                            f"not {nbytes}")


def read_blocks(
    address: tuple[str, int],
    region: str,
    layers: list[int],
    block_ids: list[int],
    expected_nbytes: int,
    chunk_size: int = DEFAULT_CHUNK_BYTES,
    timeout: float = 10.0,
) -> bytearray:
    """Pull the selected blocks of `layers` (concatenated in layer order) and verify every chunk."""
    where = f"{address[0]}:{address[1]}"
    with _connect(address, timeout) as sock:
        try:
            send_header(sock, wire.Read(region=region, layers=layers, block_ids=block_ids, chunk_size=chunk_size))
            reply = recv_reply(sock, wire.Read, where)
            if not reply.ok:
                raise TransferError(f"peer {where} refused read of region {region!r}: {reply.error}")
            if reply.nbytes != expected_nbytes:
                raise TransferError(f"peer {where} offers {reply.nbytes} bytes, expected {expected_nbytes}")
            buf = bytearray(expected_nbytes)
            view = memoryview(buf)
            got = 0
            chunk_index = 0
            while got < expected_nbytes:
                length, crc = _CHUNK.unpack(_recv_exact(sock, _CHUNK.size, f"chunk {chunk_index} header"))
                if length == 0 or length > expected_nbytes - got:
                    raise TransferError(f"chunk {chunk_index} from {where} has bad length {length} "
                                        f"({got} of {expected_nbytes} bytes received)")
                part = view[got : got + length]
                _recv_exact_into(sock, part, f"chunk {chunk_index}")
                if zlib.crc32(part) != crc:
                    raise TransferError(f"checksum mismatch in chunk {chunk_index} from {where} "
                                        f"(bytes {got}..{got + length})")
                got += length
                chunk_index += 1
        except TimeoutError as e:
            raise TransferError(f"timed out after {timeout}s reading from {where}") from e
        except OSError as e:
            raise TransferError(f"connection to {where} failed: {e}") from e
    return buf
