"""No start option can abort, crash or silently misconfigure the host.

``check_options`` runs in the caller's thread before anything is loaded, so a bad
option is a ``ConfigError`` from ``ServerActor.start()``; the boundary values it lets
through are loaded and served in child processes, because llama.cpp aborts the
process instead of raising.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from helpers import Opaque
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors import ConfigError, ServerActor, ServerOptions, Supervisor
from actors.actor._option_values import (
    KV_CACHE_TYPES,
    MAX_N_CTX,
    MAX_N_PARALLEL,
    MAX_N_THREADS,
    MAX_PROMPT_CACHE_RAM_MB,
    host_ram_mb,
)
from actors.actor._options import StartOptions, check_options
from actors.backend._options import default_n_threads
from strategies import DecodeMaximal

pytestmark = pytest.mark.timeout(120)

OPTION_NAMES = [f.name for f in dataclasses.fields(ServerOptions) if f.init]
QUANTIZED_KV = sorted(t for t in KV_CACHE_TYPES if KV_CACHE_TYPES[t] not in ("f32", "f16", "bf16"))
FLOAT_KV = sorted(t for t in KV_CACHE_TYPES if t not in QUANTIZED_KV)


# -- (a) each bad option, and each bad combination, is a ConfigError from start() ------------

BAD: list[tuple[dict[str, Any], str]] = [
    # the sizes of the context, alone and together
    ({"n_ctx": 0}, "n_ctx"),
    ({"n_ctx": 1}, "n_ctx"),
    ({"n_ctx": -8192}, "n_ctx"),
    ({"n_ctx": 2**32 + 512}, "n_ctx"),  # ctypes would wrap it to 512
    ({"n_ctx": MAX_N_CTX + 1}, "n_ctx"),
    ({"n_ctx": 10**400}, "n_ctx"),
    ({"n_ctx": 8192.0}, "n_ctx"),
    ({"n_ctx": "8192"}, "n_ctx"),
    ({"n_ctx": None}, "n_ctx"),
    ({"n_ctx": True}, "n_ctx"),
    ({"n_ctx": 7, "n_parallel": 4}, r"2 \* n_parallel"),
    ({"n_parallel": 0}, "n_parallel"),
    ({"n_parallel": MAX_N_PARALLEL + 1, "n_ctx": 4096}, "LLAMA_MAX_SEQ"),
    ({"n_parallel": 2**64}, "n_parallel"),
    ({"n_parallel": 2.5}, "n_parallel"),
    ({"n_parallel": 4.0}, "n_parallel"),
    ({"n_parallel": True}, "n_parallel"),
    ({"n_batch": 0}, "n_batch"),
    ({"n_batch": 2, "n_parallel": 4}, "at least n_parallel"),  # SIGABRT in llama.cpp
    ({"n_batch": 2**32 + 1}, "n_batch"),  # would wrap to 1
    ({"n_batch": 512.0}, "n_batch"),
    ({"n_ubatch": 0}, "n_ubatch"),
    ({"n_ubatch": 2**32}, "n_ubatch"),
    ({"n_ubatch": "512"}, "n_ubatch"),
    ({"n_ctx_per_slot": 1}, "n_ctx_per_slot"),
    ({"n_ctx_per_slot": 0}, "n_ctx_per_slot"),
    ({"n_ctx_per_slot": 4097, "n_ctx": 4096}, "n_ctx_per_slot"),
    ({"n_ctx_per_slot": "512"}, "n_ctx_per_slot"),
    # threads
    ({"n_threads": 0}, "n_threads"),
    ({"n_threads": -1}, "n_threads"),
    ({"n_threads": MAX_N_THREADS + 1}, "GGML_MAX_N_THREADS"),
    ({"n_threads": 100_000}, "n_threads"),  # SIGSEGV in llama.cpp
    ({"n_threads": 2.0}, "n_threads"),
    ({"n_threads": False}, "n_threads"),
    ({"n_threads_batch": 0}, "n_threads_batch"),
    ({"n_threads_batch": 100_000}, "n_threads_batch"),
    # the KV cache
    ({"type_k": 999}, "type_k"),  # GGML_ASSERT in llama.cpp
    ({"type_k": -1}, "type_k"),
    ({"type_k": 43}, "type_k"),  # GGML_TYPE_COUNT
    ({"type_k": 4}, "type_k"),  # a removed type: SIGFPE
    ({"type_k": 9}, "type_k"),  # q8_1: SIGSEGV
    ({"type_k": 12}, "type_k"),  # q4_K: GGML_ASSERT without flash attention
    ({"type_k": 24}, "type_k"),  # i8: SIGSEGV
    ({"type_k": True}, "type_k"),
    ({"type_k": "q8_0"}, "type_k"),
    ({"type_k": 8.0}, "type_k"),
    ({"type_v": 999}, "type_v"),
    ({"type_v": 26}, "type_v"),  # i32: GGML_ASSERT in flash attention
    ({"type_v": 8, "flash_attn": False}, "flash attention"),
    ({"type_v": 2, "flash_attn": False}, "flash attention"),
    ({"flash_attn": "yes"}, "flash_attn"),
    ({"flash_attn": 1}, "flash_attn"),
    ({"flash_attn": 0}, "flash_attn"),
    ({"n_gpu_layers": -2}, "n_gpu_layers"),
    ({"n_gpu_layers": 2**31}, "n_gpu_layers"),
    ({"n_gpu_layers": 1.0}, "n_gpu_layers"),
    ({"n_gpu_layers": True}, "n_gpu_layers"),
    ({"use_mmap": "no"}, "use_mmap"),
    ({"use_mmap": 0}, "use_mmap"),
    ({"use_mlock": 1}, "use_mlock"),
    # scheduling
    ({"chunk_size": 0}, "chunk_size"),
    ({"chunk_size": True}, "chunk_size"),
    ({"chunk_size": 1.5}, "chunk_size"),
    ({"max_queue": -1}, "max_queue"),
    ({"max_queue": 2.0}, "max_queue"),
    ({"max_queue": None}, "max_queue"),
    ({"cache_prompt": 1}, "cache_prompt"),
    ({"cache_prompt": "false"}, "cache_prompt"),  # bool("false") is True
    ({"cache_prompt": None}, "cache_prompt"),
    ({"context_shift": 0}, "context_shift"),
    ({"cache_idle_slots": 1}, "cache_idle_slots"),
    ({"cache_idle_slots": "no"}, "cache_idle_slots"),
    ({"spec_type": "ngram", "draft_min": -1}, "draft_min"),
    ({"spec_type": "ngram", "draft_min": 2.0}, "draft_min"),
    ({"spec_type": "ngram", "draft_min": True}, "draft_min"),
    ({"spec_type": "ngram", "draft_max": 4, "draft_min": 5}, "at most draft_max"),
    ({"draft_min": 2}, "draft_min is for speculative decoding"),  # never silently ignored
    ({"batch_strategy": "fast"}, "BatchStrategy"),
    ({"batch_strategy": DecodeMaximal}, "BatchStrategy"),  # the class, not an instance
    ({"prompt_cache_ram_mb": -1}, "prompt_cache_ram_mb"),
    ({"prompt_cache_ram_mb": math.nan}, "prompt_cache_ram_mb"),
    ({"prompt_cache_ram_mb": math.inf}, "prompt_cache_ram_mb"),
    ({"prompt_cache_ram_mb": 1e308}, "prompt_cache_ram_mb"),  # * 2**20 would be inf
    ({"prompt_cache_ram_mb": 10**400}, "prompt_cache_ram_mb"),  # float() overflows
    ({"prompt_cache_ram_mb": MAX_PROMPT_CACHE_RAM_MB + 1}, "prompt_cache_ram_mb"),
    ({"prompt_cache_ram_mb": host_ram_mb() + 1}, "memory"),
    ({"prompt_cache_ram_mb": True}, "prompt_cache_ram_mb"),
    ({"prompt_cache_ram_mb": "64"}, "prompt_cache_ram_mb"),
    # the name and the model path
    ({"name": ""}, "name"),
    ({"name": 5}, "name"),
    ({"name": "a\nb"}, "printable"),
    ({"name": "\ud800"}, "name"),
    ({"name": "x" * 257}, "name"),
    ({"model_path": 123}, "model_path"),
    ({"model_path": b"/tmp/model.gguf"}, "model_path"),
    ({"model_path": ["model.gguf"]}, "model_path"),
    ({"model_path": "\udcffmodel.gguf"}, "UTF-8"),
    # the sampling defaults
    ({"temp": math.nan}, "temp"),
    ({"temp": math.inf}, "temp"),
    ({"temp": -0.5}, "temp"),
    ({"temp": 10**400}, "temp"),  # >= 1e309: float() overflows
    ({"temp": 10**5000}, "temp"),  # its repr raises ValueError
    ({"temp": "0.8"}, "temp"),
    ({"temp": True}, "temp"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2**31}, "top_k"),  # int32 in llama.cpp
    ({"top_k": 10**5000}, "top_k"),
    ({"top_k": 40.0}, "top_k"),
    ({"top_p": 3.0}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**32}, "seed"),
    ({"seed": 1.0}, "seed"),
    ({"penalty_last_n": -2}, "penalty_last_n"),
    ({"penalty_last_n": 10**400}, "penalty_last_n"),
    ({"penalty_repeat": 0}, "penalty_repeat"),
    ({"penalty_freq": math.inf}, "penalty_freq"),
    ({"penalty_present": math.nan}, "penalty_present"),
    ({"grammar": ""}, "grammar"),
    ({"grammar": 5}, "grammar"),
    ({"grammar": 'root ::= "\ud800"'}, "grammar"),
    # the chat template
    ({"chat_template": ""}, "chat_template"),
    ({"chat_template": "  "}, "chat_template"),
    ({"chat_template": 5}, "chat_template"),
    ({"chat_template": b"{{ messages }}"}, "chat_template"),
    ({"chat_template": "{% for m in messages %}"}, "not a valid Jinja2 template"),
    ({"chat_template": "{{ messages }"}, "not a valid Jinja2 template"),
    ({"chat_template": "{% nosuchtag %}"}, "not a valid Jinja2 template"),
    ({"chat_template": "{%" * 100_000}, "not a valid Jinja2 template"),
    ({"chat_template": "{% if 1 %}" * 300 + "{% endif %}" * 300}, "not a valid Jinja2 template"),
    ({"chat_template": "{{ x }}" + " " * 256 * 1024}, "at most 262144 characters"),
    ({"chat_template": "{{ '\ud800' }}"}, "chat_template"),
    ({"chat_template_kwargs": {"1x": True}}, "chat_template_kwargs key '1x'"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs key 'messages'"),
    ({"chat_template_kwargs": {"a": Opaque()}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": [("a", 1)]}, "chat_template_kwargs"),
]


def case_id(options: dict[str, Any]) -> str:
    def show(v: Any) -> str:  # repr of a 4300-digit int raises
        big = isinstance(v, int) and v.bit_length() > 64
        return f"<int of {v.bit_length()} bits>" if big else repr(v)[:30]

    return ",".join(f"{k}={show(v)}" for k, v in options.items())


@pytest.mark.parametrize(("options", "match"), BAD, ids=[case_id(o) for o, _ in BAD])
def test_a_bad_option_is_a_config_error_from_start(
    model_path: str, options: dict[str, Any], match: str
) -> None:
    options = {"model_path": model_path, **options}
    with pytest.raises(ConfigError, match=match):
        ServerActor.start(**options)


def test_options_are_checked_before_the_model_is_looked_for(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="n_threads"):
        ServerActor.start(model_path=tmp_path / "missing.gguf", n_threads=100_000)


def test_an_unknown_option_is_still_a_type_error_naming_it(model_path: str) -> None:
    with pytest.raises(TypeError, match="n_ctx_slot"):
        ServerActor.start(model_path=model_path, n_ctx_slot=512)


@pytest.mark.parametrize(
    ("typo", "meant"),
    [("temperature", "temp"), ("n_paralel", "n_parallel"), ("ctx_size", "n_ctx"),
     ("presence_penalty", "penalty_present"), ("chunksize", "chunk_size"), ("model", "model_path")],
)  # fmt: skip
def test_an_unknown_option_names_the_option_it_likely_meant(typo: str, meant: str) -> None:
    for start in (ServerOptions.of, ServerActor, Supervisor.start, ServerOptions().replace):
        with pytest.raises(TypeError, match=f"did you mean '{meant}'"):
            start(**{typo: 1})
    with pytest.raises(TypeError, match=r"options\.md"):  # nothing close: where to look
        ServerOptions.of(zzzz=1)


def test_server_options_are_checked_when_made_and_frozen() -> None:
    with pytest.raises(ConfigError, match="n_parallel"):
        ServerOptions(n_parallel=0)
    strategy = DecodeMaximal()
    options = ServerOptions(n_parallel=2, n_ctx=1024, temp=0.0, batch_strategy=strategy)
    assert options.checked.n_parallel == 2 and options.checked.defaults.temp == 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.n_parallel = 8  # type: ignore[misc]
    with pytest.raises(ConfigError, match="n_batch"):  # a change is checked again, in combination
        options.replace(n_batch=1)
    assert options.replace(name="a").checked.name == "a" and options.checked.name is None
    # The keywords and the object are the same options.
    assert check_options(n_parallel=2, n_ctx=1024, temp=0.0, batch_strategy=strategy) == options.checked


def test_an_engine_starts_from_server_options_with_changes_by_name(model_path: str) -> None:
    options = ServerOptions(model_path=model_path, n_parallel=1, n_ctx=256)
    actor = ServerActor(options, name="a")  # checks only: the model loads in on_start
    assert actor.actor_server_options == options.replace(name="a")
    assert actor.actor_config.name == "a" and actor.actor_options.n_parallel == 1
    with pytest.raises(TypeError, match="ServerOptions"):
        ServerActor({"n_parallel": 1})  # type: ignore[arg-type]


def test_the_defaults_and_valid_values_are_kept() -> None:
    o = check_options()
    assert (o.n_ctx, o.n_parallel, o.n_batch, o.n_ubatch) == (8192, 4, 2048, 512)
    assert o.n_threads == o.n_threads_batch == min(default_n_threads(), MAX_N_THREADS)
    assert (o.chunk_size, o.max_queue, o.cache_prompt, o.context_shift) == (512, 64, True, True)
    assert (o.flash_attn, o.type_k, o.type_v, o.n_gpu_layers) == (None, None, None, 0)
    assert isinstance(o.batch_strategy, DecodeMaximal) and o.model_path is None
    assert o.defaults.temp == 0.8 and o.ram_budget_bytes == 0 and o.name is None
    o = check_options(n_ctx=512, n_batch=4096, n_ubatch=64, prompt_cache_ram_mb=1.5, name="replica-0")
    assert (o.n_batch, o.n_ubatch) == (4096, 64)  # llama.cpp clamps n_batch to n_ctx; on_start warns
    assert o.ram_budget_bytes == 1536 * 1024 and o.name == "replica-0"
    # llama.cpp takes min(n_ubatch, n_batch) as its physical batch: so do we, openly.
    assert check_options(n_ctx=512, n_batch=8, n_ubatch=4096).n_ubatch == 8
    assert check_options(n_ctx=2, n_parallel=1).n_batch == 2
    assert check_options(model_path=Path("/x/m.gguf")).model_path == "/x/m.gguf"
    assert check_options(n_ctx=512, n_ctx_per_slot=512).engine_config().n_ctx_per_slot == 512
    assert check_options(type_v=8).backend_options("/m.gguf").type_v == 8  # auto flash attention


def test_kv_cache_types_are_llamas_ids() -> None:
    import llama_cpp

    for ggml_id, name in KV_CACHE_TYPES.items():
        # llama-cpp-python 0.3.36 has no GGML_TYPE_BF16; ggml.h says 30.
        assert getattr(llama_cpp, f"GGML_TYPE_{name.upper()}", 30) == ggml_id


# -- (b) any value of any type: a result or a ConfigError, nothing else --------------------

HUGE = [2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 512, 2**63, 2**64, 10**309, 10**5000, -(10**5000)]
ANYTHING = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-1, max_value=600),
    st.sampled_from(HUGE),
    st.builds(lambda e: 2**e, st.integers(0, 20_000)),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), max_size=3),
    st.binary(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.sampled_from([object(), DecodeMaximal(), DecodeMaximal, Path("m.gguf"), math, 1j]),
)


def _check(options: dict[str, Any]) -> StartOptions | None:
    try:
        return check_options(**options)
    except ConfigError as e:
        assert str(e)  # a message, and never anything but a ConfigError
        return None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(OPTION_NAMES), ANYTHING)
def test_any_value_of_one_option_is_accepted_or_a_config_error(name: str, value: object) -> None:
    _check({name: value})


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(OPTION_NAMES), ANYTHING, max_size=8))
def test_any_values_of_several_options_are_accepted_or_a_config_error(options: dict[str, Any]) -> None:
    _check(options)


SIZES = st.one_of(st.none(), st.integers(-2, 600), st.sampled_from(HUGE))


@settings(max_examples=400, deadline=None)
@given(
    n_ctx=st.one_of(st.integers(-2, 1100), st.sampled_from(HUGE)),
    n_parallel=st.one_of(st.integers(-1, 300), st.sampled_from(HUGE)),
    n_batch=SIZES,
    n_ubatch=SIZES,
    n_ctx_per_slot=SIZES,
    n_threads=SIZES,
    flash_attn=st.sampled_from([None, True, False]),
    type_k=st.one_of(st.none(), st.integers(-1, 45)),
    type_v=st.one_of(st.none(), st.integers(-1, 45)),
)
def test_what_is_accepted_is_within_every_measured_limit(**options: Any) -> None:
    o = _check(options)
    if o is None:
        return
    # Each rule below stands for a crash of llama.cpp or a silent wrap measured in a child.
    assert 1 <= o.n_parallel <= MAX_N_PARALLEL
    assert 2 * o.n_parallel <= o.n_ctx <= MAX_N_CTX
    assert o.n_parallel <= min(o.n_batch, o.n_ctx) and o.n_batch <= MAX_N_CTX
    assert 1 <= o.n_ubatch <= o.n_batch
    assert 1 <= o.n_threads <= MAX_N_THREADS and 1 <= o.n_threads_batch <= MAX_N_THREADS
    assert o.n_ctx_per_slot is None or 2 <= o.n_ctx_per_slot <= o.n_ctx
    assert o.type_k is None or o.type_k in KV_CACHE_TYPES
    assert o.type_v is None or o.type_v in KV_CACHE_TYPES
    assert not (o.flash_attn is False and o.type_v in QUANTIZED_KV)
    for value in (o.n_ctx, o.n_batch, o.n_ubatch, o.n_parallel, o.n_threads, o.n_threads_batch):
        assert type(value) is int


# -- (c) what the checks let through loads and serves, in a child process ------------------

CHILD = textwrap.dedent(
    """
    import json, sys
    import pykka
    from actors import ServerActor, generate

    model_path, cases = sys.argv[1], json.loads(sys.argv[2])
    for i, options in enumerate(cases):
        print(json.dumps({"case": i, "started": True}), flush=True)
        try:
            ref = ServerActor.start(model_path=model_path, **options)
            try:
                generate(ref, "a", max_tokens=2, temp=0, timeout=60)
                outcome = "ok"
            finally:
                try:
                    ref.stop(timeout=30)
                except Exception:
                    pass  # it failed to load: the outcome is generate's error
        except Exception as e:
            outcome = "ModelLoadError" if "ModelLoadError" in repr(e) else type(e).__name__
            detail = repr(e)[:300]
        else:
            detail = ""
        print(json.dumps({"case": i, "outcome": outcome, "detail": detail}), flush=True)
    pykka.ActorRegistry.stop_all()
    """
)
SMALL = {"n_ctx": 256, "n_parallel": 1, "n_threads": 1}


def run_child(model_path: str, cases: list[dict[str, Any]]) -> list[str]:
    """Run ``cases`` one after another in a child; its exit code and each outcome."""
    result = subprocess.run(
        [sys.executable, "-c", CHILD, model_path, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=110,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    started = [line["case"] for line in lines if "started" in line]
    last = cases[started[-1]] if started else None
    assert result.returncode == 0, (
        f"the child died with {result.returncode} (a signal if < 0) in case {last}:\n{result.stderr[-3000:]}"
    )
    outcomes = {line["case"]: (line["outcome"], line["detail"]) for line in lines if "outcome" in line}
    assert sorted(outcomes) == list(range(len(cases)))
    return [f"{outcomes[i][0]} {cases[i]} {outcomes[i][1]}" for i in range(len(cases))]


def assert_served(outcomes: list[str], allowed: tuple[str, ...] = ("ok", "ModelLoadError")) -> None:
    refused = [o for o in outcomes if not o.startswith(allowed)]
    assert not refused, "\n".join(refused)


@pytest.mark.subprocess
def test_the_smallest_sizes_allowed_load_and_serve(model_path: str) -> None:
    cases = [
        {**SMALL, "n_ctx": 2},  # the smallest context
        {**SMALL, "n_ctx": 8, "n_parallel": 4, "n_batch": 4},  # n_batch == n_parallel, n_ctx == 2x
        {**SMALL, "n_ctx": 64, "n_parallel": 4, "n_batch": 4, "n_ubatch": 1},
        {**SMALL, "n_ctx": 64, "n_parallel": 2, "n_batch": 8, "n_ubatch": 4096},  # n_ubatch > n_batch
        {**SMALL, "n_ctx": 64, "n_batch": MAX_N_CTX, "n_ubatch": MAX_N_CTX},  # clamped to n_ctx
        {**SMALL, "n_ctx": 512, "n_parallel": MAX_N_PARALLEL, "n_batch": MAX_N_PARALLEL},
        {**SMALL, "n_gpu_layers": -1},
        {**SMALL, "n_gpu_layers": 2**31 - 1, "use_mmap": False, "prompt_cache_ram_mb": host_ram_mb()},
    ]
    assert_served(run_child(model_path, cases))
    # A slot of 2 positions holds a 1-token prompt and one token; a longer prompt is refused.
    assert_served(
        run_child(model_path, [{**SMALL, "n_ctx_per_slot": 2}]), ("ok", "ModelLoadError", "InvalidRequest")
    )


@pytest.mark.subprocess
def test_the_cases_that_aborted_the_host_are_refused_and_the_process_lives(model_path: str) -> None:
    cases = [
        {**SMALL, "n_batch": 2, "n_parallel": 4},
        {**SMALL, "n_ctx": 1, "n_parallel": 4},
        {**SMALL, "type_k": 999},
        {**SMALL, "n_threads": 100_000},
        {**SMALL, "flash_attn": "yes"},
        {**SMALL, "n_ctx": 2**32 + 512},
        {**SMALL, "type_v": 8, "flash_attn": False},
    ]
    outcomes = run_child(model_path, [*cases, SMALL])
    assert all(o.startswith("ConfigError") for o in outcomes[:-1]), outcomes
    assert outcomes[-1].startswith("ok"), outcomes[-1]


@pytest.mark.subprocess
def test_the_most_threads_allowed_load_and_serve(model_path: str) -> None:
    assert_served(
        run_child(
            model_path,
            [{**SMALL, "n_threads": MAX_N_THREADS, "n_threads_batch": MAX_N_THREADS}],
        )
    )


@pytest.mark.subprocess
def test_every_kv_cache_type_allowed_loads_and_serves_with_and_without_flash_attention(
    model_path: str,
) -> None:
    types = sorted(KV_CACHE_TYPES)
    cases = [
        *({**SMALL, "type_k": t, "type_v": t, "flash_attn": True} for t in types),
        *({**SMALL, "type_k": t, "flash_attn": False} for t in types),  # K may be quantized without
        *({**SMALL, "type_k": t, "type_v": t, "flash_attn": False} for t in FLOAT_KV),
        *({**SMALL, "type_v": t, "flash_attn": None} for t in QUANTIZED_KV),  # llama.cpp turns it on
    ]
    assert_served(run_child(model_path, cases))
