"""Refusing request heads whose body framing is ambiguous, before the HTTP parser settles on one reading.

A head that names both `Content-Length` and `Transfer-Encoding`, or `Content-Length` more than once (or as a
list), can be read two ways; a proxy in front reading it the other way lets a second request hide in the body
(request smuggling, RFC 9112 §6.3 and §11.2). h11 reads the first shape as chunked and merges equal duplicate
lengths, so the raw head is checked as it waits in the parser's buffer (`buffered_head`), and the parsed
headers once more before the app (`framing_problem`, for a head h11 read on from its buffer at once); such a
request is answered 400 and its connection closed: it is never served.
"""
from __future__ import annotations

import re

import h11

from meshserve.entrypoints.openai.errors import APIError

# h11 ends a head at the first empty line and accepts bare LF line ends: read it the same way
_HEAD_END = re.compile(rb"\n\r?\n")
_FRAMING_HEADERS = (b"content-length", b"transfer-encoding")


def buffered_head(conn: h11.Connection) -> bytes | None:
    """The complete request head waiting in `conn`'s buffer, or None (no head yet, or not all of it)."""
    if conn.their_state is not h11.IDLE:
        return None
    data, _ = conn.trailing_data
    end = _HEAD_END.search(data)
    return None if end is None else data[:end.start()]


def head_fields(head: bytes) -> list[tuple[bytes, bytes]]:
    """The (lower-case name, value) header fields of a raw request head."""
    fields = []
    for line in head.split(b"\n")[1:]:  # the request line first
        name, colon, value = line.rstrip(b"\r").partition(b":")
        if colon:
            fields.append((name.strip().lower(), value.strip()))
    return fields


def framing_problem(headers: list[tuple[bytes, bytes]]) -> str | None:
    """Why the body framing of a request with these (lower-case name, value) headers is ambiguous, or None
    when it has one reading."""
    fields = [(name, value) for name, value in headers if name in _FRAMING_HEADERS]
    lengths = [value for name, value in fields if name == b"content-length"]
    if lengths and len(lengths) < len(fields):
        return "both Content-Length and Transfer-Encoding are set"
    if len(lengths) > 1 or any(b"," in value for value in lengths):
        return "Content-Length is given more than once"
    return None


def ambiguous_framing_error(problem: str) -> APIError:
    return APIError(400, f"Ambiguous request framing: {problem}. Send a body with exactly one Content-Length, or "
                         "chunked without one.", code="ambiguous_framing")
