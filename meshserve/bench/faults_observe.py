"""What `meshserve bench faults` sees of a deployment while faults are injected: a sampler of every TE's, JE's
and pool server's state (the manager's view, each TE's heartbeat stats, each JE's /health), and what the samples
and the token rate say about a fault (when it was detected, by what, when its targets were whole again, the dip
of the token rate and when it was back)."""
from __future__ import annotations

import threading
import time
from typing import Any

SAMPLE_S = 0.25
BIN_S = 1.0
RECOVERED_SHARE = 0.8  # the token rate counts as back at this share of the reference phase's


class Sampler:
    """Every SAMPLE_S: one flat dict of what the system shows (`observe`), kept with its time."""

    def __init__(self, manager, jes: dict[str, str], pool_client, origin: float) -> None:
        self.manager, self.jes, self.pool_client, self.origin = manager, jes, pool_client, origin
        self.samples: list[tuple[float, dict[str, Any]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-faults-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=1.0) as client:
            while not self._stop.is_set():
                observed = self.observe(client)
                if observed is not None:
                    self.samples.append((time.perf_counter() - self.origin, observed))
                self._stop.wait(SAMPLE_S)

    def observe(self, client) -> dict[str, Any] | None:
        import httpx

        obs: dict[str, Any] = {}
        try:
            status = self.manager.status()
            heartbeats = {name: te.heartbeat for name, te in list(self.manager.tes.items())}
        except RuntimeError:  # the manager's loop changed its tables meanwhile: the next sample
            return None
        for te in status.tes:
            prefix = f"te:{te.name}:"
            obs.update({prefix + "state": te.state, prefix + "pid": te.pid, prefix + "restarts": te.restarts})
            hb = heartbeats.get(te.name)
            if hb is not None:
                for key in ("num_recoveries", "num_rollbacks", "num_migrated", "world_size", "recovering",
                            "healthy", "kv_pull_recomputed", "error"):
                    value = getattr(hb.stats, key, None)
                    if value is not None or key == "recovering":
                        obs[prefix + key] = value
                for link in getattr(hb.stats, "links", None) or ():  # link probing: decode -> prefill paths
                    obs[f"link:{link.decode}:{link.prefill}"] = str(link.state)
        for je in status.jes:
            obs.update({f"je:{je.name}:state": je.state, f"je:{je.name}:pid": je.pid})
        for name, url in self.jes.items():
            try:
                health = client.get(f"{url}/health").json()
            except (httpx.HTTPError, ValueError):
                obs[f"je:{name}:health"] = "unreachable"
                continue
            obs[f"je:{name}:health"] = health.get("status", "?")
            routed = set(health.get("colocated", {}).get("tes", []))
            for group in health.get("disaggregated", {}).get("groups", {}).values():
                routed.update(group.get("prefill", []), group.get("decode", []))
            for te in status.tes:
                obs[f"route:{name}:{te.name}"] = te.name in routed
        if self.pool_client is not None:
            view = self.pool_client.view()
            obs["pool:servers"] = len(view.servers) if view is not None else -1
        return obs

    def window(self, start: float, end: float) -> list[tuple[float, dict]]:
        return [(t, s) for t, s in list(self.samples) if start <= t <= end]

    def latest(self) -> dict[str, Any]:
        return self.samples[-1][1] if self.samples else {}


def _relevant(key: str, targets: list[str]) -> bool:
    """Whether a sampled key tells about one of `targets` (TE or JE names, or "pool")."""
    for target in targets:
        if target == "pool" and key.startswith("pool:"):
            return True
        if key.startswith((f"te:{target}:", f"je:{target}:", f"link:{target}:")) or key.endswith(f":{target}"):
            return True
    return False


def whole(obs: dict[str, Any], targets: list[str], pool_servers: int) -> bool:
    """Whether the targets serve again as before the fault: ready, healthy, routed to by every reachable JE."""
    for key, value in obs.items():
        if not _relevant(key, targets):
            continue
        if key.endswith(":state") and value != "ready":
            return False
        if key.endswith(":recovering") and value:
            return False
        if key.endswith(":healthy") and value is False:
            return False
        if key.endswith(":health") and value != "ok":
            return False
        if key.startswith("route:") and value is False and obs.get(f"je:{key.split(':')[1]}:health") == "ok":
            return False
        if key.startswith("link:") and value == "down":
            return False
        if key == "pool:servers" and value < pool_servers:
            return False
    return True


# when several things change in one sample, the one named as the detection: process state first, stats last
_SIGNAL_ORDER = (":state", ":health", ":pid", ":restarts", "route:", "link:", ":recovering", ":num_recoveries",
                 ":num_rollbacks", "pool:")


def _signal_rank(key: str) -> tuple[int, str]:
    return next((i for i, part in enumerate(_SIGNAL_ORDER) if part in key), len(_SIGNAL_ORDER)), key


def detection(samples: list[tuple[float, dict]], before: dict[str, Any], targets: list[str], t_inject: float,
              pool_servers: int) -> dict[str, Any]:
    """The first sampled change about the targets after the injection, and when they were whole again."""
    detected_at, detected_by = None, None
    for t, obs in samples:
        if t < t_inject:
            continue
        # keys on both sides only: a TE restarting has no heartbeat stats for a while, its state says more
        changed = sorted((k for k in set(obs) & set(before) if _relevant(k, targets) and obs[k] != before[k]),
                         key=_signal_rank)
        if changed:
            key = changed[0]
            detected_at, detected_by = t, f"{key}: {before[key]!r} -> {obs[key]!r}"
            break
    whole_at = None
    if detected_at is not None:
        known: dict[str, Any] = {}  # each key's last value seen: a TE between heartbeats keeps its last link states
        for t, obs in samples:
            known.update(obs)
            if t >= detected_at and whole(known, targets, pool_servers):
                whole_at = t
                break
    return {"detect_s": None if detected_at is None else detected_at - t_inject, "detected_by": detected_by,
            "routable_again_s": None if whole_at is None else whole_at - t_inject,
            "changes": changes(samples, targets, t_inject)}


def changes(samples: list[tuple[float, dict]], targets: list[str], t_inject: float,
            limit: int = 60) -> list[list]:
    """What the sampler saw change about the targets, in order: [seconds from the injection, key, old, new]. A
    key is compared with its last value seen (a TE restarting has no heartbeat stats for a while)."""
    out: list[list] = []
    known: dict[str, Any] = {}
    for t, obs in samples:
        for key in sorted(obs, key=_signal_rank):
            if key in known and _relevant(key, targets) and obs[key] != known[key] and len(out) < limit:
                out.append([round(t - t_inject, 2), key, known[key], obs[key]])
        known.update(obs)
    return out


def throughput_effect(series: list[dict], reference_rate: float, t_inject: float, t_stop: float,
                      bin_s: float = BIN_S) -> dict[str, Any]:
    """The dip of the token rate after the injection (windows of two bins) and when it was back: the start of
    the first window after the lowest one (not overlapping it) whose rate reaches RECOVERED_SHARE of the
    reference."""
    after = [p for p in series if t_inject <= p["t"] <= t_stop]
    if not after or reference_rate <= 0:
        return {"dip": None, "lowest_tokens_per_s": None, "lowest_at_s": None, "throughput_back_s": None}
    rates = [p["tokens_per_s"] for p in after]
    smooth = [(rates[i] + rates[i - 1]) / 2 if i else rates[0] for i in range(len(rates))]
    lowest_at = min(range(len(smooth)), key=smooth.__getitem__)
    lowest = smooth[lowest_at]
    back = None
    if lowest >= RECOVERED_SHARE * reference_rate:
        back = 0.0
    else:  # windows that do not overlap the lowest one: from bin i - 1 on
        for i in range(lowest_at + 2, len(smooth)):
            if smooth[i] >= RECOVERED_SHARE * reference_rate:
                back = max(0.0, after[i - 1]["t"] - bin_s / 2 - t_inject)
                break
    return {"dip": max(0.0, 1 - lowest / reference_rate), "lowest_tokens_per_s": lowest,
            "lowest_at_s": after[lowest_at]["t"] - t_inject, "throughput_back_s": back}
