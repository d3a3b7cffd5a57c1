"""Embeddings: ``Embed``, ``embed()`` and ``aembed()`` equal ``llama_cpp.Llama(embedding=True)``.

References are computed in the same run (the CPU kernels differ between machines), by
one ``Llama`` per pooling, with flash attention off on both sides (its kernel sums in
another order: with it on, vectors differ by about 1e-2). The same texts in the same
batch give the same vectors to about 1e-7; a batch of other texts moves them, in
``Llama`` too (16 texts in one batch or each alone: up to 9e-3, cosine 0.9997), so
concurrent callers, whose texts share passes as they arrive, are held to that.
"""

from __future__ import annotations

import asyncio
import pickle
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pykka
import pytest
from helpers import NO_EOG, same_greedy

from actors import (
    Cancel,
    Done,
    Embed,
    Embeddings,
    EngineError,
    GetStats,
    GetTokenizer,
    InvalidRequest,
    PromptTooLong,
    RequestTimeout,
    ServerPool,
    StrategyError,
    Stream,
    Supervisor,
    Token,
    aembed,
    embed,
    generate,
)
from strategies import DecodeMaximal, EmbedBudget

TEXTS = [
    "I believe the meaning of life is",
    "Write a joke about AI from a very long prompt which will not be truncated",
    "This is a test",
    "hello",
    "The quick brown fox jumps over the lazy dog. " * 6,
]
TOLERANCE = 1e-4  # on unit vectors, the same batch: equal kernels give ~1e-7
SPREAD = 2e-2  # on unit vectors, another batch (Llama's own spread is 9e-3)


def assert_close_across_batches(got: npt.NDArray[np.float32], expected: npt.NDArray[np.float32]) -> None:
    np.testing.assert_allclose(got, expected, atol=SPREAD)
    assert (np.sum(got * expected, axis=1) > 0.999).all()


@pytest.fixture(scope="module")
def references(model_path: str) -> Iterator[Callable[[list[str], str], npt.NDArray[np.float32]]]:
    """``ref(texts, pooling)``: Llama(embedding=True, pooling_type=...).embed(texts, normalize=True)."""
    import llama_cpp

    types = {
        "mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN,
        "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS,
        "last": llama_cpp.LLAMA_POOLING_TYPE_LAST,
    }
    models: dict[str, Any] = {}
    lock = threading.Lock()

    def reference(texts: list[str], pooling: str) -> npt.NDArray[np.float32]:
        with lock:
            if pooling not in models:
                models[pooling] = llama_cpp.Llama(
                    model_path, embedding=True, pooling_type=types[pooling], n_ctx=2048, n_batch=2048,
                    n_threads=1, flash_attn=False, verbose=False,
                )  # fmt: skip
            return np.array(models[pooling].embed(texts, normalize=True), dtype=np.float32)

    yield reference
    for llm in models.values():
        llm.close()


@pytest.fixture
def embedder(start_server: Callable[..., pykka.ActorRef[Any]]) -> pykka.ActorRef[Any]:
    return start_server(n_parallel=4, flash_attn=False)


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_equal_to_llama_embed(embedder: pykka.ActorRef[Any], references: Any, pooling: str) -> None:
    vectors = embed(embedder, TEXTS, pooling=pooling, timeout=60)  # type: ignore[arg-type]
    assert vectors.dtype == np.float32 and vectors.shape == (len(TEXTS), 576)
    assert not vectors.flags.writeable
    np.testing.assert_allclose(vectors, references(TEXTS, pooling), atol=TOLERANCE)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_the_default_pooling_is_mean_and_normalize_can_be_off(
    embedder: pykka.ActorRef[Any], references: Any
) -> None:
    result = embedder.ask(Embed(TEXTS[:2], normalize=False)).get(timeout=60)
    assert isinstance(result, Embeddings) and result.pooling == "mean" and not result.normalized
    assert result.prompt_tokens == tuple(len(embedder.ask(GetTokenizer()).tokenize(t)) for t in TEXTS[:2])
    assert result.total_tokens == sum(result.prompt_tokens)
    norms = np.linalg.norm(result.vectors, axis=1)
    assert (np.abs(norms - 1.0) > 1e-2).all()
    np.testing.assert_allclose(result.vectors / norms[:, None], references(TEXTS[:2], "mean"), atol=TOLERANCE)


