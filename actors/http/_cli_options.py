"""What ``llama-cpp-actors serve`` accepts: the option table and its value converters.

``_OPTIONS`` says what each llama-server flag we support becomes (its ``dest``, how its
value is read, its help); the spellings, negations and ``LLAMA_ARG_*`` variable of each
come from :mod:`actors.http._flags`. ``_OURS`` are our own flags. Each converter turns
one command-line or environment text into a value, or raises ``ValueError`` with the
reason (the main thread, before anything starts).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import strategies
from actors import ConfigError
from actors.http._flags import LlamaFlag, by_spelling
from actors.http._settings import HttpSettings

__all__ = ["CliError"]

# ggml's type ids (llama_cpp.GGML_TYPE_*) of the KV cache types llama.cpp's -ctk/-ctv
# accept (kv_cache_types in common/arg.cpp); ServerActor's type_k/type_v take the id.
_KV_TYPES = MappingProxyType(
    {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "iq4_nl": 20, "q5_0": 6, "q5_1": 7}
)
_STRATEGIES: Mapping[str, Callable[[], strategies.BatchStrategy]] = MappingProxyType(
    {
        "DecodeMaximal": strategies.DecodeMaximal,
        "PrefillPriority": strategies.PrefillPriority,
        "Balanced": strategies.Balanced,
        "Adaptive": strategies.Adaptive,
    }
)
_TRUTHY = ("on", "enabled", "true", "1")  # llama.cpp's is_truthy / is_falsey / is_autoy
_FALSEY = ("off", "disabled", "false", "0")
_AUTOY = ("auto", "-1")


class CliError(Exception):
    """A command line we cannot serve: printed as ``error: ...``, exit ``code``."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


# -- values (the caller's thread; each raises ValueError with the reason) --------------


def _integer(low: int, high: int | None = None, *, extra: Sequence[int] = ()) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            number = int(text.strip())
        except ValueError:
            raise ValueError(f"{text!r} is not an integer") from None
        if number not in extra and (number < low or (high is not None and number > high)):
            allowed = f">= {low}" if high is None else f"within [{low}, {high}]"
            also = "".join(f" or {x}" for x in extra)
            raise ValueError(f"{number} is out of range: must be {allowed}{also}")
        return number

    return convert


