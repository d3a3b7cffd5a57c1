"""``POST /infill``: llama-server's fill-in-the-middle, served as a native completion of
``Tokenizer.infill``'s prompt.

The default model (SmolLM2) has no FIM tokens: its 501 is checked in ``test_http.py``,
on that file's server. These run on the tiny random model (the default model's
tokenizer) with FIM tokens named in its metadata, so layouts, budgets and streams are
checked in a fraction of the time; its text is nonsense, so requests are compared with
each other, never with a text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from http_server import Running
from tiny_gguf import write_tiny_model

from actors import GetTokenizer, ServerActor, Tokenizer
from actors.http import HttpSettings

pytestmark = pytest.mark.timeout(60)

# Control tokens of the default model's vocabulary: <reponame>, <file_sep>, <issue_*>.
REP, SEP, PRE, SUF, MID = 4, 5, 8, 9, 10
N_CTX_SLOT, N_BATCH = 256, 64

# llama.cpp's tools/server/tests/unit/test_infill.py's request.
CODE: dict[str, Any] = {
    "input_extra": [{"filename": "llama.h", "text": "LLAMA_API int32_t llama_n_threads();\n"}],
    "input_prefix": '#include <cstdio>\n#include "llama.h"\n\nint main() {\n',
    "prompt": "    int n_threads = llama_",
    "input_suffix": "}\n",
}
GREEDY: dict[str, Any] = {"temperature": 0, "n_predict": 6, "cache_prompt": False, "return_tokens": True}


@pytest.fixture(scope="module")
def fim(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    path = write_tiny_model(
        tmp_path_factory.mktemp("fim") / "fim.gguf",
        fim={"pre": PRE, "suf": SUF, "mid": MID, "rep": REP, "sep": SEP},
    )
    with Running.ready(
        HttpSettings(),
        lambda: ServerActor.start(
            model_path=path, n_parallel=2, n_ctx=2 * N_CTX_SLOT, n_batch=N_BATCH, seed=7
        ),
    ) as server:
        yield server


@pytest.fixture(scope="module")
def tokenizer(fim: Running) -> Tokenizer:
    tokenizer: Tokenizer = fim.engine.ask(GetTokenizer())
    return tokenizer


@pytest.fixture(scope="module")
def client(fim: Running) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fim.url, timeout=30) as client:  # one SSL context, not one a request
        yield client


def test_infill_is_the_native_completion_of_the_tokenizers_infill_prompt(
    client: httpx.Client, tokenizer: Tokenizer
) -> None:
    assert tokenizer.fim_tokens.missing == ""
    prompt = tokenizer.infill(
        CODE["input_prefix"],
        CODE["input_suffix"],
        extra=[("llama.h", CODE["input_extra"][0]["text"])],
        prompt=CODE["prompt"],
    )
    text = tokenizer.detokenize(prompt)
    assert text.startswith("<reponame>myproject\n<file_sep>llama.h\nLLAMA_API")
    assert "<file_sep>filename\n<issue_start>#include <cstdio>" in text
    assert text.endswith("int n_threads = llama_<issue_comment>}\n<issue_closed>")
    infilled = client.post("/infill", json={**CODE, **GREEDY, "n_probs": 2})
    completed = client.post("/completion", json={"prompt": prompt, **GREEDY, "n_probs": 2})
    assert infilled.status_code == completed.status_code == 200
    got, expected = infilled.json(), completed.json()
    assert got["tokens_evaluated"] == len(prompt) == expected["tokens_evaluated"]
    assert got["tokens"] == expected["tokens"] and got["content"] == expected["content"]
    assert got["prompt"] == text and expected["prompt"] == ""  # as llama-server shows an infill's
    assert len(got["completion_probabilities"]) == got["tokens_predicted"] <= 6
    assert got["stop"] is True and got["generation_settings"]["n_predict"] == 6


def test_without_extra_the_hole_alone_is_the_prompt(client: httpx.Client, tokenizer: Tokenizer) -> None:
    body = {"input_prefix": "def f(x):\n", "input_suffix": "\n", "n_predict": 1}
    got = client.post("/infill", json=body).json()
    prefix = tokenizer.tokenize(body["input_prefix"], add_special=False, parse_special=False)
    suffix = tokenizer.tokenize(body["input_suffix"], add_special=False, parse_special=False)
    # the model has FIM_REP and FIM_SEP: the repository and the file edited are named anyway
    named = tokenizer.tokenize("myproject\n", add_special=False) + tokenizer.tokenize(
        "filename\n", add_special=False
    )
    assert got["tokens_evaluated"] == 2 + len(named) + 3 + len(prefix) + len(suffix)


def test_long_parts_are_trimmed_to_the_batch_and_the_slot(client: httpx.Client, tokenizer: Tokenizer) -> None:
    extra = [{"filename": f"f{i}.c", "text": f"int f{i}(void) {{ return {i}; }}\n"} for i in range(300)]
    body = {
        "input_prefix": "x = 1;\n" * 300,
        "input_suffix": "y = 2;\n" * 300,
        "input_extra": extra,
        "n_predict": 2,
    }
    got = client.post("/infill", json=body).json()
    expected = tokenizer.infill(
        body["input_prefix"],
        body["input_suffix"],
        extra=[(chunk["filename"], chunk["text"]) for chunk in extra],
        n_ctx=N_CTX_SLOT,
        n_batch=N_BATCH,
    )
    # the hole: the prefix's last 48 tokens, the suffix's first 14; the extra context
    # fills the slot but for one token (llama-server's budget would overflow it)
    assert got["tokens_evaluated"] == len(expected) == N_CTX_SLOT - 1
    assert expected[-(1 + 14 + 1 + 48 + 1) :][0] == PRE
    assert 1 <= got["tokens_predicted"] <= 2


def test_a_stream_joins_to_the_whole_answer(client: httpx.Client) -> None:
    whole = client.post("/infill", json={**CODE, **GREEDY}).json()
    with client.stream("POST", "/infill", json={**CODE, **GREEDY, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert "".join(e["content"] for e in events) == whole["content"]
    assert [t for e in events[:-1] for t in e["tokens"]] == whole["tokens"]
    last = events[-1]
    assert last["stop"] is True and last["tokens_evaluated"] == whole["tokens_evaluated"]
    assert last["prompt"] == whole["prompt"] and last["prompt"].endswith("<issue_closed>")


HOSTILE: list[Any] = [
    # llama.cpp's test_invalid_input_extra_req
    {**CODE, "input_extra": [{}]},
    {**CODE, "input_extra": [{"filename": "ok"}]},
    {**CODE, "input_extra": [{"filename": 123}]},
    {**CODE, "input_extra": [{"filename": 123, "text": "abc"}]},
    {**CODE, "input_extra": [{"filename": 123, "text": 456}]},
    # ours
    {**CODE, "input_extra": {"filename": "a", "text": "b"}},
    {**CODE, "input_extra": ["int a;"]},
    {**CODE, "input_extra": [{"text": ["int a;"]}]},
    {**CODE, "input_extra": [{"filename": None, "text": "a"}]},
    {**CODE, "input_extra": [{"text": ""}] * 1025},
    {**CODE, "prompt": 5},
    {**CODE, "prompt": ["a"]},
    {"input_suffix": "}\n"},
    {"input_prefix": "x", "input_suffix": 5},
    {"input_prefix": None, "input_suffix": "y"},
    {"input_prefix": ["x", True], "input_suffix": "y"},
    {"input_prefix": [10**9], "input_suffix": "y"},
    {**CODE, "n_predict": "many"},
    {**CODE, "temperature": "hot"},
    [CODE],
]


@pytest.mark.parametrize("body", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_bodies_get_400s_with_llama_server_bodies(client: httpx.Client, body: Any) -> None:
    response = client.post("/infill", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error" and error["message"]
