"""Frames on the engine's sockets: `encode` / `decode` turn messages into msgpack frames `[type name,
fields]` (no pickle crosses a process boundary).

`decode` checks a frame against the struct it names (size, known type, known fields, field types, nested
messages included) and raises `MessageError` otherwise; a request that fails its checks but still says
who asked raises `RefusedFrame`, so its receiver can answer it (a bad request fails alone, never unanswered).
"""
from __future__ import annotations

import time

import msgspec

from meshserve.utils.framing import FrameCodec
from meshserve.wire.base import Message, Shutdown
from meshserve.wire.client import (
    AbortRequests,
    AddRequest,
    AdminOp,
    AdminReply,
    AdminRequest,
    EngineError,
    EngineOutputs,
    EngineReady,
    EngineStats,
    ErrorType,
    FinishReason,
    ReleaseKV,
    RequestDelta,
    StatsQuery,
)
from meshserve.wire.cluster import (
    ClusterQuery,
    ClusterStatus,
    GroupDemand,
    GroupStatus,
    JEStatus,
    JobExecutorReport,
    TEStatus,
    WarmAssign,
    WarmReady,
)
from meshserve.wire.dp_group import EplbRelay, GroupExpertLoad, HandOver, WorldRestart
from meshserve.wire.heartbeat import EngineHeartbeat, StartupTimeline
from meshserve.wire.kv import KVCacheEvents, KVConnectorReport
from meshserve.wire.worker import (
    CachedRequestData,
    InjectFault,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    StepBatch,
    WorkerEvent,
    WorkerFailure,
    WorkerHandshake,
    WorkerPing,
    WorkerPong,
    WorkerReady,
)

_MESSAGE_TYPES = {
    cls.__name__: cls
    for cls in (
        NewRequestData, CachedRequestData, SchedulerOutput, StepBatch, ModelRunnerOutput, WorkerReady, WorkerFailure,
        WorkerHandshake,
        AddRequest, AbortRequests, RequestDelta, EngineOutputs, StatsQuery, EngineStats, EngineReady, EngineError,
        KVCacheEvents, Shutdown, WorkerEvent, AdminRequest, AdminReply, ReleaseKV, EngineHeartbeat,
        KVConnectorReport, StartupTimeline, GroupDemand, JobExecutorReport, WarmReady, WarmAssign, ClusterQuery,
        TEStatus, GroupStatus, JEStatus, ClusterStatus, WorkerPing, WorkerPong, InjectFault, WorldRestart,
        GroupExpertLoad, EplbRelay, HandOver,
    )
}


def encode(msg: Message) -> bytes:
    return _CODEC.encode(msg)


class MessageError(ValueError):
    """A frame that is not a valid message: its receiver logs it, counts it and drops it."""


_CODEC = FrameCodec(_MESSAGE_TYPES.values(), MessageError, "message")


# the largest frame any internal socket takes: far above the largest legitimate message (a step
# whose new requests carry long prompts, a prefix-cache snapshot), far below what hurts the host
MAX_MESSAGE_BYTES = 256 * 2**20


# a TE's input socket takes requests from other hosts: one prompt of a million tokens still fits
MAX_INBOX_BYTES = 64 * 2**20


class RefusedFrame(MessageError):
    """A request frame that fails its checks but still says who asked and where to answer (`answer`,
    `reply_to`): its receiver answers it with this error, so a bad request fails alone and is never lost
    unanswered (e.g. sampling params out of range, an unknown admin operation)."""

    def __init__(self, reason: str, answer: Message, reply_to: str) -> None:
        super().__init__(reason)
        self.answer = answer
        self.reply_to = reply_to


class _RequestHeader(msgspec.Struct):
    """The part of an AddRequest an error answer needs (other fields are ignored)."""

    req_id: str
    reply_to: str = ""


class _AdminHeader(msgspec.Struct):
    query_id: int
    reply_to: str = ""


# what an admin request's malformed field means to the operator
_ADMIN_FIELD_ERRORS = {"op": f"unknown admin operation (one of {', '.join(AdminOp)})",
                       "placement": "not a meshserve expert placement",
                       "cache_id": "context_cache.delete needs a cache id (a string)"}


def _refused_request(header: _RequestHeader, reason: str) -> Message:
    error_type = ErrorType.SAMPLING_PARAMS if "`$.sampling_params" in reason else ErrorType.INVALID_REQUEST
    return EngineOutputs(deltas=[RequestDelta(req_id=header.req_id, new_token_ids=[],
                                              finish_reason=FinishReason.ERROR, error=f"bad request: {reason}",
                                              error_type=error_type)], timestamp=time.time())


def _refused_admin(header: _AdminHeader, reason: str) -> Message:
    bad_field = reason.rpartition("at `$.")[2].split(".")[0].split("`")[0]
    meaning = _ADMIN_FIELD_ERRORS.get(bad_field, "bad admin request")
    return AdminReply(query_id=header.query_id, ok=False, error=f"{meaning}: {reason}")


_ANSWERABLE = {"AddRequest": (msgspec.msgpack.Decoder(_RequestHeader), _refused_request),
               "AdminRequest": (msgspec.msgpack.Decoder(_AdminHeader), _refused_admin)}


def _refusal(name: str, fields: msgspec.Raw, reason: str) -> MessageError:
    """A RefusedFrame when the frame still names who to answer; a plain MessageError otherwise."""
    answerable = _ANSWERABLE.get(name)
    if answerable is None:
        return MessageError(f"bad {name}: {reason}")
    header_decoder, make_answer = answerable
    try:
        header = header_decoder.decode(fields)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return MessageError(f"bad {name}: {reason}")
    return RefusedFrame(f"bad {name}: {reason}", make_answer(header, reason), header.reply_to)


def decode(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """The message in `data`; MessageError for an oversized, malformed or unknown frame, or for fields
    unknown to or of the wrong type for the struct it names (nested messages included); RefusedFrame
    (a MessageError) for a request that can still be answered."""
    if len(data) > max_bytes:
        raise MessageError(f"a frame of {len(data)} bytes exceeds the limit of {max_bytes}")
    name, fields = _CODEC.open(data)
    try:
        return _CODEC.decode_fields(name, fields)
    except msgspec.ValidationError as exc:
        raise _refusal(name, fields, str(exc)) from None
    except msgspec.DecodeError as exc:
        raise MessageError(f"not msgpack: {exc}") from None