def _number(low: float | None = None, high: float | None = None) -> Callable[[str], float]:
    def convert(text: str) -> float:
        try:
            number = float(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a number") from None
        if not math.isfinite(number):
            raise ValueError(f"{text!r} is not a finite number")
        if (low is not None and number < low) or (high is not None and number > high):
            bounds = f"[{'-inf' if low is None else low}, {'inf' if high is None else high}]"
            raise ValueError(f"{number:g} is out of range: must be within {bounds}")
        return number

    return convert


def _temperature(text: str) -> float:
    return max(_number()(text), 0.0)  # llama-server: a negative temperature is greedy


def _choice(table: Mapping[str, Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        if text not in table:
            raise ValueError(f"{text!r} is not one of {', '.join(table)}")
        return table[text]

    return convert


_SWITCH: Mapping[str, bool | None] = MappingProxyType(
    {**dict.fromkeys(_TRUTHY, True), **dict.fromkeys(_FALSEY, False), **dict.fromkeys(_AUTOY, None)}
)


def _csv(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _csv_lora(text: str) -> tuple[tuple[str, float], ...]:
    return tuple((path, 1.0) for path in _csv(text))


def _lora_scaled(text: str) -> tuple[tuple[str, float], ...]:
    adapters = []
    for item in _csv(text):
        path, colon, scale = item.rpartition(":")
        if not colon or not path:
            raise ValueError(f"{item!r} is not FNAME:SCALE")
        adapters.append((path, _number(-100, 100)(scale)))
    return tuple(adapters)


def _hosts(text: str) -> tuple[str, ...]:
    hosts = _csv(text)
    if not hosts:
        raise ValueError("no address given")
    for host in hosts:
        if host.endswith(".sock"):
            raise ValueError(f"{host!r}: UNIX sockets are a llama-server feature llama-cpp-actors lacks")
    return hosts


def _gpu_layers(text: str) -> int:
    # llama-server's auto fits layers to free VRAM and all offloads every layer; we do
    # not fit, so both offload every layer (llama.cpp's -1).
    if text in ("auto", "all"):
        return -1
    return _integer(0, 2**31 - 1, extra=(-1,))(text)


def _budget(text: str) -> int | None:
    value = int(text)
    if value < -1:
        raise ValueError("must be -1 (no bound) or a number of tokens >= 0")
    return None if value == -1 else value


def _directory(text: str) -> str:
    # llama-server refuses a path that is not a directory now; resolved once, so that
    # a file's path is checked against where the folder really is.
    if not os.path.isdir(text):
        raise ValueError(f"not a directory: {text}")
    return os.path.realpath(text)


def _sleep_seconds(text: str) -> int | None:
    seconds = _integer(-1)(text)
    if seconds == 0:
        raise ValueError("0 is out of range: -1 (never) or a number of seconds >= 1")
    return None if seconds == -1 else seconds


def _template_kwargs(text: str) -> tuple[tuple[str, Any], ...]:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object")
    try:  # names and values checked as a Chat's template_kwargs are
        return HttpSettings(chat_template_kwargs=tuple(value.items())).chat_template_kwargs
    except ConfigError as e:
        raise ValueError(str(e)) from None


# llama-server's --chat-template also takes the name of a template built into llama.cpp.
# We render only Jinja: the names whose Jinja text llama_cpp ships (llama_chat_format's
# CHATML_CHAT_TEMPLATE and LLAMA3_INSTRUCT_CHAT_TEMPLATE, copied here because only the
# backend may import llama_cpp; tests/http/test_http_cli.py checks that they are the same).
_BUILTIN_TEMPLATES = MappingProxyType(
    {
        "chatml": "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
        "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\n' }}{% endif %}",
        "llama3": "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
        "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
        "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
        "{{ content }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
    }
)


def _template_text(text: str) -> str:
    if text in _BUILTIN_TEMPLATES:
        return _BUILTIN_TEMPLATES[text]
    if re.fullmatch(r"[\w.+-]+", text):  # a name, not a template (which would print just it)
        raise ValueError(
            f"{text!r} is the name of a template built into llama.cpp that llama-cpp-actors cannot "
            f"resolve (it knows {', '.join(_BUILTIN_TEMPLATES)}); pass the template's Jinja text, "
            "or its file with --chat-template-file"
        )
    return text


# -- the options ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Option:
    """A llama-server flag we support: its dest, how its value is read, its help."""

    flag: str  # any spelling; the others, the negations and the env var come from _flags
    dest: str
    help: str
    convert: Callable[[str], Any] | None = None  # None: a switch
    metavar: str = "N"


_OPTIONS = (
    _Option("--model", "model", "model path to load (llama-server: required or -hf; ours: default "
            "$LLAMA_MODEL, else SmolLM2-135M-Instruct, actors.default_model_path())", str, "FNAME"),
    _Option("--host", "host", "IP addresses to listen on, comma-separated (default: 127.0.0.1; "
            "llama-server's UNIX sockets *.sock are not supported)", _hosts, "HOST"),
    _Option("--port", "port", "port to listen (default: 8080)", _integer(0, 65535), "PORT"),
    _Option("--ctx-size", "ctx_size", "size of the prompt context, ServerActor's n_ctx (default: 0 = "
            "the model's training context, read from its GGUF header; llama-server's --fit may shrink "
            "it to fit memory, ours does not)", _integer(0, 2**31 - 256)),
    _Option("--parallel", "parallel", "number of server slots, n_parallel (default: -1 = auto: 4 slots "
            "sharing the whole context, as llama-server's auto)", _integer(1, 256, extra=(-1,))),
    _Option("--kv-unified", "kv_unified", "let every slot grow to the whole context (n_ctx_per_slot = "
            "n_ctx) instead of an even share (n_ctx / n_parallel); default: on if -np is auto. Our KV "
            "cache is always one buffer, so this sets only the per-slot limit"),
    _Option("--kv-unified-per-slot", "kv_unified_per_slot", "context limit per slot, n_ctx_per_slot; "
            "without -c the context is n_parallel * N (default: unset)", _integer(2, 2**31 - 256)),
    _Option("--batch-size", "batch_size", "logical maximum batch size, n_batch (default: 2048, at most "
            "n_ctx)", _integer(1, 2**31 - 256)),
    _Option("--ubatch-size", "ubatch_size", "physical maximum batch size, n_ubatch (default: 512)",
            _integer(1, 2**31 - 256)),
    _Option("--threads", "threads", "CPU threads for generation, n_threads (default: -1 = every core "
            "this process may use but one, as ServerActor's; llama-server: all)", _integer(-(2**31), 512)),
    _Option("--threads-batch", "threads_batch", "threads for batch and prompt processing, "
            "n_threads_batch (default: same as --threads)", _integer(-(2**31), 512)),
    _Option("--n-predict", "n_predict", "tokens to predict: the default and cap per request (default: "
            "-1 = up to the slot's context)", _integer(1, 2**31 - 1, extra=(-1,))),
    _Option("--lora", "lora", "LoRA adapter files, comma-separated, each at scale 1; requests choose "
            "theirs with 'lora' (ServerActor's lora; default: none)", _csv_lora, "FNAME"),
    _Option("--lora-scaled", "lora", "LoRA adapter files with their scales, FNAME:SCALE,... (with "
            "--lora, in the order given: the adapters' ids)", _lora_scaled, "FNAME:SCALE,..."),
    _Option("--lora-init-without-apply", "lora_init_without_apply", "load the LoRA adapters at scale "
            "0: requests without 'lora' run the base model until POST /lora-adapters sets scales "
            "(default: disabled)"),
    _Option("--spm-infill", "spm_infill", "/infill puts the suffix before the prefix (the "
            "suffix-prefix-middle order some models were trained with; default: disabled)"),
    _Option("--cache-ram", "cache_ram", "RAM prompt cache in MiB, prompt_cache_ram_mb (default: 8192, "
            "ours at most half this machine's memory; -1 = no limit: this machine's memory; 0 = off)",
            _integer(-1, 2**40)),
    _Option("--cache-prompt", "cache_prompt", "reuse a slot's cached prompt prefix, cache_prompt "
            "(default: enabled)"),
    _Option("--cache-idle-slots", "cache_idle_slots", "once a request starts, move idle slots' KV "
            "to the RAM prompt cache, cache_idle_slots (default: enabled; needs --cache-ram)"),
    _Option("--context-shift", "context_shift", "on a full slot, drop old tokens and go on generating "
            "(default: disabled, as llama-server; ServerActor's own default is enabled)"),
    _Option("--flash-attn", "flash_attn", "flash attention: on, off or auto (default: auto)",
            _choice(_SWITCH), "on|off|auto"),
    _Option("--cache-type-k", "cache_type_k", f"KV cache type for K: {', '.join(_KV_TYPES)} (default: "
            "f16)", _choice(_KV_TYPES), "TYPE"),
    _Option("--cache-type-v", "cache_type_v", f"KV cache type for V: {', '.join(_KV_TYPES)} (default: "
            "f16; a quantized one needs flash attention)", _choice(_KV_TYPES), "TYPE"),
    _Option("--n-gpu-layers", "n_gpu_layers", "layers to offload to the GPU: a number, auto or all "
            "(llama-server's default: auto, fitted to VRAM; ours: 0 unless given, and auto offloads "
            "every layer, as all: we do not fit)", _gpu_layers),
    _Option("--temp", "temp", "default temperature (default: 0.80; a negative one is greedy)",
            _temperature),
    _Option("--top-k", "top_k", "default top-k (default: 40, 0 = disabled)", _integer(0, 2**31 - 1)),
    _Option("--top-p", "top_p", "default top-p (default: 0.95, 1.0 = disabled)", _number(0, 1)),
    _Option("--min-p", "min_p", "default min-p (default: 0.05, 0.0 = disabled)", _number(0, 1)),
    _Option("--seed", "seed", "default RNG seed (default: -1 = a random seed per request)",
            _integer(0, 2**32 - 1, extra=(-1,)), "SEED"),
    _Option("--repeat-last-n", "repeat_last_n", "tokens the penalties look back on, penalty_last_n "
            "(default: 64, 0 = disabled, -1 = the context)", _integer(-1, 2**31 - 1)),
    _Option("--repeat-penalty", "repeat_penalty", "repeat penalty, penalty_repeat (default: 1.00 = "
            "disabled)", _number(0)),
    _Option("--presence-penalty", "presence_penalty", "presence penalty, penalty_present (default: "
            "0.00 = disabled)", _number()),
    _Option("--frequency-penalty", "frequency_penalty", "frequency penalty, penalty_freq (default: "
            "0.00 = disabled)", _number()),
    _Option("--api-key", "api_key", "API keys, comma-separated (default: none: no key needed)", _csv,
            "KEY"),
    _Option("--api-key-file", "api_key_file", "file of API keys, one per line; lines starting with # "
            "are comments (read once at startup)", str, "FNAME"),
    _Option("--alias", "alias", "model names for the API, comma-separated (default: the model file's "
            "name)", _csv, "STRING"),
    _Option("--tags", "tags", "model tags, comma-separated (informational)", _csv, "STRING"),
    _Option("--metrics", "metrics", "serve GET /metrics, Prometheus text (default: disabled)"),
    _Option("--slots", "slots", "serve GET /slots (default: enabled)"),
    _Option("--slot-save-path", "slot_save_path", "the folder of slot files: serve POST "
            "/slots/{id}?action=save|restore|erase, whose filenames name files in it (default: "
            "disabled)", _directory, "PATH"),
    _Option("--sleep-idle-seconds", "sleep_idle_seconds", "unload the model after this many seconds "
            "without a request; the next request loads it again (/health, /props, /models and "
            "/metrics do not wake it; in router mode, each model's --models-keep-alive) (default: -1 "
            "= never)", _sleep_seconds, "SECONDS"),
    _Option("--cors-origins", "cors_origins", "allowed CORS origins, comma-separated; 'localhost' "
            "echoes only a localhost Origin (default: *)", str, "ORIGINS"),
    _Option("--cors-methods", "cors_methods", "allowed CORS methods (default: GET, POST, DELETE, "
            "OPTIONS)", str, "METHODS"),
    _Option("--cors-headers", "cors_headers", "allowed CORS headers (default: *)", str, "HEADERS"),
    _Option("--cors-credentials", "cors_credentials", "allow credentials for CORS; with origins * the "
            "Origin is echoed (default: enabled)"),
    _Option("--jinja", "jinja", "use the Jinja template engine for chat (default: enabled). Ours "
            "always renders chat templates with Jinja: --jinja and --no-jinja change nothing"),
    _Option("--chat-template", "chat_template", "a custom chat template, ServerActor's chat_template: "
            f"Jinja text, or a built-in name llama_cpp has the Jinja of ({', '.join(_BUILTIN_TEMPLATES)}; "
            "llama.cpp's other names are refused) (default: the model's own, from its GGUF metadata)",
            _template_text, "JINJA_TEMPLATE"),
    _Option("--chat-template-file", "chat_template_file", "a custom Jinja chat template file, read once "
            "at startup: ServerActor's chat_template (default: the model's own; not with "
            "--chat-template)", str, "FILE"),
    _Option("--reasoning", "reasoning", "thinking in the chat: on, off or auto; on/off set the "
            "template's enable_thinking (default: auto: the template's own default)", _choice(_SWITCH),
            "on|off|auto"),
    _Option("--reasoning-format", "reasoning_format", "where a chat's thinking goes: auto or deepseek "
            "(into reasoning_content), none (left in content); a request's reasoning_format wins "
            "(default: auto)", _choice({"auto": "auto", "deepseek": "deepseek", "none": "none"}),
            "auto|deepseek|none"),
    _Option("--reasoning-budget", "reasoning_budget", "the most tokens a chat's thinking may take, "
            "then it is closed for the model: -1 no bound, 0 no thinking; a request's "
            "reasoning_budget_tokens wins (default: -1)", _budget, "N"),
    _Option("--reasoning-budget-message", "reasoning_budget_message", "text written into the "
            "thinking when its budget ends, before the end marker (default: none)", str, "TEXT"),
    _Option("--chat-template-kwargs", "chat_template_kwargs", "extra chat template variables, a JSON "
            "object of JSON values (--reasoning wins on enable_thinking; a request's own win over "
            "these)", _template_kwargs, "JSON"),
    _Option("--cont-batching", "cont_batching", "continuous batching (default: enabled). Ours is "
            "always on: --cont-batching is accepted, --no-cont-batching refused"),
    _Option("--ui", "ui", "the web UI (default: enabled). llama-cpp-actors has none: --ui, --no-ui, "
            "--no-webui are accepted and change nothing"),
    _Option("--backend-sampling", "backend_sampling", "sample on the compute backend (experimental, "
            "default: disabled). Ours samples with llama.cpp's CPU samplers, whose results backend "
            "sampling promises to give too: accepted, it changes nothing"),
    _Option("--spec-type", "spec_type", "speculative decoding: none, ngram-simple (drafts from the "
            "slot's own prompt and output, ServerActor's spec_type='ngram') or draft-simple (a draft "
            "model, -md; spec_type='draft'); llama-server's other types are refused (default: none; "
            "draft-simple when -md is given)",
            _choice({"none": "none", "ngram-simple": "ngram", "draft-simple": "draft"}), "TYPE"),
    _Option("--spec-draft-n-max", "spec_draft_n_max", "draft tokens per slot per tick at most, "
            "ServerActor's draft_max; how many pay is decided per tick (llama-server's default: 3; "
            "ours: 16)", _integer(1, 256)),
    _Option("--spec-draft-n-min", "spec_draft_n_min", "a slot verifies a draft of at least N tokens "
            "or none: a shorter one (the drafter had no more, or fewer paid) is not used, "
            "ServerActor's draft_min; at most --spec-draft-n-max (default: 0)", _integer(0, 256)),
    _Option("--spec-draft-model", "spec_draft_model", "the draft model for draft-simple: a smaller "
            "GGUF with the model's vocabulary, draft_model_path (default: unused)", str, "FNAME"),
    _Option("--spec-draft-p-min", "spec_draft_p_min", "a draft model's draft stops at a token it is "
            "less sure of than P, draft_p_min; only with a draft model (default: 0.00)", _number(0, 1), "P"),
    _Option("--embedding", "embedding", "serve the embeddings endpoints (llama-server: only with this "
            "flag). Ours serves /v1/embeddings and /embedding always, beside generation: accepted, it "
            "changes nothing"),
    _Option("--pooling", "pooling", "how embeddings are pooled: mean, cls or last; none serves no "
            "pooled embeddings (/v1/embeddings answers 400, as llama-server's, and /embedding 501: "
            "ours has no per-token output); llama-server's rank is refused (default: the model's "
            "own, else mean)",
            _choice({"mean": "mean", "cls": "cls", "last": "last", "none": "none"}), "{mean,cls,last,none}"),
    _Option("--models-dir", "models_dir", "router mode (without -m): every *.gguf file directly in "
            "this directory is a model, named by its file name without .gguf (default: unused)", str,
            "PATH"),
    _Option("--models-preset", "models_preset", "router mode (without -m): an INI file of models, a "
            "section each, keys as flags without dashes (see the HTTP guide) (default: unused)", str,
            "PATH"),
    _Option("--models-max", "models_max", "router mode: models loaded at once at most; the least "
            "recently used idle one unloads for another (default: 4, 0 = unlimited)", _integer(0, 1024)),
    _Option("--models-autoload", "models_autoload", "router mode: load a model for its first request "
            "(default: enabled; a request's ?autoload=true|false decides for itself)"),
    _Option("--verbose", "verbose", "log everything, every request included (log level debug)"),
    _Option("--verbosity", "verbosity", "log threshold: 0 generic, 1 error, 2 warning, 3 info, 4-5 "
            "debug (llama-server's default: 3; ours: warning)", _integer(0, 2**31 - 1)),
    _Option("--log-disable", "log_disable", "write no log at all: no banner, no access lines, no warnings"),
    _Option("--log-file", "log_file", "write the log (the start-up banner, one access line per request, "
            "warnings) to this file instead of stderr", str, "FNAME"),
    _Option("--log-jsonl", "log_jsonl", "write the log as JSON, one object a line (as --log-format json)"),
)  # fmt: skip
_ACCEPTED = frozenset({"cont_batching", "ui", "jinja", "backend_sampling", "embedding"})  # without effect
_REFUSED_NEGATIONS = MappingProxyType(
    {"cont_batching": "continuous batching is always on in llama-cpp-actors"}
)
_OURS = (  # (spellings, dest, convert, metavar, help)
    (("--strategy",), "strategy", _choice({n: n for n in _STRATEGIES}), "NAME",
     f"batch strategy: {', '.join(_STRATEGIES)} (default: DecodeMaximal)"),
    (("--replicas",), "replicas", _integer(1, 1024), "N",
     "engines behind the server; more than 1 (or --backend ray) starts a ServerPool (default: 1)"),
    (("--backend",), "backend", _choice({"local": "local", "ray": "ray"}), "local|ray",
     "where a pool's replicas run: this process, or Ray actors (default: local)"),
    (("--max-queue",), "max_queue", _integer(0), "N",
     "requests that may wait for a slot before QueueFull (503) (default: 64)"),
    (("--chunk-size",), "chunk_size", _integer(1), "N",
     "prompt tokens a slot prefills per tick at most (default: 512)"),
    (("--max-connections",), "max_connections", _integer(1, 1 << 20), "N",
     "connections beyond this get a JSON 503 and are closed (default: 2048)"),
    (("--max-connections-per-client",), "max_connections_per_client", _integer(0, 1 << 20), "N",
     "connections one address may hold, and requests one API key may have in flight; 0: no bound, "
     "for a server behind a proxy (default: a quarter of --max-connections)"),
    (("--header-timeout",), "header_timeout", _number(0.1, 3600), "SECONDS",
     "a connection that has not sent a whole request head this long after it opened, or after its "
     "last response, is closed (default: 10)"),
    (("--keep-alive-timeout",), "keep_alive_timeout", _integer(1, 3600), "SECONDS",
     "an idle keep-alive connection is closed after this (default: 5)"),
    (("--log-format",), "log_format", _choice({"text": "text", "json": "json"}), "text|json",
     "the log's format: text lines, or JSON objects with each access line's fields (default: text)"),
    (("--drain-timeout",), "drain_timeout", _number(0, 3600), "SECONDS",
     "on SIGTERM/SIGINT, how long in-flight requests may finish (default: 30)"),
    (("--models-memory-mb",), "models_memory_mb", _number(1, 2**40), "MB",
     "router mode: host memory the loaded models may hold together, by their estimates from the GGUF "
     "headers; a model that cannot fit unloads idle ones first (default: 80%% of this machine's)"),
    (("--models-keep-alive",), "models_keep_alive", _number(0, 10**9), "SECONDS",
     "router mode: a model idle this long unloads (default: never, as llama-server)"),
    (("--loop-nice",), "loop_nice", _integer(0, 19), "N",
     "on Linux, the nice value of the event loop's thread once the model is loaded, so that it "
     "never preempts llama.cpp's compute threads mid-pass; 0: unchanged (default: 10)"),
)  # fmt: skip
_SAMPLING = MappingProxyType(
    {"temp": "temp", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "seed": "seed",
     "repeat_last_n": "penalty_last_n", "repeat_penalty": "penalty_repeat",
     "presence_penalty": "penalty_present", "frequency_penalty": "penalty_freq"}
)  # fmt: skip
_PASSED_IF_GIVEN = MappingProxyType(
    {"batch_size": "n_batch", "ubatch_size": "n_ubatch", "flash_attn": "flash_attn",
     "cache_type_k": "type_k", "cache_type_v": "type_v", "n_gpu_layers": "n_gpu_layers",
     "cache_prompt": "cache_prompt", "cache_idle_slots": "cache_idle_slots", "max_queue": "max_queue",
     "chunk_size": "chunk_size",
     "spec_draft_n_max": "draft_max", "spec_draft_p_min": "draft_p_min"}
)  # fmt: skip


def _llama_flag(option: _Option) -> LlamaFlag:
    return by_spelling()[option.flag]
