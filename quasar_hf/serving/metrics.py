"""The server's Prometheus metrics (`/metrics`), one registry per server, written by prometheus_client.

Requests (waiting, running, finished, failed), prompt and generated tokens, speculative drafts proposed
and accepted (their ratio per verify step is the paper's acceptance length), verify steps and their
time, prompt cache hits and the prompt tokens they saved, queue wait and request latency. The decoding worker reports through `ServingMetrics`'s methods;
the HTTP side only scrapes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from quasar_hf.speculative.stats import QuasarStats

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServingMetrics:
    """Counters, gauges and histograms of one server (its own CollectorRegistry: no process-global state)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.waiting = Gauge("quasar_requests_waiting", "Requests queued, not yet decoding", registry=r)
        self.running = Gauge("quasar_requests_running", "Requests decoding now", registry=r)
        self.finished = Counter("quasar_requests_finished", "Requests completed, by finish reason", ["reason"], registry=r)
        self.failed = Counter("quasar_requests_failed", "Requests that ended in an error, by kind", ["kind"], registry=r)
        self.prompt_tokens = Counter("quasar_prompt_tokens", "Prompt tokens of requests that started decoding", registry=r)
        self.generated_tokens = Counter("quasar_generation_tokens", "Tokens sent to clients", registry=r)
        self.drafted = Counter("quasar_spec_draft_tokens", "Draft tokens proposed to the W8A8 verifier", registry=r)
        self.accepted = Counter("quasar_spec_accepted_tokens", "Draft tokens the verifier accepted", registry=r)
        self.row_steps = Counter(
            "quasar_spec_row_steps", "Verify steps counted per row (new tokens / row steps = acceptance length)", registry=r
        )
        self.steps = Counter("quasar_steps", "Verifier forwards after the prefill (one per batch step)", registry=r)
        self.step_seconds = Counter("quasar_step_seconds", "Time in those verifier steps (divide by quasar_steps)", registry=r)
        self.prefill_seconds = Counter("quasar_prefill_seconds", "Time in prompt prefills", registry=r)
        self.cache_hits = Counter("quasar_prompt_cache_hits", "Requests that reused cached prompt tokens", registry=r)
        self.cache_tokens = Counter("quasar_prompt_cache_tokens_reused", "Prompt tokens not prefilled again", registry=r)
        self.cache_bytes = Gauge("quasar_prompt_cache_bytes", "Bytes of keys and values in the prompt cache", registry=r)
        self.batch_rows = Histogram(
            "quasar_batch_rows", "Rows decoded together per step", buckets=(1, 2, 4, 8, 16, 32, 64), registry=r
        )
        self.queue_wait = Histogram(
            "quasar_queue_wait_seconds", "From arrival to decoding start", buckets=LATENCY_BUCKETS, registry=r
        )
        self.latency = Histogram("quasar_request_seconds", "From arrival to the last token", buckets=LATENCY_BUCKETS, registry=r)

    def record_call(self, stats: QuasarStats, rows: int) -> None:
        """The speculative counters of one step (or batched call) and its rows; of one prefill with rows 0."""
        if rows:
            self.batch_rows.observe(rows)
        self.drafted.inc(stats.drafted_tokens)
        self.accepted.inc(stats.accepted_tokens)
        self.row_steps.inc(stats.verify_steps)
        self.steps.inc(stats.verifier_forwards)
        self.step_seconds.inc(stats.verify_time_s + stats.draft_time_s)
        self.prefill_seconds.inc(stats.prefill_time_s)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
