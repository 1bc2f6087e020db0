"""The rank template's socket: private to its user from the moment it exists, an earlier template's socket
replaced, and any other file at the path left alone with an error."""
from __future__ import annotations

import socket
import stat

import pytest

from meshserve.core.rank_template import _listen


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
