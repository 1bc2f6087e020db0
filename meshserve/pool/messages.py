"""Wire messages of the memory pool, msgpack-encoded (no pickle), one class per message.

Transport: ZMQ. A server binds one ROUTER socket; clients (the SDK) talk to it with DEALER
sockets, so many requests can be in flight per connection. A request is a multipart message
`[encode(request), *value_frames]`; a reply is `[encode(reply), *value_frames]`. Values travel
as their own frames (sent and received without copying where ZMQ allows), never inside the
msgpack header. The controller binds a ROUTER socket too; servers and clients reach it with
DEALER sockets.

  client     -> server     : Put (one value frame per key), Get, Exists, Delete, ServerStatsQuery
  server     -> client     : PutReply, GetReply (one frame per found key), ExistsReply, DeleteReply, ServerStats,
                             Error (a request the server could not read)
  server     -> controller : Register, Heartbeat (with its usage per namespace)
  controller -> server     : RegisterReply (the namespace quotas and server count; also the answer to
                             every Heartbeat, so servers follow quota and membership changes)
  client     -> controller : ViewQuery, CreateNamespace
  controller -> client     : View (live servers and their ring positions), NamespaceReply, Error

Every socket is a CurveZMQ socket keyed by the cluster secret (`meshserve.utils.cluster_auth`). Each message
is a msgspec struct, a frame `[type name, fields]`; `decode` checks a frame's shape and every field's type
against its struct and raises `PoolMessageError` (a ValueError) for anything else; receivers log and count
it (`decode_errors`) and go on.
"""
from __future__ import annotations

import msgspec

from meshserve.utils.framing import FrameCodec


class PoolMessage(msgspec.Struct, forbid_unknown_fields=True):
    """Base of every pool message: a frame naming a field the receiver's struct lacks is refused."""


# ---------------------------------------------------------------- client <-> server
class Put(PoolMessage):
    req_id: int
    namespace: str
    keys: list[str]  # one value frame follows per key, in order


class PutReply(PoolMessage):
    req_id: int
    stored: list[bool]  # False: refused (value larger than the namespace's share, or the server is full)
    error: str | None = None


class Get(PoolMessage):
    req_id: int
    namespace: str
    keys: list[str]


class GetReply(PoolMessage):
    req_id: int
    found: list[bool]  # one value frame follows per found key, in order
    error: str | None = None


class Exists(PoolMessage):
    req_id: int
    namespace: str
    keys: list[str]


class ExistsReply(PoolMessage):
    req_id: int
    found: list[bool]


class Delete(PoolMessage):
    req_id: int
    namespace: str
    keys: list[str]


class DeleteReply(PoolMessage):
    req_id: int
    deleted: list[bool]


class ServerStatsQuery(PoolMessage):
    req_id: int


class ServerStats(PoolMessage):
    req_id: int
    server_id: str
    dram_bytes: int
    ssd_bytes: int
    num_keys: int
    namespaces: dict[str, int] = msgspec.field(default_factory=dict)  # bytes per namespace
    hits: int = 0
    misses: int = 0


# ---------------------------------------------------------------- server <-> controller
class Register(PoolMessage):
    server_id: str
    address: str  # where clients reach it (tcp://host:port)
    dram_capacity: int
    ssd_capacity: int


class RegisterReply(PoolMessage):
    accepted: bool
    quotas: dict[str, int] = msgspec.field(default_factory=dict)  # namespace -> byte quota over the whole pool
    num_servers: int = 1
    error: str | None = None


class Heartbeat(PoolMessage):
    server_id: str
    namespaces: dict[str, int] = msgspec.field(default_factory=dict)  # bytes held per namespace


# ---------------------------------------------------------------- client <-> controller
class ViewQuery(PoolMessage):
    req_id: int


class View(PoolMessage):
    req_id: int
    version: int  # bumped whenever membership changes
    servers: dict[str, str] = msgspec.field(default_factory=dict)  # server_id -> address (live ones only)
    virtual_nodes: int = 64
    quotas: dict[str, int] = msgspec.field(default_factory=dict)


class CreateNamespace(PoolMessage):
    req_id: int
    namespace: str
    quota_bytes: int
    force: bool = False  # allow a quota below the namespace's current use (servers then evict down to it)


class NamespaceReply(PoolMessage):
    req_id: int
    ok: bool
    error: str | None = None


# ---------------------------------------------------------------- any -> requester
class Error(PoolMessage):
    req_id: int  # -1 when the request was too malformed to carry one
    message: str


_TYPES = {cls.__name__: cls for cls in (
    Put, PutReply, Get, GetReply, Exists, ExistsReply, Delete, DeleteReply, ServerStatsQuery, ServerStats,
    Register, RegisterReply, Heartbeat, ViewQuery, View, CreateNamespace, NamespaceReply, Error)}

def encode(message: PoolMessage) -> bytes:
    return _CODEC.encode(message)


class PoolMessageError(ValueError):
    """A frame that is not a well-formed pool message."""


_CODEC = FrameCodec(_TYPES.values(), PoolMessageError, "pool message")


decode_errors = 0  # frames refused by `decode` in this process (a metric)


def decode(data: bytes) -> PoolMessage:
    """The message in `data`; PoolMessageError when it is not msgpack, names no known type, or a field is
    missing, unknown or of the wrong type."""
    try:
        return _decode(data)
    except PoolMessageError:
        global decode_errors
        decode_errors += 1
        raise


def _decode(data: bytes) -> PoolMessage:
    name, fields = _CODEC.open(data)
    try:
        return _CODEC.decode_fields(name, fields)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise PoolMessageError(f"{name}: {exc}") from None
