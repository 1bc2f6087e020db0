"""The cluster secret, and how every internal TCP socket proves that its peer holds it.

Where the secret comes from (the first that is set):

1. `MESHSERVE_CLUSTER_SECRET`: the secret itself;
2. `MESHSERVE_CLUSTER_SECRET_FILE` (the `--cluster-secret-file` flag sets it): a file holding it;
3. `$MESHSERVE_CACHE/cluster_secret` (default `~/.cache/meshserve/cluster_secret`), created with 32
   random bytes and mode 0600 on first use.

Like Erlang's cookie, every process of one user on one machine shares the default file with no setup,
and child processes inherit the choice through the environment. A deployment over several hosts copies
the file (or sets the variable) on every host. A secret file must be readable by its owner only.

ZMQ sockets on TCP use CurveZMQ with ONE Curve25519 keypair derived from the secret: a binding socket
is a CURVE server, a connecting one uses the keypair as its own and as the server's key. A CURVE server
alone would admit anyone who knows its public key, so every context with a server runs a ZAP handler,
started before the server binds, that admits only the derived public key: a peer must hold the secret.
The transfer engine's raw TCP connections open with a mutual challenge-response (`handshake_server`,
`handshake_client`); block data after it costs nothing extra. ipc:// and inproc:// sockets are not
authenticated: they are reachable only through the filesystem (a private directory) or the process.

Nothing of meshserve beyond `meshserve.utils` is imported here, so any process can use it first.
"""
from __future__ import annotations

import base64
import enum
import functools
import hashlib
import hmac
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from meshserve.utils import envs

logger = logging.getLogger(__name__)

ENV_SECRET = envs.MESHSERVE_CLUSTER_SECRET.name
ENV_SECRET_FILE = envs.MESHSERVE_CLUSTER_SECRET_FILE.name
ENV_CACHE = envs.MESHSERVE_CACHE.name
SECRET_FILE_NAME = "cluster_secret"

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's ZAP handler (RFC 27)
_NONCE_BYTES = 32
_TRANSFER_MAGIC = b"MSAUTH1"  # the first bytes a transfer server sends: who it is and the handshake version


class ClusterSecretError(ValueError):
    """The cluster secret cannot be read or created (the CLI prints it as one line)."""


class ClusterAuthError(ConnectionError):
    """A peer did not prove it holds the cluster secret (or refused ours)."""


@dataclass
class AuthStats:
    """Peers refused since start, by the check that refused them (for metrics and tests)."""

    zmq_refused: int = 0
    tcp_refused: int = 0


stats = AuthStats()


# ---------------------------------------------------------------------------------------------- the secret
def default_secret_path() -> Path:
    """`$MESHSERVE_CACHE/cluster_secret`, else `~/.cache/meshserve/cluster_secret`."""
    return envs.cache_dir() / SECRET_FILE_NAME


def cluster_secret() -> bytes:
    """This process's cluster secret (see the module doc for where it comes from)."""
    return _secret_of(envs.cluster_secret(), envs.cluster_secret_file(), str(default_secret_path()))


def use_secret_file(path: str) -> None:
    """Make `path` the secret of this process and of every process it starts (`--cluster-secret-file`)."""
    path = os.path.abspath(os.path.expanduser(path))
    _read_secret_file(Path(path))  # a bad file is reported now, not at the first socket
    os.environ[ENV_SECRET_FILE] = path
    os.environ.pop(ENV_SECRET, None)  # the flag is the operator's latest word


@functools.lru_cache(maxsize=16)
def _secret_of(env_secret: str | None, env_file: str | None, default_path: str) -> bytes:
    if env_secret is not None:
        if not env_secret.strip():
            raise ClusterSecretError(f"{ENV_SECRET} is set but empty")
        return env_secret.strip().encode()
    if env_file:
        return _read_secret_file(Path(env_file).expanduser())
    path = Path(default_path)
    if not path.exists():
        _create_secret_file(path)
    return _read_secret_file(path)


def _read_secret_file(path: Path) -> bytes:
    try:
        mode = path.stat().st_mode
        text = path.read_bytes().strip()
    except OSError as exc:
        raise ClusterSecretError(f"cannot read the cluster secret file {path}: {exc.strerror}") from None
    if mode & 0o077:
        raise ClusterSecretError(f"the cluster secret file {path} is open to other users (mode {mode & 0o777:o}); "
                                 f"run `chmod 600 {path}`")
    if not text:
        raise ClusterSecretError(f"the cluster secret file {path} is empty")
    return text


