"""A TE that may not recover (`on_rank_failure="fail"`, no recoveries left) reports unhealthy and fails its
requests instead of hanging when a worker dies; prefix-cache events are published for routers. Recovery
itself is tested in test_recovery.py."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time

import httpx
import psutil
import pytest
import zmq

from meshserve import LLM, SamplingParams
from meshserve.config import EngineConfig
from meshserve.engine.async_client import AsyncEngineClient
from meshserve.entrypoints.openai.api_server import build_app
from meshserve.utils import cluster_auth
from meshserve.utils.processes import process_tree, rank_processes
from meshserve.wire import codec
from meshserve.wire.errors import EngineDeadError
from meshserve.wire.kv import BlockStored, KVCacheEvents

LONG = SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model("deepseek_v3", overrides={"num_hidden_layers": 2}))


def _worker_pid(master_pid: int) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for pid in rank_processes(master_pid).values():
            return pid
        time.sleep(0.1)
    raise AssertionError("no worker process found")


def _kill_later(pid: int, delay_s: float) -> threading.Timer:
    timer = threading.Timer(delay_s, os.kill, args=(pid, signal.SIGKILL))
    timer.start()
    return timer


def test_offline_generate_fails_when_the_worker_dies(model_dir):
    llm = LLM(model=model_dir, kv_cache_memory_gb=0.05, on_rank_failure="fail")
    try:
        _kill_later(_worker_pid(llm.engine.proc.pid), 1.5)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="worker 0"):
            llm.generate([[5, 6, 7]] * 4, LONG)
        assert time.monotonic() - start < 30
        assert llm.engine.proc.wait(timeout=30) == 1  # a failed master ends: its owner starts another
    finally:
        llm.shutdown()
    assert llm.engine.proc.poll() is not None  # the master is gone after shutdown


def test_a_killed_masters_ranks_and_forkserver_end_with_it(model_dir):
    """The ranks fork from the master's forkserver, not from the master: kill -9 of the master must still end
    them all (the forkserver sees its caller gone, the ranks see their parent gone)."""
    llm = LLM(model=model_dir, kv_cache_memory_gb=0.05, parallel="attn=TP1+DP2 moe=TP1+EP2")
    try:
        master = psutil.Process(llm.engine.proc.pid)
        below = process_tree(master.pid)  # with the session's rank template, its forkserver for this master too
        assert len(rank_processes(master.pid)) == 2 and len(below) >= 3  # the forkserver and the two ranks
        os.kill(master.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (alive := [p.pid for p in below if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]):
            assert time.monotonic() < deadline, f"still running 30 s after their master was killed: {alive}"
            time.sleep(0.1)
    finally:
        llm.shutdown()


def test_api_reports_unhealthy_and_fails_in_flight_requests(model_dir):
    engine = AsyncEngineClient(EngineConfig.from_kwargs(model_dir, kv_cache_memory_gb=0.05, on_rank_failure="fail",
                                                        max_recoveries=0))
    app = build_app(engine, served_model_name="tiny")

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            assert (await client.get("/health")).status_code == 200
            outputs = []

            async def consume():
                async for out in engine.generate(None, [5, 6, 7], LONG, "doomed"):
                    outputs.append(out)

            task = asyncio.create_task(consume())
            while not outputs:  # the request is running
                await asyncio.sleep(0.05)
            os.kill(_worker_pid(engine.engine.proc.pid), signal.SIGKILL)
            await asyncio.wait_for(task, timeout=30)
            final = outputs[-1]
            assert final.finished and final.finish_reason == "error"
            assert "worker" in (final.error or "")
            health = await client.get("/health")
            assert health.status_code == 503
            late = await client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2})
            assert late.status_code == 503
            assert "error" in late.json()

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prefix_cache_events_are_published(model_dir):
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    ctx = zmq.Context()
    sub = cluster_auth.client(ctx.socket(zmq.SUB))  # the TE's events carry users' prompts: keyed by the secret
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    prompt = list(range(100, 140))  # 40 tokens: 5 full blocks of 8
    try:
        with LLM(model=model_dir, block_size=8, kv_events_endpoint=endpoint, kv_cache_memory_gb=0.05) as llm:
            time.sleep(0.5)  # let the subscription reach the publisher
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
            stored: list[BlockStored] = []
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and sum(len(e.block_hashes) for e in stored) < 5:
                if sub.poll(200):
                    batch = codec.decode(sub.recv())
                    assert isinstance(batch, KVCacheEvents)
                    stored += [e for e in batch.events if isinstance(e, BlockStored)]
        hashes = [h for e in stored for h in e.block_hashes]
        tokens = [t for e in stored for t in e.token_ids]
        assert len(hashes) == len(set(hashes)) >= 5
        assert tokens[:40] == prompt  # the stored chain spells the prompt, block by block
        assert stored[0].parent_block_hash is None
    finally:
        sub.close(0)
        ctx.term()
