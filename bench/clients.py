"""Real agent clients against ``llama-cpp-actors serve``: does each one work unchanged?

For every client in ``CLIENTS`` this makes a fresh venv (``bench/.peers/clients/<name>-venv``;
``--reuse`` keeps one that exists), pip-installs the client's current release from the
package index and records its version. One server (``llama-cpp-actors serve -np 2 -c 8192
-t 1`` on the default model, a free port) serves them all, one client at a time, through
a recording proxy: every request and response of a client is kept in
``bench/.peers/clients/<name>.exchanges.jsonl``, tagged with the step it belongs to, so a
failure comes with the exact exchange that went wrong. The server's log is
``bench/.peers/clients/server.log``.

Each client's script (``bench/clients/check_<name>.py``, run by the venv's Python) does
whole round trips: the model is asked something that needs a tool, calls it (a
``tool_choice`` that requires a call where the 135M model would otherwise answer), the
script runs the tool and feeds the result back, and the client gets a final answer. The
model's text is never checked, only that the client parsed every reply. A script runs
every step even when one fails and writes what each did to a JSON file; the report is
``bench/results/clients.md``: per client its version, the steps, the result and the wall
time, then every failed step with its error, whose fault it is (``KNOWN`` below, else a
guess from the HTTP status) and the exchange.

Run ``python bench/clients.py`` (``make clients``; a few minutes on 2 cores, most of it
pip). ``--only NAME ...`` runs some clients and writes no results file unless ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Run as a script: import from the repository root, not bench/ (whose http.py would
# shadow the standard library's http package).
ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)

import http.client
import http.server

from bench._common import RESULTS, machine, markdown_table, write_result

BENCH = ROOT / "bench"
SCRIPTS = BENCH / "clients"
WORK = BENCH / ".peers" / "clients"
SERVE = ROOT / ".venv" / "bin" / "llama-cpp-actors"
SERVE_FLAGS = ("-np", "2", "-c", "8192", "-t", "1")
SCRIPT_TIMEOUT_S = 900


@dataclass(frozen=True)
class Client:
    """One client: what to install, which distribution's version to report, its script."""

    name: str
    requirements: tuple[str, ...]
    distribution: str
    exercises: str

    @property
    def script(self) -> Path:
        return SCRIPTS / f"check_{self.name.replace('-', '_')}.py"

    @property
    def venv(self) -> Path:
        return WORK / f"{self.name}-venv"


CLIENTS = (
    Client(
        "openai",
        ("openai",),
        "openai",
        "chat: tool_choice auto, none, required and a named function, each a round trip; parallel "
        "calls; streamed tool calls reassembled; Responses: create, stream, a function_call round "
        "trip, a streamed call; chat.completions.parse (pydantic_function_tool, response_format), "
        "responses.parse; decisions.create (predicate, choice, score), text and message items",
    ),
    Client(
        "anthropic",
        ("anthropic",),
        "anthropic",
        "messages.create (system blocks with cache_control, metadata, stop_sequences), "
        "messages.stream + get_final_message, tool_use round trips with tool_choice any and auto "
        "(tool_result fed back), a streamed tool_use round trip, count_tokens",
    ),
    Client(
        "langchain-openai",
        ("langchain-openai",),
        "langchain-openai",
        "ChatOpenAI.bind_tools with tool_choice required and by name: invoke, run the tool, "
        "a ToolMessage back, final invoke; a streamed tool call; the round trip with "
        "use_responses_api; with_structured_output (json_schema, function_calling); "
        "OpenAIDecisions and OpenAIClassifier (predicate/noul, choice, score)",
    ),
    Client(
        "pydantic-ai",
        ("pydantic-ai-slim[openai]",),
        "pydantic-ai-slim",
        "Agent with a tool on OpenAIChatModel + OpenAICompatibleProvider, run to completion; "
        "output_type a pydantic model (the default tool output), a nested one, after a tool; "
        "run_stream_sync with text and with a structured output; SystemOneModel and "
        "OpenAIDecisionsModel decide (noul, choice, score)",
    ),
    Client(
        "instructor",
        ("instructor",),
        "instructor",
        "from_openai, default TOOLS mode: chat.completions.create(response_model=...) "
        "returns a validated pydantic object; a nested model; create_with_completion; "
        "create_partial (streamed); async",
    ),
    Client(
        "openai-agents",
        ("openai-agents",),
        "openai-agents",
        "Agent with a @function_tool on the default client (Responses) and OpenAIResponsesModel, "
        "Runner.run_sync: tool_choice required then reset, run to a final output; "
        "stop_on_first_tool; Runner.run_streamed; OpenAIChatCompletionsModel; output_type a "
        "pydantic model",
    ),
)

