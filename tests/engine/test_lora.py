"""LoRA adapters on the default model, with adapters made for the test (``tiny_lora``:
random weights of the model's shapes): an adapter moves the logits, scale 0 is the base
model, requests of different adapter sets in flight each give their solo run's numbers,
and an adapter llama.cpp could not apply is refused before the model loads."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pykka
import pytest
from helpers import NO_EOG, same_numbers
from tiny_lora import write_lora

from actors import (
    Completion,
    Generate,
    GetLora,
    LoraAdapter,
    ModelLoadError,
    ServerActor,
    SetLora,
    generate,
)

pytestmark = pytest.mark.timeout(180)

PROMPT = "The three most useful kitchen tools are"
N = 8


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    folder = tmp_path_factory.mktemp("lora")
    return write_lora(folder / "tenant-a.gguf", seed=1), write_lora(folder / "tenant-b.gguf", seed=2)


@pytest.fixture(scope="module")
def ref(model_path: str, adapters: tuple[str, str]) -> Iterator[Any]:
    # Loaded but off by default (llama-server's --lora-init-without-apply).
    server = ServerActor.start(
        model_path=model_path, n_parallel=4, n_ctx=2048, lora=[(adapters[0], 0.0), (adapters[1], 0.0)]
    )
    yield server
    server.stop()


def run(ref: Any, lora: Any = None, prompt: str = PROMPT, **options: Any) -> Completion:
    options = {"max_tokens": N, "temp": 0.0, "logprobs": 4, "logit_bias": NO_EOG, **options}
    return generate(ref, prompt, lora=lora, cache_prompt=False, **options)


def test_an_adapter_moves_the_logits_and_scale_zero_is_the_base_model(ref: Any, model_path: str) -> None:
    base = run(ref)
    tuned = run(ref, {"tenant-a": 1.0})
    assert tuned.logprobs is not None and base.logprobs is not None
    moved = max(abs(a.logprob - b.logprob) for a, b in zip(tuned.logprobs, base.logprobs, strict=True))
    assert moved > 1e-3 or tuned.token_ids != base.token_ids
    same_numbers(base, run(ref, {"tenant-a": 0.0, "tenant-b": 0.0}))
    # Adapters loaded change nothing for the base model: an engine with none agrees.
    bare = ServerActor.start(model_path=model_path, n_parallel=4, n_ctx=2048)
    try:
        same_numbers(base, run(bare))
    finally:
        bare.stop()


def test_requests_of_different_adapter_sets_in_flight_equal_their_solo_runs(ref: Any) -> None:
    sets = [{"tenant-a": 1.0}, {1: 0.7}, None, {"tenant-a": 0.5, "tenant-b": 0.5}]
    prompts = [PROMPT, "A short poem about rain:", PROMPT, "Three facts about owls:"]
    solo = [run(ref, lora, p) for lora, p in zip(sets, prompts, strict=True)]
    futures = [
        ref.ask(
            Generate(p, lora=lora, max_tokens=N, temp=0.0, logprobs=4, logit_bias=NO_EOG, cache_prompt=False)
        )
        for lora, p in zip(sets, prompts, strict=True)
    ]
    for alone, future in zip(solo, futures, strict=True):
        same_numbers(alone, future.get(timeout=120))


def test_a_prefix_is_reused_within_a_set_only(ref: Any) -> None:
    prompt = "Write a list of ten colours, one per line, starting with red. " * 4
    options = {"max_tokens": 2, "temp": 0.0}
    first = generate(ref, prompt, lora={"tenant-b": 1.0}, **options)
    assert generate(ref, prompt, **options).prefix_cache_tokens == 0
    again = generate(ref, prompt, lora={"tenant-b": 1.0}, logprobs=2, **options)
    assert again.prefix_cache_tokens > 0
    fresh = generate(ref, prompt, lora={"tenant-b": 1.0}, logprobs=2, cache_prompt=False, **options)
    same_numbers(fresh, again)
    assert first.token_ids == again.token_ids


def test_the_default_scales_are_listed_and_set(ref: Any, adapters: tuple[str, str]) -> None:
    listed = ref.ask(GetLora())
    assert listed == (LoraAdapter(adapters[0], 0.0, "tenant-a"), LoraAdapter(adapters[1], 0.0, "tenant-b"))
    try:
        assert [a.scale for a in ref.ask(SetLora({"tenant-a": 1.0}))] == [1.0, 0.0]
        same_numbers(run(ref, {"tenant-a": 1.0}), run(ref))
    finally:
        ref.ask(SetLora({}))
    with pytest.raises(Exception, match="does not have"):
        ref.ask(SetLora({"tenant-z": 1.0}))


def refused(model_path: str, lora: Any, match: str) -> None:
    running = len(pykka.ActorRegistry.get_all())
    with pytest.raises(ModelLoadError, match=match):
        ServerActor.start(model_path=model_path, n_ctx=512, lora=lora)
    assert len(pykka.ActorRegistry.get_all()) == running  # refused in the caller's thread


def test_an_adapter_llama_cpp_could_not_apply_is_refused_before_loading(
    model_path: str, tmp_path: Path
) -> None:
    refused(model_path, [write_lora(tmp_path / "gemma.gguf", architecture="gemma3")], "'gemma3' model")
    refused(model_path, [write_lora(tmp_path / "shape.gguf", n_in_delta=64)], "do not fit")
    refused(model_path, [model_path], "not a LoRA adapter")
    refused(model_path, [str(tmp_path / "missing.gguf")], "no file")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\xff" * 64)
    refused(model_path, [str(tmp_path / "junk.gguf")], "cannot read")


def test_a_decision_runs_with_its_adapters(ref: Any) -> None:
    from actors import decide

    questions = {"ok": {"type": "noul", "instructions": "Is the sky blue?"}}
    base = decide(ref, "a clear day", questions)
    tuned = decide(ref, "a clear day", questions, lora={"tenant-a": 1.0})
    assert base.answers["ok"].probabilities != tuned.answers["ok"].probabilities
    again = decide(ref, "a clear day", questions, lora={"tenant-a": 1.0})
    assert again.answers["ok"].probabilities == tuned.answers["ok"].probabilities
