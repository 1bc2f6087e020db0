"""Prometheus metrics of one API server: request latencies measured here, engine state mirrored at scrape time,
and per tenant (an API key's hash or a client address, never a key) requests, rejections and tokens."""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from meshserve.engine.outputs import RequestOutput
from meshserve.entrypoints.openai.tenant_limits import current_ticket
from meshserve.wire.client import EngineStats
from meshserve.wire.kv import LinkState, LinkStatus
from meshserve.wire.receive import dropped_frames

logger = logging.getLogger(__name__)

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 600.0)
# finish reasons of a request that completed as asked (not aborted, not failed)
_SUCCESS_REASONS = ("stop", "length")
STATS_TIMEOUT_S = 5.0
# distinct tenant labels kept; later tenants share one label (client addresses are unbounded without keys)
MAX_TENANT_LABELS = 1000
OTHER_TENANTS = "other"


class TokenRateWindow:
    """Generated tokens per second over the last `window_s` seconds."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._events: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, num_tokens: int, now: float) -> None:
        self._events.append((now, num_tokens))
        self._drop_before(now - self.window_s)

    def rate(self, now: float) -> float:
        self._drop_before(now - self.window_s)
        return sum(n for _, n in self._events) / self.window_s

    def _drop_before(self, horizon: float) -> None:
        while self._events and self._events[0][0] < horizon:
            self._events.popleft()


class _EngineStatsCollector(Collector):
    """Gauges and counters read from the latest engine stats snapshot (refreshed before each scrape)."""

    def __init__(self, token_rate: TokenRateWindow) -> None:
        self.stats = EngineStats()
        self._token_rate = token_rate

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        yield GaugeMetricFamily("meshserve_num_requests_running", "Requests the engine is running.", s.num_running)
        yield GaugeMetricFamily("meshserve_num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield GaugeMetricFamily("meshserve_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use.", s.kv_usage)
        yield GaugeMetricFamily("meshserve_prefix_cache_hit_rate",
                                "Prompt tokens found in the prefix cache / tokens looked up, since start.", hit_rate)
        yield GaugeMetricFamily("meshserve_generation_tokens_per_second",
                                f"Generated tokens per second over the last {self._token_rate.window_s:g} s.",
                                self._token_rate.rate(time.monotonic()))
        yield CounterMetricFamily("meshserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  s.prefix_cache_queries)
        yield CounterMetricFamily("meshserve_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  s.prefix_cache_hits)
        yield from _spec_decode_metrics(s)
        yield from _link_metrics(s.links)
        # this process's sockets and the engine master's (its socket names differ from ours)
        dropped = CounterMetricFamily("meshserve_dropped_frames", "Bad frames internal sockets dropped, by socket.",
                                      labels=["socket"])
        for socket_name, count in sorted({**s.dropped_frames, **dropped_frames()}.items()):
            dropped.add_metric([socket_name], count)
        yield dropped


def _link_metrics(links: list[LinkStatus]) -> Iterator[Metric]:
    """Link probing (xdeepserve §6.1): each decode TE's KV link from each prefill TE it pulls from."""
    labels = ["decode", "prefill"]
    state = GaugeMetricFamily("meshserve_kv_link_state", "1 for the KV link's state (ok, saturated, down), else 0.",
                              labels=[*labels, "state"])
    rtt = GaugeMetricFamily("meshserve_kv_link_rtt_seconds", "Round trip of the link's last probe.", labels=labels)
    failing = GaugeMetricFamily("meshserve_kv_link_consecutive_probe_failures",
                                "Probes of the link failed in a row.", labels=labels)
    probes = CounterMetricFamily("meshserve_kv_link_probes", "Probes of the link, since start.", labels=labels)
    probe_failures = CounterMetricFamily("meshserve_kv_link_probe_failures", "Probes of the link that failed.",
                                         labels=labels)
    pull_failures = CounterMetricFamily("meshserve_kv_link_pull_failures", "KV pulls over the link that failed.",
                                        labels=labels)
    slow_pulls = CounterMetricFamily("meshserve_kv_link_slow_pulls", "KV pulls over the link that stalled.",
                                     labels=labels)
    for link in links:
        names = [link.decode, link.prefill]
        for value in LinkState:
            state.add_metric([*names, value.value], float(link.state is value))
        rtt.add_metric(names, link.rtt_s)
        failing.add_metric(names, link.consecutive_failures)
        probes.add_metric(names, link.probes)
        probe_failures.add_metric(names, link.probe_failures)
        pull_failures.add_metric(names, link.pull_failures)
        slow_pulls.add_metric(names, link.slow_pulls)
    yield from (state, rtt, failing, probes, probe_failures, pull_failures, slow_pulls)


