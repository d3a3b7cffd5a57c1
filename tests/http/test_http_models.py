"""Router mode (llama-server's, several models behind ``serve``): a preset of the
default model under two names and a random-weight model, served in-process from the
command line's own plan and driven with the ``openai`` client and raw HTTP: routing by
``model``, ``/v1/models`` with each status, ``/models/load`` and ``/models/unload``,
autoload off, ``--models-max 1``, and the preset's and ``--models-dir``'s errors.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from helpers import wait_until
from http_server import Running, child_ready, serve_child
from tiny_gguf import write_tiny_model

from actors import GetStats, ServerActor, default_model_path, estimate_memory
from actors.http import HttpSettings
from actors.http._cli import CliError, parse

pytestmark = [pytest.mark.timeout(120), pytest.mark.model]

CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny.gguf")


def _preset(path: Path, tiny: str, *, eager: bool = True) -> str:
    smol = default_model_path()
    path.write_text(
        "version = 1\n"
        "; every model: a small context, two slots, no RAM prompt cache\n"
        "[*]\nc = 1024\nnp = 2\ncache-ram = 0\n\n"
        f"[smol]\nmodel = {smol}\nload-on-startup = {'true' if eager else 'false'}\ntemp = 0\n\n"
        f"[smol-b]\nmodel = {smol}\nLLAMA_ARG_TEMPERATURE = 0\n\n"
        f"[tiny]\nmodel = {tiny}\nc = 512\n"
    )
    return str(path)


def _router(*argv: str) -> Running:
    plan = parse(["serve", *argv], environ={})
    server = Running(plan.settings, plan.start_engine)
    server.wait_ready()
    return server


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, tiny_model: str) -> Iterator[Running]:
    preset = _preset(tmp_path_factory.mktemp("preset") / "models.ini", tiny_model)
    server = _router("--models-preset", preset, "--metrics")
    yield server
    server.stop()


def _client(server: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def _status(server: Running) -> dict[str, str]:
    listing = httpx.get(server.url + "/v1/models", timeout=30).json()
    return {m["id"]: m["status"]["value"] for m in listing["data"]}


def _error(response: httpx.Response) -> tuple[int, str]:
    body = response.json()["error"]
    assert body["code"] == response.status_code and isinstance(body["type"], str)
    return response.status_code, body["message"]


# -- routing -----------------------------------------------------------------------------


def test_a_model_that_cannot_load_now_is_a_503_on_every_path() -> None:
    # A load refused while a request was routed (models-max reached between the router's
    # check and the lease) was a 500 "the engine failed"; the docs promise 503.
    from actors import MemoryBudgetExceeded, ModelLoadError
    from actors.http._errors import from_engine_error

    full = from_engine_error(ModelLoadError("model 'b' cannot load: 2 models are loaded (max_models=2)"))
    assert (full.status, full.message) == (503, "model 'b' cannot load: 2 models are loaded (max_models=2)")
    refused = MemoryBudgetExceeded("no room", needed_mb=120.4, budget_mb=100.0, held_mb=90.0)
    budget = from_engine_error(refused)
    assert (budget.status, budget.extra) == (503, {"needed_mb": 120, "budget_mb": 100})


def test_requests_go_to_the_model_they_name(router: Running) -> None:
    client = _client(router)
    answers = {}
    for name in ("smol", "smol-b", "tiny"):
        done = client.chat.completions.create(model=name, messages=CHAT, max_tokens=8, temperature=0)  # type: ignore[arg-type]
        assert done.model == name and done.usage is not None and done.usage.completion_tokens > 0
        answers[name] = done.choices[0].message.content
    assert answers["smol"] == answers["smol-b"]  # one model under two names, greedy
    # Each model's own settings: the preset's context, its path.
    for name, path, n_ctx in (("smol", default_model_path(), 1024), ("tiny", "tiny.gguf", 512)):
        props = httpx.get(router.url + "/props", params={"model": name}, timeout=30).json()
        assert props["model_path"].endswith(path) and props["default_generation_settings"]["n_ctx"] == n_ctx
    # The native endpoints route by the body's model too.
    done = httpx.post(
        router.url + "/completion", json={"model": "tiny", "prompt": "Hi", "n_predict": 3}, timeout=60
    )
    assert done.status_code == 200 and done.json()["tokens_predicted"] == 3
    tokens = httpx.post(router.url + "/tokenize", json={"model": "smol-b", "content": "Hello"}, timeout=30)
    assert tokens.status_code == 200 and tokens.json()["tokens"]
    embedded = client.embeddings.create(model="tiny", input=["a", "b"])
    assert len(embedded.data) == 2 and embedded.model == "tiny"
    # GET endpoints by ?model=: each model's own slots and gauges.
    slots = httpx.get(router.url + "/slots", params={"model": "tiny"}, timeout=30).json()
    assert [s["id"] for s in slots] == [0, 1] and all(s["n_ctx"] == 512 for s in slots)
    metrics = httpx.get(router.url + "/metrics", params={"model": "smol"}, timeout=30)
    assert metrics.status_code == 200 and "llamacpp:requests_processing 0" in metrics.text


def test_requests_that_find_a_model_unloaded_share_one_load(router: Running) -> None:
    url = router.url
    if _status(router)["tiny"] != "unloaded":
        httpx.post(url + "/models/unload", json={"model": "tiny"}, timeout=60)
    loads = router.engine.ask(GetStats())["models"]["tiny"]["loads"]

    async def main() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
            replies = await asyncio.gather(
                *(client.post(url + "/v1/completions", json=body) for _ in range(8))
            )
        return [reply.status_code for reply in replies]

    assert asyncio.run(main()) == [200] * 8
    assert router.engine.ask(GetStats())["models"]["tiny"]["loads"] == loads + 1


def test_every_model_is_listed_with_its_status(router: Running) -> None:
    listing = httpx.get(router.url + "/models", timeout=30).json()
    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == ["smol", "smol-b", "tiny"]
    for model in listing["data"]:
        assert model["object"] == "model" and model["owned_by"] == "llamacpp"
        assert model["status"]["value"] in ("unloaded", "loading", "loaded")
    assert _status(router)["smol"] == "loaded"  # load-on-startup
    ids = [m.id for m in _client(router).models.list()]
    assert ids == ["smol", "smol-b", "tiny"]


def test_a_missing_or_unknown_model_is_llama_servers_400(router: Running) -> None:
    url = router.url + "/v1/chat/completions"
    assert _error(httpx.post(url, json={"messages": CHAT}, timeout=30)) == (
        400,
        "model name is missing from the request",
    )
    assert _error(httpx.post(url, json={"model": "nope", "messages": CHAT}, timeout=30)) == (
        400,
        "model 'nope' not found",
    )
    assert _error(httpx.post(url, json={"model": 7, "messages": CHAT}, timeout=30))[0] == 400
    # A lone surrogate (JSON's "\\ud800") is named back escaped, in our JSON error, on every
    # routed endpoint; it was a plain-text 500 while the message was encoded.
    for path in ("/v1/chat/completions", "/completion", "/v1/embeddings", "/tokenize"):
        response = httpx.post(
            router.url + path,
            content=b'{"model": "a\\ud800", "messages": [], "prompt": "x", "input": "x", "content": "x"}',
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert _error(response) == (400, "model 'a\ud800' not found"), (path, response.text[:200])
        assert b"a\\ud800" in response.content
    assert _error(httpx.get(router.url + "/slots", params={"model": "nope"}, timeout=30))[0] == 400
    assert _error(httpx.get(router.url + "/slots", timeout=30)) == (
        400,
        "model name is missing from the request",
    )


def test_router_props(router: Running) -> None:
    props = httpx.get(router.url + "/props", timeout=30).json()
    assert props["role"] == "router" and props["max_instances"] == 4 and props["models_autoload"] is True
    assert httpx.get(router.url + "/health", timeout=30).json() == {"status": "ok"}


def test_load_and_unload_endpoints(router: Running) -> None:
    url = router.url
    if _status(router)["smol-b"] != "unloaded":
        assert httpx.post(url + "/models/unload", json={"model": "smol-b"}, timeout=60).json() == {
            "success": True
        }
    assert _status(router)["smol-b"] == "unloaded"
    assert _error(httpx.post(url + "/models/unload", json={"model": "smol-b"}, timeout=30)) == (
        400,
        "model is not running",
    )
    assert httpx.post(url + "/models/load", json={"model": "smol-b"}, timeout=60).json() == {"success": True}
    assert _error(httpx.post(url + "/models/load", json={"model": "smol-b"}, timeout=30)) == (
        400,
        "model is already running",
    )
    wait_until(lambda: _status(router)["smol-b"] == "loaded")
    done = _client(router).completions.create(model="smol-b", prompt="One, two,", max_tokens=3)
    assert done.model == "smol-b"
    assert httpx.post(url + "/models/unload", json={"model": "smol-b"}, timeout=60).json() == {
        "success": True
    }
    assert _status(router)["smol-b"] == "unloaded"
    # Its next request loads it again (autoload), with a fresh view of the new engine.
    tokens = httpx.post(url + "/tokenize", json={"model": "smol-b", "content": "Hello"}, timeout=60)
    assert tokens.status_code == 200 and tokens.json()["tokens"]
    assert _error(httpx.post(url + "/models/load", json={"model": "nope"}, timeout=30)) == (
        404,
        "model is not found",
    )
    assert _error(httpx.post(url + "/models/unload", json={"model": "nope"}, timeout=30)) == (
        400,
        "model is not found",
    )
    assert _error(httpx.post(url + "/models/load", json=["smol"], timeout=30))[0] == 400


def test_autoload_false_in_the_query(router: Running) -> None:
    url = router.url
    if _status(router)["tiny"] != "unloaded":
        httpx.post(url + "/models/unload", json={"model": "tiny"}, timeout=60)
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    refused = httpx.post(url + "/v1/completions", params={"autoload": "false"}, json=body, timeout=30)
    assert _error(refused) == (400, "model is not loaded")
    assert (
        httpx.post(url + "/v1/completions", params={"autoload": "true"}, json=body, timeout=60).status_code
        == 200
    )


def test_no_models_autoload(tmp_path: Path, tiny_model: str) -> None:
    server = _router(
        "--models-preset", _preset(tmp_path / "m.ini", tiny_model, eager=False), "--no-models-autoload"
    )
    try:
        url = server.url
        assert httpx.get(url + "/props", timeout=30).json()["models_autoload"] is False
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
        assert _error(httpx.post(url + "/v1/completions", json=body, timeout=30)) == (
            400,
            "model is not loaded",
        )
        assert (
            httpx.post(url + "/v1/completions", params={"autoload": "1"}, json=body, timeout=60).status_code
            == 200
        )
        assert httpx.post(url + "/models/load", json={"model": "smol"}, timeout=60).json() == {
            "success": True
        }
        done = httpx.post(url + "/v1/completions", json={**body, "model": "smol"}, timeout=60)
        assert done.status_code == 200 and done.json()["model"] == "smol"
    finally:
        server.stop()


def test_models_max_1_unloads_the_idle_model(tmp_path: Path, tiny_model: str) -> None:
    preset = _preset(tmp_path / "m.ini", tiny_model, eager=False)
    server = _router("--models-preset", preset, "--models-max", "1")
    try:
        client = _client(server)
        client.completions.create(model="smol", prompt="Hi", max_tokens=2)
        assert _status(server) == {"smol": "loaded", "smol-b": "unloaded", "tiny": "unloaded"}
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
        assert _status(server) == {"smol": "unloaded", "smol-b": "unloaded", "tiny": "loaded"}
        assert httpx.get(server.url + "/props", timeout=30).json()["max_instances"] == 1
        # And back: the first model's fresh view tokenizes with its new engine.
        tokens = httpx.post(server.url + "/tokenize", json={"model": "smol", "content": "Hello"}, timeout=60)
        assert tokens.status_code == 200 and tokens.json()["tokens"]
    finally:
        server.stop()


def test_models_max_1_queues_behind_a_busy_model_then_serves_both(tmp_path: Path, tiny_model: str) -> None:
    # llama-server's router queue: a request for another model waits for the busy one to
    # finish instead of evicting it mid-stream; requests for two models both get served.
    preset = _preset(tmp_path / "m.ini", tiny_model, eager=True)
    server = _router("--models-preset", preset, "--models-max", "1")
    try:
        url = server.url
        body = {"model": "smol", "prompt": "Go on", "n_predict": 120, "ignore_eos": True, "stream": True}
        finished: dict[str, float] = {}

        def stream() -> list[str]:
            with httpx.stream("POST", url + "/completion", json=body, timeout=120) as response:
                lines = [line for line in response.iter_lines() if line.startswith("data: ")]
            finished["smol"] = time.monotonic()
            return lines

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            busy = pool.submit(stream)
            time.sleep(0.5)  # the stream holds smol's engine
            queued = httpx.post(url + "/tokenize", json={"model": "tiny", "content": "Hello"}, timeout=120)
            finished["tiny"] = time.monotonic()
            events = [json.loads(line[6:]) for line in busy.result()]
        assert queued.status_code == 200 and queued.json()["tokens"]
        assert events[-1]["stop"] is True and events[-1]["tokens_predicted"] == 120  # never cut off
        assert finished["tiny"] > finished["smol"]
        assert _status(server) == {"smol": "unloaded", "smol-b": "unloaded", "tiny": "loaded"}

        async def both() -> list[int]:
            async with httpx.AsyncClient(timeout=120) as client:
                replies = await asyncio.gather(
                    *(
                        client.post(
                            url + "/v1/completions", json={"model": m, "prompt": "Hi", "max_tokens": 2}
                        )
                        for m in ("smol", "smol-b")
                    )
                )
            return [reply.status_code for reply in replies]

        assert asyncio.run(both()) == [200, 200]
        assert _status(server)["tiny"] == "unloaded"
    finally:
        server.stop()


def test_a_queued_client_that_leaves_takes_no_models_place(tmp_path: Path, tiny_model: str) -> None:
    preset = _preset(tmp_path / "m.ini", tiny_model, eager=True)
    server = _router("--models-preset", preset, "--models-max", "1")
    try:
        url = server.url
        body = {"model": "smol", "prompt": "Go on", "n_predict": 400, "ignore_eos": True}  # seconds
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            busy = pool.submit(httpx.post, url + "/completion", json=body, timeout=120)
            time.sleep(0.5)
            with pytest.raises(httpx.TimeoutException):
                httpx.post(url + "/tokenize", json={"model": "tiny", "content": "Hello"}, timeout=1)
            assert busy.result().status_code == 200
        time.sleep(2)  # the queue's next look: nobody waits for tiny any more
        assert _status(server) == {"smol": "loaded", "smol-b": "unloaded", "tiny": "unloaded"}
    finally:
        server.stop()


def test_a_model_that_cannot_fit_is_a_503_naming_the_numbers(tmp_path: Path, tiny_model: str) -> None:
    # The default model is pinned: the tiny one cannot fit beside it in a budget of the
    # first and half the second, and nothing may make way.
    preset = tmp_path / "m.ini"
    smol = default_model_path()
    small = {"n_ctx": 512, "n_parallel": 1}
    budget = int(estimate_memory(smol, **small).total_mb + estimate_memory(tiny_model, **small).total_mb / 2)
    preset.write_text(
        f"[*]\nc = 512\nnp = 1\ncache-ram = 0\n[smol]\nmodel = {smol}\npin = true\nload-on-startup = true\n"
        f"[tiny]\nmodel = {tiny_model}\n"
    )
    server = _router("--models-preset", str(preset), "--models-memory-mb", str(budget))
    try:
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
        refused = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        status, message = _error(refused)
        assert status == 503 and "needs about" in message and f"{budget} MiB" in message
        assert refused.json()["error"]["budget_mb"] == budget and refused.headers["retry-after"]
        loading = httpx.post(server.url + "/models/load", json={"model": "tiny"}, timeout=60)
        assert _error(loading)[0] == 503
        assert _status(server) == {"smol": "loaded", "tiny": "unloaded"}
    finally:
        server.stop()


# -- the command line --------------------------------------------------------------------


def _models(*argv: str) -> dict[str, Any]:
    plan = parse(["serve", *argv], environ={})
    assert plan.manager_options is not None
    return dict(plan.manager_options["models"])


def test_precedence_command_line_then_section_then_globals(tmp_path: Path, tiny_model: str) -> None:
    preset = tmp_path / "m.ini"
    preset.write_text(
        f"[*]\nc = 512\ntemp = 0.3\n[a]\nmodel = {tiny_model}\nctx-size = 768\n[b]\nmodel = {tiny_model}\n"
        "pin = true\nkeep-alive = 5\nno-context-shift = true\nreplicas = 2\njinja = true\n"
    )
    models = _models("--models-preset", str(preset))
    assert (models["a"]["n_ctx"], models["b"]["n_ctx"], models["a"]["temp"]) == (768, 512, 0.3)
    assert (
        models["b"]["pinned"] is True and models["b"]["keep_alive_s"] == 5.0 and models["a"]["load"] == "lazy"
    )
    assert (models["a"]["replicas"], models["b"]["replicas"]) == (1, 2)
    models = _models(
        "--models-preset", str(preset), "-c", "1024", "--temp", "0.7", "--models-keep-alive", "9"
    )
    assert (models["a"]["n_ctx"], models["b"]["n_ctx"], models["a"]["temp"]) == (1024, 1024, 0.7)
    assert models["a"]["keep_alive_s"] == 9.0 and models["b"]["keep_alive_s"] == 5.0
    # llama-server's router passes --sleep-idle-seconds to each model: its keep-alive here.
    models = _models("--models-preset", str(preset), "--sleep-idle-seconds", "7")
    assert models["a"]["keep_alive_s"] == 7 and models["b"]["keep_alive_s"] == 5.0
    plan = parse(
        ["serve", "--models-preset", str(preset), "--models-max", "0", "--models-memory-mb", "900"], {}
    )
    assert plan.manager_options is not None
    assert (plan.manager_options["max_models"], plan.manager_options["memory_budget_mb"]) == (0, 900.0)
    assert any("prompt cache (--cache-ram, default" in note for note in plan.notes)  # it counts in full


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("foo = 1", r"\[a\] line 3: foo: not a llama-server flag"),
        (
            "control-vector = x.gguf",
            r"\[a\]: --control-vector is a llama-server flag that llama-cpp-actors does not support",
        ),
        ("c = big", r"\[a\]: argument -c/--ctx-size: 'big' is not an integer"),
        ("np = 0", r"\[a\]: argument -np/--parallel: 0 is out of range"),
        ("port = 9000", r"\[a\] line 3: port: --port is the router's"),
        ("load-on-startup = maybe", "'maybe' is not a boolean"),
        ("keep-alive = -1", "out of range"),
        ("temp = nan", r"\[a\]: argument --temp"),
        ("stop-timeout = 5", "a llama-server preset key llama-cpp-actors does not support"),
    ],
)
def test_a_bad_preset_key_or_value_names_its_section(
    tmp_path: Path, tiny_model: str, section: str, message: str
) -> None:
    preset = tmp_path / "m.ini"
    preset.write_text(f"[a]\nmodel = {tiny_model}\n{section}\n")
    with pytest.raises(CliError, match=message):
        parse(["serve", "--models-preset", str(preset)], environ={})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[a]\nmodel = /no/such/model.gguf\n", r"\[a\]: model = '/no/such/model.gguf': no such file"),
        ("[a]\nc = 512\n", r"\[a\]: no model = PATH"),
        ("c = 512\n[a]\n", "line 1: 'c' before the first section"),
        ("[a]\njust words\n", "expected key = value"),
        ("[a\n", "a bad section header"),
        ("[*]\nload-on-startup = true\n[a]\n", r"\[\*\]: load-on-startup belongs in a model's section"),
        ("version = 1\n", "has no model section"),
    ],
)
def test_a_bad_preset_file_is_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    preset = tmp_path / "m.ini"
    preset.write_text(text)
    with pytest.raises(CliError, match=message):
        parse(["serve", "--models-preset", str(preset)], environ={})
    with pytest.raises(CliError, match="cannot read the models preset"):
        parse(["serve", "--models-preset", str(tmp_path / "missing.ini")], environ={})


def test_router_flags_need_router_mode_and_no_model() -> None:
    with pytest.raises(CliError, match="--models-max is for router mode"):
        parse(["serve", "--models-max", "2"], environ={})
    with pytest.raises(CliError, match="-m serves one model"):
        parse(["serve", "-m", "x.gguf", "--models-dir", "."], environ={})
    with pytest.raises(CliError, match="--alias is for one model"):
        parse(["serve", "--models-dir", ".", "-a", "x"], environ={})
    with pytest.raises(CliError, match="--backend is for one model"):
        parse(["serve", "--models-dir", ".", "--backend", "ray"], environ={})


def test_models_dir(tmp_path: Path, tiny_model: str) -> None:
    folder = tmp_path / "models"
    (folder / "sharded").mkdir(parents=True)
    os.symlink(tiny_model, folder / "tiny.gguf")
    os.symlink(default_model_path(), folder / "smol.gguf")
    (folder / "notes.txt").write_text("not a model")
    plan = parse(["serve", "--models-dir", str(folder), "-c", "512", "-cram", "0"], environ={})
    assert [name for name, _ in plan.settings.models] == ["smol", "tiny"]
    assert any("sharded skipped" in note for note in plan.notes)
    assert plan.manager_options is not None and plan.manager_options["models"]["tiny"]["n_ctx"] == 512
    # A preset section named as a file of the directory configures it.
    preset = tmp_path / "m.ini"
    preset.write_text("[tiny]\nc = 256\n")
    models = _models("--models-dir", str(folder), "--models-preset", str(preset))
    assert models["tiny"]["n_ctx"] == 256 and models["tiny"]["model_path"] == str(folder / "tiny.gguf")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CliError, match="holds no"):
        parse(["serve", "--models-dir", str(empty)], environ={})
    server = Running(plan.settings, plan.start_engine)
    try:
        server.wait_ready()
        assert _status(server) == {"smol": "unloaded", "tiny": "unloaded"}
        done = _client(server).completions.create(model="tiny", prompt="Hi", max_tokens=2)
        assert done.model == "tiny"
    finally:
        server.stop()


def test_one_models_server_has_no_router_routes(model_path: str) -> None:
    server = Running(
        HttpSettings(), lambda: ServerActor.start(model_path=model_path, n_ctx=256, n_parallel=1)
    )
    try:
        server.wait_ready()
        assert _error(httpx.post(server.url + "/models/load", json={"model": "x"}, timeout=30)) == (
            404,
            "File Not Found",
        )
        props = httpx.get(server.url + "/props", timeout=30).json()
        assert "role" not in props and props["model_path"] == model_path
    finally:
        server.stop()


@pytest.mark.timeout(180)
def test_serve_with_a_preset_then_sigterm(tmp_path: Path, tiny_model: str) -> None:
    child, url = serve_child(
        "--models-preset", _preset(tmp_path / "m.ini", tiny_model, eager=False), "-cram", "0"
    )
    try:
        child_ready(url, child)
        assert _status_at(url) == {"smol": "unloaded", "smol-b": "unloaded", "tiny": "unloaded"}
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        for name in ("tiny", "smol"):
            assert client.completions.create(model=name, prompt="Hi", max_tokens=2).model == name
        assert _status_at(url) == {"smol": "loaded", "smol-b": "unloaded", "tiny": "loaded"}
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=60) == 0
        log = child.stdout.read()
        assert "Traceback" not in log, log
    finally:
        child.kill()


def _status_at(url: str) -> dict[str, str]:
    listing = httpx.get(url + "/v1/models", timeout=30).json()
    return {m["id"]: m["status"]["value"] for m in listing["data"]}


def test_api_key_guards_the_router_and_one_model_needs_no_name(tmp_path: Path, tiny_model: str) -> None:
    preset = tmp_path / "m.ini"
    preset.write_text(f"[tiny]\nmodel = {tiny_model}\nc = 256\nnp = 1\ncache-ram = 0\n")
    server = _router("--models-preset", str(preset), "--api-key", "sk-router")
    try:
        url, key = server.url, {"Authorization": "Bearer sk-router"}
        body = {"messages": CHAT, "max_tokens": 2}  # no model: the only one
        refused = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        assert httpx.post(url + "/models/load", json={"model": "tiny"}, timeout=30).status_code == 401
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        done = httpx.post(url + "/v1/chat/completions", json=body, headers=key, timeout=60)
        assert done.status_code == 200 and done.json()["model"] == "tiny"
    finally:
        server.stop()
