"""``GET /metrics``: llama-server's ``llamacpp:*`` metrics, so its dashboards work
unchanged, followed by the engine's own ``llama_cpp_actors_*`` metrics.

The receivers run in the engine's thread and only add to numbers under a lock; the
text is rendered in a worker thread of the event loop. As llama-server's, the two
throughput gauges (``prompt_tokens_seconds``, ``predicted_tokens_seconds``) are
averaged over the window between two scrapes: each scrape reports the requests that
ended since the one before, then starts a new window.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import telemetry

__all__ = ["Metrics"]

# (name, type, help) in llama-server's order (server-context.cpp, handle_metrics).
_SERIES = (
    ("prompt_tokens_total", "counter", "Number of prompt tokens processed."),
    ("prompt_tokens_cached_total", "counter", "Number of prompt tokens served from the cache."),
    ("prompt_seconds_total", "counter", "Prompt process time"),
    ("tokens_predicted_total", "counter", "Number of generation tokens processed."),
    ("tokens_predicted_seconds_total", "counter", "Predict process time"),
    ("n_decode_total", "counter", "Total number of llama_decode() calls"),
    ("n_tokens_max", "counter", "Largest observed n_tokens."),
    ("spec_decode_num_draft_tokens_total", "counter", "Number of speculative draft tokens generated."),
    ("spec_decode_num_accepted_tokens_total", "counter", "Number of speculative draft tokens accepted."),
    ("spec_decode_num_drafts_total", "counter", "Number of speculative drafts attempted."),
    ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s."),
    ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s."),
    ("requests_processing", "gauge", "Number of requests processing."),
    ("requests_deferred", "gauge", "Number of requests deferred."),
    ("n_busy_slots_per_decode", "gauge", "Average number of busy slots per llama_decode() call"),
)

# The throughput window's sums: prompt tokens and their seconds, generated tokens and theirs.
_WINDOW = ("prompt", "prompt_s", "predicted", "predicted_s")


class Metrics:
    """Counts from the engine's signals, rendered as Prometheus text.

    Construct and render in any thread; the receivers run in the engine's thread.
    """

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry

        from telemetry.prometheus import PrometheusExporter

        self._lock = threading.Lock()
        self._values: dict[str, float] = {name: 0.0 for name, _, _ in _SERIES}
        self._window = dict.fromkeys(_WINDOW, 0.0)  # since the last scrape
        self._busy_slots = 0
        self.registry = CollectorRegistry()
        self._exporter = PrometheusExporter(self.registry)
        self._subscription = telemetry.Subscription(
            {
                telemetry.request_done: self._on_finished,
                telemetry.request_exception: self._on_finished,
                telemetry.tick: self._on_tick,
            }
        )

    def close(self) -> None:
        """Unsubscribe (idempotent)."""
        self._subscription.close()
        self._exporter.close()

    def _on_finished(self, sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        cached = measurements["prefix_cache_tokens"]
        ttft_ms, duration_ms = measurements["ttft_ms"], measurements["duration_ms"]
        prompt, prompt_s = measurements["prompt_tokens"] - cached, ttft_ms / 1000.0
        predicted = measurements["generated_tokens"]
        predicted_s = max(duration_ms - ttft_ms, 0.0) / 1000.0
        with self._lock:
            v, w = self._values, self._window
            for name, value in zip(_WINDOW, (prompt, prompt_s, predicted, predicted_s), strict=True):
                w[name] += value
            v["prompt_tokens_total"] += prompt
            v["prompt_tokens_cached_total"] += cached
            v["prompt_seconds_total"] += prompt_s
            v["tokens_predicted_total"] += predicted
            v["tokens_predicted_seconds_total"] += predicted_s

    def _on_tick(self, sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        with self._lock:
            v = self._values
            v["n_decode_total"] += 1
            v["n_tokens_max"] = max(v["n_tokens_max"], measurements["batch_size"])
            self._busy_slots += measurements["active_slots"]
            v["spec_decode_num_drafts_total"] += measurements["drafts"]
            v["spec_decode_num_draft_tokens_total"] += measurements["draft_tokens"]
            v["spec_decode_num_accepted_tokens_total"] += measurements["draft_accepted"]

    def render(self, stats: Mapping[str, Any]) -> str:
        """llama-server's metrics, then this engine's (Prometheus text format); the
        gauges of the load come from ``stats`` (``GetStats``), not the last tick, which
        an engine that went idle by cancels never sends."""
        from prometheus_client import generate_latest

        with self._lock:
            v = dict(self._values)
            w, self._window = self._window, dict.fromkeys(_WINDOW, 0.0)
            busy = self._busy_slots
        v["requests_processing"] = stats.get("active_slots", 0)
        v["requests_deferred"] = stats.get("queue_depth", 0)
        n_decode = v["n_decode_total"]
        v["n_busy_slots_per_decode"] = busy / n_decode if n_decode else 0.0
        v["prompt_tokens_seconds"] = w["prompt"] / w["prompt_s"] if w["prompt_s"] else 0.0
        v["predicted_tokens_seconds"] = w["predicted"] / w["predicted_s"] if w["predicted_s"] else 0.0
        lines = []
        for name, kind, help_text in _SERIES:
            lines += [f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}"]
            lines.append(f"llamacpp:{name} {v[name]:g}")
        return "\n".join(lines) + "\n" + generate_latest(self.registry).decode()
