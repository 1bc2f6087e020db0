"""Deployments of several TEs behind one job executor: the file, the presets, the local launcher.

```yaml
model: models/ds-small          # optional: default is the built-in default model
routing: combined               # round_robin | load | locality | pd_aware | combined
heatmap: pd_heatmap.json        # optional: `meshserve profile pd` output, read by pd_aware / combined
predictor: lengths.safetensors  # optional: `meshserve predictor train` output
engine: {num_kv_blocks: 512}    # settings every TE gets (any EngineConfig field)
te_groups:
  - {group: pd, role: prefill, count: 1, parallel: "attn=TP1+DP1 moe=TP1+EP1"}
  - {group: pd, role: decode, count: 1, engine: {max_num_seqs: 128}}
  - {group: main, role: colocated, count: 2}
job_executors: 1                # JE replicas: frontends on --port, --port+1, ...; every TE registers with all
```

Under the cluster manager (`meshserve cluster up`) a group may also give `min` and `max` TEs (`count` is
where it starts; without an `autoscaler:` mapping only an operator scales it, `meshserve cluster scale`), and
the file an `autoscaler:` mapping (`meshserve.cluster.autoscaler.AutoscalerSettings`; `{}` for the defaults)
and `prewarm: N`, the pre-warmed TE processes kept ready (`meshserve.cluster.warm`). `devices: N` is the
deployment's capacity: the ranks (devices) its TEs may hold at once (absent: no limit); the manager starts no
TE beyond it, and frees a prefill TE's devices to restart a decode TE (`meshserve.cluster.manager`).

`te_groups: []` runs a job executor alone: TEs started elsewhere join it with `meshserve te --register`.

A prefill TE and a decode TE of the same group form P/D pairs (full mesh: any prefill TE of a
group hands off to any decode TE of it). Presets: `colocated`, `colocatedN`, `MpNd` (e.g. `1p1d`,
`2p1d`, `1p2d`) and sums of them joined by `+` (`colocated2+1p1d`). `meshserve serve --deployment
FILE|PRESET` starts every TE as its own processes on this machine (`meshserve te`), waits for them to
register, and serves the OpenAI API through the job executor. Every TE and JE socket authenticates
with the cluster secret (`meshserve.utils.cluster_auth`), which the started TEs inherit.
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
from dataclasses import dataclass, field
from typing import Any

from meshserve.config import CONCERN_OF, ConfigError, EngineConfig, read_deployment_yaml
from meshserve.router.routing import POLICIES
from meshserve.utils import cluster_auth
from meshserve.utils.processes import launch

logger = logging.getLogger(__name__)

_TOP_KEYS = {"model", "routing", "heatmap", "predictor", "engine", "te_groups", "job_executors", "name",
             "description", "autoscaler", "prewarm", "devices"}
_GROUP_KEYS = {"group", "role", "count", "model", "parallel", "engine", "min", "max"}
_ROLES = ("colocated", "prefill", "decode")
_PD_PRESET = re.compile(r"^(\d+)p(\d+)d$")
_COLOCATED_PRESET = re.compile(r"^colocated(\d*)$")


@dataclass(frozen=True)
class TEGroupSpec:
    group: str
    role: str
    count: int = 1
    model: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)  # includes "parallel" when given
    min_count: int | None = None  # the cluster manager's scaling range (default: count, no scaling)
    max_count: int | None = None

    @property
    def pool(self) -> str:
        """The scaling unit: one role of one group ("GROUP/ROLE")."""
        return f"{self.group}/{self.role}"

    @property
    def bounds(self) -> tuple[int, int]:
        return (self.count if self.min_count is None else self.min_count,
                self.count if self.max_count is None else self.max_count)


@dataclass(frozen=True)
class TESpec:
    """One TE to start: its name, role, group and engine settings."""

    name: str
    role: str
    group: str
    model: str | None
    engine: dict[str, Any]


@dataclass(frozen=True)
class MultiDeployment:
    groups: list[TEGroupSpec]
    model: str | None = None
    routing: str = "round_robin"
    heatmap: str | None = None
    predictor: str | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    job_executors: int = 1  # JE replicas (frontends); every TE registers with each
    autoscaler: dict[str, Any] | None = None  # the cluster manager's scaling policy (None: no autoscaling)
    prewarm: int = 0  # pre-warmed TE processes the cluster manager keeps ready
    devices: int | None = None  # the ranks its TEs may hold at once, all pools together (None: no limit)

    def tes(self) -> list[TESpec]:
        out = []
        for spec in self.groups:
            for i in range(spec.count):
                name = f"{spec.group}-{spec.role}-{i}"
                out.append(TESpec(name, spec.role, spec.group, spec.model or self.model,
                                  {**self.engine, **spec.engine, "te_name": name}))
        return out

    def waiting_room(self, overrides: dict[str, Any] | None = None) -> int:
        """The requests its TEs may hold waiting, counted where a request waits first: the `max_waiting` of
        its colocated and prefill TEs summed (a decode TE takes only what a prefill TE hands it), each group
        at the most TEs the cluster manager may scale it to (a group scaled to zero still takes requests)."""
        room = 0
        for spec in self.groups:
            if spec.role != "decode":
                engine = {**self.engine, **spec.engine, **(overrides or {})}
                room += max(spec.bounds) * EngineConfig.from_kwargs("", **engine).scheduler_config.max_waiting
        return room

    def role_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for spec in self.groups:
            counts[spec.role] = counts.get(spec.role, 0) + spec.count
        return counts

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_dict(cls, data: Any, source: str = "deployment") -> MultiDeployment:
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping at the top level")
        unknown = sorted(set(data) - _TOP_KEYS)
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {', '.join(unknown)}")
        engine = _engine_settings(data.get("engine"), f"{source}: engine")
        routing = data.get("routing", "round_robin")
        if routing not in POLICIES:
            raise ConfigError(f"{source}: routing must be one of {', '.join(POLICIES)}, got {routing!r}")
        raw_groups = data.get("te_groups")
        if not isinstance(raw_groups, list):
            raise ConfigError(f"{source}: te_groups must be a list of TE groups")
        groups = [_group(g, f"{source}: te_groups[{i}]") for i, g in enumerate(raw_groups)]
        for name in {g.group for g in groups}:
            roles = {g.role for g in groups if g.group == name}
            if ("prefill" in roles) != ("decode" in roles):
                raise ConfigError(f"{source}: group {name!r} needs both prefill and decode TEs to form P/D pairs")
            if "colocated" in roles and len(roles) > 1:
                raise ConfigError(f"{source}: group {name!r} mixes colocated and P/D TEs; give them separate groups")
        for key in ("model", "heatmap", "predictor"):
            if data.get(key) is not None and not isinstance(data[key], str):
                raise ConfigError(f"{source}: {key!r} must be a path")
        job_executors = data.get("job_executors", 1)
        if not isinstance(job_executors, int) or job_executors < 1:
            raise ConfigError(f"{source}: job_executors must be a positive integer, got {job_executors!r}")
        autoscaler = data.get("autoscaler")
        if autoscaler is not None and not isinstance(autoscaler, dict):
            raise ConfigError(f"{source}: autoscaler must be a mapping of scaling settings")
        prewarm = data.get("prewarm", 0)
        if not isinstance(prewarm, int) or prewarm < 0:
            raise ConfigError(f"{source}: prewarm must be a non-negative integer, got {prewarm!r}")
        devices = data.get("devices")
        if devices is not None and (not isinstance(devices, int) or isinstance(devices, bool) or devices < 1):
            raise ConfigError(f"{source}: devices must be a positive integer, got {devices!r}")
        pools = [g.pool for g in groups]
        if len(set(pools)) != len(pools):
            raise ConfigError(f"{source}: each role of a group is given once (repeated: "
                              f"{', '.join(sorted({p for p in pools if pools.count(p) > 1}))})")
        return cls(groups=groups, model=data.get("model"), routing=routing, heatmap=data.get("heatmap"),
                   predictor=data.get("predictor"), engine=engine, job_executors=job_executors,
                   autoscaler=None if autoscaler is None else dict(autoscaler), prewarm=prewarm, devices=devices)

    @classmethod
    def load(cls, path: str) -> MultiDeployment:
        return cls.from_dict(read_deployment_yaml(path), path)

    @classmethod
    def preset(cls, name: str) -> MultiDeployment:
        groups = []
        for part in name.split("+"):
            pd = _PD_PRESET.match(part)
            colocated = _COLOCATED_PRESET.match(part)
            if pd:
                num_p, num_d = int(pd.group(1)), int(pd.group(2))
                if num_p < 1 or num_d < 1:
                    raise ConfigError(f"preset {part!r}: need at least one prefill and one decode TE")
                groups += [TEGroupSpec("pd", "prefill", num_p), TEGroupSpec("pd", "decode", num_d)]
            elif part == "none":  # a job executor alone: TEs join it with `meshserve te --register`
                continue
            elif colocated:
                count = int(colocated.group(1) or 1)
                if count < 1:
                    raise ConfigError(f"preset {part!r}: need at least one TE")
                groups.append(TEGroupSpec("main", "colocated", count))
            else:
                raise ConfigError(f"unknown deployment preset {part!r}: use colocated, colocatedN or MpNd "
                                  "(e.g. 1p1d), joined by + (e.g. colocated2+1p1d)")
        return cls(groups=groups)


def _engine_settings(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping of engine settings")
    names = set(CONCERN_OF) - {"model", "te_name", "kv_transfer"}
    bad = sorted(set(value) - names)
    if bad:
        raise ConfigError(f"{where}: unknown engine setting(s) {', '.join(bad)}")
    try:
        EngineConfig.from_kwargs("", **value)
    except (TypeError, ConfigError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return dict(value)


def _group(data: Any, where: str) -> TEGroupSpec:
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping")
    unknown = sorted(set(data) - _GROUP_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}")
    role = data.get("role")
    if role not in _ROLES:
        raise ConfigError(f"{where}: role must be one of {', '.join(_ROLES)}, got {role!r}")
    count = data.get("count", 1)
    if not isinstance(count, int) or count < 0:
        raise ConfigError(f"{where}: count must be a non-negative integer, got {count!r}")
    group = data.get("group", role)
    if not isinstance(group, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", group):
        raise ConfigError(f"{where}: group must be a name of letters, digits, '-', '_' or '.', got {group!r}")
    engine = dict(data.get("engine") or {})
    if "parallel" in data:
        engine["parallel"] = data["parallel"]
    engine = _engine_settings(engine, where)
    bounds = {}
    for key in ("min", "max"):
        value = data.get(key)
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ConfigError(f"{where}: {key} must be a non-negative integer, got {value!r}")
        bounds[key] = value
    low = count if bounds["min"] is None else bounds["min"]
    high = count if bounds["max"] is None else bounds["max"]
    if not low <= count <= high:
        raise ConfigError(f"{where}: need min <= count <= max, got min {low}, count {count}, max {high}")
    return TEGroupSpec(group, role, count, data.get("model"), engine, bounds["min"], bounds["max"])


def is_multi_te(deployment: str) -> bool:
    """Whether --deployment names a preset or a file with TE groups (else: a one-TE deployment file)."""
    if not os.path.exists(deployment):
        return True  # a preset (an unknown name is reported by MultiDeployment.preset)
    # start-up: yaml only when a deployment file is read
    import yaml

    try:
        with open(deployment) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return False  # Deployment.load reports it
    return isinstance(data, dict) and "te_groups" in data


def load_multi(deployment: str) -> MultiDeployment:
    return MultiDeployment.load(deployment) if os.path.exists(deployment) else MultiDeployment.preset(deployment)


def check_pd_layouts(tes: list[TESpec], configs: list[EngineConfig]) -> None:
    """Refuse P/D groups whose prefill and decode attention TP differ on a model without MLA.

    With MLA every attention TP rank holds the whole latent cache, so any layout can pull from any other
    (cloudmatrix-infer §4.3.3); with GQA each TP rank holds its share of the KV heads, and a decode rank
    would need parts from several prefill ranks."""
    # keeps torch out of the router process
    from meshserve.models.loader import load_hf_config

    layouts: dict[str, set[tuple[int, str]]] = {}
    for spec, config in zip(tes, configs):
        if spec.role != "colocated":
            layouts.setdefault(spec.group, set()).add((config.parallel_config.strategy.attn_tp,
                                                       config.model_config.model))
    for group, pairs in sorted(layouts.items()):
        if len({tp for tp, _ in pairs}) < 2:
            continue
        for model in sorted({model for _, model in pairs}):
            try:
                mla = load_hf_config(model).get("kv_lora_rank") is not None
            except (FileNotFoundError, ValueError):
                continue  # the TE reports a missing model itself, in one line
            if not mla:
                tps = ", ".join(str(tp) for tp in sorted({tp for tp, _ in pairs}))
                raise ConfigError(f"group {group!r}: prefill and decode TEs use attention TP {tps}, but {model} "
                                  f"has no MLA latent cache; with GQA the KV heads are split by TP rank, so "
                                  f"prefill and decode need the same attention TP")


# ---------------------------------------------------------------------- local launcher
def launch_tes(tes: list[TESpec], default_model: str, register_addrs: list[str], overrides: dict[str, Any],
               log_level: int, host: str = "127.0.0.1") -> list[subprocess.Popen]:
    """Start each TE as `meshserve te` processes on this machine; they register with every JE address.

    The machine's cores (less one) are shared among all the TEs' ranks unless num_threads is set."""
    total_ranks = sum(EngineConfig.from_kwargs("", **{**spec.engine, **overrides}).parallel_config.world_size
                      for spec in tes)
    # one core is left to the TEs' masters and the job executor, which run beside the ranks
    threads = max(1, ((os.cpu_count() or 1) - 1) // max(1, total_ranks))
    configs = [EngineConfig.from_kwargs(spec.model or default_model,  # validated before any start
                                        **{"num_threads": threads, **spec.engine, **overrides, "te_name": spec.name})
               for spec in tes]
    check_pd_layouts(tes, configs)
    # the TEs inherit this process's secret (its file or environment); a bad one is reported once, here
    cluster_auth.cluster_secret()
    procs = []
    for spec, config in zip(tes, configs):
        procs.append(launch("te", config=config.to_dict(), role=spec.role, group=spec.group,
                            listen=f"tcp://{host}:0", register=list(register_addrs), log_level=log_level,
                            watch_parent=True))
    return procs
