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

Every socket is a CurveZMQ socket keyed by the cluster secret (`meshserve.utils.cluster_auth`). `decode`
checks a frame's shape and every field's type against its class and raises `PoolMessageError` (a
ValueError) for anything else; receivers log and count it (`decode_errors`) and go on.
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
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
    force: bool = False  # allow a quota below the namespace's current use (servers then evict down to it)


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


class PoolMessageError(ValueError):
    """A frame that is not a well-formed pool message."""


decode_errors = 0  # frames refused by `decode` in this process (a metric)


def decode(data: bytes) -> Any:
    """The message in `data`; PoolMessageError when it is not msgpack, names no known type, or a field is
    missing, unknown or of the wrong type."""
    try:
        return _decode(data)
    except PoolMessageError:
        global decode_errors
        decode_errors += 1
        raise


def _decode(data: bytes) -> Any:
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types for bad bytes
        raise PoolMessageError(f"not a msgpack frame ({type(exc).__name__})") from None
    if not (isinstance(obj, list) and len(obj) == 2 and isinstance(obj[0], str) and isinstance(obj[1], dict)):
        raise PoolMessageError("a pool message is [type name, fields]")
    name, fields = obj
    cls = _TYPES.get(name)
    if cls is None:
        raise PoolMessageError(f"unknown pool message {name[:64]!r}")
    hints = _field_types(cls)
    unknown = [k for k in fields if k not in hints]
    if unknown:
        raise PoolMessageError(f"{name}: unknown field(s) {', '.join(map(str, unknown))[:200]}")
    for key, value in fields.items():
        if not _conforms(value, hints[key]):
            raise PoolMessageError(f"{name}.{key}: expected {hints[key]}, got {type(value).__name__}")
    try:
        return cls(**fields)
    except TypeError as exc:  # a required field is missing
        raise PoolMessageError(f"{name}: {exc}") from None


@functools.lru_cache(maxsize=None)
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _conforms(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, arg) for arg in args)
    if hint is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_conforms(k, args[0]) and _conforms(v, args[1])
                                               for k, v in value.items())
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint)
