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
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack


# ---------------------------------------------------------------- client <-> server
@dataclass
class Put:
    req_id: int
    namespace: str
    keys: list[str]  # one value frame follows per key, in order


@dataclass
class PutReply:
    req_id: int
    stored: list[bool]  # False: refused (value larger than the namespace's share, or the server is full)
    error: str | None = None


@dataclass
class Get:
    req_id: int
    namespace: str
    keys: list[str]


@dataclass
class GetReply:
    req_id: int
    found: list[bool]  # one value frame follows per found key, in order
    error: str | None = None


@dataclass
class Exists:
    req_id: int
    namespace: str
    keys: list[str]


@dataclass
class ExistsReply:
    req_id: int
    found: list[bool]


@dataclass
class Delete:
    req_id: int
    namespace: str
    keys: list[str]


@dataclass
class DeleteReply:
    req_id: int
    deleted: list[bool]


@dataclass
class ServerStatsQuery:
    req_id: int


@dataclass
class ServerStats:
    req_id: int
    server_id: str
    dram_bytes: int
    ssd_bytes: int
    num_keys: int
    namespaces: dict[str, int] = field(default_factory=dict)  # bytes per namespace
    hits: int = 0
    misses: int = 0


# ---------------------------------------------------------------- server <-> controller
@dataclass
class Register:
    server_id: str
    address: str  # where clients reach it (tcp://host:port)
    dram_capacity: int
    ssd_capacity: int


@dataclass
class RegisterReply:
    accepted: bool
    quotas: dict[str, int] = field(default_factory=dict)  # namespace -> byte quota over the whole pool
    num_servers: int = 1
    error: str | None = None


@dataclass
class Heartbeat:
    server_id: str
    namespaces: dict[str, int] = field(default_factory=dict)  # bytes held per namespace


# ---------------------------------------------------------------- client <-> controller
@dataclass
class ViewQuery:
    req_id: int


@dataclass
class View:
    req_id: int
    version: int  # bumped whenever membership changes
    servers: dict[str, str] = field(default_factory=dict)  # server_id -> address (live ones only)
    virtual_nodes: int = 64
    quotas: dict[str, int] = field(default_factory=dict)


@dataclass
class CreateNamespace:
    req_id: int
    namespace: str
    quota_bytes: int


@dataclass
class NamespaceReply:
    req_id: int
    ok: bool
    error: str | None = None


# ---------------------------------------------------------------- any -> requester
@dataclass
class Error:
    req_id: int  # -1 when the request was too malformed to carry one
    message: str


_TYPES = {cls.__name__: cls for cls in (
    Put, PutReply, Get, GetReply, Exists, ExistsReply, Delete, DeleteReply, ServerStatsQuery, ServerStats,
    Register, RegisterReply, Heartbeat, ViewQuery, View, CreateNamespace, NamespaceReply, Error)}


def encode(message: Any) -> bytes:
    return msgpack.packb([type(message).__name__, dataclasses.asdict(message)], use_bin_type=True)


def decode(data: bytes) -> Any:
    name, fields = msgpack.unpackb(data, raw=False, strict_map_key=False)
    cls = _TYPES.get(name)
    if cls is None:
        raise ValueError(f"unknown pool message {name!r}")
    return cls(**fields)
