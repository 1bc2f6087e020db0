"""Shared-memory regions of a process killed with SIGKILL are removed by the next allocation on the host."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from meshserve.transfer.shm import allocate_shm_kv_cache

_OWNER = """
import os, sys, torch
from meshserve.transfer.shm import allocate_shm_kv_cache
region = allocate_shm_kv_cache(2, 4, 2, (8,), torch.float32)
print(" ".join(region.shm_names), flush=True)
sys.stdin.read()  # until killed
"""


def test_a_killed_owners_segments_are_swept_by_the_next_allocation():
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        names = owner.stdout.readline().split()
        assert names and all((Path("/dev/shm") / n).exists() for n in names)
    finally:
        # SIGKILL to the owner and its resource tracker at once: nobody is left to unlink the segments
        os.killpg(owner.pid, signal.SIGKILL)
        owner.wait(10)
    assert all((Path("/dev/shm") / n).exists() for n in names)  # leaked
    region = allocate_shm_kv_cache(1, 2, 2, (4,), torch.float32)
    try:
        assert not [n for n in names if (Path("/dev/shm") / n).exists()]
        assert all((Path("/dev/shm") / n).exists() for n in region.shm_names)  # a live owner's stay
    finally:
        region.close()
