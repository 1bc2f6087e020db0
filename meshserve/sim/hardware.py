"""Op-level hardware profiles: what one device does per kernel and per link, each figure with its source.

A profile (`meshserve/sim/hardware/<name>.json`) names the device, how many of them its system holds, and per op a
figure measured by a kernel or link micro-benchmark (never a system-level result: those are what the simulator's
output is compared with). The op model (`meshserve/sim/op_model.py`) builds a step's time from them.

Ops, by name:
- `gemm_int8_tflops`, `gemm_bf16_tflops`: achieved GEMM throughput by weight format;
- `attention_tflops`, `hbm_read_gbps`: achieved attention throughput when compute-bound, and HBM read bandwidth
  when memory-bound (weights and KV cache are read at this rate);
- `dispatch`, `combine`: EP all-to-all latency by EP degree (`ep`, `latency_us`) at `tokens_per_rank` tokens;
- `a2e_us`, `e2a_us` (attention-expert disaggregation only): the A2E / E2A latency at `tokens_per_rank`;
- `kv_link_gbps`: one device's bandwidth for a P/D KV pull;
- `step_overhead_ms`: the host's time between two steps;
- `microbatch_compute_share`: the compute share of the attention and the MoE stream when two microbatches overlap;
- `intra_node_link`, `inter_node_link` (tensor parallelism only): one device's collective bandwidth (`gbps`) and a
  message's latency (`latency_us`) inside a node and across nodes;
- `devices_per_node`, `device_memory_gb` (the strategy ranking only): the node's size and a device's memory.
"""
from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path

HARDWARE_DIR = Path(__file__).parent / "hardware"
SCALAR_OPS = ("gemm_int8_tflops", "gemm_bf16_tflops", "attention_tflops", "hbm_read_gbps", "kv_link_gbps",
              "step_overhead_ms")
TABLE_OPS = ("dispatch", "combine")
LINK_OPS = ("intra_node_link", "inter_node_link")
NODE_OPS = ("devices_per_node", "device_memory_gb")
# only a disaggregated deployment needs A2E / E2A, only tensor parallelism the links, only the ranking the node
OPTIONAL_OPS = ("a2e_us", "e2a_us", *LINK_OPS, *NODE_OPS)
REQUIRED_OPS = (*SCALAR_OPS, *TABLE_OPS, "microbatch_compute_share")


class HardwareError(ValueError):
    """A hardware profile that cannot time a step (one line for the user)."""


@dataclass(frozen=True)
class EPTable:
    """An EP collective's latency measured at a few EP degrees, for `tokens_per_rank` tokens per rank."""

    ep: tuple[int, ...]
    latency_us: tuple[float, ...]
    tokens_per_rank: int

    def seconds(self, ep: int, tokens_per_rank: float) -> float:
        """The latency at `ep` (interpolated between the measured degrees, held beyond them), scaled by the tokens
        each rank sends: the micro-benchmarks measure one batch size, and the bytes on the link grow with it."""
        i = bisect.bisect_left(self.ep, ep)
        if i == 0:
            latency = self.latency_us[0]
        elif i == len(self.ep):
            latency = self.latency_us[-1]
        else:
            low, high = self.ep[i - 1], self.ep[i]
            weight = (ep - low) / (high - low)
            latency = self.latency_us[i - 1] + weight * (self.latency_us[i] - self.latency_us[i - 1])
        return 1e-6 * latency * tokens_per_rank / self.tokens_per_rank


@dataclass(frozen=True)
class Link:
    """One device's bandwidth on a link and a message's latency over it."""

    gbps: float
    latency_us: float

    def ring_seconds(self, nbytes: float, degree: int, passes: int = 1) -> float:
        """`passes` ring passes (reduce-scatter or all-gather: 1, all-reduce: 2) of `nbytes` per device among
        `degree` devices: each pass sends (degree - 1) / degree of the bytes in degree - 1 messages."""
        if degree <= 1 or nbytes <= 0:
            return 0.0
        hops = degree - 1
        return passes * (nbytes * hops / degree / (1e9 * self.gbps) + hops * 1e-6 * self.latency_us)


