"""`meshserve worker --rejoin`: a rank on another host that joins its TE again each time its world ends.

A TE restarts every rank after a failure (a rank that died or hung, a collective error it could not roll back),
and a rank on another host, which the master cannot start, ends with its world. Without a supervisor of its own
(systemd, a pod, a Ray actor) the TE then waits for it in vain. With `--rejoin` the command is that supervisor: it
runs the rank as a child process (a fresh interpreter per world: torch.distributed, the model and the native
kernels start clean) and, when the child ends for any reason but a refused or unanswered join, starts it again
to join the TE's next world. It stops once the TE no longer answers within `rejoin_timeout_s` (the TE stopped)
or refuses the rank; SIGTERM and SIGINT stop the child too.
"""
from __future__ import annotations

import signal
import subprocess
import sys

JOIN_FAILED_EXIT_CODE = 2  # `meshserve worker`'s code when the engine refused the rank or never answered


def run_rejoining(engine: str, rank: int, timeout_s: float, rejoin_timeout_s: float, log_level: str) -> int:
    """The exit code: the first join's failure, or 0 once the TE is gone after at least one world."""
    command = [sys.executable, "-m", "meshserve.entrypoints.cli", "--log-level", log_level, "worker", "--engine",
               engine, "--rank", str(rank)]
    child: subprocess.Popen | None = None

    def stop(signum, frame) -> None:
        if child is not None and child.poll() is None:
            child.terminate()
            child.wait()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    worlds = 0
    while True:
        wait_s = timeout_s if worlds == 0 else rejoin_timeout_s
        child = subprocess.Popen([*command, "--timeout", f"{wait_s:g}"], stdin=subprocess.DEVNULL)
        code = child.wait()
        if code == JOIN_FAILED_EXIT_CODE:
            if worlds == 0:
                return code  # the child said why, in one line
            print(f"meshserve worker: rank {rank} served {worlds} world(s) of the engine at {engine}, which no "
                  f"longer takes it: done", file=sys.stderr)
            return 0
        worlds += 1
        print(f"meshserve worker: rank {rank}'s world {worlds} ended (exit code {code}); joining the next one",
              file=sys.stderr)
