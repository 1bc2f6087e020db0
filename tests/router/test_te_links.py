"""The job executor's link monitors (meshserve/router/te_links.py), without processes."""
from __future__ import annotations

import zmq

from meshserve.router.te_links import TELinkWatch


def test_a_te_registering_again_gets_a_monitor_while_its_dropped_sockets_monitor_lives():
    """A TE that registers again under its name gets a new socket, which takes the file descriptor its dropped
    socket freed; pyzmq's default monitor address is named after that descriptor, still held while the dropped
    socket's monitor waits for the reader to close it ("Address already in use": the TE never registered again
    and the JE's shutdown hung on the socket left open)."""
    ctx = zmq.Context()
    watch = TELinkWatch()
    try:
        for attempt in range(20):  # each TE socket closed (dropped) before the next one is watched
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                watch.watch(sock, "a", f"tcp://127.0.0.1:{1000 + attempt}")
            finally:
                sock.close(0)
        assert watch._new.qsize() == 20
    finally:
        watch.close()
        ctx.term()
