"""The server's Prometheus metrics (``GET /metrics``), as vLLM names the same figures.

Each app has a registry of its own (not ``prometheus_client``'s global one), so several servers in
one process (the tests) keep their own counts. Latencies are observed by the batch pool's reader
thread as token events arrive; queue time is measured in the batch process (a request's arrival
there to the step that admits it) and sent with the step's report.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds: from a few ms (one decode step of a tiny model) to the request timeout's order
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STATUSES = ("ok", "error", "cancelled", "timeout", "refused")


class ServeMetrics:
    """Histograms of latency, gauges of the batch's load, and requests counted by how they ended."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=r)

        self.ttft = histogram("chatpipe_time_to_first_token_seconds", "request arrival to its first token")
        self.itl = histogram("chatpipe_inter_token_latency_seconds", "between two tokens of one sample")
        self.queue = histogram("chatpipe_queue_time_seconds", "arrival in the batch to the step that admits it")
        self.e2e = histogram("chatpipe_e2e_request_latency_seconds", "request arrival to its last token")
        self.running = Gauge("chatpipe_running_rows", "batch rows decoding", registry=r)
        self.waiting = Gauge("chatpipe_waiting_rows", "samples waiting for a batch row", registry=r)
        self.kv_used = Gauge("chatpipe_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_total = Gauge("chatpipe_kv_blocks_total", "KV cache blocks in all", registry=r)
        self.prefix_hit_rate = Gauge(
            "chatpipe_prefix_cache_hit_rate", "prompt tokens found in the prefix cache / prompt tokens looked up",
            registry=r,
        )  # fmt: skip
        self.up = Gauge("chatpipe_batch_process_up", "1 while the batch process answers, else 0", registry=r)
        self.restarts = Counter("chatpipe_batch_process_restarts", "times the batch process was restarted", registry=r)
        self.requests = Counter("chatpipe_requests", "requests by how they ended", ["status"], registry=r)
        for status in STATUSES:  # every series exists from the start (a scraper sees 0, not nothing)
            self.requests.labels(status)

    def load(self, stats: dict[str, Any]) -> None:
        """The batch's report after a step (:meth:`chatpipe.inference.scheduler.Scheduler.stats`)."""
        self.running.set(stats.get("running", 0))
        self.waiting.set(stats.get("waiting", 0))
        self.kv_used.set(stats.get("kv_blocks_used", 0))
        self.kv_total.set(stats.get("kv_blocks_total", 0))
        queried = stats.get("prefix_query_tokens", 0)
        self.prefix_hit_rate.set(stats.get("prefix_hit_tokens", 0) / queried if queried else 0.0)
        for seconds in stats.get("queue_times", ()):
            self.queue.observe(seconds)

    def count(self, status: str) -> None:
        self.requests.labels(status).inc()

    def exposition(self) -> tuple[bytes, str]:
        """The text format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
