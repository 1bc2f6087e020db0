"""The transfer engine's wire headers: one msgspec struct per request kind, one per reply shape.

A request is a tagged union on "op"; each request type names the reply type its server answers with
(`Request.reply`). Headers travel as msgpack (framing in `tcp.py`). Decoding checks a header against its
struct: a known op, no unknown field, every field of its type and in range, nested region descriptors
included. A server refuses a header that fails with `Reply(ok=False, error=...)` and closes the
connection; a client fails its transfer (`TransferError`) on a reply that fails.

Every reply carries `ok` and `error`; the other fields have defaults, so a refusal decodes as any reply.
"""
from __future__ import annotations

import enum
from typing import Annotated, ClassVar

import msgspec
from msgspec import Meta

MAX_CHUNK_BYTES = 64 << 20
DEFAULT_CHUNK_BYTES = 1 << 20
MAX_LINK_ID = 128
MAX_PROBE_BYTES = 4096

Index = Annotated[int, Meta(ge=0)]  # a layer, a block id, a byte count or a tag
ChunkSize = Annotated[int, Meta(gt=0, le=MAX_CHUNK_BYTES)]
LinkId = Annotated[str, Meta(pattern=f"^[0-9A-Za-z]{{1,{MAX_LINK_ID}}}$")]
Seconds = Annotated[float, Meta(ge=0)]


class HeaderError(ValueError):
    """A header that is not a valid request or reply."""


class GroupBackend(enum.StrEnum):
    """The torch.distributed backend of a "dist" link's 2-rank group."""

    GLOO = "gloo"  # CPU tensors
    NCCL = "nccl"  # CUDA tensors on two different GPUs