def _spec_decode_metrics(s: EngineStats) -> Iterator[Metric]:
    """Speculative decoding (MTP): accepted tokens per verifying step and acceptance per draft position."""
    yield CounterMetricFamily("meshserve_spec_decode_verify_steps",
                              "Decode steps (per request) that verified drafts, since start.", s.spec_verify_steps)
    yield CounterMetricFamily("meshserve_spec_decode_tokens",
                              "Tokens produced by decode steps that verified drafts, since start.", s.spec_tokens)
    yield GaugeMetricFamily("meshserve_spec_decode_tokens_per_step",
                            "Tokens per verifying decode step (accepted drafts + 1), since start.",
                            s.spec_tokens / s.spec_verify_steps if s.spec_verify_steps else 0.0)
    drafted = CounterMetricFamily("meshserve_spec_decode_draft_tokens", "Drafts verified, by draft position.",
                                  labels=["position"])
    accepted = CounterMetricFamily("meshserve_spec_decode_accepted_tokens", "Drafts accepted, by draft position.",
                                   labels=["position"])
    rate = GaugeMetricFamily("meshserve_spec_decode_acceptance_rate",
                             "Accepted / verified drafts by draft position, since start.", labels=["position"])
    for position, (num_drafted, num_accepted) in enumerate(zip(s.spec_drafted, s.spec_accepted)):
        drafted.add_metric([str(position)], num_drafted)
        accepted.add_metric([str(position)], num_accepted)
        rate.add_metric([str(position)], num_accepted / num_drafted if num_drafted else 0.0)
    yield from (drafted, accepted, rate)


