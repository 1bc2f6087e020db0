"""The pool controller: membership, heartbeats, timeouts, view versions, namespace quotas."""
import zmq

from meshserve.entrypoints.cli import main
from meshserve.pool import messages as m
from meshserve.pool.controller import ControllerState
from meshserve.utils import cluster_auth
from tests.pool.pool_processes import free_address, pool_processes, start_pool, wait_until


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_membership_heartbeats_and_timeouts():
    clock = FakeClock()
    state = ControllerState(server_timeout_s=3.0, virtual_nodes=16, clock=clock)
    assert state.handle(m.ViewQuery(1)) == m.View(req_id=1, version=0, servers={}, virtual_nodes=16, quotas={})

    reply = state.handle(m.Register("s0", "tcp://127.0.0.1:1", 100, 0))
    assert reply.accepted and reply.num_servers == 1
    reply = state.handle(m.Register("s1", "tcp://127.0.0.1:2", 100, 50))
    assert reply.accepted and reply.num_servers == 2
    view = state.handle(m.ViewQuery(2))
    assert view.version == 2 and view.servers == {"s0": "tcp://127.0.0.1:1", "s1": "tcp://127.0.0.1:2"}

    # Registering again at the same address (a quick restart) does not change the view.
    state.handle(m.Register("s0", "tcp://127.0.0.1:1", 100, 0))
    assert state.handle(m.ViewQuery(3)).version == 2

    # s0 keeps beating, s1 goes silent and leaves after the timeout.
    for _ in range(3):
        clock.now += 1.5
        reply = state.handle(m.Heartbeat("s0", {"ns": 10}))
        assert reply.accepted
    assert state.servers["s0"].usage == {"ns": 10}
    view = state.handle(m.ViewQuery(4))
    assert view.version == 3 and list(view.servers) == ["s0"]
    assert state.handle(m.Heartbeat("s0")).num_servers == 1

    # A heartbeat from a server the controller no longer knows asks it to register again.
    reply = state.handle(m.Heartbeat("s1"))
    assert not reply.accepted and "register" in reply.error
    assert state.handle(m.Register("s1", "tcp://127.0.0.1:2", 100, 50)).num_servers == 2
    assert state.handle(m.ViewQuery(5)).version == 4

    # A server back at a new address is a membership change too.
    state.handle(m.Register("s1", "tcp://127.0.0.1:3", 100, 50))
    view = state.handle(m.ViewQuery(6))
    assert view.version == 5 and view.servers["s1"] == "tcp://127.0.0.1:3"
    assert not state.handle(m.Register("", "tcp://127.0.0.1:4", 1, 0)).accepted


def test_namespace_quotas_reach_servers_and_clients():
    state = ControllerState(server_timeout_s=3.0, clock=FakeClock())
    state.handle(m.Register("s0", "tcp://127.0.0.1:1", 100, 0))
    assert state.handle(m.CreateNamespace(1, "tenant-a", 1000)) == m.NamespaceReply(1, ok=True)
    assert state.handle(m.CreateNamespace(2, "tenant-a", 2000)).ok  # an update
    assert not state.handle(m.CreateNamespace(3, "tenant-b", -1)).ok
    assert not state.handle(m.CreateNamespace(4, "", 10)).ok
    assert state.handle(m.Heartbeat("s0")).quotas == {"tenant-a": 2000}
    assert state.handle(m.ViewQuery(5)).quotas == {"tenant-a": 2000}


def request(sock: zmq.Socket, message, timeout_ms: int = 5000):
    sock.send(m.encode(message))
    assert sock.poll(timeout_ms), f"no answer to {message}"
    return m.decode(sock.recv())


def test_controller_process_over_zmq(tmp_path):
    """`meshserve pool controller` with two fake servers and a client on DEALER sockets."""
    address = free_address()
    context = zmq.Context()
    socks = []

    def dealer():
        sock = cluster_auth.client(context.socket(zmq.DEALER))
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        socks.append(sock)
        return sock

    try:
        with pool_processes() as procs:
            procs.append(start_pool(["controller", "--bind", address, "--server-timeout", "1.0"],
                                    tmp_path / "controller.log"))
            s0, s1, client = dealer(), dealer(), dealer()
            assert request(s0, m.Register("s0", "tcp://127.0.0.1:7001", 10, 0), timeout_ms=20000).accepted
            assert request(s1, m.Register("s1", "tcp://127.0.0.1:7002", 10, 0)).num_servers == 2
            view = request(client, m.ViewQuery(1))
            assert set(view.servers) == {"s0", "s1"}
            assert request(client, m.CreateNamespace(2, "tenant", 4096)).ok
            assert request(s1, m.Heartbeat("s1")).quotas == {"tenant": 4096}

            # Only s0 heartbeats from now on: s1 leaves the view and the version goes up.
            def s1_gone():
                assert request(s0, m.Heartbeat("s0")).accepted
                return set(request(client, m.ViewQuery(3)).servers) == {"s0"}

            wait_until(s1_gone, timeout_s=10, what="s1 to leave the view", interval_s=0.2)
            after = request(client, m.ViewQuery(4))
            assert after.version > view.version
            assert request(s0, m.Heartbeat("s0")).num_servers == 1
    finally:
        for sock in socks:
            sock.close(0)
        context.term()


def test_bad_arguments_print_one_line_and_exit_2(capsys):
    for args in (["controller", "--bind", "127.0.0.1:5"],
                 ["controller", "--bind", "tcp://127.0.0.1:5", "--server-timeout", "0"],
                 ["server", "--controller", "tcp://127.0.0.1:5", "--bind", "tcp://127.0.0.1:6", "--dram-gb", "-1"],
                 ["server", "--controller", "tcp://127.0.0.1:5", "--bind", "tcp://127.0.0.1:6", "--dram-gb", "1",
                  "--ssd-dir", "/nonexistent-dir"],
                 ["server", "--bind", "tcp://127.0.0.1:6"],
                 ["stats"]):
        try:
            code = main(["pool", *args])
        except SystemExit as exc:  # argparse's own errors
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2, (args, err)
        assert len(err.strip().splitlines()) == 1, (args, err)
