"""Compatibility with llama-server, checked by llama.cpp's own server test suite.

The llama-cpp-python sdist (``make bench-peers``) vendors llama.cpp with its server
tests in ``vendor/llama.cpp/tools/server/tests``. They start ``$LLAMA_SERVER_BIN_PATH``
with llama-server's flags; here that is ``bench/compat/llama_server.py``, which maps
their model downloads to the default model and execs either llama-server
(``bench/.peers/llama-server``) or ours (``llama-cpp-actors serve``). The same test
files run once against each, one test at a time, each with a timeout; the report is
both pass counts and the tests that pass on llama-server but not on ours, except those
that need a part we deliberately leave out (``LEFT_OUT``).

The suite's own requirements go in a venv of their own, ``bench/.peers/compat-venv``
(made on first use). Logs, JUnit XML and per-test outcomes of the last run are in
``bench/.peers/compat-runs/``; the summary goes to ``bench/results/compat.md``.

Run ``python bench/compat.py`` (``make compat``); ``--server llama-server`` or
``--server ours`` runs one side only, ``-k`` selects tests as pytest's ``-k`` does
(a run with ``-k`` or ``--files`` writes no results file).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

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
OURS = REPO / ".venv" / "bin" / "llama-cpp-actors"

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
)

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
)

# Test-only extras the suite's requirements.txt does not list.
EXTRA_REQUIREMENTS = ("pytest-timeout",)
# Environment variables that change what the suite does; never inherited.
SUITE_SWITCHES = ("DEBUG", "DEBUG_EXTERNAL", "N_GPU_LAYERS", "SLOW_TESTS", "PORT", "LLAMA_SERVER_BIN_PATH")

Outcomes = dict[str, dict[str, str]]


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
    """Run the suite's ``files`` against ``server``; returns the outcome of each test."""
    RUNS.mkdir(parents=True, exist_ok=True)
    outcomes_path = RUNS / f"{server}.json"
    outcomes_path.unlink(missing_ok=True)
    env = {key: value for key, value in os.environ.items() if key not in SUITE_SWITCHES}
    env.update(
        LLAMA_SERVER_BIN_PATH=str(WRAPPER),
        COMPAT_SERVER=server,
        COMPAT_MODEL=model,
        COMPAT_OUTCOMES=str(outcomes_path),
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
        "-m",
        "not slow",
        f"--timeout={timeout_s}",
        f"--junitxml={RUNS / f'{server}.xml'}",
        "-v",
        "-rN",
        *(["-k", keyword] if keyword else []),
        *[f"unit/{name}" for name in files],
    ]
    print(f"\n=== {server}: {' '.join(command[3:])}  (PORT={env['PORT']})", flush=True)
    log_path = RUNS / f"{server}.log"
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
    print(f"({server}: pytest exited {proc.returncode}; full log in {log_path})")
    if not outcomes_path.exists():
        sys.exit(f"{server}: the suite wrote no outcomes; see {log_path}")
    result: Outcomes = json.loads(outcomes_path.read_text())
    return result


def left_out_reason(nodeid: str) -> str | None:
    return next((reason for pattern, reason in LEFT_OUT if fnmatch.fnmatchcase(nodeid, pattern)), None)


def passed(outcomes: Outcomes) -> set[str]:
    return {nodeid for nodeid, entry in outcomes.items() if entry["outcome"] == "passed"}


def counts(outcomes: Outcomes) -> str:
    tally: dict[str, int] = {}
    for entry in outcomes.values():
        tally[entry["outcome"]] = tally.get(entry["outcome"], 0) + 1
    order = ("passed", "failed", "error", "skipped")
    return ", ".join(f"{tally[key]} {key}" for key in order if key in tally) + f" of {len(outcomes)}"


def _short(text: str, width: int = 140) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= width else text[: width - 1] + "…"


def report(
    llama: Outcomes, ours: Outcomes | None, ours_note: str, skipped_requirements: list[str], tests: Path
) -> str:
    lines = [
        "# Compatibility: llama.cpp's server test suite",
        "",
        f"Machine: {machine()}. Model: the default model (SmolLM2-135M-Instruct Q4_1) for every",
        "preset of the suite. Produced by `python bench/compat.py` (`make compat`), from",
        f"`{tests.relative_to(REPO)}/unit/`: {', '.join(f'`{name}`' for name in FILES)};",
        "not the tests marked slow; one test at a time.",
        "",
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
                            _short(ours.get(n, {}).get("message", "")),
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
    lines += [
        "Mostly tests that expect the text of the suite's own tiny model (stories260K), or that",
        "need images, a second model or a download. The first line of each failure:",
        "",
        markdown_table(
            ["test", "outcome", "message"],
            [[f"`{n}`", llama[n]["outcome"], _short(llama[n]["message"])] for n in failing],
        ),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--server", choices=("both", "llama-server", "ours"), default="both")
    parser.add_argument("--timeout", type=int, default=180, help="per-test timeout, seconds (default 180)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression; no results file is written")
    parser.add_argument("--files", nargs="+", choices=FILES, help="a subset of the test files")
    args = parser.parse_args()

    tests = suite_dir()
    skipped_requirements = ensure_venv(tests)
    if skipped_requirements:
        print(f"requirements that did not install (their tests may fail): {', '.join(skipped_requirements)}")
    model = default_model_path()
    files = args.files or list(FILES)

    llama: Outcomes | None = None
    ours: Outcomes | None = None
    ours_note = "not run"
    if args.server in ("both", "llama-server"):
        if not LLAMA_SERVER.exists():
            sys.exit(f"{LLAMA_SERVER} is missing: run `make bench-peers` first")
        llama = run_suite("llama-server", tests, model, args.timeout, files, args.keyword)
    if args.server in ("both", "ours"):
        if OURS.exists():
            ours = run_suite("ours", tests, model, args.timeout, files, args.keyword)
        else:
            ours_note = f"not installed yet ({OURS.relative_to(REPO)} is missing): not run"
            print(f"\nllama-cpp-actors is {ours_note}")

    print()
    for name, outcomes in (("llama-server", llama), ("ours", ours)):
        if outcomes is not None:
            print(f"{name:>12}: {len(passed(outcomes))} passed ({counts(outcomes)})")
    if llama is not None and ours is not None:
        for nodeid in sorted(passed(llama) - passed(ours)):
            reason = left_out_reason(nodeid)
            entry = ours.get(nodeid, {"outcome": "not run", "message": ""})
            tag = (
                f"left out: {reason}"
                if reason
                else f"DIFFERENCE ({entry['outcome']}: {_short(entry['message'], 100)})"
            )
            print(f"  {nodeid}  {tag}")
    if llama is None:
        print("(llama-server not run: no results file written)")
        return
    if args.keyword or args.files:
        print("(a partial run: no results file written)")
        return
    path = write_result("compat", report(llama, ours, ours_note, skipped_requirements, tests))
    print(f"wrote {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