class Header(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Base of every header."""


# ---------------------------------------------------------------- region descriptors
class RegionLayer(Header):
    shape: list[int]  # [num_blocks, block_size, *entry]
    dtype: str  # a torch dtype without its "torch." prefix ("bfloat16")


class ShmSegment(Header):
    """A layer in a shared-memory segment another process on the host can map."""

    shm_name: str
    shape: list[int]
    dtype: str


class RegionDescriptor(Header):
    """What another process needs to reach a region; `to_dict()` is msgpack/JSON-safe."""

    engine: str
    region: str
    layers: list[RegionLayer]
    host_id: str
    tcp_address: tuple[str, int] | None = None
    shm: list[ShmSegment] | None = None  # per layer, when the region is in shared memory
    device: str = "cpu"  # device type of the layer tensors ("cpu", "cuda"); older descriptors lack it
    device_id: str | None = None  # which GPU holds them (its UUID), to never pair two ranks of one GPU in NCCL

    @property
    def backends(self) -> list[str]:
        tcp = self.tcp_address is not None
        return [b for b, ok in (("shm", self.shm is not None), ("tcp", tcp), ("dist", tcp)) if ok]

    def to_dict(self) -> dict:
        return msgspec.msgpack.decode(msgspec.msgpack.encode(self))  # plain dicts and lists, as JSON gives

    @classmethod
    def from_dict(cls, data: dict) -> RegionDescriptor:
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as e:
            raise ValueError(f"malformed region descriptor: {e}") from e


# ---------------------------------------------------------------- replies
class Reply(Header):
    ok: bool = True
    error: str | None = None  # why the server refused, when not ok


class DescribeReply(Reply):
    regions: list[RegionDescriptor] = msgspec.field(default_factory=list)


class ReadReply(Reply):
    nbytes: Index = 0  # block bytes that follow (over TCP) or that the group sends (over dist)


class BytesReply(Reply):
    value: bytes = b""


class IntReply(Reply):
    value: int = 0


class BoolReply(Reply):
    value: bool = False


# ---------------------------------------------------------------- requests
class Request(Header, tag_field="op"):
    reply: ClassVar[type[Reply]] = Reply  # what the server answers with


class Describe(Request, tag="describe"):
    """The server's region descriptors."""

    reply: ClassVar[type[Reply]] = DescribeReply


class Read(Request, tag="read"):
    """Send the selected blocks of `layers` over this connection, in chunks of `chunk_size` bytes."""

    reply: ClassVar[type[Reply]] = ReadReply
    region: str
    layers: list[Index]
    block_ids: list[Index]
    chunk_size: ChunkSize = DEFAULT_CHUNK_BYTES


class Probe(Request, tag="probe"):
    """A link probe (xdeepserve §6.1): answer with `nbytes` of dummy payload; the puller times the round trip.
    It reads no region, so a busy or full KV cache never delays it."""

    reply: ClassVar[type[Reply]] = BytesReply
    nbytes: Annotated[int, Meta(ge=0, le=MAX_PROBE_BYTES)] = 64


class DistLink(Request, tag="dist_link"):
    """The source starts building rank 0 of the link's group."""

    link: LinkId
    backend: GroupBackend


class DistRead(Request, tag="dist_read"):
    """Send the selected blocks of the i-th requested layer over the link's group with tag `tag + i`."""

    reply: ClassVar[type[Reply]] = ReadReply
    link: LinkId
    region: str
    layers: list[Index]
    block_ids: list[Index]
    tag: Index


class DistUnlink(Request, tag="dist_unlink"):
    link: LinkId


# The rendezvous store calls of a puller's group (torch.distributed.Store), served by the source's store.
class StoreSet(Request, tag="store.set"):
    key: str
    value: bytes


class StoreGet(Request, tag="store.get"):
    reply: ClassVar[type[Reply]] = BytesReply
    key: str


class StoreAdd(Request, tag="store.add"):
    reply: ClassVar[type[Reply]] = IntReply
    key: str
    amount: int


class StoreCompareSet(Request, tag="store.compare_set"):
    reply: ClassVar[type[Reply]] = BytesReply
    key: str
    expected: bytes
    desired: bytes


class StoreDeleteKey(Request, tag="store.delete_key"):
    reply: ClassVar[type[Reply]] = BoolReply
    key: str


class StoreWait(Request, tag="store.wait"):
    keys: list[str]
    timeout: Seconds | None = None  # the server caps it at its own io timeout


class StoreCheck(Request, tag="store.check"):
    reply: ClassVar[type[Reply]] = BoolReply
    keys: list[str]


class StoreNumKeys(Request, tag="store.num_keys"):
    reply: ClassVar[type[Reply]] = IntReply


STORE_REQUESTS = (StoreSet, StoreGet, StoreAdd, StoreCompareSet, StoreDeleteKey, StoreWait, StoreCheck, StoreNumKeys)
REQUESTS = (Describe, Read, Probe, DistLink, DistRead, DistUnlink, *STORE_REQUESTS)

AnyRequest = Describe | Read | Probe | DistLink | DistRead | DistUnlink | StoreSet | StoreGet | StoreAdd \
    | StoreCompareSet | StoreDeleteKey | StoreWait | StoreCheck | StoreNumKeys

# ---------------------------------------------------------------- codec
_ENCODER = msgspec.msgpack.Encoder()
_REQUEST_DECODER = msgspec.msgpack.Decoder(AnyRequest)
_REPLY_DECODERS = {cls: msgspec.msgpack.Decoder(cls) for cls in {r.reply for r in REQUESTS}}


def encode(header: Header) -> bytes:
    return _ENCODER.encode(header)


def decode_request(data: bytes) -> Request:
    try:
        return _REQUEST_DECODER.decode(data)
    except msgspec.DecodeError as e:
        raise HeaderError(f"malformed request: {e}") from e


def decode_reply(data: bytes, request: type[Request]) -> Reply:
    """The reply to a request of type `request`."""
    try:
        return _REPLY_DECODERS[request.reply].decode(data)
    except msgspec.DecodeError as e:
        raise HeaderError(f"malformed {op_of(request)} reply: {e}") from e


def op_of(request: type[Request]) -> str:
    return request.__struct_config__.tag