def test_token_id_texts_equal_their_text(embedder: pykka.ActorRef[Any]) -> None:
    ids = embedder.ask(GetTokenizer()).tokenize(TEXTS[0])
    both = embed(embedder, [TEXTS[0], ids], timeout=60)
    np.testing.assert_allclose(both[0], both[1], atol=1e-6)


def test_one_string_is_one_vector(embedder: pykka.ActorRef[Any]) -> None:
    # embed(ref, "text"), as sentence-transformers' encode takes one: its vector, 1-D.
    listed = embed(embedder, [TEXTS[0]], timeout=60)
    one = embed(embedder, TEXTS[0], timeout=60)
    assert one.shape == listed.shape[1:] and not one.flags.writeable
    np.testing.assert_array_equal(one, listed[0])
    got = asyncio.run(aembed(embedder, TEXTS[0], timeout=60))
    np.testing.assert_array_equal(got, listed[0])


def test_one_text_at_a_time(embedder: pykka.ActorRef[Any], references: Any) -> None:
    for text in TEXTS:
        got = embed(embedder, [text], pooling="last", timeout=60)
        np.testing.assert_allclose(got, references([text], "last"), atol=TOLERANCE)
    stats = embedder.ask(GetStats())
    assert stats["embed_queue_depth"] == 0 and stats["embedded_texts"] == stats["embed_passes"] == len(TEXTS)


def test_sixteen_concurrent_callers(embedder: pykka.ActorRef[Any], references: Any) -> None:
    texts = [f"{TEXTS[i % len(TEXTS)]} (caller {i})" for i in range(16)]
    expected = np.concatenate([references([t], "last") for t in texts])
    got: dict[int, npt.NDArray[np.float32]] = {}

    def call(i: int) -> None:
        got[i] = embed(embedder, [texts[i]], pooling="last", timeout=120)[0]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(got) == list(range(16))
    assert_close_across_batches(np.stack([got[i] for i in range(16)]), expected)


def test_a_text_longer_than_the_batch_is_fed_in_chunks(
    start_server: Callable[..., pykka.ActorRef[Any]], references: Any
) -> None:
    ref = start_server(n_parallel=2, n_batch=64, flash_attn=False)
    text = "Once upon a time, in a land far away, there lived a curious fox. " * 12  # ~190 tokens
    assert len(ref.ask(GetTokenizer()).tokenize(text)) > 64
    for pooling in ("mean", "last"):
        got = embed(ref, [text, "short"], pooling=pooling, timeout=60)  # type: ignore[arg-type]
        np.testing.assert_allclose(got, references([text, "short"], pooling), atol=TOLERANCE)
    assert ref.ask(GetStats())["kv_cells_used"] == 0  # every embedding cell was freed
    # A long text is fed one pass a tick, its cells on the books; a cancel frees them.
    long = "Once upon a time, in a land far away, there lived a curious fox. " * 60  # ~960 tokens: 15 ticks
    future = ref.ask(Embed([long], request_id="long"))
    beside = generate(ref, "Hello", max_tokens=4, timeout=60)  # generation goes on meanwhile
    assert beside.generated_tokens > 0
    ref.tell(Cancel("long"))
    with pytest.raises(EngineError, match="cancelled"):
        future.get(timeout=60)
    assert ref.ask(GetStats())["kv_cells_used"] == beside.prompt_tokens + beside.generated_tokens - 1


def test_generation_is_unchanged_beside_embeddings(start_server: Callable[..., pykka.ActorRef[Any]]) -> None:
    ref = start_server(n_parallel=2)
    prompt = "The capital of France is"
    alone = generate(ref, prompt, max_tokens=24, temp=0, logprobs=2, timeout=60)
    stop = threading.Event()

    def keep_embedding() -> None:
        while not stop.is_set():
            embed(ref, TEXTS[:4], timeout=60)

    worker = threading.Thread(target=keep_embedding)
    worker.start()
    try:
        beside = generate(ref, prompt, max_tokens=24, temp=0, cache_prompt=False, timeout=60)
    finally:
        stop.set()
        worker.join(timeout=60)
    same_greedy(alone, beside.token_ids)
    # Every embedding cell was freed: llama.cpp holds the slots' positions only.
    stats = ref.ask(GetStats())
    assert stats["kv_positions"] == tuple(s.kv_tokens for s in stats["slots"])


