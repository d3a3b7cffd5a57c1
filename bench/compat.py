"""Compatibility with llama-server, checked by llama.cpp's own server test suite.

The llama-cpp-python sdist (``make bench-peers``) vendors llama.cpp with its server
tests in ``vendor/llama.cpp/tools/server/tests``. They start ``$LLAMA_SERVER_BIN_PATH``
with llama-server's flags; here that is ``bench/compat/llama_server.py``, which maps
their model downloads to the default model (``bench/compat/compat_plugin.py`` maps the
files the tests fetch themselves, a draft model, to it too) and execs either llama-server
(``bench/.peers/llama-server``) or ours (``llama-cpp-actors serve``). The same test
files run once against each, one test at a time, each with a timeout; the report is
both pass counts and the tests that pass on llama-server but not on ours, except those
that need a part we deliberately leave out (``LEFT_OUT``).

The tests marked slow are left out except in ``SLOW_FILES`` (``test_tool_call.py`` and
``test_compat_anthropic.py``: tool calls, reasoning and thinking with the hub models they
name). The wrapper maps each hub model to the default model as well and, when the test
gives no template of its own (no ``--chat-template``/``--chat-template-file``), adds the
hub model's template from llama.cpp's ``models/templates/`` (the table is in the wrapper's
docstring and ``HUB_TEMPLATES``), so both servers render the same template.
The tests of a file in ``FILE_TIMEOUTS`` get a longer per-test timeout (the default
model may generate up to 8192 tokens there). The wall time of each run, and of each file,
goes in the report.

The suite's own requirements go in a venv of their own, ``bench/.peers/compat-venv``
(made on first use). The suite picks its port from ``$PORT`` (8080 by default); we give
it a free one, so it never talks to another server on this machine. Its session
warm-up, which only fills the download cache, is skipped (``bench/compat/compat_plugin.py``).
Logs, JUnit XML and per-test outcomes of the last run of each side are in
``bench/.peers/compat-runs/``; the summary goes to ``bench/results/compat.md``.

Run ``python bench/compat.py`` (``make compat``, about 65 minutes on 2 cores, of which
``test_tool_call.py`` takes about 28 minutes on llama-server and 21 on ours).
``--server ours`` runs our side only and compares it with llama-server's last full run;
``--report-only`` rewrites the results from the last full runs; ``-k`` (as pytest's) and
``--files`` run a part, which writes no results file.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import machine, markdown_table, write_result

from actors import default_model_path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
PEERS = BENCH / ".peers"
WRAPPER = BENCH / "compat" / "llama_server.py"
PLUGIN_DIR = BENCH / "compat"
VENV = PEERS / "compat-venv"
RUNS = PEERS / "compat-runs"
LLAMA_SERVER = PEERS / "llama-server"
# ``$COMPAT_OURS`` (as in the wrapper) lets a worktree without its own venv use another
# checkout's script; the wrapper puts this checkout first on its PYTHONPATH either way.
OURS = Path(os.environ.get("COMPAT_OURS", str(REPO / ".venv" / "bin" / "llama-cpp-actors")))

FILES = (
    "test_basic.py",
    "test_completion.py",
    "test_chat_completion.py",
    "test_ctx_shift.py",
    "test_ignore_eos.py",
    "test_stream.py",
    "test_tokenize.py",
    "test_metrics.py",
    "test_security.py",
    "test_template.py",
    "test_kv_keep_only_active.py",
    "test_embedding.py",  # issue 17: embeddings (the suite's BERT model mapped to the default one)
    # issue 30: tool calls, reasoning, Anthropic /v1/messages, OpenAI /v1/responses
    "test_tool_call.py",
    "test_compat_anthropic.py",
    "test_compat_oai_responses.py",
    "test_infill.py",  # POST /infill (fill-in-the-middle)
    "test_slot_save.py",  # POST /slots/{id}?action=save|restore|erase (--slot-save-path)
    "test_sleep.py",  # --sleep-idle-seconds
    "test_speculative.py",  # --spec-type, -md (its draft model mapped to the default one)
)

# Files whose tests marked slow run too (the others run ``not slow``).
SLOW_FILES = ("test_tool_call.py", "test_compat_anthropic.py")

# Per-test timeouts (seconds) longer than ``--timeout`` for the tests of these files: the
# slow tool-call tests generate up to 512 tokens (8192 for one) with the default model,
# 60-90 tokens/s on 2 cores, grammar-constrained on llama-server, plus the server start.
# A speculative test starts up to five servers, each loading the draft model too, and
# llama-server verifying 8-token drafts on 2 busy cores took 175-236 s for some of them
# (0.3 to 5 tokens/s; ours 23-53 s).
FILE_TIMEOUTS = {"test_tool_call.py": 300, "test_compat_anthropic.py": 300, "test_speculative.py": 600}

# Tests that need a part of llama-server we deliberately leave out (issue 14): a
# node-id pattern (fnmatch) and the reason. A test matched here is reported as
# "left out: <reason>", never counted as a difference.
LEFT_OUT: tuple[tuple[str, str], ...] = (
    (
        "unit/test_security.py::test_cors_proxy_only_forwards_explicit_proxy_headers",
        "the web UI's /cors-proxy (--ui-mcp-proxy)",
    ),
    (
        "unit/test_security.py::test_cors_origins_defaults_to_localhost_with_tools_enabled",
        "tools run by the server (--tools)",
    ),
    (
        "unit/test_kv_keep_only_active.py::*",
        "reads llama-server's own debug log lines (__TEST_TAG_...)",
    ),
    (
        "unit/test_completion.py::test_completion_unified[[]256-4-n_predict_vals2-*",
        "llama-server answers 500 to the three requests that overflow the unified KV; ours "
        "preempts and completes all four, and the test then wants each 200 to reach n_predict, "
        "which a sampled completion that meets end-of-generation first does not",
    ),
    (
        "unit/test_compat_anthropic.py::test_anthropic_empty_messages",
        "an empty conversation: Anthropic's own API answers 400 (at least one message), and so "
        "do we; llama-server renders an empty chat and answers 200",
    ),
    (
        "unit/test_compat_anthropic.py::test_anthropic_tool_result_with_image",
        "an image on a text-only model: the test wants llama-server's 500; ours answers 400 "
        "'image input is not supported' (the caller's error, not the server's)",
    ),
    (
        "unit/test_compat_anthropic.py::test_anthropic_vision_format_accepted",
        "an image on a text-only model: the test wants llama-server's 500; ours answers 400 "
        "'image input is not supported' (the caller's error, not the server's)",
    ),
    (
        "unit/test_speculative.py::test_synth_*",
        "synthetic draft acceptance (--spec-synth-rates, --spec-synth-len): llama-server's "
        "benchmarking mode, which keeps draft tokens at random instead of the model's and says "
        "its output is not valid; ours refuses both flags by name",
    ),
    (
        "unit/test_speculative.py::test_with_and_without_draft",
        "its last part starts a server with --spec-synth-rates (synthetic draft acceptance, "
        "refused by ours by name); before that it wants draft_n > 0 in a 16-token answer, and "
        "ours verifies a draft only where the measured cost of a pass says it pays",
    ),
    (
        "unit/test_chat_completion.py::test_apply_chat_template",
        "a template built into llama.cpp's C++ by name (command-r); ours knows chatml and llama3, "
        "or takes the Jinja text",
    ),
)

# Tests whose outcome on llama-server varies from run to run on this machine: marked
# "flaky" wherever they are listed.
FLAKY: tuple[tuple[str, str], ...] = (
    (
        "unit/test_completion.py::test_completion_unified[[]256-4-n_predict_vals3-*",
        "four parallel sampled requests; one may meet end-of-generation before n_predict",
    ),
)

# Why llama-server fails a test with the default model: a node-id pattern and the
# category shown in the results. A failure that matches none shows "?", so a new one
# stands out.
_TINY_TEXT = "expects the text, token counts or tokenizer of the suite's tiny model (stories260K)"
_BOS = "expects a BOS token (`<s>`); SmolLM2 adds none"
_HUB_MODEL = (
    "expects what the hub model it names would answer (a tool call, a sum, reasoning); "
    "the default model (SmolLM2-135M) answers with other text"
)
WHY_LLAMA_SERVER_FAILS: tuple[tuple[str, str], ...] = (
    ("unit/test_chat_completion.py::test_chat_completion[[]*", _TINY_TEXT),
    ("unit/test_chat_completion.py::test_chat_completion_stream[[]*", _TINY_TEXT),
    ("unit/test_chat_completion.py::test_chat_completion_with_openai_library", _TINY_TEXT),
    ("unit/test_chat_completion.py::test_chat_completion_cached_tokens", _TINY_TEXT),
    ("unit/test_chat_completion.py::test_completion_with_json_schema[[]*", _TINY_TEXT),
    ("unit/test_chat_completion.py::test_return_progress[[]*", _TINY_TEXT),
    ("unit/test_completion.py::test_completion[[]*", _TINY_TEXT),
    ("unit/test_completion.py::test_completion_stream[[]*", _TINY_TEXT),
    ("unit/test_completion.py::test_completion_*openai_library", _TINY_TEXT),
    ("unit/test_completion.py::test_completion_prompt_cache", _TINY_TEXT),
    ("unit/test_completion.py::test_completion_unified[[]*", _TINY_TEXT),
    ("unit/test_completion.py::test_nocache_long_input_prompt", _TINY_TEXT),
    ("unit/test_ctx_shift.py::*", _TINY_TEXT),
    ("unit/test_tokenize.py::test_tokenize_with_bos", _BOS),
    ("unit/test_chat_completion.py::test_chat_template", _BOS),
    ("unit/test_completion.py::test_completion_response_fields[[]*", _BOS),
    ("unit/test_security.py::test_local_media_file[[]*", "needs images (tinygemma3 and its projector)"),
    ("unit/test_basic.py::test_load_split_model", "needs a download (a split model)"),
    ("unit/test_metrics.py::test_metrics_embedding_prompt_is_counted", "needs a second model (embeddings)"),
    (
        "unit/test_completion.py::test_cache_vs_nocache_prompt",
        "skipped by the suite itself (marked as failing on Linux)",
    ),
    # The suite's prompts and n_predict=64 fill 84 cells with its tiny model; SmolLM2's
    # answer to them ends at once (n_saved 7), and its text matches no regex.
    ("unit/test_slot_save.py::test_slot_save_restore", _TINY_TEXT),
    ("unit/test_slot_save.py::test_slot_erase", _TINY_TEXT),
    ("unit/test_slot_save.py::test_slot_restore_legacy_token_list", _TINY_TEXT),
    *(
        (
            f"unit/test_slot_save.py::test_slot_*{which}*",
            "needs images (tinygemma3 and its projector); its --slot-save-path ./tmp is no directory here",
        )
        for which in ("multimodal", "image", "mmproj")
    ),
    ("unit/test_basic.py::test_no_ui", "needs the web UI, not built into bench/.peers/llama-server"),
    ("unit/test_tool_call.py::test_completion_with_required_tool_real_model[[]*", _HUB_MODEL),
    ("unit/test_tool_call.py::test_weather[[]*", _HUB_MODEL),
    ("unit/test_tool_call.py::test_hello_world[[]*", _HUB_MODEL),
    ("unit/test_tool_call.py::test_calc_result[[]*", _HUB_MODEL),
    ("unit/test_tool_call.py::test_thoughts[[]*", _HUB_MODEL),
    ("unit/test_compat_anthropic.py::test_anthropic_thinking_with_reasoning_model[[]*", _HUB_MODEL),
    (
        "unit/test_tool_call.py::test_completion_without_tool_call_slow[[]meetkai-functionary-*",
        "the default model's text under a functionary template: llama.cpp's parser rejects it "
        "(500, 'does not match the expected peg-native format') or reads a tool call in it",
    ),
    (
        "unit/test_compat_anthropic.py::test_anthropic_tool_result",
        "the default model's sampled answer to a tool result is empty",
    ),
    (
        "unit/test_compat_anthropic.py::test_anthropic_vision_base64_with_multimodal_model",
        "needs a download (tinygemma3 and an image from huggingface.co)",
    ),
    ("unit/test_compat_oai_responses.py::test_responses_*with_openai_library", _TINY_TEXT),
    ("unit/test_speculative.py::test_multi_requests_parallel[[]*", _TINY_TEXT),
    (
        "unit/test_speculative.py::test_with_and_without_draft",
        "the default model drafting for itself: the 16th token of the sampled answer "
        "(temperature 0.2, top_k 5) is a near tie that the batch's shape decides (198 without "
        "drafts, 657 with)",
    ),
    (
        "unit/test_infill.py::*",
        "the default model has no FIM prefix, suffix or middle token: llama-server answers 501 "
        "'Infill is not supported by this model' (the suite's model is stories260K-infill)",
    ),
    (
        "unit/test_security.py::test_access_static_assets_without_api_key",
        "needs the web UI, not built into bench/.peers/llama-server",
    ),
)

# Test-only extras the suite's requirements.txt does not list.
EXTRA_REQUIREMENTS = ("pytest-timeout",)
# Environment variables that change what the suite does; never inherited.
SUITE_SWITCHES = ("DEBUG", "DEBUG_EXTERNAL", "N_GPU_LAYERS", "SLOW_TESTS", "PORT", "LLAMA_SERVER_BIN_PATH")

Outcomes = dict[str, dict[str, Any]]


def suite_dir() -> Path:
    """The server tests of the newest unpacked sdist under bench/.peers."""
    candidates = sorted(PEERS.glob("llama_cpp_python-*/vendor/llama.cpp/tools/server/tests"))
    if not candidates:
        sys.exit(f"no llama-cpp-python sdist under {PEERS}: run `make bench-peers` first")
    return candidates[-1]


def ensure_venv(tests: Path) -> list[str]:
    """Make the suite's venv if needed; returns the requirements that did not install."""
    python = VENV / "bin" / "python"
    lines = [line.strip() for line in (tests / "requirements.txt").read_text().splitlines()]
    wanted = [line for line in lines if line and not line.startswith("#")] + list(EXTRA_REQUIREMENTS)
    digest = hashlib.sha256("\n".join(wanted).encode()).hexdigest()
    stamp = VENV / ".compat-installed"
    try:
        installed = json.loads(stamp.read_text())
        if python.exists() and installed["digest"] == digest:
            return list(installed["skipped"])
    except (OSError, ValueError, KeyError):
        pass
    if not python.exists():
        print(f"making {VENV.relative_to(REPO)} for the suite's requirements", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    skipped: list[str] = []
    if subprocess.run([*pip, *wanted]).returncode != 0:
        # One at a time, to keep whatever installs; the rest is reported.
        skipped = [req for req in wanted if subprocess.run([*pip, req]).returncode != 0]
    stamp.write_text(json.dumps({"digest": digest, "skipped": skipped}))
    return skipped


def free_port() -> int:
    """A port nobody listens on now, so the suite never talks to somebody else's server."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_suite(
    server: str, tests: Path, model: str, timeout_s: int, files: list[str], keyword: str | None
) -> Outcomes:
    """Run the suite's ``files`` against ``server``; returns the outcome of each test.

    A full run keeps its outcomes in ``compat-runs/<server>.json`` (the baseline a later
    ``--server ours`` compares with); a partial one in ``<server>.partial.json``.
    """
    RUNS.mkdir(parents=True, exist_ok=True)
    stem = server if keyword is None and files == list(FILES) else f"{server}.partial"
    outcomes_path = RUNS / f"{stem}.json"
    outcomes_path.unlink(missing_ok=True)
    env = {key: value for key, value in os.environ.items() if key not in SUITE_SWITCHES}
    env.update(
        LLAMA_SERVER_BIN_PATH=str(WRAPPER),
        COMPAT_SERVER=server,
        COMPAT_MODEL=model,
        COMPAT_OUTCOMES=str(outcomes_path),
        COMPAT_SLOW_FILES=",".join(SLOW_FILES),
        COMPAT_TIMEOUTS=json.dumps(
            {name: max(seconds, timeout_s) for name, seconds in FILE_TIMEOUTS.items()}
        ),
        COMPAT_TEMPLATES=str((tests / ".." / ".." / ".." / "models" / "templates").resolve()),
        PORT=str(free_port()),
        PYTHONPATH=str(PLUGIN_DIR),
        PYTHONDONTWRITEBYTECODE="1",
    )
    command = [
        str(VENV / "bin" / "python"),
        "-m",
        "pytest",
        "-p",
        "compat_plugin",
        "-p",
        "no:cacheprovider",
        f"--timeout={timeout_s}",
        f"--junitxml={RUNS / f'{stem}.xml'}",
        "-v",
        "-rN",
        *(["-k", keyword] if keyword else []),
        *[f"unit/{name}" for name in files],
    ]
    print(f"\n=== {server}: {' '.join(command[3:])}  (PORT={env['PORT']})", flush=True)
    log_path = RUNS / f"{stem}.log"
    started = time.monotonic()
    with (
        open(log_path, "w") as log,
        subprocess.Popen(
            command, cwd=tests, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as proc,
    ):
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            # The per-test lines and the summary; the failure details stay in the log.
            if "::" in line or line.startswith("=") or line.startswith("ERROR"):
                print(line, end="", flush=True)
    wall_s = round(time.monotonic() - started)
    print(f"({server}: pytest exited {proc.returncode} after {_minutes(wall_s)}; full log in {log_path})")
    if not outcomes_path.exists():
        sys.exit(f"{server}: the suite wrote no outcomes; see {log_path}")
    what = _llama_server_version() if server == "llama-server" else _our_commit()
    meta = {
        "when": datetime.datetime.now().isoformat(timespec="minutes"),
        "what": what,
        "wall_s": wall_s,
        "timeout_s": timeout_s,
    }
    (RUNS / f"{stem}.meta.json").write_text(json.dumps(meta))
    result: Outcomes = json.loads(outcomes_path.read_text())
    return result


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def _meta(server: str) -> dict[str, Any]:
    try:
        result: dict[str, Any] = json.loads((RUNS / f"{server}.meta.json").read_text())
        return result
    except (OSError, ValueError):
        return {}


def wall_times(outcomes: Outcomes) -> dict[str, float]:
    """Seconds spent in each test file (setup, call and teardown of its tests)."""
    times: dict[str, float] = {}
    for nodeid, entry in outcomes.items():
        name = nodeid.partition("::")[0].rpartition("/")[2]
        times[name] = times.get(name, 0.0) + float(entry.get("duration", 0.0))
    return times


def file_passes(outcomes: Outcomes, select: str = "") -> dict[str, tuple[int, int]]:
    """Per test file: the tests that passed and the tests run (those whose node id
    contains ``select``)."""
    counts: dict[str, tuple[int, int]] = {}
    for nodeid, entry in outcomes.items():
        if select not in nodeid:
            continue
        name = nodeid.partition("::")[0].rpartition("/")[2]
        won, run = counts.get(name, (0, 0))
        counts[name] = (won + (entry.get("outcome") == "passed"), run + 1)
    return counts


def _hub_templates() -> dict[str, str]:
    """The wrapper's table: each template file and the hub models it stands for."""
    sys.path.insert(0, str(PLUGIN_DIR))
    try:
        import llama_server  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(PLUGIN_DIR))
    by_file: dict[str, list[str]] = {}
    for model, file in llama_server.HUB_TEMPLATES:
        by_file.setdefault(file, []).append(model)
    return {file: ", ".join(models) for file, models in by_file.items()}