# Failures whose cause was found by reading the exchange and the server log: the client,
# a regular expression on the failed step's name and one on its error, and the verdict.
# A failure that matches none is classified from the HTTP status the step got.
# "*" matches every client.
KNOWN: tuple[tuple[str, str, str, str], ...] = (
    (
        "*",
        ".",
        r"\$ref '#/\$defs/\w+' at #/.*properties/arguments/.* points nowhere",
        "ours: a tool whose parameters use local `$ref`s into `$defs` (what pydantic makes of a "
        "nested model) is a 400 under every tool_choice: `call_schema` in actors/chat/_grammar.py "
        "nests the parameters under the call object's arguments without their `$defs`, so "
        "`#/$defs/...` resolves against the wrapper's root. The same schema as a `response_format` "
        "works",
    ),
)


# -- the recording proxy ---------------------------------------------------------------

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "host",
}
_KEEP_BYTES = 256_000  # of each body, in the exchange log


class Recorder:
    """Where the proxy writes exchanges: one JSONL file per client, the current step."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.path: Path | None = None
        self.step = ""

    def start(self, path: Path | None) -> None:
        """Record into ``path`` from now on (emptied first); None records nothing."""
        with self.lock:
            self.path, self.step = path, ""
            if path is not None:
                path.write_text("")

    def write(self, entry: dict[str, Any]) -> None:
        with self.lock:
            if self.path is not None:
                with open(self.path, "a") as f:
                    f.write(json.dumps({"step": self.step, **entry}) + "\n")


def _text(body: bytes) -> Any:
    """A body for the log: its JSON when it is JSON, else its text (cut)."""
    text = body[:_KEEP_BYTES].decode("utf-8", "replace")
    try:
        return json.loads(text)
    except ValueError:
        return text


def make_proxy(upstream_port: int, recorder: Recorder) -> http.server.ThreadingHTTPServer:
    """A proxy on a free port that forwards to the server, streams the responses through
    as they arrive, and records every exchange. ``POST /__step`` names the step."""

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                parts = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        self.rfile.readline()
                        return b"".join(parts)
                    parts.append(self.rfile.read(size))
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _forward(self) -> None:
            body = self._body()
            if self.path == "/__step":
                with recorder.lock:
                    recorder.step = json.loads(body)["step"]
                self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            headers["Content-Length"] = str(len(body))
            t0 = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=SCRIPT_TIMEOUT_S)
            kept = bytearray()
            status = 0
            try:
                conn.request(self.command, self.path, body if body else None, headers)
                response = conn.getresponse()
                status = response.status
                self.send_response(response.status, response.reason)
                length = response.getheader("Content-Length")
                for key, value in response.getheaders():
                    if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                        self.send_header(key, value)
                if length is not None:
                    self.send_header("Content-Length", length)
                else:
                    self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                while chunk := response.read1(65536):
                    if len(kept) < _KEEP_BYTES:
                        kept += chunk
                    if length is not None:
                        self.wfile.write(chunk)
                    else:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                if length is None:
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
            except OSError as e:
                kept += f"\n[proxy: {type(e).__name__}: {e}]".encode()
                self.close_connection = True
            finally:
                conn.close()
                recorder.write(
                    {
                        "method": self.command,
                        "path": self.path,
                        "request": _text(body) if body else None,
                        "status": status,
                        "response": _text(bytes(kept)),
                        "ms": round((time.perf_counter() - t0) * 1000),
                    }
                )

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _forward

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


# -- the server ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def get_json(port: int, path: str) -> Any:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return json.loads(response.read()) if response.status == 200 else None
    finally:
        conn.close()


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def served_source(ref: str | None) -> tuple[dict[str, str], str]:
    """The server's environment and a line saying which code it runs: the work tree, or
    with ``ref`` a snapshot of that commit's packages (``git archive``) first on its
    ``PYTHONPATH``, which wins over the venv's editable install of the work tree."""
    env = dict(os.environ)
    if ref is None:
        dirty = git("status", "--porcelain", "--", "actors", "strategies", "telemetry")
        note = " with uncommitted changes in actors/" if dirty else ""
        return env, f"the work tree at commit {git('rev-parse', '--short', 'HEAD')}{note}"
    commit = git("rev-parse", "--short", f"{ref}^{{commit}}")
    if not commit:
        sys.exit(f"no commit {ref!r}")
    source = WORK / "server-src"
    shutil.rmtree(source, ignore_errors=True)
    source.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", commit, "actors", "strategies", "telemetry"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    )
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
    env["PYTHONPATH"] = os.pathsep.join(part for part in (str(source), env.get("PYTHONPATH", "")) if part)
    return env, f"commit {commit} (a snapshot of its packages, not the work tree)"