def _stream_ms(ref: pykka.ActorRef[Any]) -> float:
    """A 32-token greedy stream's time from its first token to its last (ms)."""
    tokens = queue.Queue[Any]()
    ref.tell(
        Stream(
            "Tell me a long story about a dragon.", max_tokens=32, temp=0, logit_bias=NO_EOG, reply_to=tokens
        )
    )
    times = []
    while True:
        event = tokens.get(timeout=300)
        if isinstance(event, Token):
            times.append(time.perf_counter())
        elif isinstance(event, Done):
            return (times[-1] - times[0]) * 1000.0
        else:
            raise AssertionError(event)


def test_an_embedding_client_costs_a_stream_at_most_half_its_speed(
    start_server: Callable[..., pykka.ActorRef[Any]],
) -> None:
    # A hostile review: one client looping /v1/embeddings (8 texts of ~80 tokens) took a
    # 30-token stream from 0.25 s to 21.75 s; every tick ran a whole pass before decoding.
    ref = start_server(n_parallel=4)
    alone = sorted(_stream_ms(ref) for _ in range(3))[1]
    stop = threading.Event()
    served = []

    def keep_embedding() -> None:
        while not stop.is_set():
            served.append(embed(ref, [TEXTS[4] + f" ({i})" for i in range(8)], timeout=300))

    worker = threading.Thread(target=keep_embedding)
    worker.start()
    try:
        time.sleep(0.5)
        beside = sorted(_stream_ms(ref) for _ in range(3))[1]
    finally:
        stop.set()
        worker.join(timeout=300)
    assert served  # embeddings go on, more slowly, beside the stream
    assert beside <= 2.0 * alone, (beside, alone)


class _Rows(DecodeMaximal):
    """Embedding passes of ``rows`` rows while slots are busy; records the budgets."""

    def __init__(self, rows: Any) -> None:
        self.rows = rows
        self.budgets: list[EmbedBudget] = []

    def embed_rows(self, budget: EmbedBudget) -> int:
        self.budgets.append(budget)
        return self.rows  # type: ignore[no-any-return]


def test_the_strategy_sizes_embedding_passes_beside_generation(
    start_server: Callable[..., pykka.ActorRef[Any]], references: Any
) -> None:
    strategy = _Rows(3)
    ref = start_server(n_parallel=2, flash_attn=False, batch_strategy=strategy)
    busy = ref.ask(
        Stream("Count to a thousand:", max_tokens=400, temp=0, logit_bias=NO_EOG, reply_to=queue.Queue())
    )
    del busy
    got = embed(ref, TEXTS, timeout=120)  # fed 3 rows a pass, each text over several ticks
    assert_close_across_batches(got, references(TEXTS, "mean"))
    assert strategy.budgets and all(b.rows_max == 256 for b in strategy.budgets)
    assert any(b.generation_ms > 0 and b.row_ms > 0 for b in strategy.budgets)
    # A strategy that answers nonsense fails the embedding requests, not the engine.
    for bad in (-1, 257, "3", None):
        strategy.rows = bad
        with pytest.raises(StrategyError, match="embed_rows must return an int"):
            embed(ref, TEXTS[:1], timeout=60)