def _described(server: str) -> str:
    """What the last full run against ``server`` ran (version or commit) and when."""
    try:
        meta = json.loads((RUNS / f"{server}.meta.json").read_text())
        return f"{meta['what']}, run {meta['when']}"
    except (OSError, ValueError, KeyError):
        return "(not recorded)"


def _lookup(table: tuple[tuple[str, str], ...], nodeid: str) -> str | None:
    return next((reason for pattern, reason in table if fnmatch.fnmatchcase(nodeid, pattern)), None)


def left_out_reason(nodeid: str) -> str | None:
    return _lookup(LEFT_OUT, nodeid)


def _flaky(nodeid: str) -> str:
    reason = _lookup(FLAKY, nodeid)
    return f" (flaky on llama-server: {reason})" if reason else ""


def passed(outcomes: Outcomes) -> set[str]:
    return {nodeid for nodeid, entry in outcomes.items() if entry["outcome"] == "passed"}


def counts(outcomes: Outcomes) -> str:
    tally: dict[str, int] = {}
    for entry in outcomes.values():
        tally[entry["outcome"]] = tally.get(entry["outcome"], 0) + 1
    order = ("passed", "failed", "error", "skipped")
    return ", ".join(f"{tally[key]} {key}" for key in order if key in tally) + f" of {len(outcomes)}"


