"""A stand-in OpenAI completions server for load-generator tests: streams one SSE chunk per token.

The requested model name picks the timing, so one server covers every case:
  "fake-model": first token after FIRST_TOKEN_S, then one every TOKEN_S;
  "slow-model": one token every SLOW_TOKEN_S (for time-limit tests);
  "garbage-model": a stream event that is a JSON list, not an object.
Requests with max_tokens above MAX_TOKENS are refused with an OpenAI error (HTTP 400). A prompt sent before is
reported as cached, all but its last token (usage.prompt_tokens_details.cached_tokens), as a prefix cache would.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

FIRST_TOKEN_S = 0.03
TOKEN_S = 0.005
SLOW_TOKEN_S = 0.5
MAX_TOKENS = 8


def build_app(received: list[dict]) -> FastAPI:
    app = FastAPI()
    seen_prompts: set[tuple] = set()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        received.append(body)
        max_tokens = int(body.get("max_tokens", 16))
        if max_tokens > MAX_TOKENS:
            return JSONResponse(status_code=400, content={"error": {
                "message": f"max_tokens {max_tokens} is too large", "type": "invalid_request_error"}})
        first, gap = (SLOW_TOKEN_S, SLOW_TOKEN_S) if body.get("model") == "slow-model" else (FIRST_TOKEN_S, TOKEN_S)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        prompt = tuple(body["prompt"]) if isinstance(body.get("prompt"), list) else (body.get("prompt"),)
        cached = len(prompt) - 1 if prompt in seen_prompts else 0
        seen_prompts.add(prompt)

        async def events():
            if body.get("model") == "garbage-model":
                yield "data: [1, 2]\n\n"
                return
            await asyncio.sleep(first)
            for i in range(max_tokens):
                if i:
                    await asyncio.sleep(gap)
                choice = {"index": 0, "text": f" t{i}", "finish_reason": "length" if i == max_tokens - 1 else None}
                yield f"data: {json.dumps({'object': 'text_completion', 'choices': [choice]})}\n\n"
            if include_usage:
                usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": max_tokens,
                         "total_tokens": len(body["prompt"]) + max_tokens,
                         "prompt_tokens_details": {"cached_tokens": cached}}
                yield f"data: {json.dumps({'object': 'text_completion', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_server():
    """Yields (base_url, received request bodies); stops the server on exit."""
    received: list[dict] = []
    # port 0: the kernel picks a free port as it binds (a port picked before could be taken by then)
    config = uvicorn.Config(build_app(received), host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("fake server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", received
    finally:
        server.should_exit = True
        thread.join(timeout=10)
