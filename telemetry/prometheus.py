"""Export the engine's telemetry to Prometheus (needs the ``prometheus`` extra).

    from prometheus_client import start_http_server
    from telemetry.prometheus import PrometheusExporter

    exporter = PrometheusExporter()    # subscribes now, registers in the default registry
    start_http_server(9464)            # or mount prometheus_client's WSGI/ASGI app
    ...
    exporter.close()                   # unsubscribes and unregisters

The receivers run in the engine thread (as every receiver) and only update counters,
gauges and histograms, which ``prometheus_client`` makes thread-safe; scraping happens in
the HTTP server's thread. Every metric carries a ``replica`` label: empty for a single
engine, the replica's name for the engines of a ``ServerPool``, the model's name for
those of a ``ModelManager`` (``model_unloads`` has ``model`` instead).

======================================================  =========  ==========================
metric                                                  type       from
======================================================  =========  ==========================
``llama_cpp_actors_requests_total{stop_reason}``        counter    request_done, _exception
``llama_cpp_actors_prompt_tokens_total``                counter    request_done, _exception
``llama_cpp_actors_prefix_cache_tokens_total``          counter    request_done, _exception
``llama_cpp_actors_generated_tokens_total``             counter    request_done, _exception
``llama_cpp_actors_prefix_cache_hit_ratio``             gauge      cached / prompt tokens
``llama_cpp_actors_time_to_first_token_seconds``        histogram  request_done
``llama_cpp_actors_request_duration_seconds``           histogram  request_done, _exception
``llama_cpp_actors_tick_batch_tokens``                  histogram  tick
``llama_cpp_actors_tick_eval_seconds``                  histogram  tick
``llama_cpp_actors_queue_depth``                        gauge      tick
``llama_cpp_actors_active_slots``                       gauge      tick
``llama_cpp_actors_kv_cells_used``                      gauge      tick
``llama_cpp_actors_kv_usage_ratio``                     gauge      tick
``llama_cpp_actors_kv_pressure_events_total{event}``    counter    kv_pressure
``llama_cpp_actors_server_restarts_total``              counter    server_restart
``llama_cpp_actors_model_loads_total``                  counter    model_load (once loaded)
``llama_cpp_actors_model_unloads_total{model,reason}``  counter    model_unload
======================================================  =========  ==========================
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

import telemetry

__all__ = ["PrometheusExporter"]

_LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)
_EVAL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def _replica(metadata: dict[str, Any]) -> str:
    replica = metadata.get("replica")
    return "" if replica is None else str(replica)


class PrometheusExporter:
    """Subscribes to every engine signal and keeps Prometheus metrics up to date.

    Args:
        registry: where to register the metrics; ``prometheus_client.REGISTRY`` when None.
            Use your own ``CollectorRegistry`` to run two exporters side by side.
        namespace: the metric-name prefix.

    Construct it in any thread; its receivers run in the engine thread. ``close()``
    unsubscribes and unregisters, so a new exporter may take the same registry.
    """

    def __init__(
        self, registry: CollectorRegistry | None = None, namespace: str = "llama_cpp_actors"
    ) -> None:
        self.registry = REGISTRY if registry is None else registry
        kw: dict[str, Any] = {"namespace": namespace, "registry": self.registry}
        self.requests = Counter(
            "requests", "Finished requests by stop reason.", ["replica", "stop_reason"], **kw
        )
        self.prompt_tokens = Counter(
            "prompt_tokens", "Prompt tokens of finished requests.", ["replica"], **kw
        )
        self.prefix_cache_tokens = Counter(
            "prefix_cache_tokens",
            "Prompt tokens served from a cache instead of evaluated.",
            ["replica"],
            **kw,
        )
        self.generated_tokens = Counter("generated_tokens", "Tokens generated.", ["replica"], **kw)
        self.prefix_cache_hit_ratio = Gauge(
            "prefix_cache_hit_ratio", "Cached prompt tokens / prompt tokens, since start.", ["replica"], **kw
        )
        self.ttft = Histogram(
            "time_to_first_token_seconds",
            "From admission to the first generated token.",
            ["replica"],
            buckets=_LATENCY_BUCKETS,
            **kw,
        )
        self.duration = Histogram(
            "request_duration_seconds",
            "From admission to the end of a request.",
            ["replica"],
            buckets=_LATENCY_BUCKETS,
            **kw,
        )
        self.batch_tokens = Histogram(
            "tick_batch_tokens", "Tokens in each tick's batch.", ["replica"], buckets=_BATCH_BUCKETS, **kw
        )
        self.eval_time = Histogram(
            "tick_eval_seconds",
            "Time inside llama_decode per tick.",
            ["replica"],
            buckets=_EVAL_BUCKETS,
            **kw,
        )
        self.queue_depth = Gauge("queue_depth", "Requests waiting for a slot.", ["replica"], **kw)
        self.active_slots = Gauge("active_slots", "Slots prefilling or generating.", ["replica"], **kw)
        self.kv_cells_used = Gauge("kv_cells_used", "KV cells holding tokens.", ["replica"], **kw)
        self.kv_usage = Gauge("kv_usage_ratio", "KV cells used / KV cells in the context.", ["replica"], **kw)
        self.kv_pressure = Counter(
            "kv_pressure_events", "KV-pressure actions by event.", ["replica", "event"], **kw
        )
        self.restarts = Counter(
            "server_restarts", "Supervisor restarts of a crashed engine.", ["replica"], **kw
        )
        self.draft_tokens = Counter(
            "draft_tokens", "Draft tokens verified (speculative decoding).", ["replica"], **kw
        )
        self.draft_accepted = Counter(
            "draft_accepted_tokens", "Draft tokens verified and right.", ["replica"], **kw
        )
        self.draft_acceptance = Gauge(
            "draft_acceptance_ratio",
            "Draft tokens right / draft tokens verified, since start.",
            ["replica"],
            **kw,
        )
        self.model_loads = Counter("model_loads", "Engines that finished loading a model.", ["replica"], **kw)
        self.model_unloads = Counter(
            "model_unloads", "Models a ModelManager unloaded, by reason.", ["model", "reason"], **kw
        )
        self._collectors = [
            self.requests,
            self.prompt_tokens,
            self.prefix_cache_tokens,
            self.generated_tokens,
            self.prefix_cache_hit_ratio,
            self.ttft,
            self.duration,
            self.batch_tokens,
            self.eval_time,
            self.queue_depth,
            self.active_slots,
            self.kv_cells_used,
            self.kv_usage,
            self.kv_pressure,
            self.restarts,
            self.draft_tokens,
            self.draft_accepted,
            self.draft_acceptance,
            self.model_loads,
            self.model_unloads,
        ]
        self._lock = threading.Lock()  # the hit ratio's two sums; engines of a pool run in parallel
        self._prompt_sum: dict[str, int] = {}
        self._cached_sum: dict[str, int] = {}
        self._drafted_sum: dict[str, int] = {}
        self._accepted_sum: dict[str, int] = {}
        self._subscription = telemetry.Subscription(
            {
                telemetry.request_done: self._on_done,
                telemetry.request_exception: self._on_exception,
                telemetry.tick: self._on_tick,
                telemetry.kv_pressure: self._on_kv_pressure,
                telemetry.server_restart: self._on_restart,
                telemetry.model_load: self._on_load,
                telemetry.model_unload: self._on_unload,
            }
        )

    def close(self) -> None:
        """Unsubscribe from the signals and unregister the metrics. Idempotent."""
        self._subscription.close()
        for collector in self._collectors:
            with contextlib.suppress(KeyError):  # closed already
                self.registry.unregister(collector)

    # -- receivers (engine thread) --------------------------------------------------

    def _finished(self, measurements: dict[str, Any], metadata: dict[str, Any]) -> str:
        replica = _replica(metadata)
        prompt, cached = measurements["prompt_tokens"], measurements["prefix_cache_tokens"]
        self.requests.labels(replica, metadata["stop_reason"]).inc()
        self.prompt_tokens.labels(replica).inc(prompt)
        self.prefix_cache_tokens.labels(replica).inc(cached)
        self.generated_tokens.labels(replica).inc(measurements["generated_tokens"])
        self.duration.labels(replica).observe(measurements["duration_ms"] / 1000.0)
        with self._lock:
            total = self._prompt_sum[replica] = self._prompt_sum.get(replica, 0) + prompt
            hits = self._cached_sum[replica] = self._cached_sum.get(replica, 0) + cached
        self.prefix_cache_hit_ratio.labels(replica).set(hits / total if total else 0.0)
        return replica

    def _on_done(self, sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        replica = self._finished(measurements, metadata)
        if measurements["generated_tokens"]:
            self.ttft.labels(replica).observe(measurements["ttft_ms"] / 1000.0)

    def _on_exception(self, sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        self._finished(measurements, metadata)

    def _on_tick(self, sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        replica = _replica(metadata)
        self.batch_tokens.labels(replica).observe(measurements["batch_size"])
        self.eval_time.labels(replica).observe(measurements["eval_ms"] / 1000.0)
        self.queue_depth.labels(replica).set(measurements["queue_depth"])
        self.active_slots.labels(replica).set(measurements["active_slots"])
        used, total = measurements["kv_cells_used"], measurements["kv_cells_total"]
        self.kv_cells_used.labels(replica).set(used)
        self.kv_usage.labels(replica).set(used / total if total else 0.0)
        drafted = measurements.get("draft_tokens", 0)
        if drafted:
            accepted = measurements.get("draft_accepted", 0)
            self.draft_tokens.labels(replica).inc(drafted)
            self.draft_accepted.labels(replica).inc(accepted)
            with self._lock:
                d = self._drafted_sum[replica] = self._drafted_sum.get(replica, 0) + drafted
                a = self._accepted_sum[replica] = self._accepted_sum.get(replica, 0) + accepted
            self.draft_acceptance.labels(replica).set(a / d)

    def _on_kv_pressure(self, sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        self.kv_pressure.labels(_replica(metadata), metadata["event"]).inc()

    def _on_restart(self, sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        self.restarts.labels(_replica(metadata)).inc()

    def _on_load(self, sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        if measurements.get("load_ms") is not None:  # progress reports come before it
            self.model_loads.labels(_replica(metadata)).inc()

    def _on_unload(self, sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        self.model_unloads.labels(str(metadata["model"]), str(metadata["reason"])).inc()
