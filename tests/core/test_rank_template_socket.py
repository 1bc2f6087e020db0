"""The rank template's socket: private to its user from the moment it exists, an earlier template's socket
replaced, and any other file at the path left alone with an error."""
from __future__ import annotations

import array
import os
import socket
import stat

import pytest

from meshserve.core.rank_template import FORKSERVER_FDS, _listen, _serve_request


def test_the_socket_is_private_and_replaces_a_stale_one(tmp_path):
    path = tmp_path / "socket"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # what a killed template leaves behind
    listener = _listen(str(path))
    try:
        mode = path.lstat().st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(str(path))  # the new listener, not the stale socket
    finally:
        listener.close()


def test_a_file_that_is_not_a_socket_is_not_deleted(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("keep me")
    with pytest.raises(SystemExit, match="exists and is not a socket"):
        _listen(str(path))
    assert path.read_text() == "keep me"


@pytest.mark.parametrize("message", [b"not json", b"[1, 2]", b"\xff\xfe"])
def test_a_garbage_request_is_dropped_and_its_descriptors_closed(message):
    """No fork for a request that is not a JSON object: the template goes on serving the next one."""
    template_end, master_end = socket.socketpair(socket.AF_UNIX)
    passed = [os.open(os.devnull, os.O_RDONLY) for _ in range(FORKSERVER_FDS)]
    before = set(os.listdir("/proc/self/fd"))
    with template_end, master_end, socket.socket(socket.AF_UNIX) as unused_listener:
        master_end.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", passed))])
        _serve_request(template_end, unused_listener)  # returns, forking nothing
        template_end.close()  # as the template's loop does after each request
        master_end.settimeout(1.0)
        assert master_end.recv(100) == b""  # no pid was sent back
    for fd in passed:
        os.close(fd)
    assert set(os.listdir("/proc/self/fd")) <= before  # the received copies were closed too