def _create_secret_file(path: Path) -> None:
    """Write a fresh secret; a process racing us either wins (we read its file) or loses (it reads ours)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=") + b"\n")
        try:
            os.link(tmp, path)  # atomic, and never replaces a secret another process wrote first
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    except OSError as exc:
        raise ClusterSecretError(f"cannot create the cluster secret file {path}: {exc.strerror}") from None
    logger.info("created the cluster secret %s (copy it to every host of a multi-host deployment)", path)


def _derive(secret: bytes | None, purpose: bytes) -> bytes:
    return hmac.new(cluster_secret() if secret is None else secret, purpose, hashlib.sha256).digest()


# ---------------------------------------------------------------------------------------------- ZMQ: CurveZMQ
@dataclass(frozen=True)
class CurveKeys:
    public: bytes  # z85, 40 bytes
    secret: bytes  # z85, 40 bytes


@functools.lru_cache(maxsize=16)
def _curve_keys_of(material: bytes) -> CurveKeys:
    secret_key = z85.encode(material)
    return CurveKeys(public=zmq.curve_public(secret_key), secret=secret_key)


def curve_keys(secret: bytes | None = None) -> CurveKeys:
    """The cluster's one CURVE keypair, derived from the secret."""
    return _curve_keys_of(_derive(secret, b"meshserve curve v1"))


def is_tcp(endpoint: str) -> bool:
    return endpoint.startswith("tcp://")


def server(sock: zmq.Socket, endpoint: str = "tcp://", secret: bytes | None = None) -> zmq.Socket:
    """Before `sock` binds `endpoint`: on TCP, make it a CURVE server that admits only holders of the secret."""
    if not is_tcp(endpoint):
        return sock
    keys = curve_keys(secret)
    _ensure_zap_handler(sock.context)
    sock.setsockopt(zmq.ZAP_DOMAIN, keys.public)  # the handler admits the client key equal to this one
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    return sock


def client(sock: zmq.Socket, endpoint: str = "tcp://", secret: bytes | None = None) -> zmq.Socket:
    """Before `sock` connects to `endpoint`: on TCP, present the cluster keypair to a CURVE server."""
    if not is_tcp(endpoint):
        return sock
    keys = curve_keys(secret)
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    return sock


_zap_lock = threading.Lock()
_zap_contexts: dict[int, zmq.Context] = {}  # id -> context whose ZAP handler runs (kept alive while it runs)


def _ensure_zap_handler(ctx: zmq.Context) -> None:
    """Start the context's ZAP handler once; it is bound before this returns, so no server binds without it
    (libzmq lets every CURVE client in when a context has no handler)."""
    with _zap_lock:
        if id(ctx) in _zap_contexts:
            return
        # not through ctx.socket(): `ctx.destroy()` would close it under the handler thread; a context's
        # termination ends the handler instead (ETERM), which then closes it itself
        zap = zmq.Socket(ctx, zmq.ROUTER)  # not REP: no send/receive state a failed reply could wedge
        zap.setsockopt(zmq.LINGER, 0)
        zap.bind(_ZAP_ENDPOINT)
        _zap_contexts[id(ctx)] = ctx
    threading.Thread(target=_serve_zap, args=(ctx, zap), name="meshserve-zap", daemon=True).start()


def _serve_zap(ctx: zmq.Context, zap: zmq.Socket) -> None:
    """Answer ZAP requests until the context terminates (ETERM), then close, so `ctx.term()` can finish."""
    try:
        while True:
            try:
                envelope_and_request = zap.recv_multipart()
            except zmq.ContextTerminated:
                return
            try:  # libzmq asks through a REQ socket: [its identity, b"", request...]
                identity, request = envelope_and_request[0], envelope_and_request[2:]
                zap.send_multipart([identity, b"", *_zap_reply(request)])
            except zmq.ContextTerminated:
                return
            except Exception:  # noqa: BLE001 - the handler must outlive any request: without it libzmq admits all
                logger.exception("ZAP request not answered")
    finally:
        zap.close(0)
        with _zap_lock:
            _zap_contexts.pop(id(ctx), None)


def _zap_reply(frames: list[bytes]) -> list[bytes]:
    """RFC 27: version, request id, domain, address, identity, mechanism, credentials."""
    request_id = frames[1] if len(frames) > 1 else b""
    ok = False
    if len(frames) >= 7 and frames[5] == b"CURVE":
        try:
            ok = hmac.compare_digest(frames[6], z85.decode(frames[2]))
        except (ValueError, TypeError):
            ok = False
    if ok:
        return [b"1.0", request_id, b"200", b"OK", b"", b""]
    stats.zmq_refused += 1
    if stats.zmq_refused in (1, 10, 100) or stats.zmq_refused % 1000 == 0:
        address = frames[3].decode(errors="replace") if len(frames) > 3 else "?"
        logger.warning("refused a ZMQ peer from %s: it does not hold the cluster secret (%d refused so far)",
                       address, stats.zmq_refused)
    return [b"1.0", request_id, b"400", b"not a holder of the cluster secret", b"", b""]