class TenantMetrics:
    """Requests admitted, requests refused by reason and tokens used, per tenant."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("meshserve_tenant_requests", "Requests admitted, by tenant.", ["tenant"],
                                registry=registry)
        self.rejected = Counter("meshserve_tenant_rejected", "Requests refused over a tenant limit, by reason.",
                                ["tenant", "reason"], registry=registry)
        self.tokens = Counter("meshserve_tenant_tokens", "Tokens used, by tenant and kind (prompt, generation).",
                              ["tenant", "kind"], registry=registry)
        self._labels: set[str] = set()

    def label(self, tenant: str) -> str:
        if tenant not in self._labels and len(self._labels) >= MAX_TENANT_LABELS:
            return OTHER_TENANTS
        self._labels.add(tenant)
        return tenant

    def count_request(self, tenant: str) -> None:
        self.requests.labels(tenant=self.label(tenant)).inc()

    def count_rejected(self, tenant: str, reason: str) -> None:
        self.rejected.labels(tenant=self.label(tenant), reason=reason).inc()

    def count_tokens(self, tenant: str, prompt_tokens: int, generation_tokens: int) -> None:
        label = self.label(tenant)
        self.tokens.labels(tenant=label, kind="prompt").inc(prompt_tokens)
        self.tokens.labels(tenant=label, kind="generation").inc(generation_tokens)


class ServerMetrics:
    """All metrics of one app, in a registry of its own (several apps can live in one process)."""

    def __init__(self, rate_window_s: float = 10.0) -> None:
        self.registry = CollectorRegistry()
        self.time_to_first_token = Histogram(
            "meshserve_time_to_first_token_seconds", "Time from arrival to the first generated token.",
            buckets=_TTFT_BUCKETS, registry=self.registry)
        self.time_per_output_token = Histogram(
            "meshserve_time_per_output_token_seconds", "Mean time between output tokens, per request.",
            buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e_request_latency = Histogram(
            "meshserve_e2e_request_latency_seconds", "Time from arrival to the last token.",
            buckets=_E2E_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("meshserve_prompt_tokens", "Prompt tokens prefilled.", registry=self.registry)
        self.generation_tokens = Counter("meshserve_generation_tokens", "Tokens generated.", registry=self.registry)
        self.request_success = Counter("meshserve_request_success", "Completions finished as asked, by reason.",
                                       ["finish_reason"], registry=self.registry)
        self.http_rejected = Counter("meshserve_http_rejected", "Requests turned away before a handler, by reason.",
                                     ["reason"], registry=self.registry)
        self.tenants = TenantMetrics(self.registry)
        self.token_rate = TokenRateWindow(rate_window_s)
        self._engine_stats = _EngineStatsCollector(self.token_rate)
        self.registry.register(self._engine_stats)

    def track(self, arrival_time: float) -> RequestTracker:
        """A tracker for one engine request; `arrival_time` is on the time.monotonic() clock."""
        return RequestTracker(self, arrival_time)

    def count_rejected(self, reason: str) -> None:
        self.http_rejected.labels(reason=reason).inc()

    def update_engine_stats(self, stats: EngineStats) -> None:
        self._engine_stats.stats = stats

    async def refresh(self, get_stats) -> None:
        """Pull engine stats for the next scrape; on failure the previous snapshot stays."""
        try:
            self.update_engine_stats(await asyncio.wait_for(get_stats(), timeout=STATS_TIMEOUT_S))
        except Exception as exc:  # a dead or slow engine must not break /metrics
            logger.warning("could not read engine stats for /metrics: %s", exc)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTracker:
    """Feeds one engine request's outputs into the latency histograms and token counters, and the tokens into
    the tenant's ticket of the request it serves (its token budget is settled with them)."""

    def __init__(self, metrics: ServerMetrics, arrival_time: float) -> None:
        self._metrics = metrics
        self._arrival_time = arrival_time
        self._first_token_time: float | None = None
        self._ticket = current_ticket()  # built in the request's task, where its ticket is current

    def observe(self, output: RequestOutput, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        new_tokens = sum(len(c.token_ids_delta) for c in output.outputs)
        if new_tokens:
            self._metrics.generation_tokens.inc(new_tokens)
            self._metrics.token_rate.add(new_tokens, now)
            if self._first_token_time is None:
                self._first_token_time = now
                self._metrics.prompt_tokens.inc(len(output.prompt_token_ids))
                self._metrics.time_to_first_token.observe(now - self._arrival_time)
                self._count_for_tenant(len(output.prompt_token_ids), 0)
            self._count_for_tenant(0, new_tokens)
        if output.finished and output.error is None:
            self._on_finished(output, now)

    def _count_for_tenant(self, prompt_tokens: int, generation_tokens: int) -> None:
        if self._ticket is not None:
            self._ticket.add_usage(prompt_tokens, generation_tokens)

    def _on_finished(self, output: RequestOutput, now: float) -> None:
        m = self._metrics
        succeeded = [c.finish_reason for c in output.outputs if c.finish_reason in _SUCCESS_REASONS]
        if not succeeded:
            return
        for reason in succeeded:
            m.request_success.labels(finish_reason=reason).inc()
        m.e2e_request_latency.observe(now - self._arrival_time)
        longest = max(len(c.token_ids) for c in output.outputs)
        if self._first_token_time is not None and longest > 1:
            m.time_per_output_token.observe((now - self._first_token_time) / (longest - 1))