@dataclass(frozen=True)
class Hardware:
    name: str
    device: str
    devices: int  # how many the system holds: a deployment larger than this is refused
    ops: dict  # op name -> its figure (a number, an EPTable, or a pair of shares)
    sources: dict  # op name -> where the figure comes from

    def value(self, op: str):
        if op not in self.ops:
            raise HardwareError(f"hardware profile {self.name!r} has no figure for op {op!r}")
        return self.ops[op]

    def link(self, span: int) -> Link:
        """The link a collective among `span` consecutive devices crosses."""
        per_node = self.value("devices_per_node")
        return self.value("intra_node_link" if span <= per_node else "inter_node_link")

    def check_devices(self, wanted: int) -> None:
        if wanted > self.devices:
            raise HardwareError(f"the deployment needs {wanted} devices; hardware profile {self.name!r} has "
                                f"{self.devices}")

    @classmethod
    def from_dict(cls, data: dict, where: str) -> Hardware:
        if not isinstance(data, dict):
            raise HardwareError(f"{where} is not a JSON object")
        missing = [key for key in ("name", "device", "devices", "ops") if key not in data]
        if missing:
            raise HardwareError(f"{where} lacks {', '.join(missing)}")
        devices = data["devices"]
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise HardwareError(f"{where}: devices must be a positive integer, got {devices!r}")
        raw = data["ops"]
        if not isinstance(raw, dict):
            raise HardwareError(f"{where}: ops must be an object of op name -> figure")
        absent = [op for op in REQUIRED_OPS if op not in raw]
        if absent:
            raise HardwareError(f"{where} is missing op {', '.join(absent)}")
        unknown = sorted(set(raw) - set(REQUIRED_OPS) - set(OPTIONAL_OPS))
        if unknown:
            raise HardwareError(f"{where} has unknown op(s) {', '.join(unknown)}")
        ops, sources = {}, {}
        for op, entry in raw.items():
            if not isinstance(entry, dict) or not str(entry.get("source", "")).strip():
                raise HardwareError(f"{where}: op {op} needs a figure and its source")
            ops[op] = _figure(op, entry, where)
            sources[op] = entry["source"]
        return cls(str(data["name"]), str(data["device"]), devices, ops, sources)

    @classmethod
    def load(cls, name_or_path: str | Path) -> Hardware:
        """A profile by name (`meshserve/sim/hardware/<name>.json`) or by path."""
        path = Path(name_or_path)
        if not path.suffix:
            path = HARDWARE_DIR / f"{name_or_path}.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            known = ", ".join(sorted(p.stem for p in HARDWARE_DIR.glob("*.json")))
            raise HardwareError(f"no hardware profile {name_or_path} (built in: {known})") from None
        except (OSError, ValueError) as exc:
            raise HardwareError(f"cannot read hardware profile {path}: {exc}") from None
        return cls.from_dict(data, where=f"hardware profile {path.name}")


def _figure(op: str, entry: dict, where: str):
    if op in TABLE_OPS:
        try:
            ep = tuple(int(x) for x in entry["ep"])
            latency = tuple(float(x) for x in entry["latency_us"])
            tokens = int(entry["tokens_per_rank"])
        except (KeyError, TypeError, ValueError):
            raise HardwareError(f"{where}: op {op} needs ep, latency_us and tokens_per_rank") from None
        if not ep or len(ep) != len(latency) or list(ep) != sorted(set(ep)) or tokens < 1 \
                or min(ep) < 1 or not min(latency) > 0:
            raise HardwareError(f"{where}: op {op} needs increasing EP degrees with a positive latency each")
        return EPTable(ep, latency, tokens)
    if op in LINK_OPS:
        gbps, latency = entry.get("gbps"), entry.get("latency_us")
        if not (_positive(gbps) and _positive(latency)):
            raise HardwareError(f"{where}: op {op} needs a positive gbps and latency_us")
        return Link(float(gbps), float(latency))
    value = entry.get("value")
    if op == "microbatch_compute_share":
        if not (isinstance(value, list) and len(value) == 2 and all(_positive(v) and v <= 1 for v in value)):
            raise HardwareError(f"{where}: op {op} needs two shares in (0, 1]")
        return tuple(float(v) for v in value)
    if not _positive(value) and not (op == "step_overhead_ms" and value == 0):
        raise HardwareError(f"{where}: op {op} needs a positive value, got {value!r}")
    if op == "devices_per_node":
        if isinstance(value, bool) or not isinstance(value, int):
            raise HardwareError(f"{where}: op {op} needs a whole number of devices, got {value!r}")
        return value
    if op in ("a2e_us", "e2a_us"):
        tokens = entry.get("tokens_per_rank")
        if not _positive(tokens):
            raise HardwareError(f"{where}: op {op} needs tokens_per_rank")
        return EPTable((1,), (float(value),), int(tokens))
    return float(value)


def _positive(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0
