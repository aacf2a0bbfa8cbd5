"""Prometheus metrics of one server."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ServerMetrics:
    """Prometheus metrics of one server (its own registry, so tests can run several)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("specdec_requests", "Finished choices by finish reason", ["finish_reason"], registry=r)
        self.rejected = Counter("specdec_rejected_requests", "Requests refused (queue full or invalid)", ["reason"], registry=r)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generated = Counter("specdec_generated_tokens", "Tokens generated", registry=r)
        self.target_calls = Counter("specdec_target_calls", "Target forward calls (prefill and verification)", registry=r)
        self.queue = Gauge("specdec_queue_depth", "Requests waiting for a batch row", registry=r)
        self.batch = Gauge("specdec_batch_size", "Rows decoded in the last step", registry=r)
        self.calls_per_token = Gauge("specdec_target_calls_per_token", "Target calls per generated token so far", registry=r)
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "From arrival to first token", buckets=buckets, registry=r)
        self.tpot = Histogram("specdec_time_per_output_token_seconds", "Mean time per token after the first",
                              buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56), registry=r)
        self.phase_seconds = Counter("specdec_engine_seconds", "Engine time by phase (prefill, draft, target_forward, "
                                     "verification, cache)", ["phase"], registry=r)
        self.reached = Counter("specdec_draft_reached", "Verifications that reached each draft position", ["position"], registry=r)
        self.accepted = Counter("specdec_draft_accepted", "Draft tokens accepted at each position", ["position"], registry=r)
        self.prefix_hit_rate = Gauge("specdec_prefix_cache_hit_rate", "Share of prompt tokens whose KV came from the "
                                     "prefix cache", registry=r)
        self.prefill_saved = Gauge("specdec_prefix_cache_saved_tokens", "Prompt tokens not prefilled thanks to the "
                                   "prefix cache (total)", registry=r)
        self.prefix_bytes = Gauge("specdec_prefix_cache_bytes", "Memory held by the prefix cache", registry=r)

    def observe_prefix(self, prefix) -> None:
        """The prefix cache's totals (:class:`specdec.core.prefix_cache.PrefixStats`) as gauges."""
        self.prefix_hit_rate.set(prefix.stats.hit_rate)
        self.prefill_saved.set(prefix.stats.hit_tokens)
        self.prefix_bytes.set(prefix.bytes)


