"""The cluster secret: where it comes from, CurveZMQ on TCP sockets (with the ZAP check), the raw-TCP
handshake, and the torch.distributed rendezvous store listening on the master address only."""
from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading

import psutil
import pytest
import zmq

from meshserve.utils import cluster_auth

RIGHT, WRONG = b"the-cluster-secret", b"an-attackers-guess"


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    monkeypatch.delenv(cluster_auth.ENV_SECRET, raising=False)
    monkeypatch.delenv(cluster_auth.ENV_SECRET_FILE, raising=False)
    monkeypatch.setenv(cluster_auth.ENV_CACHE, str(tmp_path / "cache"))
    return tmp_path


# ---------------------------------------------------------------- the secret
def test_default_secret_file_is_created_private_and_shared(clean_env):
    first = cluster_auth.cluster_secret()
    path = clean_env / "cache" / "cluster_secret"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(first) >= 32 and first == path.read_bytes().strip()
    # another process of this user reads the same file
    child = subprocess.run([sys.executable, "-c", "import sys; from meshserve.utils import cluster_auth as a; "
                            "sys.stdout.write(a.cluster_secret().decode())"],
                           capture_output=True, text=True, env=dict(os.environ), timeout=60, check=True)
    assert child.stdout.encode() == first


def test_env_secret_wins_then_secret_file(clean_env, monkeypatch):
    secret_file = clean_env / "secret"
    secret_file.write_bytes(b"from-a-file\n")
    secret_file.chmod(0o600)
    monkeypatch.setenv(cluster_auth.ENV_SECRET_FILE, str(secret_file))
    assert cluster_auth.cluster_secret() == b"from-a-file"
    monkeypatch.setenv(cluster_auth.ENV_SECRET, "from-the-env")
    assert cluster_auth.cluster_secret() == b"from-the-env"
    assert cluster_auth.curve_keys() != cluster_auth.curve_keys(b"from-a-file")
    cluster_auth.use_secret_file(str(secret_file))  # what --cluster-secret-file does: it is the last word
    assert cluster_auth.ENV_SECRET not in os.environ and cluster_auth.cluster_secret() == b"from-a-file"


def test_a_secret_file_others_can_read_is_refused(clean_env, monkeypatch):
    secret_file = clean_env / "secret"
    secret_file.write_bytes(b"s3cret")
    secret_file.chmod(0o644)
    monkeypatch.setenv(cluster_auth.ENV_SECRET_FILE, str(secret_file))
    with pytest.raises(cluster_auth.ClusterSecretError, match="chmod 600"):
        cluster_auth.cluster_secret()
    monkeypatch.setenv(cluster_auth.ENV_SECRET_FILE, str(clean_env / "missing"))
    with pytest.raises(cluster_auth.ClusterSecretError, match="cannot read"):
        cluster_auth.cluster_secret()


# ---------------------------------------------------------------- CurveZMQ
@pytest.fixture
def curve_server():
    """A CURVE ROUTER keyed by RIGHT that echoes; yields its endpoint."""
    ctx = zmq.Context()
    sock = cluster_auth.server(ctx.socket(zmq.ROUTER), secret=RIGHT)
    sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    stop = threading.Event()

    def echo():
        while not stop.is_set():
            if sock.poll(50):
                sock.send_multipart(sock.recv_multipart())

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    yield endpoint
    stop.set()
    thread.join(5)
    sock.close(0)
    ctx.term()  # returns: the ZAP handler closes its socket when the context terminates


def ask(endpoint: str, configure) -> bytes | None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    configure(sock)
    sock.connect(endpoint)
    try:
        sock.send(b"ping")
        return sock.recv() if sock.poll(1500) else None
    finally:
        sock.close(0)
        ctx.term()


def test_only_holders_of_the_secret_reach_a_curve_server(curve_server):
    assert ask(curve_server, lambda s: cluster_auth.client(s, secret=RIGHT)) == b"ping"
    assert ask(curve_server, lambda s: cluster_auth.client(s, secret=WRONG)) is None
    assert ask(curve_server, lambda s: None) is None  # no CURVE at all


def test_knowing_the_public_key_is_not_enough(curve_server):
    """The ZAP handler admits only the derived public key: a peer with a key pair of its own is refused."""
    public, secret = zmq.curve_keypair()
    refused = cluster_auth.stats.zmq_refused

    def forged(sock):
        sock.curve_serverkey = cluster_auth.curve_keys(RIGHT).public
        sock.curve_publickey, sock.curve_secretkey = public, secret

    assert ask(curve_server, forged) is None
    assert cluster_auth.stats.zmq_refused > refused


def test_probe_tells_a_refusal_from_silence(curve_server):
    assert cluster_auth.probe(curve_server, 5, secret=RIGHT) is None
    assert "does not share the cluster secret" in cluster_auth.probe(curve_server, 5, secret=WRONG)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        silent = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        assert "does not answer" in cluster_auth.probe(silent, 0.3, secret=RIGHT)


def test_ipc_sockets_are_left_alone(tmp_path):
    ctx = zmq.Context()
    try:
        sock = cluster_auth.server(ctx.socket(zmq.PULL), f"ipc://{tmp_path}/x")
        assert sock.getsockopt(zmq.MECHANISM) == zmq.NULL
        sock.close(0)
    finally:
        ctx.term()


# ---------------------------------------------------------------- raw TCP handshake
def handshake_pair(server_secret: bytes, client_secret: bytes) -> tuple[bool, Exception | None]:
    left, right = socket.socketpair()
    left.settimeout(5)
    right.settimeout(5)
    result = {}

    def serve():
        result["server"] = cluster_auth.handshake_server(left, server_secret)
        left.close()

    thread = threading.Thread(target=serve)
    thread.start()
    error = None
    try:
        cluster_auth.handshake_client(right, client_secret)
    except cluster_auth.ClusterAuthError as exc:
        error = exc
    thread.join(10)
    right.close()
    return result["server"], error


def test_transfer_handshake_is_mutual():
    assert handshake_pair(RIGHT, RIGHT) == (True, None)
    accepted, error = handshake_pair(RIGHT, WRONG)
    assert accepted is False and "does not share the cluster secret" in str(error)


# ---------------------------------------------------------------- torch.distributed rendezvous
def non_loopback_ipv4() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


def test_rendezvous_store_listens_on_the_master_address_only():
    from datetime import timedelta

    from meshserve.parallel.topology import rendezvous_store

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = rendezvous_store("127.0.0.1", port, 0, 1, timedelta(seconds=10))
    store.set("k", b"v")
    listening = [c.laddr for c in psutil.net_connections("inet")
                 if c.pid == os.getpid() and c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening
    other = non_loopback_ipv4()
    if other is not None:  # the same port on another local address answers nothing
        with pytest.raises(OSError):
            socket.create_connection((other, port), timeout=2).close()
    del store
