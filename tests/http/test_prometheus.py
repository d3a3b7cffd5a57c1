"""telemetry.prometheus: the exposition text after real requests says what happened."""

from __future__ import annotations

from typing import Any

import pykka
import pytest
from helpers import NO_EOG

from actors import Generate, GetStats, generate

prometheus_client = pytest.importorskip("prometheus_client", reason="the prometheus extra is not installed")
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from telemetry.prometheus import PrometheusExporter  # noqa: E402


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition text, keyed by name and sorted labels."""
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    labels.setdefault("replica", "")
    return samples[(f"llama_cpp_actors_{name}", tuple(sorted(labels.items())))]


def test_exposition_after_real_requests(server: pykka.ActorRef[Any]) -> None:
    registry = CollectorRegistry()
    exporter = PrometheusExporter(registry)
    try:
        system = "You are a terse assistant who answers in one short sentence. " * 6
        first = generate(server, system + "Q: sky?", max_tokens=4, logit_bias=NO_EOG)
        second = generate(server, system + "Q: sea?", max_tokens=6, logit_bias=NO_EOG)
        third = generate(server, "Hi", max_tokens=3, stop=[first.text[:1] or "x"], logit_bias=NO_EOG)
        stats = server.ask(GetStats())  # the last tick's signal has fired once this returns
        samples = scrape(registry)
    finally:
        exporter.close()
    assert scrape(registry) == {}  # close() unregistered every metric
    completions = [first, second, third]

    by_reason: dict[str, int] = {}
    for c in completions:
        by_reason[c.stop_reason] = by_reason.get(c.stop_reason, 0) + 1
    for reason, count in by_reason.items():
        assert value(samples, "requests_total", stop_reason=reason) == count
    prompt = sum(c.prompt_tokens for c in completions)
    cached = sum(c.prefix_cache_tokens for c in completions)
    assert value(samples, "prompt_tokens_total") == prompt
    assert value(samples, "generated_tokens_total") == sum(c.generated_tokens for c in completions)
    assert value(samples, "prefix_cache_tokens_total") == cached
    assert second.prefix_cache_tokens > 0  # the shared system prompt came from the cache
    assert value(samples, "prefix_cache_hit_ratio") == pytest.approx(cached / prompt)

    assert value(samples, "time_to_first_token_seconds_count") == 3
    assert value(samples, "request_duration_seconds_count") == 3
    assert value(samples, "request_duration_seconds_sum") == pytest.approx(
        sum(c.duration_ms for c in completions) / 1000.0, rel=1e-6
    )
    assert value(samples, "time_to_first_token_seconds_sum") <= value(samples, "request_duration_seconds_sum")
    ticks = value(samples, "tick_batch_tokens_count")
    assert ticks >= 4 + 6 + 1  # at least one tick per decoded token
    # Every prompt token not cached was evaluated, and every token but each request's last.
    assert value(samples, "tick_batch_tokens_sum") >= prompt - cached + 3 + 5
    assert value(samples, "tick_eval_seconds_count") == ticks
    assert value(samples, "tick_batch_tokens_bucket", le="+Inf") == ticks
    # After the last tick nothing runs or waits, and the idle caches still hold KV.
    assert value(samples, "queue_depth") == 0
    assert value(samples, "active_slots") == 0
    assert value(samples, "kv_cells_used") == stats["kv_cells_used"] > 0
    assert value(samples, "kv_usage_ratio") == pytest.approx(stats["kv_cells_used"] / stats["kv_cells_total"])


def test_close_unsubscribes_and_frees_the_default_registry(server: pykka.ActorRef[Any]) -> None:
    exporter = PrometheusExporter()  # the default registry
    try:
        generate(server, "Hello", max_tokens=2, logit_bias=NO_EOG)
        assert value(scrape(REGISTRY), "generated_tokens_total") >= 2
    finally:
        exporter.close()
    exporter.close()  # idempotent
    # Closed: the names are free again, and the old exporter no longer counts.
    again = PrometheusExporter()
    try:
        before = exporter.generated_tokens.labels("")._value.get()
        generate(server, "Hello", max_tokens=2, logit_bias=NO_EOG)
        assert exporter.generated_tokens.labels("")._value.get() == before
        assert value(scrape(REGISTRY), "generated_tokens_total") == 2
    finally:
        again.close()


def test_a_pool_is_exported_per_replica(model_path: str) -> None:
    from actors import ServerPool

    registry = CollectorRegistry()
    exporter = PrometheusExporter(registry)
    pool = ServerPool.start(replicas=2, model_path=model_path, n_parallel=2, n_ctx=1024, n_threads=1)
    try:
        futures = [pool.ask(Generate(f"Topic {i}", max_tokens=3, logit_bias=NO_EOG)) for i in range(4)]
        for future in futures:
            future.get(timeout=60)
        pool.ask(GetStats())
        samples = scrape(registry)
    finally:
        pool.stop()
        exporter.close()
    for replica in ("replica-0", "replica-1"):
        assert value(samples, "requests_total", replica=replica, stop_reason="max_tokens") == 2
        assert value(samples, "generated_tokens_total", replica=replica) == 6
        assert value(samples, "tick_batch_tokens_count", replica=replica) >= 3


def test_a_model_managers_engines_are_exported_by_model(model_path: str) -> None:
    from actors import ModelManager

    registry = CollectorRegistry()
    exporter = PrometheusExporter(registry)
    small = {"model_path": model_path, "n_parallel": 1, "n_ctx": 512, "n_threads": 1}
    manager = ModelManager.start({"chat": small, "other": small}, memory_budget_mb=10_000)
    try:
        for name in ("chat", "chat", "other"):
            manager.ask(Generate("Hi", max_tokens=3, logit_bias=NO_EOG, model=name)).get(timeout=60)
        manager.unload("other")
        samples = scrape(registry)
    finally:
        manager.stop()
        exporter.close()
    assert value(samples, "requests_total", replica="chat", stop_reason="max_tokens") == 2
    assert value(samples, "requests_total", replica="other", stop_reason="max_tokens") == 1
    assert value(samples, "model_loads_total", replica="chat") == 1
    unloads = ("llama_cpp_actors_model_unloads_total", (("model", "other"), ("reason", "unloaded")))
    assert samples[unloads] == 1


def test_llama_servers_speculative_counters_count(start_server: Any) -> None:
    # They stayed 0 while llama_cpp_actors_draft_tokens_total counted (a hostile review).
    from speculation import GROUNDED, AllDrafts

    from actors.http._metrics import Metrics

    metrics = Metrics()
    try:
        spec = start_server(n_parallel=2, spec_type="ngram", batch_strategy=AllDrafts())
        futures = [spec.ask(Generate(p, max_tokens=32, temp=0, logit_bias=NO_EOG)) for p in GROUNDED[:2]]
        done = [f.get(timeout=240) for f in futures]
        stats = spec.ask(GetStats())
        text = metrics.render(stats)
    finally:
        metrics.close()
    counters = {
        name: float(number)
        for name, number in (line.split(" ") for line in text.splitlines() if line.startswith("llamacpp:"))
    }
    drafted = sum(d.draft_tokens for d in done)
    assert drafted > 0 and stats["draft_tokens"] == drafted
    assert counters["llamacpp:spec_decode_num_draft_tokens_total"] == drafted
    assert counters["llamacpp:spec_decode_num_accepted_tokens_total"] == sum(d.draft_accepted for d in done)
    # one draft per slot and tick that verified one: between one per request and one per token
    assert len(done) <= counters["llamacpp:spec_decode_num_drafts_total"] <= drafted
