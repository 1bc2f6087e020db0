"""Ambiguous body framing (Content-Length with Transfer-Encoding, Content-Length twice or as a list) is refused
with 400 OpenAI error JSON and the connection closed, never served: read from raw sockets against a real
server, so no client library tidies the head first; the head checks themselves as units."""
from __future__ import annotations

import asyncio
import json
import socket

import pytest

from meshserve.entrypoints.openai.http_framing import framing_problem, head_fields
from meshserve.entrypoints.openai.http_guard import refusing_ambiguous_framing
from tests.entrypoints.openai.fake_server import running_fake_server
from tests.entrypoints.openai.test_api import MODEL

BODY = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 3}).encode()
# a second request hidden in the body: served only if the server read the body the other way
SMUGGLED = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def _chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


AMBIGUOUS = {
    "length-and-chunked": HEAD + b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n%s" % (
        len(_chunked(BODY)), _chunked(BODY)) + SMUGGLED,
    "chunked-then-length": HEAD + b"Transfer-Encoding: chunked\r\nContent-Length: %d\r\n\r\n%s" % (
        len(BODY), _chunked(BODY)) + SMUGGLED,
    "length-twice-equal": HEAD + b"Content-Length: %d\r\nContent-Length: %d\r\n\r\n%s" % (
        len(BODY), len(BODY), BODY) + SMUGGLED,
    "length-twice-different": HEAD + b"Content-Length: %d\r\ncontent-length: %d\r\n\r\n%s" % (
        len(BODY), len(BODY) + len(SMUGGLED), BODY) + SMUGGLED,
    "length-as-a-list": HEAD + b"Content-Length: %d, %d\r\n\r\n%s" % (len(BODY), len(BODY), BODY) + SMUGGLED,
    "bare-lf-line-ends": (HEAD + b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n").replace(
        b"\r\n", b"\n") % len(_chunked(BODY)) + _chunked(BODY) + SMUGGLED,
}


@pytest.fixture(scope="module")
def server():
    with running_fake_server({}) as (base, proc):
        yield base
        assert proc.poll() is None


def _exchange(base: str, data: bytes, timeout_s: float = 15.0) -> bytes:
    """Send `data`, then read until the server closes the connection (a socket timeout fails the test)."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return received


@pytest.mark.parametrize("request_bytes", AMBIGUOUS.values(), ids=AMBIGUOUS)
def test_ambiguous_framing_is_400_and_the_connection_closed(server, request_bytes):
    answer = _exchange(server, request_bytes)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer[:300]
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "ambiguous_framing", error
    assert answer.count(b"HTTP/1.1 ") == 1, answer  # neither the completion nor the hidden request was served


def test_one_reading_of_the_framing_is_still_served(server):
    plain = HEAD + b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(BODY), BODY)
    chunked = HEAD + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + _chunked(BODY)
    for request_bytes in (plain, chunked):
        answer = _exchange(server, request_bytes)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        assert b'"text_completion"' in answer


def test_a_head_h11_cannot_parse_gets_openai_json(server):
    answer = _exchange(server, HEAD + b"Content-Length: nine\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), answer[:300]
    assert json.loads(body)["error"]["code"] == "invalid_http_request"


# ---------------------------------------------------------------- the checks as units
@pytest.mark.parametrize(("headers", "problem"), [
    ([(b"content-length", b"5")], None),
    ([(b"transfer-encoding", b"chunked")], None),
    ([], None),
    ([(b"content-length", b"5"), (b"transfer-encoding", b"chunked")], "both"),
    ([(b"transfer-encoding", b"chunked"), (b"content-length", b"0")], "both"),
    ([(b"content-length", b"5"), (b"content-length", b"5")], "more than once"),
    ([(b"content-length", b"5,5")], "more than once"),
])
def test_framing_problem_names_each_ambiguous_shape(headers, problem):
    found = framing_problem(headers)
    assert found is None if problem is None else problem in found


def test_head_fields_read_names_case_blind_and_skip_the_request_line():
    head = b"POST /a:b HTTP/1.1\r\nContent-LENGTH :  7 \r\nX-Other: y\nno colon here"
    assert head_fields(head) == [(b"content-length", b"7"), (b"x-other", b"y")]


def test_the_app_wrapper_refuses_framing_h11_parsed_before_the_head_check():
    """A head h11 read on from its buffer (pipelined after an early answer) still meets the check."""
    served, sent = [], []

    async def app(scope, receive, send):
        served.append(scope)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "headers": [(b"content-length", b"5"), (b"transfer-encoding", b"chunked")]}
    asyncio.run(refusing_ambiguous_framing(app)(scope, None, send))
    assert served == []
    assert sent[0]["status"] == 400 and (b"connection", b"close") in sent[0]["headers"]
    assert json.loads(sent[1]["body"])["error"]["code"] == "ambiguous_framing"
    asyncio.run(refusing_ambiguous_framing(app)({"type": "http", "headers": [(b"content-length", b"5")]}, None,
                                                 send))
    assert len(served) == 1
