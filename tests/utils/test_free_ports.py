"""free_tcp_port picks ports that another process's outgoing connection cannot take before the bind."""
from __future__ import annotations

import random
import socket

from meshserve.utils import processes
from meshserve.utils.processes import free_tcp_port


def test_a_picked_port_is_below_the_ephemeral_range_and_bindable():
    start = processes._ephemeral_range_start()
    for _ in range(20):
        port = free_tcp_port()
        assert processes._LOWEST_PICKED_PORT <= port < start
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_a_seeded_random_module_does_not_fix_the_pick():
    picks = set()
    for _ in range(5):
        random.seed(0)
        picks.add(free_tcp_port())
    assert len(picks) > 1


def test_a_port_in_use_is_not_picked(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        choices = iter([taken, taken])
        real = processes._port_picker.randint
        monkeypatch.setattr(processes._port_picker, "randint", lambda a, b: next(choices, None) or real(a, b))
        port = free_tcp_port()
    assert port != taken
