"""Prometheus metrics of the server (one registry per app, so tests can run several).

Where vLLM has a metric for the same thing, it has vLLM's name, type and `model_name` label,
so dashboards built for vLLM work unchanged. The rest are `muse_*`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from muse.multimodal.encoder_cache import (METRIC_CAPACITY_BYTES, METRIC_ENTRIES,
                                           METRIC_EVICTIONS, METRIC_HITS, METRIC_MISSES,
                                           METRIC_USAGE_BYTES)
from muse.server.messages import EngineStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 120.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000, 200000, 500000, 1000000)


class ServerMetrics:
    def __init__(self, model_name: str = "") -> None:
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        model = ["model_name"]

        def counter(name: str, text: str, labels: list[str] = model) -> Counter:
            return Counter(name, text, labels, registry=r)

        def gauge(name: str, text: str) -> Gauge:
            return Gauge(name, text, model, registry=r).labels(model_name)

        def histogram(name: str, text: str, buckets: tuple) -> Histogram:
            return Histogram(name, text, model, buckets=buckets, registry=r).labels(model_name)

        # Every HTTP request once, by outcome: finished, abort, http_<status>.
        self.requests = Counter("muse_requests", "HTTP requests by outcome", ["status"],
                                registry=r)
        self.request_success = counter("vllm:request_success",
                                       "Finished samples by finish reason",
                                       ["model_name", "finished_reason"])
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed"
                                     ).labels(model_name)
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated"
                                         ).labels(model_name)
        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds",
                                             "Time to first token", LATENCY_BUCKETS)
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds",
                                             "Time between output tokens", LATENCY_BUCKETS)
        self.e2e_latency = histogram("vllm:e2e_request_latency_seconds",
                                     "Request latency from arrival to last token",
                                     LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Prompt tokens per request", TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Generated tokens per request",
                                                   TOKEN_BUCKETS)
        self.running = gauge("vllm:num_requests_running", "Requests in the running batch")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc",
                              "Fraction of KV blocks held by requests (0 to 1)")
        self.kv_blocks_used = Gauge("muse_kv_cache_blocks_used",
                                    "KV blocks held by requests (cached free blocks excluded)",
                                    registry=r)
        # Engine-side totals arrive as running sums; the counters advance by the difference.
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache"
                                      ).labels(model_name)
        self.prefix_hits = counter("vllm:prefix_cache_hits",
                                   "Prompt tokens served from the prefix cache"
                                   ).labels(model_name)
        self.preemptions = counter("vllm:num_preemptions", "Requests preempted"
                                   ).labels(model_name)
        self.spec_drafts = counter("vllm:spec_decode_num_drafts",
                                   "Drafts verified (one per request and step)"
                                   ).labels(model_name)
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens",
                                         "Draft tokens verified").labels(model_name)
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens",
                                     "Draft tokens accepted").labels(model_name)
        self.spec_accepted_per_position = counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this position (0-based) was accepted",
            ["model_name", "position"])
        # The engine's encoder-output cache, under the names `EncoderCache.stats()` gives
        # (prometheus_client adds the `_total` of a counter itself).
        self.encoder_cache_counters = {
            name: counter(name.removesuffix("_total"), text).labels(model_name)
            for name, text in ((METRIC_HITS, "Media items served from the encoder cache"),
                               (METRIC_MISSES, "Media items not in the encoder cache"),
                               (METRIC_EVICTIONS, "Encoder cache entries evicted"))}
        self.encoder_cache_gauges = {
            name: gauge(name, text)
            for name, text in ((METRIC_USAGE_BYTES, "Bytes of encoder outputs cached"),
                               (METRIC_CAPACITY_BYTES, "The encoder cache's byte budget"),
                               (METRIC_ENTRIES, "Encoder outputs cached"))}
        self.kv_tier_hits = counter("muse:kv_tier_hit_tokens",
                                    "Prompt tokens served from the prefix cache, by the tier "
                                    "their KV came from", ["model_name", "tier"])
        self.kv_tier_used = Gauge("muse:kv_tier_used_bytes",
                                  "Bytes of KV held per tier (GPU: blocks in use or caching)",
                                  ["model_name", "tier"], registry=r)
        self.kv_tier_capacity = Gauge("muse:kv_tier_capacity_bytes", "KV bytes each tier may hold",
                                      ["model_name", "tier"], registry=r)
        self._last = EngineStats()

    def update_engine(self, stats: EngineStats) -> None:
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_usage.set(stats.kv_usage)
        self.kv_blocks_used.set(stats.kv_blocks_used)
        last = self._last
        for counter, now, before in (
                (self.prefix_queries, stats.prefix_cache_queries, last.prefix_cache_queries),
                (self.prefix_hits, stats.prefix_cache_hits, last.prefix_cache_hits),
                (self.preemptions, stats.num_preemptions, last.num_preemptions),
                (self.spec_drafts, stats.spec_num_drafts, last.spec_num_drafts),
                (self.spec_draft_tokens, stats.spec_num_draft_tokens,
                 last.spec_num_draft_tokens),
                (self.spec_accepted, stats.spec_num_accepted_tokens,
                 last.spec_num_accepted_tokens)):
            _advance(counter, now, before)
        for name, encoder_counter in self.encoder_cache_counters.items():
            _advance(encoder_counter, stats.encoder_cache.get(name, 0),
                     last.encoder_cache.get(name, 0))
        for name, encoder_gauge in self.encoder_cache_gauges.items():
            encoder_gauge.set(stats.encoder_cache.get(name, 0))
        for tier, now in stats.kv_tier_hit_tokens.items():
            _advance(self.kv_tier_hits.labels(self.model_name, tier), now,
                     last.kv_tier_hit_tokens.get(tier, 0))
        for tier, value in stats.kv_tier_used_bytes.items():
            self.kv_tier_used.labels(self.model_name, tier).set(value)
        for tier, value in stats.kv_tier_capacity_bytes.items():
            self.kv_tier_capacity.labels(self.model_name, tier).set(value)
        previous = last.spec_accepted_per_position
        for position, now in enumerate(stats.spec_accepted_per_position):
            _advance(self.spec_accepted_per_position.labels(self.model_name, str(position)),
                     now, previous[position] if position < len(previous) else 0)
        self._last = stats

    def sample_finished(self, reason: str) -> None:
        self.request_success.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _advance(counter: Counter, now: int, before: int) -> None:
    """Move a counter to an engine's running sum (a restarted engine counts from zero)."""
    counter.inc(now - before if now >= before else now)