class Handshake(enum.Enum):
    """How a CURVE server at an endpoint met this process."""

    ACCEPTED = "accepted"
    REFUSED = "refused"  # it does not share our secret
    SILENT = "silent"  # nothing listens there (yet)
    STALLED = "stalled"  # connected, but the handshake did not finish in time


def handshake(endpoint: str, timeout_s: float, secret: bytes | None = None,
              socket_type: int = zmq.DEALER) -> Handshake:
    """Connect a throw-away socket of `socket_type` (one the server's type accepts: ZMTP refuses a pair
    that does not match, which would look like a refusal) and watch its handshake."""
    ctx = zmq.Context()
    sock = client(ctx.socket(socket_type), endpoint, secret)
    sock.setsockopt(zmq.LINGER, 0)
    events = sock.get_monitor_socket()
    try:
        sock.connect(endpoint)
        return _await_handshake(events, time.monotonic() + timeout_s)
    finally:
        sock.disable_monitor()
        events.close(0)
        sock.close(0)
        ctx.term()


def probe(endpoint: str, timeout_s: float, secret: bytes | None = None, socket_type: int = zmq.DEALER) -> str | None:
    """None when a CURVE server at `endpoint` accepts this process's secret, else a one-line why not:
    for a CLI's clear error instead of waiting on a peer that will never answer."""
    result = handshake(endpoint, timeout_s, secret, socket_type)
    return {Handshake.ACCEPTED: None,
            Handshake.REFUSED: f"{endpoint} refused this process: it does not share the cluster secret "
                               f"(set {ENV_SECRET} or {ENV_SECRET_FILE} to the cluster's secret)",
            Handshake.SILENT: f"{endpoint} does not answer",
            Handshake.STALLED: f"{endpoint} did not complete the handshake"}[result]


_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                     zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def _await_handshake(events: zmq.Socket, deadline: float) -> Handshake:
    connected = False
    while True:
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0 or not events.poll(left_ms):
            return Handshake.STALLED if connected else Handshake.SILENT
        event = recv_monitor_message(events)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return Handshake.ACCEPTED
        if event == zmq.EVENT_CONNECTED:
            connected = True
        elif event in _HANDSHAKE_FAILED or (event == zmq.EVENT_DISCONNECTED and connected):
            return Handshake.REFUSED


# ---------------------------------------------------------------------------------------------- raw TCP
def _transfer_key(secret: bytes | None) -> bytes:
    return _derive(secret, b"meshserve transfer v1")


def _proof(key: bytes, side: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, side + server_nonce + client_nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise ClusterAuthError("connection closed during the cluster-secret handshake")
        data += part
    return data


def handshake_server(conn: socket.socket, secret: bytes | None = None, purpose: str = "transfer") -> bool:
    """The accepting side (the socket's timeout applies): True when the peer proved it holds the secret.
    A peer that did not is counted and logged (as a refused `purpose` connection); the caller closes it."""
    key = _transfer_key(secret)
    server_nonce = secrets.token_bytes(_NONCE_BYTES)
    try:
        conn.sendall(_TRANSFER_MAGIC + server_nonce)
        answer = _recv_exact(conn, _NONCE_BYTES + hashlib.sha256().digest_size)
    except (OSError, ClusterAuthError):
        answer = b""
    client_nonce, proof = answer[:_NONCE_BYTES], answer[_NONCE_BYTES:]
    if not answer or not hmac.compare_digest(proof, _proof(key, b"client", server_nonce, client_nonce)):
        stats.tcp_refused += 1
        peer = _peer_name(conn)
        logger.warning("refused a %s connection from %s: it does not hold the cluster secret", purpose, peer)
        return False
    conn.sendall(_proof(key, b"server", server_nonce, client_nonce))
    return True


def handshake_client(sock: socket.socket, secret: bytes | None = None) -> None:
    """The connecting side: prove we hold the secret and check that the server does; ClusterAuthError if not."""
    key = _transfer_key(secret)
    hello = _recv_exact(sock, len(_TRANSFER_MAGIC) + _NONCE_BYTES)
    if not hello.startswith(_TRANSFER_MAGIC):
        raise ClusterAuthError("the peer does not speak the meshserve transfer protocol")
    server_nonce = hello[len(_TRANSFER_MAGIC):]
    client_nonce = secrets.token_bytes(_NONCE_BYTES)
    sock.sendall(client_nonce + _proof(key, b"client", server_nonce, client_nonce))
    try:
        answer = _recv_exact(sock, hashlib.sha256().digest_size)
    except ClusterAuthError:
        raise ClusterAuthError("the peer refused this process: it does not share the cluster secret") from None
    if not hmac.compare_digest(answer, _proof(key, b"server", server_nonce, client_nonce)):
        raise ClusterAuthError("the peer does not hold the cluster secret")


def _peer_name(conn: socket.socket) -> str:
    try:
        peer = conn.getpeername()
    except OSError:
        return "?"
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else (str(peer) or "a local socket")
