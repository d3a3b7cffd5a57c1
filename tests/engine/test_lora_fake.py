"""LoRA adapter sets in the engine, on the scripted backend: each request equals its
solo run under its own set whatever else is in flight, a tick serves one set, no set
starves, and KV computed under one set is never reused under another."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from fake_backend import FakeBackend, solo
from test_engine_fake import engine, prompt, result, run, submit

from actors.contract import GetLora, InvalidRequest, LoraAdapter, SetLora, StrategyError
from actors.engine import Engine
from strategies import DecodeMaximal, SlotView

pytestmark = pytest.mark.timeout(60)

A, B = ((0, 1.0),), ((1, 0.5),)


def lora_engine(n_seq_max: int = 4, **config: Any) -> Engine:
    backend = FakeBackend(n_ctx=512, n_seq_max=n_seq_max, adapters=("a", "b"), adapter_scales=(0.0, 0.0))
    return engine(backend, **config)


def solo_of(e: Engine, tokens: list[int], n: int, adapters: tuple[tuple[int, float], ...]) -> list[int]:
    return solo(e.backend.model, tokens, n, adapters)  # type: ignore[attr-defined]


def test_requests_of_different_sets_in_flight_each_equal_their_solo_run() -> None:
    e = lora_engine()
    asks = [({"a": 1.0}, A), ({1: 0.5}, B), (None, ()), ({"a": 1.0, "b": 0.0}, A), ({}, ())]
    prompts = [prompt(i, 6 + 5 * i) for i in range(len(asks))]
    futures = [submit(e, p, max_tokens=10, lora=lora) for p, (lora, _) in zip(prompts, asks, strict=True)]
    run(e)
    for p, f, (_, adapters) in zip(prompts, futures, asks, strict=True):
        assert list(result(f).token_ids) == solo_of(e, p, 10, adapters)
    # The sets really differ: the same prompt's run under A is not the base run.
    assert solo_of(e, prompts[0], 10, A) != solo_of(e, prompts[0], 10, ())


def test_a_tick_serves_one_set_and_the_sets_take_turns() -> None:
    e = lora_engine()
    fake = e.backend
    assert isinstance(fake, FakeBackend)
    futures = [submit(e, prompt(i, 8), max_tokens=24, lora={"a": 1.0} if i % 2 else None) for i in range(4)]
    passes: list[tuple[tuple[int, float], ...]] = []
    while e.has_work:
        e.step()
        passes.append(fake.adapters.current)
    for f in futures:
        assert result(f).stop_reason == "max_tokens"
    # Both sets advance: neither waits for the other to finish.
    first_a, last_base = passes.index(A), len(passes) - 1 - passes[::-1].index(())
    assert first_a < last_base
    # A set keeps the batch for at most the strategy's quantum while the other waits.
    runs, streak = [], 1
    for before, now in itertools.pairwise(passes):
        streak = streak + 1 if now == before else 1
        runs.append(streak)
    both = max(i for i in range(len(passes)) if passes[i] == A or passes[i] == ())
    assert max(runs[: both - 1]) <= DecodeMaximal.adapter_quantum + 1


def test_kv_of_one_set_is_never_reused_under_another() -> None:
    e = lora_engine(n_seq_max=2)
    p = prompt(3, 40)
    first_future = submit(e, p, max_tokens=4, lora={"a": 1.0})
    run(e)
    first = result(first_future)
    base = submit(e, p, max_tokens=4)
    run(e)
    assert result(base).prefix_cache_tokens == 0
    assert list(result(base).token_ids) == solo_of(e, p, 4, ())
    again = submit(e, p, max_tokens=4, lora={"a": 1.0})
    run(e)
    assert result(again).prefix_cache_tokens > 0  # the same set reuses its own
    assert list(result(again).token_ids) == list(first.token_ids) == solo_of(e, p, 4, A)


def test_prefix_sharing_works_within_a_set_and_not_across() -> None:
    e = lora_engine()
    fake = e.backend
    assert isinstance(fake, FakeBackend)
    system = prompt(5, 64)
    prompts = [[*system, 1 + i] for i in range(4)]
    futures = [submit(e, p, max_tokens=6, lora={"b": 0.5} if i < 3 else None) for i, p in enumerate(prompts)]
    run(e)
    assert fake.kv.copies > 0
    for i, (p, f) in enumerate(zip(prompts, futures, strict=True)):
        assert list(result(f).token_ids) == solo_of(e, p, 6, B if i < 3 else ())
    assert sum(result(f).prefix_cache_tokens > 0 for f in futures[:3]) >= 1
    assert result(futures[3]).prefix_cache_tokens == 0


def test_the_ram_cache_keeps_sets_apart() -> None:
    e = lora_engine(n_seq_max=1, ram_budget_bytes=1 << 20)
    p, filler = prompt(1, 30), prompt(2, 30)
    result_a = submit(e, p, max_tokens=3, lora={"a": 1.0})
    run(e)
    submit(e, filler, max_tokens=3)  # pushes p's KV (set A) to RAM
    run(e)
    base = submit(e, p, max_tokens=3)
    run(e)
    assert result(base).prefix_cache_tokens == 0
    assert list(result(base).token_ids) == solo_of(e, p, 3, ())
    a_again = submit(e, p, max_tokens=3, lora={"a": 1.0})
    run(e)
    assert list(result(a_again).token_ids) == list(result(result_a).token_ids)


def test_scale_zero_is_the_base_model() -> None:
    e = lora_engine()
    p = prompt(4, 20)
    off = submit(e, p, max_tokens=6, lora={"a": 0.0})
    run(e)
    assert list(result(off).token_ids) == solo_of(e, p, 6, ())
    base = submit(e, p, max_tokens=6)
    run(e)
    assert result(base).prefix_cache_tokens > 0  # one set: the same cache


def test_default_scales_apply_to_requests_without_lora_and_can_change() -> None:
    e = lora_engine()
    assert e.lora() == (LoraAdapter("/fake/a.gguf", 0.0, "a"), LoraAdapter("/fake/b.gguf", 0.0, "b"))
    listed = e.set_lora(SetLora({"b": 0.5}).by_adapter)
    assert [a.scale for a in listed] == [0.0, 0.5]
    p = prompt(7, 12)
    f = submit(e, p, max_tokens=5)
    run(e)
    assert list(result(f).token_ids) == solo_of(e, p, 5, B)
    with pytest.raises(InvalidRequest, match="does not have"):
        e.set_lora(SetLora({"c": 1.0}).by_adapter)
    assert GetLora() == GetLora()


@pytest.mark.parametrize("lora", [{"c": 1.0}, {2: 1.0}])
def test_an_adapter_the_server_lacks_is_refused_when_prepared(lora: dict[Any, float]) -> None:
    e = lora_engine()
    with pytest.raises(InvalidRequest, match="does not have"):
        submit(e, prompt(1, 5), max_tokens=2, lora=lora)
    bare = engine()
    with pytest.raises(InvalidRequest, match="has none"):
        submit(bare, prompt(1, 5), max_tokens=2, lora={0: 1.0})
    f = submit(bare, prompt(1, 5), max_tokens=2, lora={})  # naming none is the base model
    run(bare)
    assert result(f).stop_reason == "max_tokens"


class ChoosesNothing(DecodeMaximal):
    def choose_adapters(self, slots: Any, *, current: Any, streak: int) -> Any:
        return ((9, 1.0),)


class Raises(DecodeMaximal):
    def choose_adapters(self, slots: Any, *, current: Any, streak: int) -> Any:
        raise SystemExit("a strategy's exit must not stop the actors")


@pytest.mark.parametrize("strategy", [ChoosesNothing(), Raises()])
def test_a_bad_choice_fails_the_requests_and_the_engine_serves_on(strategy: DecodeMaximal) -> None:
    e = lora_engine(batch_strategy=strategy)
    futures = [submit(e, prompt(i, 6), max_tokens=3, lora={"a": 1.0} if i else None) for i in range(2)]
    run(e)
    for f in futures:
        with pytest.raises(StrategyError):
            f.get(timeout=0)
    f = submit(e, prompt(3, 6), max_tokens=3)  # one set: choose_adapters is not asked
    run(e)
    assert result(f).stop_reason == "max_tokens"


def test_the_views_carry_the_set_and_the_wait() -> None:
    seen: list[list[SlotView]] = []

    class Spy(DecodeMaximal):
        def choose_adapters(self, slots: Any, *, current: Any, streak: int) -> Any:
            seen.append(list(slots))
            return super().choose_adapters(slots, current=current, streak=streak)

    e = lora_engine(batch_strategy=Spy())
    for i in range(3):
        submit(e, prompt(i, 6), max_tokens=8, lora=[None, {"a": 1.0}, {"b": 0.5}][i])
    run(e)
    assert seen and {v.adapters for v in seen[0]} == {(), A, B}
    assert max(v.waited_ticks for views in seen for v in views) >= 1
