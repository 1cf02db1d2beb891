"""``GET /metrics``: the engine's counters and per-request latency histograms for Prometheus.

Names follow vLLM's where they measure the same thing (``vllm:time_to_first_token_seconds``
is ``agentx_time_to_first_token_seconds``). Engine counters are read from
``Engine.stats()`` at scrape time (:class:`EngineStats`: monotonically growing fields are
counters, the rest gauges); latencies are observed when a request ends
(``ChatService.on_finished``). Each app has its own registry, so several servers in one process
do not collide. Uses the maintained ``prometheus_client``; it does not know HTTP.
"""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from agentx.engine.outputs import EngineStats
from agentx.openai.service import ChatService
from agentx.openai.timing import RequestTiming

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_COUNTERS = frozenset(
    {
        "num_steps",
        "num_preemptions",
        "prefix_cache_queries",
        "prefix_cache_query_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_generated_tokens",
        "kv_policy_errors",
        "offload_loaded_blocks",
        "offload_stored_blocks",
        "offload_failed_blocks",
        "offload_num_prefetches",
        "num_draft_tokens",
        "num_accepted_tokens",
        "num_copied_tokens",
    }
)
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240)
_ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.4, 0.8)

# deprecated metric names, still exported with the renamed field's value
_RENAMED = {"num_cached_tokens": ("prefix_cache_hit_tokens", "num_reused_tokens")}


class _EngineCollector(Collector):
    def __init__(self, service: ChatService) -> None:
        self._service = service

    def collect(self):
        engine = self._service.engine
        if engine is None or engine.closed:
            return
        stats = engine.stats()
        for field in dataclasses.fields(EngineStats):
            value = getattr(stats, field.name)
            for key in (field.name, *_RENAMED.get(field.name, ())):
                name = f"agentx_{key}"
                if field.name in _COUNTERS:
                    yield CounterMetricFamily(name, f"engine {key}", value=value)
                else:
                    yield GaugeMetricFamily(name, f"engine {key}", value=value)


class ServerMetrics:
    """The registry of one server; ``observe`` is the service's ``on_finished``."""

    def __init__(self, service: ChatService) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(service))
        labels = ["route"]
        self.ttft = Histogram(
            "agentx_time_to_first_token_seconds",
            "time from accepting a request to its first output token",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "agentx_e2e_request_latency_seconds",
            "time from accepting a request to its end",
            labels,
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "agentx_inter_token_latency_seconds",
            "time between two output tokens of a request",
            labels,
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "agentx_requests", "requests that ended", labels, registry=self.registry
        )
        self.prompt_tokens = Counter(
            "agentx_request_prompt_tokens",
            "prompt tokens of ended requests",
            labels,
            registry=self.registry,
        )
        self.output_tokens = Counter(
            "agentx_request_generation_tokens",
            "output tokens of ended requests",
            labels,
            registry=self.registry,
        )

    def observe(self, timing: RequestTiming) -> None:
        route = timing.route
        self.requests.labels(route).inc()
        self.e2e.labels(route).observe(timing.e2e_s)
        if timing.ttft_s is not None:
            self.ttft.labels(route).observe(timing.ttft_s)
        itl = self.itl.labels(route)
        for gap in timing.inter_token_s:
            itl.observe(gap)
        self.prompt_tokens.labels(route).inc(timing.num_prompt_tokens)
        self.output_tokens.labels(route).inc(timing.num_output_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
