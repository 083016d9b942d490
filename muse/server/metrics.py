"""Prometheus metrics of the server (one registry per app, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from muse.server.messages import EngineStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 120.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("muse_requests", "Finished requests by outcome", ["status"],
                                registry=r)
        self.prompt_tokens = Counter("muse_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("muse_generation_tokens", "Tokens generated",
                                         registry=r)
        self.time_to_first_token = Histogram("muse_time_to_first_token_seconds",
                                             "Time to first token", buckets=LATENCY_BUCKETS,
                                             registry=r)
        self.inter_token_latency = Histogram("muse_inter_token_latency_seconds",
                                             "Time between output tokens",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e_latency = Histogram("muse_e2e_request_latency_seconds",
                                     "Request latency from arrival to last token",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("muse_num_requests_running", "Requests in the running batch",
                             registry=r)
        self.waiting = Gauge("muse_num_requests_waiting", "Requests waiting to be scheduled",
                             registry=r)
        self.kv_usage = Gauge("muse_kv_cache_usage_ratio",
                              "Fraction of KV blocks held by requests", registry=r)
        self.kv_blocks_used = Gauge("muse_kv_cache_blocks_used",
                                    "KV blocks held by requests (cached free blocks excluded)",
                                    registry=r)
        self.prefix_queries = Gauge("muse_prefix_cache_queries_tokens",
                                    "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_hits = Gauge("muse_prefix_cache_hits_tokens",
                                 "Prompt tokens served from the prefix cache", registry=r)
        self.prefix_hit_rate = Gauge("muse_prefix_cache_hit_rate",
                                     "Prefix-cache hits over queries (tokens)", registry=r)
        self.preemptions = Gauge("muse_num_preemptions", "Requests preempted so far",
                                 registry=r)

    def update_engine(self, stats: EngineStats) -> None:
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_usage.set(stats.kv_usage)
        self.kv_blocks_used.set(stats.kv_blocks_used)
        self.prefix_queries.set(stats.prefix_cache_queries)
        self.prefix_hits.set(stats.prefix_cache_hits)
        self.prefix_hit_rate.set(stats.prefix_cache_hits / stats.prefix_cache_queries
                                 if stats.prefix_cache_queries else 0.0)
        self.preemptions.set(stats.num_preemptions)

    def render(self) -> bytes:
        return generate_latest(self.registry)