class Server:
    """One ``llama-cpp-actors serve``, its log in ``WORK/server.log``."""

    def __init__(self, ref: str | None) -> None:
        self.port = free_port()
        self.log_path = WORK / "server.log"
        self.command = [str(SERVE), "serve", *SERVE_FLAGS, "--port", str(self.port)]
        env, self.source = served_source(ref)
        self.log = open(self.log_path, "w")  # noqa: SIM115 (open while the server runs; stop() closes it)
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"the server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if get_json(self.port, "/health"):
                    break
            except OSError:
                pass
            time.sleep(0.3)
        else:
            self.stop()
            sys.exit(f"the server did not come up in 180 s; see {self.log_path}")
        models = get_json(self.port, "/v1/models") or {}
        self.model = str((models.get("data") or [{}])[0].get("id", "default"))

    def log_size(self) -> int:
        self.log.flush()
        return self.log_path.stat().st_size

    def log_since(self, offset: int) -> str:
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            f.seek(offset)
            return f.read()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# -- one client ------------------------------------------------------------------------


@dataclass
class Step:
    name: str
    ok: bool
    seconds: float
    error: str = ""
    detail: str = ""


@dataclass
class Outcome:
    client: Client
    version: str = "?"
    setup_s: float = 0.0
    run_s: float = 0.0
    steps: list[Step] = field(default_factory=list)
    problem: str = ""  # a failure outside any step: install, crash, timeout
    reused: bool = False  # the venv of an earlier run (--reuse)
    exchanges: list[dict[str, Any]] = field(default_factory=list)
    server_errors: str = ""

    @property
    def passed(self) -> bool:
        return not self.problem and bool(self.steps) and all(step.ok for step in self.steps)


def setup(client: Client, reuse: bool) -> tuple[str, str, bool]:
    """The client's venv, made afresh unless ``reuse`` and it exists; (version, problem,
    whether it was reused)."""
    python = client.venv / "bin" / "python"
    stamp = client.venv / ".clients-installed"
    reused = reuse and stamp.exists() and python.exists()
    if not reused:
        shutil.rmtree(client.venv, ignore_errors=True)
        print(f"[{client.name}] making {client.venv.relative_to(ROOT)}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(client.venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--upgrade"]
        installed = subprocess.run([*pip, *client.requirements], capture_output=True, text=True)
        if installed.returncode != 0:
            return "?", f"pip install failed: {installed.stderr.strip().splitlines()[-1:]}", False
        stamp.write_text(" ".join(client.requirements))
    version = subprocess.run(
        [str(python), "-c", f"import importlib.metadata as m; print(m.version({client.distribution!r}))"],
        capture_output=True,
        text=True,
    )
    return version.stdout.strip() or "?", "", reused


