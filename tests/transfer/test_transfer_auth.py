"""The transfer engine's TCP server admits only holders of the cluster secret: a process with another
secret can neither list an engine's regions nor pull its KV blocks; one with the secret pulls them intact."""
from __future__ import annotations

import pytest
import torch

from meshserve.transfer import BlockRef, TransferEngine, TransferError
from meshserve.transfer import tcp as tcp_mod
from meshserve.utils import cluster_auth

pytestmark = pytest.mark.timeout(60)

NUM_BLOCKS, BLOCK_SIZE, WIDTH = 4, 2, 8


@pytest.fixture
def source(monkeypatch):
    """An engine serving one KV region, keyed by the cluster's secret."""
    monkeypatch.setenv(cluster_auth.ENV_SECRET, "the-cluster-secret")
    engine = TransferEngine("source", io_timeout=2.0)
    layers = [torch.arange(NUM_BLOCKS * BLOCK_SIZE * WIDTH, dtype=torch.float32).reshape(NUM_BLOCKS, BLOCK_SIZE, WIDTH)
              + 1000 * layer for layer in range(2)]
    descriptor = engine.register("kv", layers)
    yield engine, layers, descriptor
    engine.close()


def pull(descriptor, address) -> tuple[object, torch.Tensor]:
    """Pull blocks 1 and 3 into a fresh engine's region over TCP: (completion, destination layer 1)."""
    puller = TransferEngine("puller", serve_tcp=False, force_tcp=True, io_timeout=2.0)
    try:
        dest = [torch.zeros(NUM_BLOCKS, BLOCK_SIZE, WIDTH) for _ in range(2)]
        puller.register("kv", dest)
        assert puller.link("source", descriptor.to_dict()) == "tcp"
        done = puller.wait(puller.transfer(BlockRef("kv", (1, 3), "source"), BlockRef("kv", (0, 1))), 10.0)
        return done, dest[1].clone()
    finally:
        puller.close()


def test_a_process_without_the_secret_cannot_pull_blocks(source, monkeypatch):
    engine, layers, descriptor = source
    monkeypatch.setenv(cluster_auth.ENV_SECRET, "an-attackers-guess")
    refused = cluster_auth.stats.tcp_refused
    done, dest = pull(descriptor, engine.tcp_address)
    assert done.error is not None and "cluster secret" in done.error
    assert torch.count_nonzero(dest) == 0
    with pytest.raises(TransferError, match="cluster secret"):
        tcp_mod.describe_remote(engine.tcp_address, timeout=2.0)
    with pytest.raises(TransferError, match="cluster secret"):
        tcp_mod.read_blocks(engine.tcp_address, "kv", [0], [0], BLOCK_SIZE * WIDTH * 4, timeout=2.0)
    assert cluster_auth.stats.tcp_refused - refused == 3


def test_a_process_with_the_secret_pulls_them_intact(source):
    engine, layers, descriptor = source
    done, dest = pull(descriptor, engine.tcp_address)
    assert done.error is None
    assert torch.equal(dest[:2], layers[1][[1, 3]])
    assert tcp_mod.describe_remote(engine.tcp_address, timeout=2.0) == [descriptor]  # typed, validated on decode
