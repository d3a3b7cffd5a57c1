"""LoRA adapters over HTTP, as llama-server serves them: ``--lora``, ``--lora-scaled``
and ``--lora-init-without-apply``, ``GET``/``POST /lora-adapters``, and a request's own
``lora`` on the native and OpenAI endpoints, with the same numbers as in-process."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from http_server import Running
from tiny_lora import write_lora

from actors import ServerActor, generate
from actors.http import HttpSettings
from actors.http._cli import parse

pytestmark = pytest.mark.timeout(180)

PROMPT = "The best thing about autumn is"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    folder = tmp_path_factory.mktemp("lora")
    return write_lora(folder / "a.gguf", seed=3), write_lora(folder / "b.gguf", seed=4)


@pytest.fixture(scope="module")
def running(model_path: str, files: tuple[str, str]) -> Iterator[Running]:
    # What `serve --lora a.gguf --lora-scaled b.gguf:0.5 --lora-init-without-apply` starts.
    options = parse(
        ["serve", "--lora", files[0], "--lora-scaled", f"{files[1]}:0.5", "--lora-init-without-apply"]
    )
    lora = options.server_options["lora"]
    assert lora == ((files[0], 0.0), (files[1], 0.0))
    with Running.ready(
        HttpSettings(model_ids=("smol",)),
        lambda: ServerActor.start(model_path=model_path, n_parallel=4, n_ctx=2048, lora=list(lora)),
    ) as server:
        yield server


def post(running: Running, path: str, body: Any) -> httpx.Response:
    return httpx.post(running.url + path, json=body, timeout=120)


def completion(running: Running, **extra: Any) -> dict[str, Any]:
    body = {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "n_probs": 3, "cache_prompt": False, **extra}
    response = post(running, "/completion", body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def probs(out: dict[str, Any]) -> list[Any]:
    return [(p["id"], p["logprob"]) for p in out["completion_probabilities"]]


def test_the_adapters_are_listed_and_their_scales_set(running: Running, files: tuple[str, str]) -> None:
    listed = httpx.get(running.url + "/lora-adapters", timeout=10).json()
    assert [(a["id"], a["path"], a["scale"]) for a in listed] == [(0, files[0], 0.0), (1, files[1], 0.0)]
    assert {"task_name", "prompt_prefix", "name"} <= set(listed[0])
    try:
        assert post(running, "/lora-adapters", [{"id": 1, "scale": 0.5}]).json() == {"success": True}
        assert [a["scale"] for a in httpx.get(running.url + "/lora-adapters").json()] == [0.0, 0.5]
        # Requests without their own lora now run with it.
        assert probs(completion(running)) == probs(completion(running, lora=[{"id": 1, "scale": 0.5}]))
    finally:
        post(running, "/lora-adapters", [])
    assert [a["scale"] for a in httpx.get(running.url + "/lora-adapters").json()] == [0.0, 0.0]


def test_a_request_runs_with_its_own_adapters_as_in_process(running: Running) -> None:
    base, tuned = completion(running), completion(running, lora=[{"id": 0, "scale": 1.0}])
    assert probs(base) != probs(tuned)
    local = generate(
        running.engine, PROMPT, lora={0: 1.0}, max_tokens=6, temp=0.0, logprobs=3, cache_prompt=False
    )
    assert local.logprobs is not None
    assert [(e.token_id, e.logprob) for e in local.logprobs] == probs(tuned)  # the same numbers
    chat = post(
        running,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "lora": [{"id": 0, "scale": 1.0}]},
    )
    assert chat.status_code == 200, chat.text


@pytest.mark.parametrize(
    ("lora", "says"),
    [
        ([{"id": 5, "scale": 1.0}], "does not have"),
        ([{"id": 0, "scale": "high"}], "finite number"),
        ([{"id": 0, "scale": 1e9}], "within"),
        ("a.gguf", "list"),
        ([{"id": 0, "scale": 1.0, "alpha": 2}], "'id', 'scale'"),
        ([{"id": i, "scale": 1.0} for i in range(65)], "at most 64"),
    ],
)
def test_a_bad_lora_is_a_400_that_says_why(running: Running, lora: Any, says: str) -> None:
    response = post(running, "/completion", {"prompt": PROMPT, "n_predict": 2, "lora": lora})
    assert response.status_code == 400 and says in response.text, response.text
    bad_set = post(running, "/lora-adapters", lora)
    assert bad_set.status_code == 400, bad_set.text


def test_post_wants_an_array(running: Running) -> None:
    response = post(running, "/lora-adapters", {"id": 0, "scale": 1.0})
    assert response.status_code == 400 and "array" in response.text


@pytest.mark.subprocess
def test_serve_refuses_an_adapter_of_another_model_before_listening(model_path: str, tmp_path: Path) -> None:
    wrong = write_lora(tmp_path / "other.gguf", base=model_path, architecture="qwen2")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "actors.http",
            "serve",
            "-m",
            model_path,
            "--port",
            "0",
            "-c",
            "512",
            "--lora",
            wrong,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "'qwen2' model" in done.stderr + done.stdout
