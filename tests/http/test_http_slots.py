"""llama-server's slot files and sleep over HTTP: ``--slot-save-path`` with ``POST
/slots/{id}?action=save|restore|erase`` (its JSON shapes, its filename checks, files
confined to the folder), and ``--sleep-idle-seconds`` (the model unloaded when idle, the
read-only endpoints answering without waking it, the next request loading it again, a
resumable stream holding it awake)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import wait_until
from http_server import Running

from actors import ServerActor
from actors.http import HttpSettings
from actors.http._slot_actions import valid_filename

pytestmark = pytest.mark.timeout(120)

PROMPT = "The lighthouse keeper climbed the stairs every evening to light the lamp, and"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def running(model_path: str, folder: Path) -> Iterator[Running]:
    settings = HttpSettings(slot_save_path=os.path.realpath(folder))
    start = lambda: ServerActor.start(model_path=model_path, n_parallel=2, n_ctx=1024, prompt_cache_ram_mb=0)  # noqa: E731
    with Running.ready(settings, start) as server:
        yield server


def post(running: Running, path: str, body: Any = None) -> httpx.Response:
    return httpx.post(running.url + path, json=body, timeout=60)


def completion(running: Running, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "n_predict": 4, "temperature": 0, "n_probs": 2, **extra}
    response = post(running, "/completion", body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_a_slot_saved_erased_and_restored_elsewhere_is_reused_as_llama_server_answers(
    running: Running, folder: Path
) -> None:
    first = completion(running, PROMPT)
    slot = first["id_slot"]
    held = first["tokens_evaluated"] + first["tokens_predicted"] - 1  # the last token is not decoded
    saved = post(running, f"/slots/{slot}?action=save", {"filename": "keeper.bin"})
    assert saved.status_code == 200, saved.text
    body = saved.json()
    assert set(body) == {"id_slot", "filename", "n_saved", "n_written", "timings"}
    assert (body["id_slot"], body["filename"], body["n_saved"]) == (slot, "keeper.bin", held)
    assert body["n_written"] == (folder / "keeper.bin").stat().st_size and body["timings"]["save_ms"] >= 0
    assert post(running, f"/slots/{slot}?action=erase").json() == {"id_slot": slot, "n_erased": held}
    restored = post(running, f"/slots/{1 - slot}?action=restore", {"filename": "keeper.bin"}).json()
    assert set(restored) == {"id_slot", "filename", "n_restored", "n_read", "timings"}
    assert (restored["id_slot"], restored["n_restored"], restored["n_read"]) == (
        1 - slot,
        held,
        body["n_written"],
    )
    again = completion(running, PROMPT + " then")
    assert again["timings"]["cache_n"] >= first["tokens_evaluated"] - 1
    fresh = completion(running, PROMPT + " then", cache_prompt=False)
    assert again["completion_probabilities"] == fresh["completion_probabilities"]


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/slots/x?action=save", {"filename": "a.bin"}, 400, "Invalid slot ID"),
        ("/slots/-1?action=save", {"filename": "a.bin"}, 400, "Invalid slot ID"),
        ("/slots/2?action=erase", None, 400, "Invalid slot ID"),
        ("/slots/0", {"filename": "a.bin"}, 400, "Invalid action"),
        ("/slots/0?action=load", {"filename": "a.bin"}, 400, "Invalid action"),
        ("/slots/0?action=save", {}, 400, "Invalid filename"),
        ("/slots/0?action=save", {"filename": "../a.bin"}, 400, "Invalid filename"),
        ("/slots/0?action=restore", {"filename": 7}, 400, "Invalid filename"),
        ("/slots/0?action=restore", {"filename": "missing.bin"}, 400,
         "Unable to restore slot: cannot restore 'missing.bin': no such file"),
        ("/slots/0?action=restore", {"filename": "junk.bin"}, 400, "not a llama-cpp-actors slot file"),
        ("/slots/0?action=restore", {"filename": "outside.bin"}, 400, "Invalid filename"),
    ],
)  # fmt: skip
def test_bad_actions_get_llama_servers_errors_and_never_the_servers_paths(
    running: Running, folder: Path, path: str, body: Any, status: int, message: str
) -> None:
    (folder / "junk.bin").write_bytes(b"GGUF and more")
    if not (folder / "outside.bin").is_symlink():
        (folder / "outside.bin").symlink_to(folder.parent / "elsewhere.bin")  # a link out of the folder
    response = post(running, path, body)
    assert response.status_code == status and message in response.json()["error"]["message"], response.text
    assert str(folder) not in response.text


@pytest.mark.parametrize(
    "name",
    ["", ".", "..", "a..b", "a/b", "a\\b", "a:b", "a*b", 'a"b', "a<b", "a|b", "a?b", " a", "a ", "a.",
     "a\x00b", "a\x1fb", "a\x7fb", "a\u0085b", "a\uff0eb", "a\u2215b", "a\u2216b", "a\ufffdb", "a\ufeffb",
     "a\ud800b", "é" * 128],
)  # fmt: skip
def test_filenames_are_checked_as_llama_server_checks_them(name: str) -> None:
    assert not valid_filename(name)


def test_ordinary_filenames_pass() -> None:
    assert all(valid_filename(n) for n in ("slot1.bin", "a.b.c", "x y", "é" * 127, "日本.bin", "a" * 255))


# -- --sleep-idle-seconds ----------------------------------------------------------------


@pytest.fixture(scope="module")
def sleepy(model_path: str) -> Iterator[Running]:
    settings = HttpSettings(sleep_idle_s=0.5, metrics=True)
    start = lambda: ServerActor.start(model_path=model_path, n_parallel=2, n_ctx=1024)  # noqa: E731
    with Running.ready(settings, start) as server:
        yield server


def props(server: Running) -> dict[str, Any]:
    return dict(httpx.get(server.url + "/props", timeout=30).json())


def test_an_idle_model_sleeps_answers_read_only_endpoints_and_wakes_for_a_request(sleepy: Running) -> None:
    service = sleepy.app.service  # type: ignore[attr-defined]
    wait_until(lambda: props(sleepy)["is_sleeping"], 10)
    assert service.engine is None and service.tokenizer is None  # the model is unloaded
    for path in ("/health", "/props", "/models", "/v1/models", "/metrics"):
        assert httpx.get(sleepy.url + path, timeout=30).status_code == 200, path
    time.sleep(0.6)
    assert props(sleepy)["is_sleeping"] and service.sleeper.n_sleeps == 1  # none of them woke it
    # Requests arriving while it sleeps wait for one reload, and none fails.
    asks = [
        ("/completion", {"prompt": "Hello", "n_predict": 2}),
        ("/tokenize", {"content": "Hello"}),
        ("/completion", {"prompt": "Hi", "n_predict": 2}),
    ]
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda ask: httpx.post(sleepy.url + ask[0], json=ask[1], timeout=60), asks))
    assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
    assert not props(sleepy)["is_sleeping"] and service.engine is not None
    wait_until(lambda: props(sleepy)["is_sleeping"], 10)  # and sleeps again
    assert service.sleeper.n_sleeps == 2


def test_a_resumable_stream_keeps_the_model_awake_and_its_replay_does_not_wake_it(sleepy: Running) -> None:
    service = sleepy.app.service  # type: ignore[attr-defined]
    body = {"prompt": "Go on", "n_predict": 64, "ignore_eos": True, "stream": True}
    headers = {"X-Conversation-Id": "awake"}
    with httpx.stream("POST", sleepy.url + "/completion", json=body, headers=headers, timeout=60) as response:
        next(response.iter_raw())  # then the client leaves; 64 tokens outlast the 0.5 s idle time
    lookup = {"conversation_ids": ["awake"]}
    wait_until(lambda: httpx.post(sleepy.url + "/v1/streams/lookup", json=lookup).json()[0]["is_done"], 30)
    wait_until(lambda: props(sleepy)["is_sleeping"], 10)
    sleeps = service.sleeper.n_sleeps
    replay = httpx.get(sleepy.url + "/v1/stream", params={"conv_id": "awake"}, timeout=30)
    last = json.loads(replay.text.strip().rsplit("data: ", 1)[1])
    assert last["stop"] is True and last["tokens_predicted"] == 64  # never cut by a sleep
    assert props(sleepy)["is_sleeping"] and service.sleeper.n_sleeps == sleeps


def test_without_a_slot_save_path_slot_actions_answer_501(sleepy: Running) -> None:
    response = httpx.post(sleepy.url + "/slots/0?action=save", json={"filename": "a.bin"}, timeout=30)
    assert response.status_code == 501
    assert response.json()["error"]["message"] == (
        "This server does not support slots action. Start it with `--slot-save-path`"
    )
