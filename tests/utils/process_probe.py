"""A stand-in for `python -m meshserve.utils.processes` that lets a test read the process's modules.

It runs the entry point exactly as meshserve.utils.processes does, after installing one SIGUSR1 handler:
on the signal it writes the sorted names in `sys.modules` to the file $MESHSERVE_PROBE_OUT (through a
temporary file, so a reader never sees half of it). A test points meshserve.utils.processes.RUNNER_MODULE
here, so the real launch path, the real process and its real imports are what is checked.
"""
from __future__ import annotations

import json
import os
import signal
import sys

OUT_ENV = "MESHSERVE_PROBE_OUT"


def _write_modules(*_) -> None:
    out = os.environ[OUT_ENV]
    with open(out + ".tmp", "w") as f:
        json.dump(sorted(sys.modules), f)
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, _write_modules)
    from meshserve.utils.processes import main

    main(sys.argv)
