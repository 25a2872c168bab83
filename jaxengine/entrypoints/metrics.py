"""Prometheus metrics of a served engine, with vLLM's names under the `jaxengine:` prefix.

  jaxengine:num_requests_running            gauge: completions holding a batch row
  jaxengine:num_requests_waiting            gauge: completions waiting for a row
  jaxengine:prompt_tokens_total             counter: prompt tokens of requests that started
  jaxengine:generation_tokens_total         counter: generated tokens
  jaxengine:request_success_total           counter by finished_reason (stop, length, abort)
  jaxengine:time_to_first_token_seconds     histogram: arrival to first token
  jaxengine:time_per_output_token_seconds   histogram: between a request's later tokens
  jaxengine:e2e_request_latency_seconds     histogram: arrival to finish
  jaxengine:prefix_cache_queries_total      counter: prompt tokens looked up in the prefix cache
  jaxengine:prefix_cache_hits_total         counter: of those, tokens found

Each `ServerMetrics` has its own registry (several servers in one process do not collide). The
engine thread records each step's `IterationStats`; the prefix-cache counters are read from the
engine's `kv_cache_stats` when scraped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxengine.entrypoints.stats import IterationStats

PREFIX = "jaxengine:"
#: Bucket bounds in seconds (vLLM's, trimmed).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 10.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0)  # fmt: skip


class _PrefixCacheCollector:
  """Reads the engine's cumulative prefix-cache counters at scrape time (and, with the paged KV
  cache, its occupancy and preemptions, under vLLM's names)."""

  def __init__(self, engine, labels: dict[str, str]) -> None:
    self.engine = engine
    self.labels = labels

  def collect(self):
    paged = self.engine.kv_cache_stats
    counters = []
    if paged is not None:
      counters = [
        ("prefix_cache_queries", paged.prefix_cache_queries, PREFIX_QUERIES_DOC),
        ("prefix_cache_hits", paged.prefix_cache_hits, PREFIX_HITS_DOC),
        ("num_preemptions", paged.num_preemptions, "Requests preempted (pages freed)."),
      ]
      usage = GaugeMetricFamily(
        PREFIX + "kv_cache_usage_perc",
        "Fraction of the paged KV cache's blocks in use (1 = full).",
        labels=list(self.labels),
      )
      usage.add_metric(list(self.labels.values()), paged.num_used_blocks / paged.num_blocks)
      yield usage
    for name, value, doc in counters:
      family = CounterMetricFamily(PREFIX + name, doc, labels=list(self.labels))
      family.add_metric(list(self.labels.values()), value)
      yield family


PREFIX_QUERIES_DOC = "Prompt tokens looked up in the prefix cache."
PREFIX_HITS_DOC = "Prompt tokens found in the prefix cache."


class ServerMetrics:
  """The metrics of one served model; `record` is an `AsyncLLM` stat logger.

  Args:
    model_name: the `model_name` label of every metric.
    engine: the `LLMEngine` whose prefix-cache counters to export.
  """

  def __init__(self, model_name: str, engine) -> None:
    self.registry = CollectorRegistry()
    labels = {"model_name": model_name}
    names = list(labels)

    def make(kind, name, doc, **kwargs):
      metric = kind(PREFIX + name, doc, labelnames=names, registry=self.registry, **kwargs)
      return metric.labels(**labels)

    self.running = make(Gauge, "num_requests_running", "Completions holding a batch row.")
    self.waiting = make(Gauge, "num_requests_waiting", "Completions waiting for a row.")
    self.prompt_tokens = make(Counter, "prompt_tokens", "Prompt tokens of requests started.")
    self.generation_tokens = make(Counter, "generation_tokens", "Tokens generated.")
    self._success = Counter(
      PREFIX + "request_success",
      "Finished requests by finish reason.",
      labelnames=[*names, "finished_reason"],
      registry=self.registry,
    )
    self._labels = labels
    self.ttft = make(
      Histogram, "time_to_first_token_seconds", "Arrival to first token.", buckets=TTFT_BUCKETS
    )
    self.tpot = make(
      Histogram,
      "time_per_output_token_seconds",
      "Time between a request's tokens after its first.",
      buckets=TPOT_BUCKETS,
    )
    self.e2e = make(
      Histogram, "e2e_request_latency_seconds", "Arrival to finish.", buckets=E2E_BUCKETS
    )
    self.registry.register(_PrefixCacheCollector(engine, labels))

  def record(self, stats: IterationStats) -> None:
    """Adds one engine step's numbers (called on the engine thread)."""
    self.running.set(stats.num_running)
    self.waiting.set(stats.num_waiting)
    if stats.num_prompt_tokens:
      self.prompt_tokens.inc(stats.num_prompt_tokens)
    if stats.num_generation_tokens:
      self.generation_tokens.inc(stats.num_generation_tokens)
    for value in stats.time_to_first_tokens_s:
      self.ttft.observe(value)
    for value in stats.time_per_output_tokens_s:
      self.tpot.observe(value)
    for finished in stats.finished:
      self._success.labels(**self._labels, finished_reason=finished.finish_reason).inc()
      self.e2e.observe(finished.e2e_latency_s)

  def exposition(self) -> bytes:
    """The Prometheus text format of every metric."""
    return generate_latest(self.registry)
