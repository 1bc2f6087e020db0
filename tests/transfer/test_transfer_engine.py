"""TransferEngine across processes: a prefill process owns KV regions, a decode process pulls blocks.

Source contents come from a seeded generator, so the test process rebuilds the expected destination
independently of any transfer path and compares bit for bit.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import msgpack
import pytest
import torch

from meshserve.transfer import BlockRef, RegionDescriptor, TransferEngine, TransferStatus

pytestmark = pytest.mark.timeout(60)

WAIT_S = 15.0
IO_TIMEOUT_S = 2.0
CHUNK_BYTES = 256  # small, so every test transfer spans several chunks
BLOCK_SIZE = 4
SRC_BLOCKS, DST_BLOCKS = 6, 8
# name -> (num_layers, entry_shape, dtype): an MLA latent cache and a GQA K/V cache
SHAPES = {
    "mla": (3, (24,), torch.bfloat16),
    "gqa": (2, (2, 2, 8), torch.float32),
}


def source_layers(region: str) -> list[torch.Tensor]:
    num_layers, entry, dtype = SHAPES[region]
    g = torch.Generator().manual_seed(sum(map(ord, region)))
    return [torch.randn((SRC_BLOCKS, BLOCK_SIZE, *entry), generator=g).to(dtype) for _ in range(num_layers)]


def expected_destination(region: str, src_ids, dst_ids, layers=None) -> list[torch.Tensor]:
    num_layers, entry, dtype = SHAPES[region]
    src = source_layers(region)
    out = [torch.zeros((DST_BLOCKS, BLOCK_SIZE, *entry), dtype=dtype) for _ in range(num_layers)]
    for layer in range(num_layers) if layers is None else layers:
        for s, d in zip(src_ids, dst_ids):
            out[layer][d] = src[layer][s]
    return out


def block_bytes(region: str) -> int:
    _, entry, dtype = SHAPES[region]
    return torch.zeros((BLOCK_SIZE, *entry), dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------- child processes
def prefill_main(conn, name: str, use_shm: bool, midway) -> None:
    """Owns the source regions and serves them until told to close."""
    engine = TransferEngine(name, io_timeout=IO_TIMEOUT_S)
    release = threading.Event()
    try:
        descriptors = []
        for region, (num_layers, entry, dtype) in SHAPES.items():
            if use_shm:
                tensors = engine.allocate_region(region, num_layers, SRC_BLOCKS, BLOCK_SIZE, entry, dtype)
                for t, src in zip(tensors, source_layers(region)):
                    t.copy_(src)
            else:
                tensors = source_layers(region)
                engine.register(region, tensors)
            descriptors.append(engine.descriptor(region).to_dict())
        conn.send({"descriptors": descriptors, "address": list(engine.tcp_address)})
        while True:
            cmd = conn.recv()
            if cmd[0] == "corrupt":
                bad_chunk = cmd[1]
                engine.server.fault_hook = lambda i, p, bad=bad_chunk: bytes([p[0] ^ 0xFF]) + p[1:] if i == bad else p
            elif cmd[0] == "stall":
                stall_at = cmd[1]  # a TCP chunk index, or the position of a layer in a dist read
                release = threading.Event()  # a fresh gate: an earlier "heal" set the old one

                def stall(i, payload, at=stall_at, gate=release):
                    if i == at:
                        midway.set()
                        gate.wait(WAIT_S)
                    return payload

                engine.server.fault_hook = stall
                engine.dist_source.fault_hook = stall
            elif cmd[0] == "heal":
                engine.server.fault_hook = None
                engine.dist_source.fault_hook = None
                release.set()
            elif cmd[0] == "dist_links":
                conn.send({"open": engine.dist_source.link_count, "made": engine.dist_source.links_made})
                continue
            elif cmd[0] == "close":
                break
            conn.send("ok")
    finally:
        release.set()
        engine.close()
        conn.send("closed")


def decode_main(conn) -> None:
    """Owns zeroed destination regions; pulls blocks on command and sends back what landed."""
    engine = TransferEngine("decode", chunk_size=CHUNK_BYTES, io_timeout=IO_TIMEOUT_S)
    try:
        dst = {
            region: engine.allocate_region(region, num_layers, DST_BLOCKS, BLOCK_SIZE, entry, dtype)
            for region, (num_layers, entry, dtype) in SHAPES.items()
        }
        conn.send("ready")
        while True:
            cmd = conn.recv()
            if cmd[0] == "link":
                _, peer, target, backend = cmd
                if isinstance(target, list) and target and isinstance(target[0], dict):
                    chosen = {engine.link(peer, d, backend=backend) for d in target}
                    conn.send(chosen.pop() if len(chosen) == 1 else sorted(chosen))
                else:
                    conn.send(engine.link(peer, tuple(target), backend=backend))
            elif cmd[0] == "unlink":
                engine.unlink(cmd[1])
                conn.send("ok")
            elif cmd[0] == "pull":
                _, peer, region, src_ids, dst_ids, layer_steps = cmd
                for t in dst[region]:
                    t.zero_()
                handles = [
                    engine.transfer(BlockRef(region, src_ids, peer), BlockRef(region, dst_ids), layers=step)
                    for step in layer_steps
                ]
                waited = []
                for h in handles:
                    try:
                        waited.append(vars(engine.wait(h, WAIT_S)) | {"status": engine.status(h).value})
                    except TimeoutError as e:
                        waited.append({"handle_id": h.id, "status": "TIMEOUT", "error": str(e)})
                polled = [vars(c) | {"status": c.status.value} for c in engine.poll()]
                conn.send({"handles": [h.id for h in handles], "waited": waited, "polled": polled,
                           "layers": [t.clone() for t in dst[region]]})
            elif cmd[0] == "close":
                break
    finally:
        engine.close()
        conn.send("closed")


class Child:
    def __init__(self, target, *args):
        ctx = mp.get_context("spawn")
        self.args = args  # keeps synchronisation primitives alive until the child has them
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child_conn, *args), daemon=True)
        self.proc.start()
        child_conn.close()

    def recv(self, timeout: float = WAIT_S):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"child {self.proc.pid} sent nothing within {timeout}s")
        return self.conn.recv()

    def ask(self, *cmd, timeout: float = WAIT_S):
        self.conn.send(cmd)
        return self.recv(timeout)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.ask("close")
            except (OSError, EOFError, TimeoutError):
                pass
            self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)
        self.conn.close()


@pytest.fixture(scope="module")
def cluster():
    ctx = mp.get_context("spawn")
    children = {}
    try:
        children["prefill"] = Child(prefill_main, "prefill", True, ctx.Event())
        children["decode"] = Child(decode_main)
        info = children["prefill"].recv()
        assert children["decode"].recv() == "ready"
        yield children, info
    finally:
        for child in children.values():
            child.stop()


def check_pull(result, region, src_ids, dst_ids, layer_steps):
    n_layers = SHAPES[region][0]
    covered = [layer for step in layer_steps for layer in (range(n_layers) if step is None else step)]
    expected = expected_destination(region, src_ids, dst_ids, covered)
    for got, want in zip(result["layers"], expected):
        assert got.dtype == want.dtype
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # bit-exact
    for step, done in zip(layer_steps, result["waited"]):
        steps_layers = n_layers if step is None else len(step)
        assert done["status"] == "DONE", done
        assert done["nbytes"] == len(src_ids) * block_bytes(region) * steps_layers
        assert done["error"] is None
    assert sorted(c["handle_id"] for c in result["polled"]) == sorted(result["handles"])
    assert {c["handle_id"]: c for c in result["polled"]} == {c["handle_id"]: c for c in result["waited"]}


@pytest.mark.parametrize("backend", ["shm", "tcp", "dist"])
@pytest.mark.parametrize("region", ["mla", "gqa"])
@pytest.mark.parametrize("by_layer", [False, True], ids=["whole", "layerwise"])
def test_pull_is_bit_exact(cluster, backend, region, by_layer):
    children, info = cluster
    decode = children["decode"]
    decode.ask("unlink", "prefill")
    # Linking by descriptor picks shm on one host; tcp and dist are forced. Either way the source is the same.
    assert decode.ask("link", "prefill", info["descriptors"], None if backend == "shm" else backend) == backend
    n_layers = SHAPES[region][0]
    steps = [[layer] for layer in range(n_layers)] if by_layer else [None]
    src_ids, dst_ids = [4, 0, 2], [1, 7, 3]
    result = decode.ask("pull", "prefill", region, src_ids, dst_ids, steps)
    check_pull(result, region, src_ids, dst_ids, steps)


def test_corrupted_chunk_fails_checksum_then_recovers(cluster):
    children, info = cluster
    prefill, decode = children["prefill"], children["decode"]
    decode.ask("unlink", "prefill")
    assert decode.ask("link", "prefill", info["address"], "tcp") == "tcp"
    try:
        assert prefill.ask("corrupt", 2) == "ok"
        result = decode.ask("pull", "prefill", "mla", [0, 1, 2], [0, 1, 2], [None])
        (done,) = result["waited"]
        assert done["status"] == "FAILED" and done["nbytes"] == 0
        assert "checksum mismatch in chunk 2" in done["error"]
        assert result["polled"] == result["waited"]
    finally:
        prefill.ask("heal")
    result = decode.ask("pull", "prefill", "mla", [0, 1, 2], [0, 1, 2], [None])
    check_pull(result, "mla", [0, 1, 2], [0, 1, 2], [None])


@pytest.mark.parametrize("backend", ["tcp", "dist"])
def test_stalled_server_times_out_instead_of_hanging(cluster, backend):
    children, info = cluster
    prefill, decode = children["prefill"], children["decode"]
    decode.ask("unlink", "prefill")
    decode.ask("link", "prefill", info["address"], backend)
    try:
        assert prefill.ask("stall", 1) == "ok"  # chunk 1 over tcp, layer 1 of 2 over dist
        result = decode.ask("pull", "prefill", "gqa", [5], [0], [None])
        (done,) = result["waited"]
        assert done["status"] == "FAILED"
        timed_out = (f"timed out after {IO_TIMEOUT_S}s" if backend == "tcp"
                     else f"Timed out waiting {IO_TIMEOUT_S * 1000:.0f}ms")
        assert timed_out in done["error"], done["error"]
    finally:
        prefill.ask("heal")
    # the stalled source recovers: a fresh pull (over a fresh group, for dist) succeeds
    result = decode.ask("pull", "prefill", "gqa", [5], [0], [None])
    check_pull(result, "gqa", [5], [0], [None])


def test_killed_server_fails_transfer_and_healthy_peer_still_serves(cluster):
    children, info = cluster
    decode = children["decode"]
    midway = mp.get_context("spawn").Event()
    victim = Child(prefill_main, "victim", False, midway)  # plain tensors: tcp only, nothing in /dev/shm
    try:
        victim_info = victim.recv()
        assert all(d["shm"] is None for d in victim_info["descriptors"])
        assert decode.ask("link", "victim", victim_info["descriptors"], None) == "tcp"
        assert victim.ask("stall", 3) == "ok"
        decode.conn.send(("pull", "victim", "mla", [0, 1, 2, 3], [4, 5, 6, 7], [None]))
        assert midway.wait(WAIT_S), "victim never reached the middle of the stream"
        victim.proc.kill()
        victim.proc.join(timeout=5)
        result = decode.recv(WAIT_S)
        (done,) = result["waited"]
        assert done["status"] == "FAILED"
        # EOF or RST depending on timing; either way the reader names the broken peer connection.
        assert done["error"].startswith("TransferError:") and "peer" in done["error"], done["error"]
    finally:
        victim.stop()
        decode.ask("unlink", "victim")
    decode.ask("unlink", "prefill")
    decode.ask("link", "prefill", info["address"], "tcp")
    result = decode.ask("pull", "prefill", "mla", [0, 1, 2, 3], [4, 5, 6, 7], [None])
    check_pull(result, "mla", [0, 1, 2, 3], [4, 5, 6, 7], [None])


def test_killed_dist_peer_fails_transfer_and_healthy_peer_still_serves(cluster):
    children, info = cluster
    decode = children["decode"]
    midway = mp.get_context("spawn").Event()
    victim = Child(prefill_main, "victim", False, midway)
    try:
        victim_info = victim.recv()
        assert decode.ask("link", "victim", victim_info["descriptors"], "dist") == "dist"
        assert victim.ask("stall", 1) == "ok"  # layer 0 of 3 arrives, then the victim stops sending
        decode.conn.send(("pull", "victim", "mla", [0, 1, 2, 3], [4, 5, 6, 7], [None]))
        assert midway.wait(WAIT_S), "victim never reached the middle of the dist read"
        victim.proc.kill()
        victim.proc.join(timeout=5)
        killed_at = time.monotonic()
        result = decode.recv(WAIT_S)
        assert time.monotonic() - killed_at < IO_TIMEOUT_S + 1.0  # the io timeout bounds the wait at worst
        (done,) = result["waited"]
        assert done["status"] == "FAILED" and done["nbytes"] == 0
        pulled_from_victim = "TransferError: dist pull of region 'mla' from peer 'victim' at 127.0.0.1:"
        assert done["error"].startswith(pulled_from_victim), done
        assert result["polled"] == result["waited"]
        assert all(not t.any() for t in result["layers"])  # nothing landed from the half-sent read
        # The broken link was dropped: the next pull tries to link again and is refused at once.
        result = decode.ask("pull", "victim", "mla", [0], [0], [None])
        (done,) = result["waited"]
        assert done["status"] == "FAILED" and "peer 'victim'" in done["error"] and "cannot connect" in done["error"]
    finally:
        victim.stop()
        decode.ask("unlink", "victim")
    decode.ask("unlink", "prefill")
    assert decode.ask("link", "prefill", info["descriptors"], "dist") == "dist"
    result = decode.ask("pull", "prefill", "mla", [0, 1, 2, 3], [4, 5, 6, 7], [None])
    check_pull(result, "mla", [0, 1, 2, 3], [4, 5, 6, 7], [None])


def test_dist_pulls_reuse_one_group_until_unlinked(cluster):
    children, info = cluster
    prefill, decode = children["prefill"], children["decode"]
    decode.ask("unlink", "prefill")
    assert all(RegionDescriptor.from_dict(d).backends == ["shm", "tcp", "dist"] for d in info["descriptors"])
    made = prefill.ask("dist_links")["made"]
    assert prefill.ask("dist_links") == {"open": 0, "made": made}  # unlink dropped the source's side too
    assert decode.ask("link", "prefill", info["address"], "dist") == "dist"
    assert prefill.ask("dist_links") == {"open": 0, "made": made}  # linking is lazy: no group yet
    for src_ids, dst_ids, steps in (([1], [2], [None]), ([3, 4], [0, 5], [[1], [0]]), ([5, 0, 2], [7, 6, 1], [None])):
        result = decode.ask("pull", "prefill", "gqa", src_ids, dst_ids, steps)
        check_pull(result, "gqa", src_ids, dst_ids, steps)
        assert prefill.ask("dist_links") == {"open": 1, "made": made + 1}  # one group serves every pull
    decode.ask("unlink", "prefill")
    assert prefill.ask("dist_links") == {"open": 0, "made": made + 1}
    assert decode.ask("link", "prefill", info["address"], "dist") == "dist"
    result = decode.ask("pull", "prefill", "mla", [2], [3], [None])
    check_pull(result, "mla", [2], [3], [None])
    assert prefill.ask("dist_links") == {"open": 1, "made": made + 2}


def test_owner_close_unlinks_shm_segments():
    owner = Child(prefill_main, "owner", True, None)
    try:
        descriptors = owner.recv()["descriptors"]
        names = [layer["shm_name"] for d in descriptors for layer in d["shm"]]
        assert len(names) == sum(n for n, _, _ in SHAPES.values())
        assert all(os.path.exists(f"/dev/shm/{n}") for n in names)
        # Attaching and detaching from another process must not unlink the owner's pages.
        reader = TransferEngine("reader", serve_tcp=False)
        try:
            assert reader.link("owner", descriptors[0]) == "shm"
            reader.unlink("owner")
            assert all(os.path.exists(f"/dev/shm/{n}") for n in names)
        finally:
            reader.close()
        owner.conn.send(("close",))
        assert owner.recv() == "closed"
        owner.proc.join(timeout=WAIT_S)
        assert owner.proc.exitcode == 0
        assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)
    finally:
        owner.stop()


# ---------------------------------------------------------------- in-process behaviour
@pytest.fixture
def engine():
    e = TransferEngine("local", serve_tcp=False)
    yield e
    e.close()


def test_local_transfer_and_descriptor_round_trip(engine):
    src = engine.allocate_region("src", 3, SRC_BLOCKS, BLOCK_SIZE, (24,), torch.bfloat16)
    for t, want in zip(src, source_layers("mla")):
        t.copy_(want)
    dst = engine.allocate_region("dst", 3, DST_BLOCKS, BLOCK_SIZE, (24,), torch.bfloat16)
    h = engine.transfer(BlockRef("src", [5, 1]), BlockRef("dst", [0, 6]), layers=[2, 0])
    done = engine.wait(h, WAIT_S)
    assert done.status is TransferStatus.DONE and engine.status(h) is TransferStatus.DONE
    assert done.nbytes == 2 * 2 * block_bytes("mla")
    expected = expected_destination("mla", [5, 1], [0, 6], [2, 0])
    assert all(torch.equal(a, b) for a, b in zip(dst, expected))
    assert engine.poll() == [done] and engine.poll() == []
    desc = engine.descriptor("src")
    assert RegionDescriptor.from_dict(msgpack.unpackb(msgpack.packb(desc.to_dict()))) == desc
    assert desc.backends == ["shm"]
    assert desc.device == "cpu" and desc.device_id is None
    older = {k: v for k, v in desc.to_dict().items() if k not in ("device", "device_id")}
    assert RegionDescriptor.from_dict(older) == desc  # descriptors without a device are CPU regions


def test_auto_link_picks_tcp_for_a_remote_peer_and_dist_only_when_asked(engine):
    engine.allocate_region("kv", 1, 4, BLOCK_SIZE, (8,), torch.float32)
    peer = {**engine.descriptor("kv").to_dict(), "engine": "gpu-peer", "host_id": "elsewhere", "shm": None,
            "tcp_address": ["127.0.0.1", 9], "device": "cuda", "device_id": "GPU-peer"}
    assert engine.link("gpu-peer", peer) == "tcp"  # a peer on another host: TCP unless dist is asked for
    engine.unlink("gpu-peer")
    assert engine.link("gpu-peer", peer, backend="dist") == "dist"  # forced: a Gloo group, built on first pull
    engine.unlink("gpu-peer")
    with pytest.raises(ValueError, match="no TCP address"):
        engine.link("gpu-peer", {**peer, "tcp_address": None}, backend="dist")
    with pytest.raises(ValueError, match="backend must be"):
        engine.link("gpu-peer", peer, backend="nccl")


def test_bad_requests_raise_clear_errors(engine):
    engine.allocate_region("a", 2, 4, BLOCK_SIZE, (8,), torch.float32)
    engine.allocate_region("b", 2, 4, BLOCK_SIZE, (8,), torch.bfloat16)
    engine.register("c", [torch.zeros(4, BLOCK_SIZE, 8)])
    with pytest.raises(ValueError, match="do not match"):
        engine.transfer(BlockRef("a", [0]), BlockRef("b", [0]))
    with pytest.raises(ValueError, match="layers"):
        engine.transfer(BlockRef("a", [0]), BlockRef("c", [0]))
    with pytest.raises(ValueError, match="out of range"):
        engine.transfer(BlockRef("a", [4]), BlockRef("a", [0]))
    with pytest.raises(ValueError, match="equal, non-empty"):
        engine.transfer(BlockRef("a", [0, 1]), BlockRef("a", [2]))
    with pytest.raises(ValueError, match="layers must be distinct"):
        engine.transfer(BlockRef("a", [0]), BlockRef("a", [1]), layers=[0, 0])
    with pytest.raises(ValueError, match="pulls"):
        engine.transfer(BlockRef("a", [0]), BlockRef("a", [1], engine="elsewhere"))
    with pytest.raises(ValueError, match="not linked"):
        engine.transfer(BlockRef("a", [0], engine="elsewhere"), BlockRef("a", [1]))
    with pytest.raises(KeyError, match="no region"):
        engine.transfer(BlockRef("missing", [0]), BlockRef("a", [1]))
    with pytest.raises(ValueError, match="already registered"):
        engine.register("a", [torch.zeros(4, BLOCK_SIZE, 8)])
    with pytest.raises(ValueError, match="belongs to engine"):
        engine.link("other", engine.descriptor("a"))
    assert engine.descriptor("c").shm is None  # plain tensors are not shareable by name


def test_each_completion_calls_on_complete_from_the_finishing_thread():
    """A loop that waits on its sockets is told as each transfer ends, not at its next poll."""
    told = []
    engine = TransferEngine("told", serve_tcp=False, on_complete=lambda: told.append(threading.current_thread()))
    try:
        engine.allocate_region("src", 1, SRC_BLOCKS, BLOCK_SIZE, (8,), torch.float32)
        engine.allocate_region("dst", 1, DST_BLOCKS, BLOCK_SIZE, (8,), torch.float32)
        first = engine.wait(engine.transfer(BlockRef("src", [1]), BlockRef("dst", [2])), WAIT_S)
        second = engine.wait(engine.transfer(BlockRef("src", [4, 0]), BlockRef("dst", [0, 7])), WAIT_S)
        assert len(told) == 2 and threading.current_thread() not in told  # the transfer threads told it
        assert engine.poll() == [first, second]  # and what they told of is there to poll
    finally:
        engine.close()