def run_client(client: Client, reuse: bool, server: Server, proxy_port: int, recorder: Recorder) -> Outcome:
    outcome = Outcome(client)
    t0 = time.perf_counter()
    outcome.version, outcome.problem, outcome.reused = setup(client, reuse)
    outcome.setup_s = time.perf_counter() - t0
    if outcome.problem:
        return outcome
    exchanges = WORK / f"{client.name}.exchanges.jsonl"
    result = WORK / f"{client.name}.result.json"
    result.unlink(missing_ok=True)
    recorder.start(exchanges)
    log_offset = server.log_size()
    env = {
        **os.environ,
        "CLIENT_BASE_URL": f"http://127.0.0.1:{proxy_port}",
        "CLIENT_MODEL": server.model,
        "CLIENT_RESULT": str(result),
        "PYTHONDONTWRITEBYTECODE": "1",
        "NO_PROXY": "127.0.0.1,localhost",
    }
    for key in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL"):
        env.pop(key, None)
    print(f"[{client.name}] {outcome.version}: running {client.script.relative_to(ROOT)}", flush=True)
    t0 = time.perf_counter()
    log_path = WORK / f"{client.name}.log"
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(
                [str(client.venv / "bin" / "python"), str(client.script)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=SCRIPT_TIMEOUT_S,
                cwd=WORK,
            )
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
    outcome.run_s = time.perf_counter() - t0
    recorder.start(None)
    outcome.exchanges = [json.loads(line) for line in exchanges.read_text().splitlines() if line]
    outcome.server_errors = _server_errors(server.log_since(log_offset))
    if result.exists():
        data = json.loads(result.read_text())
        outcome.steps = [Step(**step) for step in data["steps"]]
    if code is None:
        outcome.problem = f"timed out after {SCRIPT_TIMEOUT_S} s (see {log_path.relative_to(ROOT)})"
    elif not result.exists():
        tail = log_path.read_text().strip().splitlines()[-1:] or ["no output"]
        outcome.problem = f"the script exited {code} without a result: {tail[0]}"
    for step in outcome.steps:
        mark = "ok  " if step.ok else "FAIL"
        print(
            f"  {mark} {step.name} ({step.seconds:.1f} s){'' if step.ok else ': ' + step.error}", flush=True
        )
    if outcome.problem:
        print(f"  FAIL {outcome.problem}", flush=True)
    return outcome


def _server_errors(log: str) -> str:
    """The server log's tracebacks and error lines (not its access log)."""
    lines = [
        line
        for line in log.splitlines()
        if re.search(r"Traceback|Error|ERROR|Exception|CRITICAL", line) and '" 200' not in line
    ]
    return "\n".join(lines[:40])


# -- the report ------------------------------------------------------------------------


def verdict(outcome: Outcome, step: Step) -> tuple[str, str]:
    """Whose fault a failed step is, and why: ``KNOWN``, else the step's HTTP statuses."""
    for client, step_re, error_re, text in KNOWN:
        if (
            client in ("*", outcome.client.name)
            and re.search(step_re, step.name)
            and re.search(error_re, step.error, re.S)
        ):
            fault, _, why = text.partition(": ")
            return fault, why
    bad = [x for x in outcome.exchanges if x["step"] == step.name and not 200 <= x["status"] < 300]
    if any(x["status"] >= 500 or x["status"] == 0 for x in bad):
        return "ours?", "the server answered 5xx or dropped the connection (not yet analysed)"
    if bad:
        return "ours?", "the server refused a request the client sends (not yet analysed)"
    return "?", "no HTTP error: the client did not accept a reply (not yet analysed)"


def _short(text: str, width: int = 160) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"


def _exchange(outcome: Outcome, step: Step) -> str:
    """The step's first exchange that was not a 2xx, else its last one, for the report."""
    mine = [x for x in outcome.exchanges if x["step"] == step.name]
    if not mine:
        return "(no HTTP exchange in this step)"
    bad = [x for x in mine if not 200 <= x["status"] < 300]
    x = bad[0] if bad else mine[-1]
    request = json.dumps(x["request"], ensure_ascii=False)
    response = x["response"] if isinstance(x["response"], str) else json.dumps(x["response"])
    cut = 1500
    return (
        f"`{x['method']} {x['path']}` → {x['status']}\n\n"
        f"```json\n{request[:cut]}{' …' if len(request) > cut else ''}\n```\n\n"
        f"```\n{response[:cut]}{' …' if len(response) > cut else ''}\n```"
    )


def report(outcomes: list[Outcome], server: str, source: str) -> str:
    lines = [
        "# Agent clients",
        "",
        f"Measured: {machine()}.",
        "",
        f"Server: `llama-cpp-actors {server}` on the default model (SmolLM2-135M-Instruct Q4_1), "
        f"one for all clients, running {source}. Each client is the release pip installed into a "
        "fresh venv that day; "
        "its script (`bench/clients/check_<name>.py`) makes whole round trips: a question that "
        "needs a tool, the call, the tool's result fed back, a final answer. The model's text is "
        "never checked, only that the client accepted every reply. Produced by "
        "`python bench/clients.py` (`make clients`).",
        "",
    ]
    rows = []
    for o in outcomes:
        failed = [step.name for step in o.steps if not step.ok]
        if o.passed:
            result = f"pass ({len(o.steps)} of {len(o.steps)} steps)"
        elif o.problem and not o.steps:
            result = f"**fail**: {_short(o.problem, 100)}"
        else:
            result = f"**fail** ({len(o.steps) - len(failed)} of {len(o.steps)} steps): " + ", ".join(failed)
            if o.problem:
                result += f"; {_short(o.problem, 100)}"
        install = "reused" if o.reused else f"{o.setup_s:.0f}"
        rows.append([o.client.name, o.version, o.client.exercises, result, f"{o.run_s:.0f}", install])
    lines += [markdown_table(["client", "version", "exercised", "result", "wall s", "install s"], rows)]
    lines += [
        "Steps, in order (wall seconds each):",
        "",
    ]
    for o in outcomes:
        steps = "; ".join(f"{step.name} {'✓' if step.ok else '✗'} {step.seconds:.1f}" for step in o.steps)
        lines.append(f"- **{o.client.name}**: {steps or '(none ran)'}")
    lines.append("")
    failures = [(o, step) for o in outcomes for step in o.steps if not step.ok]
    problems = [o for o in outcomes if o.problem]
    lines += [f"## Failures: {len(failures) + len(problems)}", ""]
    if failures:
        lines += [
            markdown_table(
                ["client", "step", "error", "fault", "cause"],
                [[o.client.name, step.name, _short(step.error), *verdict(o, step)] for o, step in failures],
            )
        ]
        for o, step in failures:
            lines += [f"### {o.client.name}: {step.name}", "", _exchange(o, step), ""]
    for o in problems:
        lines += [f"- **{o.client.name}**: {o.problem}", ""]
    for o in outcomes:
        if o.server_errors:
            lines += [f"Server log while {o.client.name} ran:", "", f"```\n{o.server_errors}\n```", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    names = [client.name for client in CLIENTS]
    parser.add_argument("--only", nargs="+", choices=names, help="run these clients only")
    parser.add_argument("--reuse", action="store_true", help="keep a client's venv if it exists")
    parser.add_argument("--out", type=Path, help=f"write clients.md here (default {RESULTS})")
    parser.add_argument("--setup-only", action="store_true", help="make the venvs, run nothing")
    parser.add_argument(
        "--ref",
        help="serve this commit's actors/ (a git archive snapshot) instead of the work tree's, "
        "e.g. HEAD while the work tree has changes in progress",
    )
    args = parser.parse_args()
    if not SERVE.exists():
        sys.exit(f"{SERVE} is missing: run `make install` first")
    WORK.mkdir(parents=True, exist_ok=True)
    chosen = [client for client in CLIENTS if not args.only or client.name in args.only]
    if args.setup_only:
        for client in chosen:
            print(f"{client.name}: {setup(client, args.reuse)}", flush=True)
        return
    server = Server(args.ref)
    recorder = Recorder()
    proxy = make_proxy(server.port, recorder)
    proxy_port = int(proxy.server_address[1])
    print(f"server: {' '.join(server.command[1:])} ({server.model}, {server.source}); proxy {proxy_port}")
    outcomes: list[Outcome] = []
    try:
        for client in chosen:
            outcomes.append(run_client(client, args.reuse, server, proxy_port, recorder))
    finally:
        proxy.shutdown()
        server.stop()
    print()
    for o in outcomes:
        state = "pass" if o.passed else "FAIL"
        print(f"{o.client.name:>17} {o.version:<10} {state}  {o.run_s:.0f} s (setup {o.setup_s:.0f} s)")
        if o.server_errors:
            print(f"    server log: {o.server_errors.splitlines()[0]}")
    if args.only and args.out is None:
        print("(a partial run: no results file written; --out DIR writes one)")
        return
    path = write_result(
        "clients", report(outcomes, " ".join(["serve", *SERVE_FLAGS]), server.source), args.out or RESULTS
    )
    print(f"wrote {path}")
    when = datetime.datetime.now().isoformat(timespec="minutes")
    failed = sum(not step.ok for o in outcomes for step in o.steps) + sum(bool(o.problem) for o in outcomes)
    print(f"({when}; {failed} failures; exchanges and logs in {WORK.relative_to(ROOT)})")


if __name__ == "__main__":
    main()
