"""Every environment variable meshserve reads: its name, default and meaning, and a typed accessor.

Code reads the environment through these accessors only (a test holds every other module to it), and
docs/serving.md's "Environment variables" section lists `ENV_VARS`. Each accessor reads the environment when
called, so a variable set after start-up (a test's monkeypatch, `--cluster-secret-file`) is seen. Setting a
variable for child processes to inherit is not reading and stays where it happens.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None  # None: unset unless the environment sets it
    meaning: str

    def get(self, environ: Mapping[str, str] | None = None) -> str | None:
        return (os.environ if environ is None else environ).get(self.name, self.default)

    @contextlib.contextmanager
    def set_to(self, value: str) -> Iterator[None]:
        """This variable set to `value` for the processes started meanwhile to inherit, as it was afterwards."""
        before = os.environ.get(self.name)
        os.environ[self.name] = value
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(self.name, None)
            else:
                os.environ[self.name] = before


MESHSERVE_API_KEY = EnvVar(
    "MESHSERVE_API_KEY", None,
    "API key(s) the HTTP server requires, comma-separated for several (what `--api-key` gives); "
    "keeps the keys out of the process listing")
MESHSERVE_ADMIN_KEY = EnvVar(
    "MESHSERVE_ADMIN_KEY", None,
    "the key guarding `/admin/*` and the context-cache listing; `meshserve eplb` sends it too")
MESHSERVE_CLUSTER_SECRET = EnvVar(
    "MESHSERVE_CLUSTER_SECRET", None,
    "the cluster secret every internal TCP socket authenticates with, given directly")
MESHSERVE_CLUSTER_SECRET_FILE = EnvVar(
    "MESHSERVE_CLUSTER_SECRET_FILE", None,
    "a file holding the cluster secret (`--cluster-secret-file` sets it for the processes it starts)")
MESHSERVE_CACHE = EnvVar(
    "MESHSERVE_CACHE", "~/.cache/meshserve",
    "where generated models and the default cluster secret file live")
MESHSERVE_CPU_KERNELS = EnvVar(
    "MESHSERVE_CPU_KERNELS", "1",
    "0 turns the native CPU kernels off (the torch path runs instead)")
MESHSERVE_FUSED_DECODE = EnvVar(
    "MESHSERVE_FUSED_DECODE", "1",
    "0 runs decode steps layer by layer in Python ops instead of the fused native layer ops")
MESHSERVE_INT8_KV_SCORES = EnvVar(
    "MESHSERVE_INT8_KV_SCORES", "1",
    "0 keeps the INT8 KV cache's decode scores in float32 (by default they are integer dot products with an "
    "int8 query where the CPU has AVX512-VNNI)")
MASTER_ADDR = EnvVar(
    "MASTER_ADDR", None,
    "`meshserve worker`: the master's host when `--engine` is not given (torch's name for it)")
RANK = EnvVar(
    "RANK", None,
    "`meshserve worker`: this worker's rank when `--rank` is not given (torch's name for it)")
MESHSERVE_NUM_THREADS = EnvVar(
    "MESHSERVE_NUM_THREADS", None,
    "torch threads of each rank of a TE started without `--num-threads` (default: this host's cores shared "
    "among the TE's ranks); for hosts that run several TEs side by side")
MESHSERVE_RANK_TEMPLATE = EnvVar(
    "MESHSERVE_RANK_TEMPLATE", None,
    "the unix socket of this host's rank template (`meshserve rank-template`): each TE's forkserver is forked "
    "from it, torch already imported, instead of started anew (about 5 s of CPU a TE start)")
MESHSERVE_HOST_ID = EnvVar(
    "MESHSERVE_HOST_ID", None,
    "the host a rank counts itself on when self-contained DP groups span hosts: ranks of one host meet on the "
    "step board through their host's lowest rank (default: the hostname and the kernel's boot id)")
MESHSERVE_FAULTS = EnvVar(
    "MESHSERVE_FAULTS", None,
    "tests and benchmarks only: faults to inject, `kind:key=value:...;...` (see meshserve/utils/faults.py); "
    "every process started under it reads it")
MESHSERVE_FAULT_INJECTION = EnvVar(
    "MESHSERVE_FAULT_INJECTION", None,
    "tests and benchmarks only: 1 opens `POST /admin/faults` (what `--enable-fault-injection` does)")

MESHSERVE_EMULATED_LINK_LATENCY_MS = EnvVar(
    "MESHSERVE_EMULATED_LINK_LATENCY_MS", None,
    "benchmarks only: each expert-parallel dispatch and combine takes at least this long from its launch (ms), "
    "standing in for a slower link than loopback; what overlaps it hides it (also A2E and E2A, meshserve/moe/a2e.py)")
MESHSERVE_A2E_TIMELINE = EnvVar(
    "MESHSERVE_A2E_TIMELINE", None,
    "benchmarks only: each rank of a disaggregated layout records when its MoE layers wait on the expert ranks "
    "(attention ranks) or serve a DP domain (expert ranks) and writes a window of them to <value>-rank<N>.json")
MESHSERVE_NULL_MODEL_MS = EnvVar(
    "MESHSERVE_NULL_MODEL_MS", None,
    "benchmarks only: every rank runs without a model (worker/null_runner.py), each forward taking this long "
    "(ms, 0: none) and making up its tokens, so what a step costs beyond it is the control plane around the model")
ENV_VARS: tuple[EnvVar, ...] = (
    MESHSERVE_API_KEY, MESHSERVE_ADMIN_KEY, MESHSERVE_CLUSTER_SECRET, MESHSERVE_CLUSTER_SECRET_FILE,
    MESHSERVE_CACHE, MESHSERVE_CPU_KERNELS, MESHSERVE_FUSED_DECODE, MESHSERVE_INT8_KV_SCORES, MESHSERVE_NUM_THREADS,
    MESHSERVE_RANK_TEMPLATE,
    MASTER_ADDR, RANK, MESHSERVE_HOST_ID,
    MESHSERVE_FAULTS, MESHSERVE_FAULT_INJECTION, MESHSERVE_EMULATED_LINK_LATENCY_MS, MESHSERVE_A2E_TIMELINE,
    MESHSERVE_NULL_MODEL_MS,
)


def fault_injection_enabled(environ: Mapping[str, str] | None = None) -> bool:
    return (MESHSERVE_FAULT_INJECTION.get(environ) or "") not in ("", "0")


def api_keys(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    return tuple(k.strip() for k in (MESHSERVE_API_KEY.get(environ) or "").split(",") if k.strip())


def admin_key(environ: Mapping[str, str] | None = None) -> str | None:
    return MESHSERVE_ADMIN_KEY.get(environ) or None


def cluster_secret() -> str | None:
    return MESHSERVE_CLUSTER_SECRET.get()


def cluster_secret_file() -> str | None:
    return MESHSERVE_CLUSTER_SECRET_FILE.get()


def cache_dir() -> Path:
    return Path(MESHSERVE_CACHE.get() or MESHSERVE_CACHE.default).expanduser()


def cpu_kernels_enabled() -> bool:
    return MESHSERVE_CPU_KERNELS.get() != "0"


def fused_decode_enabled() -> bool:
    return MESHSERVE_FUSED_DECODE.get() != "0"


def int8_kv_scores_enabled() -> bool:
    return MESHSERVE_INT8_KV_SCORES.get() != "0"


def num_threads() -> int | None:
    """MESHSERVE_NUM_THREADS as a positive count; None where unset. ValueError names a bad value."""
    text = MESHSERVE_NUM_THREADS.get()
    if text is None or not text.strip():
        return None
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"MESHSERVE_NUM_THREADS must be a positive integer, got {text!r}")
    return int(text)


def emulated_link_latency_s() -> float:
    """MESHSERVE_EMULATED_LINK_LATENCY_MS in seconds (0 where unset); ValueError names a bad value."""
    seconds = _milliseconds_as_seconds(MESHSERVE_EMULATED_LINK_LATENCY_MS)
    return 0.0 if seconds is None else seconds


def _milliseconds_as_seconds(var: EnvVar) -> float | None:
    """A variable that holds milliseconds, in seconds (None where unset); ValueError names a bad value."""
    text = (var.get() or "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{var.name} must be a number of milliseconds >= 0, got {text!r}")
    return value / 1e3


def rank_template_socket() -> str | None:
    return MESHSERVE_RANK_TEMPLATE.get() or None


def master_addr() -> str | None:
    return MASTER_ADDR.get() or None


def host_id() -> str | None:
    return MESHSERVE_HOST_ID.get() or None


def rank() -> int | None:
    """RANK as a number; None when unset or not a non-negative integer."""
    value = (RANK.get() or "").strip()
    return int(value) if value.isdigit() else None


def markdown_table() -> str:
    """The table of ENV_VARS in docs/serving.md (a test checks the page against it)."""
    rows = [f"| `{v.name}` | {f'`{v.default}`' if v.default is not None else 'unset'} | {v.meaning} |"
            for v in ENV_VARS]
    return "\n".join(["| variable | default | meaning |", "| --- | --- | --- |", *rows])


def a2e_timeline() -> str | None:
    """MESHSERVE_A2E_TIMELINE: where ranks write their A2E timeline (None: they record none)."""
    return MESHSERVE_A2E_TIMELINE.get() or None


def null_model_s() -> float | None:
    """MESHSERVE_NULL_MODEL_MS in seconds: None (unset) runs the model; ValueError names a bad value."""
    return _milliseconds_as_seconds(MESHSERVE_NULL_MODEL_MS)