def _short(text: str, width: int = 140, markdown: bool = True) -> str:
    text = text.replace("\n", " ")
    if markdown:
        text = text.replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"


def _llama_server_version() -> str:
    try:
        out = subprocess.run([str(LLAMA_SERVER), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "(version unknown)"
    line = next((line for line in (out.stdout + out.stderr).splitlines() if line.startswith("version:")), "")
    return line.removeprefix("version:").strip() or "(version unknown)"


def _our_commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "an unknown commit"
    dirty = git("status", "--porcelain", "--", "actors", "pyproject.toml")
    return f"commit {commit}" + (" with uncommitted changes in actors/ or pyproject.toml" if dirty else "")


def report(
    llama: Outcomes, ours: Outcomes | None, ours_note: str, skipped_requirements: list[str], tests: Path
) -> str:
    lines = [
        "# Compatibility: llama.cpp's server test suite",
        "",
        f"Measured: {machine()}.",
        "",
        f"Servers: llama-server {_described('llama-server')} (`bench/.peers/llama-server`);",
        f"llama-cpp-actors at {_described('ours')}. Model: the default model",
        "(SmolLM2-135M-Instruct Q4_1) for every preset of the suite (`bench/compat/llama_server.py`",
        "maps the suite's downloads to it), and for `test_speculative.py`'s draft model too",
        "(`bench/compat/compat_plugin.py`). Produced by",
        f"`python bench/compat.py` (`make compat`) from `{tests.relative_to(REPO)}/unit/`:",
        f"{', '.join(f'`{name}`' for name in FILES)}; one test at a time. The tests marked slow run",
        f"only in {', '.join(f'`{name}`' for name in SLOW_FILES)}; per-test timeout "
        f"{', '.join(f'{seconds} s for `{name}`' for name, seconds in FILE_TIMEOUTS.items())}, "
        f"{_meta('llama-server').get('timeout_s', 180)} s for the rest.",
        "",
        "Hub models: the slow tests name hub models (`bartowski/...-GGUF`), each mapped to the",
        "default model too; when a test gives no template of its own (no `--chat-template` or",
        "`--chat-template-file`) the wrapper adds the hub model's template from llama.cpp's",
        "`models/templates/`, the same for both servers: "
        + "; ".join(f"{models} → `{file}`" for file, models in _hub_templates().items())
        + ".",
        "",
    ]
    walls = [(name, _meta(name).get("wall_s")) for name in ("llama-server", "ours")]
    if any(wall for _, wall in walls):
        lines += [
            "Wall time of the last full run: "
            + ", ".join(f"{name} {_minutes(wall)}" for name, wall in walls if wall)
            + ". Per file (setup, call and teardown of its tests):",
            "",
        ]
        sides = [(side, outcomes) for side, outcomes in (("llama-server", llama), ("ours", ours)) if outcomes]
        per_file = {side: wall_times(outcomes) for side, outcomes in sides}
        won = {side: file_passes(outcomes) for side, outcomes in sides}
        lines += [
            markdown_table(
                ["file", *(f"{side} passed" for side in per_file), *per_file],
                [
                    [
                        f"`{name}`",
                        *("{} of {}".format(*won[side].get(name, (0, 0))) for side in won),
                        *(_minutes(times.get(name, 0.0)) for times in per_file.values()),
                    ]
                    for name in FILES
                ],
            )
        ]
    if skipped_requirements:
        lines += [f"Requirements that did not install: {', '.join(skipped_requirements)}.", ""]
    rows = [["llama-server", str(len(passed(llama))), counts(llama)]]
    rows.append(
        ["llama-cpp-actors", str(len(passed(ours))), counts(ours)]
        if ours
        else ["llama-cpp-actors", "—", ours_note]
    )
    lines += [markdown_table(["server", "passed", "outcomes"], rows)]
    required = "required_tool_real_model"
    if any(required in nodeid for nodeid in llama):
        got = [
            f"{side} {sum(w for w, _ in file_passes(outcomes, required).values())} of "
            f"{sum(r for _, r in file_passes(outcomes, required).values())}"
            for side, outcomes in (("llama-server", llama), ("ours", ours or {}))
            if outcomes
        ]
        lines += [f'`tool_choice: "required"` tests (`{required}`): {", ".join(got)}.', ""]
    llama_passed = passed(llama)
    if ours is not None:
        missing = sorted(llama_passed - passed(ours))
        differences = [nodeid for nodeid in missing if left_out_reason(nodeid) is None]
        lines += [f"## Pass on llama-server, not on ours: {len(differences)}", ""]
        if differences:
            lines += [
                markdown_table(
                    ["test", "ours", "message"],
                    [
                        [
                            f"`{n}`",
                            ours.get(n, {}).get("outcome", "not run"),
                            _short(ours.get(n, {}).get("message", "")) + _flaky(n),
                        ]
                        for n in differences
                    ],
                )
            ]
        extra = sorted(passed(ours) - llama_passed)
        if extra:
            lines += [f"Pass on ours, not on llama-server: {', '.join(f'`{n}`' for n in extra)}.", ""]
    left = sorted(n for n in set(llama) | set(ours or {}) if left_out_reason(n))
    if left:
        lines += ["## Left out", ""]
        lines += [
            markdown_table(
                ["test", "llama-server", "left out"],
                [
                    [f"`{n}`", llama.get(n, {}).get("outcome", "not run"), f"left out: {left_out_reason(n)}"]
                    for n in left
                ],
            )
        ]
    failing = sorted(n for n, entry in llama.items() if entry["outcome"] != "passed")
    lines += [f"## What llama-server does not pass: {len(failing)}", ""]
    why = {n: _lookup(WHY_LLAMA_SERVER_FAILS, n) or "?" for n in failing}
    tally: dict[str, int] = {}
    for category in why.values():
        tally[category] = tally.get(category, 0) + 1
    lines += [
        markdown_table(
            ["why", "tests"],
            [[category, str(n)] for category, n in sorted(tally.items(), key=lambda kv: -kv[1])],
        ),
        "Each test, with the first line of its failure:",
        "",
        markdown_table(
            ["test", "outcome", "why", "message"],
            [
                [f"`{n}`", llama[n]["outcome"], why[n], _short(llama[n]["message"]) + _flaky(n)]
                for n in failing
            ],
        ),
    ]
    return "\n".join(lines)


def _stored(server: str) -> Outcomes | None:
    """The outcomes of the last full run against ``server``, if any."""
    path = RUNS / f"{server}.json"
    if not path.exists():
        return None
    when = datetime.datetime.fromtimestamp(path.stat().st_mtime).isoformat(timespec="minutes")
    print(f"{server}: the outcomes of the last full run ({when}, {path.relative_to(REPO)})")
    result: Outcomes = json.loads(path.read_text())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--server",
        choices=("both", "llama-server", "ours"),
        default="both",
        help="which side to run (default both); 'ours' compares with llama-server's last full run",
    )
    parser.add_argument("--timeout", type=int, default=180, help="per-test timeout, seconds (default 180)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression; no results file is written")
    parser.add_argument("--files", nargs="+", choices=FILES, help="a subset of the test files")
    parser.add_argument(
        "--report-only", action="store_true", help="no run: the report from the last full run of each side"
    )
    args = parser.parse_args()

    tests = suite_dir()
    partial = bool(args.keyword or args.files)
    files = args.files or list(FILES)
    llama: Outcomes | None = None
    ours: Outcomes | None = None
    ours_note = "not run"
    skipped_requirements: list[str] = []
    if args.report_only:
        llama, ours = _stored("llama-server"), _stored("ours")
    else:
        skipped_requirements = ensure_venv(tests)
        if skipped_requirements:
            print(
                f"requirements that did not install (their tests may fail): {', '.join(skipped_requirements)}"
            )
        model = default_model_path()
        if args.server in ("both", "llama-server"):
            if not LLAMA_SERVER.exists():
                sys.exit(f"{LLAMA_SERVER} is missing: run `make bench-peers` first")
            llama = run_suite("llama-server", tests, model, args.timeout, files, args.keyword)
        elif not partial:
            llama = _stored("llama-server")
        if args.server in ("both", "ours"):
            if OURS.exists():
                ours = run_suite("ours", tests, model, args.timeout, files, args.keyword)
            else:
                ours_note = f"not installed yet ({OURS} is missing): not run"
                print(f"\nllama-cpp-actors is {ours_note}")

    print()
    for name, outcomes in (("llama-server", llama), ("ours", ours)):
        if outcomes is not None:
            print(f"{name:>12}: {len(passed(outcomes))} passed ({counts(outcomes)})")
            times = wall_times(outcomes)
            print(" " * 14 + ", ".join(f"{file} {_minutes(t)}" for file, t in times.items()))
    if llama is not None and ours is not None:
        differences = sorted((passed(llama) - passed(ours)) & set(ours))
        num_left_out = sum(1 for nodeid in differences if left_out_reason(nodeid))
        print(
            f"pass on llama-server, not on ours: {len(differences) - num_left_out} "
            f"(and {num_left_out} left out)"
        )
        for nodeid in differences:
            reason = left_out_reason(nodeid)
            entry = ours[nodeid]
            message = _short(entry["message"], 100, markdown=False)
            tag = (
                f"left out: {reason}"
                if reason
                else f"DIFFERENCE ({entry['outcome']}: {message}){_flaky(nodeid)}"
            )
            print(f"  {nodeid}  {tag}")
    if llama is None:
        print("(no full run of llama-server to compare with: no results file written)")
        return
    if partial:
        print("(a partial run: no results file written)")
        return
    path = write_result("compat", report(llama, ours, ours_note, skipped_requirements, tests))
    print(f"wrote {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