@pytest.mark.parametrize(
    ("texts", "options", "match"),
    [
        ([], {}, "must not be empty"),
        ("a string", {}, "must be a list"),
        ([""], {}, "texts\\[0\\] is empty"),
        (["ok", []], {}, "texts\\[1\\] is empty"),
        (["\ud83d"], {}, "lone surrogate"),
        ([b"bytes"], {}, "must be a str or a list of token ids"),
        ([3], {}, "must be a str or a list of token ids"),
        ([[1, -2]], {}, "not a non-negative int32"),
        ([[1, "x"]], {}, "not a non-negative int32"),
        ([[True]], {}, "not a non-negative int32"),
        (["x"] * 2049, {}, "at most 2048 texts"),
        (["x" * (16 * 1024 * 1024 + 1)], {}, "at most"),
        (["ok"], {"pooling": "max"}, "pooling must be one of"),
        (["ok"], {"pooling": 1}, "pooling must be one of"),
        (["ok"], {"normalize": 1}, "normalize must be a bool"),
        (["ok"], {"model": 3}, "model must be a str"),
        (["ok"], {"request_id": ""}, "request_id must be a non-empty"),
        (["ok"], {"deadline_s": 0}, "deadline_s must be"),
        (["ok"], {"deadline_s": float("nan")}, "finite"),
    ],
)
def test_bad_input_is_refused_in_the_callers_thread(texts: Any, options: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        Embed(texts, **options)


def test_bad_input_needing_the_model(embedder: pykka.ActorRef[Any]) -> None:
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        embed(embedder, [[1, 10**6]], timeout=30)
    with pytest.raises(PromptTooLong, match="too large"):
        embed(embedder, ["This is a test " * 512], timeout=30)
    with pytest.raises(InvalidRequest, match="already in use"):
        embedder.ask(Embed(["a"] * 400, request_id="same"), block=False)
        embedder.ask(Embed(["b"], request_id="same")).get(timeout=30)
    assert embed(embedder, ["still serving"], timeout=60).shape == (1, 576)


def test_cancel_and_deadline(embedder: pykka.ActorRef[Any]) -> None:
    many = [f"text number {i} " * 8 for i in range(1500)]
    future = embedder.ask(Embed(many, request_id="big"))
    embedder.tell(Cancel("big"))
    with pytest.raises(EngineError, match="cancelled"):
        future.get(timeout=60)
    with pytest.raises(RequestTimeout, match="deadline"):
        embedder.ask(Embed(many, deadline_s=0.05)).get(timeout=60)
    assert embed(embedder, ["after"], timeout=60).shape == (1, 576)


def test_a_supervisor_and_a_pool_serve_embed(model_path: str, references: Any) -> None:
    supervisor = Supervisor.start(
        model_path=model_path, n_parallel=2, n_ctx=1024, n_threads=1, flash_attn=False
    )
    pool = ServerPool.start(
        replicas=2, model_path=model_path, n_parallel=2, n_ctx=1024, n_threads=1, flash_attn=False
    )
    try:
        expected = references(TEXTS[:3], "mean")
        for handle in (supervisor, pool):
            np.testing.assert_allclose(embed(handle, TEXTS[:3], timeout=60), expected, atol=TOLERANCE)
            got = asyncio.run(aembed(handle, TEXTS[:3], timeout=60))
            np.testing.assert_allclose(got, expected, atol=TOLERANCE)
        assert pool.ask(GetStats())["replicas_up"] == 2
    finally:
        supervisor.stop()
        pool.stop()


def test_a_model_manager_routes_embed_by_model(model_path: str, tmp_path: Any) -> None:
    from tiny_gguf import write_tiny_model

    from actors import ModelManager

    tiny = write_tiny_model(tmp_path / "tiny.gguf")
    small = {"n_ctx": 512, "n_parallel": 2, "n_threads": 1}
    manager = ModelManager.start(
        {"smol": {"model_path": model_path, **small}, "tiny": {"model_path": tiny, **small}}
    )
    try:
        smol = embed(manager, ["hello", "world"], model="smol", timeout=60)
        assert smol.shape == (2, 576)
        small_one = asyncio.run(aembed(manager, ["hello"], model="tiny", timeout=60))
        assert small_one.shape[0] == 1 and small_one.shape[1] != 576
        np.testing.assert_allclose(np.linalg.norm(small_one, axis=1), 1.0, atol=1e-5)
    finally:
        manager.stop()


def test_aembed_many_tasks_and_cancel(embedder: pykka.ActorRef[Any], references: Any) -> None:
    texts = [f"asynchronous caller {i}" for i in range(16)]

    async def main() -> list[npt.NDArray[np.float32]]:
        results = await asyncio.gather(*(aembed(embedder, [t], timeout=120) for t in texts))
        task = asyncio.create_task(aembed(embedder, [f"long text {i} " * 8 for i in range(1500)]))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return [r[0] for r in results]

    got = asyncio.run(main())
    assert_close_across_batches(np.stack(got), np.concatenate([references([t], "mean") for t in texts]))
    with pytest.raises(InvalidRequest):
        asyncio.run(aembed(embedder, []))


def test_embed_pickles_and_checks_again() -> None:
    message = Embed(["a", [1, 2]], pooling="cls", normalize=False, model="m", deadline_s=3)
    again = pickle.loads(pickle.dumps(message))
    assert again == message and again.texts == ("a", (1, 2))


# -- over HTTP: /v1/embeddings (OpenAI's), /embedding and /embeddings (llama-server's) -----


@pytest.fixture(scope="module")
def http(model_path: str) -> Iterator[Any]:
    from http_server import Running

    from actors import ServerActor
    from actors.http import HttpSettings

    server = Running(
        HttpSettings(model_ids=("smol",), pooling="last"),
        # Flash attention as by default: it skips other sequences' cells, so equal texts in
        # one batch give equal vectors (without it they differ by up to 5e-3).
        lambda: ServerActor.start(model_path=model_path, n_parallel=2, n_ctx=2048),
    )
    server.wait_ready()
    yield server
    server.stop()


def test_openai_client_embeddings(http: Any) -> None:
    import openai

    client = openai.OpenAI(base_url=http.url + "/v1", api_key="none", max_retries=0)
    one = client.embeddings.create(model="text-embedding-3-small", input=TEXTS[0])
    assert one.model == "text-embedding-3-small" and len(one.data) == 1
    np.testing.assert_allclose(
        one.data[0].embedding, embed(http.engine, TEXTS[:1], pooling="last")[0], atol=1e-6
    )
    expected = embed(http.engine, TEXTS[:4], pooling="last")
    many = client.embeddings.create(model="smol", input=TEXTS[:4])
    assert [d.index for d in many.data] == [0, 1, 2, 3]
    np.testing.assert_allclose([d.embedding for d in many.data], expected, atol=1e-6)
    n_tokens = sum(len(http.engine.ask(GetTokenizer()).tokenize(t)) for t in TEXTS[:4])
    assert many.usage.prompt_tokens == many.usage.total_tokens == n_tokens
    # The openai package asks for base64 by default and decodes it: the same floats.
    ids = client.embeddings.create(model="smol", input=[[1, 2, 3], [4, 5]])
    assert len(ids.data) == 2


def test_llama_server_shapes_and_errors(http: Any) -> None:
    import base64
    import struct

    import httpx

    def post(path: str, body: Any) -> httpx.Response:
        return httpx.post(http.url + path, json=body, timeout=60)

    floats = post("/v1/embeddings", {"input": "Test base64 embedding output"}).json()["data"][0]["embedding"]
    encoded = post("/v1/embeddings", {"input": "Test base64 embedding output", "encoding_format": "base64"})
    entry = encoded.json()["data"][0]
    assert entry["encoding_format"] == "base64"
    decoded = struct.unpack(f"{len(floats)}f", base64.b64decode(entry["embedding"]))
    np.testing.assert_allclose(decoded, floats, atol=1e-6)
    for path in ("/embedding", "/embeddings"):
        native = post(path, {"content": "hello hello hello"}).json()
        assert len(native) == 1 and native[0]["index"] == 0 and len(native[0]["embedding"][0]) == 576
    mixed = post(
        "/v1/embeddings",
        {"input": ["string1", [12, 34, 56], [12, "string", 34], {"prompt_string": "s"},
                   {"content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]},
                   "hello world"]},
    ).json()["data"]  # fmt: skip
    assert len(mixed) == 6
    assert mixed[4]["embedding"] == mixed[5]["embedding"]
    same = post("/v1/embeddings", {"input": ["I believe the meaning of life is"] * 5}).json()["data"]
    assert all(d["embedding"] == same[0]["embedding"] for d in same)
    raw = post("/embedding", {"content": "x", "embd_normalize": -1}).json()[0]["embedding"][0]
    assert abs(np.linalg.norm(raw) - 1.0) > 1e-2
    for body in (
        {"input": []},
        {"input": ""},
        {"input": {"content": "string"}},
        {"input": {"content": [{"type": "input_audio", "input_audio": {}}]}},
        {"input": {"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}},
        {"input": "x", "encoding_format": "hex"},
        {"nothing": 1},
        {"input": [[1, 10**9]]},
    ):
        response = post("/v1/embeddings", body)
        assert response.status_code == 400, body
        assert response.json()["error"]["type"] in ("invalid_request_error", "exceed_context_size_error")
    too_long = post("/v1/embeddings", {"input": "This is a test " * 512})
    assert too_long.status_code == 400 and "too large" in too_long.json()["error"]["message"]


def test_serve_accepts_embedding_and_pooling() -> None:
    from actors.http._cli import CliError, parse

    plan = parse(["serve", "-c", "64", "--embedding", "--pooling", "cls"], environ={})
    assert plan.settings.pooling == "cls"
    assert parse(["serve", "-c", "64"], environ={}).settings.pooling is None
    assert parse(["serve", "-c", "64", "--pooling", "none"], environ={}).settings.pooling == "none"
    for refused in ("rank", "max"):
        with pytest.raises((CliError, SystemExit)):
            parse(["serve", "-c", "64", "--pooling", refused], environ={})


# llama.cpp aborts the process on a sequence id past n_seq_max, a batch past n_batch,
# or sequences outnumbering n_batch: the edges of the lanes run in a child process.
EDGES = """
import numpy as np
from actors import InvalidRequest, ServerActor, embed, generate
ref = ServerActor.start(n_parallel=2, n_ctx=256, n_batch=8, n_threads=1)  # 6 lanes, passes of 8 rows
vectors = embed(ref, [f"text {i}" for i in range(20)] + ["a longer text " * 12], timeout=120)
assert vectors.shape == (21, 576) and np.isfinite(vectors).all()
generate(ref, "Hello", max_tokens=4, timeout=60)
ref.stop()
ref = ServerActor.start(n_parallel=4, n_ctx=256, n_batch=4, n_threads=1)  # no lane to spare
try:
    embed(ref, ["x"], timeout=60)
    raise SystemExit("not refused")
except InvalidRequest as e:
    assert "no sequence to spare" in str(e), e
ref.stop()
ref = ServerActor.start(n_parallel=255, n_ctx=4096, n_batch=512, n_threads=1)  # one lane: LLAMA_MAX_SEQ
assert embed(ref, ["one", "two", "three"], timeout=120).shape == (3, 576)
ref.stop()
print("ok")
"""


@pytest.mark.model
@pytest.mark.subprocess
def test_the_lanes_edges_never_abort_llama_cpp() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", EDGES], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_embeddings_pickle() -> None:
    result = Embeddings("r", np.ones((2, 3), np.float32), (1, 2), "mean", True, 1.0)
    again = pickle.loads(pickle.dumps(result))
    assert again.request_id == "r" and again.total_tokens == 3
    np.testing.assert_array_equal(again.vectors, result.vectors)


def test_pooling_none_is_llama_servers_400_on_the_openai_endpoint(model_path: str) -> None:
    import httpx
    from http_server import Running

    from actors import ServerActor
    from actors.http import HttpSettings

    server = Running(
        HttpSettings(pooling="none"),
        lambda: ServerActor.start(model_path=model_path, n_parallel=1, n_ctx=512),
    )
    try:
        server.wait_ready()
        oai = httpx.post(server.url + "/v1/embeddings", json={"input": "hello hello hello"}, timeout=60)
        assert oai.status_code == 400 and "not OAI compatible" in oai.json()["error"]["message"]
        native = httpx.post(server.url + "/embedding", json={"content": "hello"}, timeout=60)
        assert native.status_code == 501
    finally:
        server.stop()


def test_a_long_text_gives_its_cells_back_to_generation(
    start_server: Callable[..., pykka.ActorRef[Any]],
) -> None:
    from helpers import wait_until

    ref = start_server(n_parallel=1, n_ctx=256, n_batch=32)
    text = "Once upon a time, in a land far away, there lived a curious fox. " * 14  # ~225 tokens
    future = ref.ask(Embed([text]))
    wait_until(lambda: ref.ask(GetStats())["kv_cells_used"] >= 128, seconds=120)  # half fed, cells held
    # 150 prompt tokens fit the 256 cells only if the embedding gives its cells back.
    completion = generate(ref, "word " * 150, max_tokens=4, timeout=120)
    assert completion.generated_tokens == 4 and completion.stop_reason == "max_tokens"
    first = future.get(timeout=120).vectors  # it started over, and finished
    np.testing.assert_allclose(first, embed(ref, [text], timeout=120), atol=1e-4)
    assert ref.ask(GetStats())["kv_cells_used"] <= completion.prompt_tokens + 4
