"""An exit status says whether a process was stopped on purpose (SIGTERM, handled or not) or crashed: the
engine client restarts a crashed master, never a stopped one."""
from __future__ import annotations

import signal

import pytest

from meshserve.utils.processes import STOPPED_BY_SIGNAL_EXIT_CODE, stopped_on_request


@pytest.mark.parametrize("returncode", [-signal.SIGTERM, STOPPED_BY_SIGNAL_EXIT_CODE])
def test_sigterm_is_a_stop(returncode):
    assert stopped_on_request(returncode)


@pytest.mark.parametrize("returncode", [None, 0, 1, -signal.SIGKILL, -signal.SIGSEGV])
def test_a_crash_or_a_running_process_is_not(returncode):
    assert not stopped_on_request(returncode)
