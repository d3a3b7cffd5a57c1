"""The systems bench/throughput.py measures, each behind ``start / run / stop``.

Every system serves ``concurrency`` greedy requests of exactly ``max_tokens`` tokens at
once (end-of-generation banned or ignored) and reports, per request, when it was sent
and when each token arrived at the caller.
"""

from __future__ import annotations

import functools
import http.client
import json
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from actors import Done, Failed, ServerActor, Stream, Token
from bench._common import EOG_IDS, NO_EOG, Measurement, run_threads, timings_to_measurement

__all__ = ["ALL", "System", "available"]

Timings = list[tuple[float, list[float]]]


class System:
    name = "system"

    def __init__(self, model_path: str, n_ctx: int, n_threads: int) -> None:
        self.model_path = model_path
        self.n_ctx = n_ctx
        self.n_threads = n_threads

    def start(self, concurrency: int) -> None: ...

    def run(self, prompts: Sequence[str], max_tokens: int) -> Measurement:
        t0 = time.perf_counter()
        timings = self._run(prompts, max_tokens)
        return timings_to_measurement(self.name, len(prompts), t0, timings)

    def _run(self, prompts: Sequence[str], max_tokens: int) -> Timings:
        raise NotImplementedError

    def stop(self) -> None: ...


def _in_threads(prompts: Sequence[str], one: Any) -> Timings:
    """Run ``one(prompt) -> (t_sent, arrivals)`` for every prompt at once."""
    results: Timings = [(0.0, [])] * len(prompts)

    def work(i: int) -> None:
        results[i] = one(prompts[i])

    run_threads([functools.partial(work, i) for i in range(len(prompts))])
    return results


class Engine(System):
    """This project's ServerActor, streamed through queues as a caller would."""

    name = "engine"
    options: Mapping[str, Any] = MappingProxyType({})  # more ServerActor options (bench/http.py: serve's)

    def start(self, concurrency: int) -> None:
        self.ref = ServerActor.start(
            **{
                "model_path": self.model_path,
                "n_parallel": concurrency,
                "n_ctx": self.n_ctx,
                "n_threads": self.n_threads,
                **self.options,
            }
        )

    def _run(self, prompts: Sequence[str], max_tokens: int) -> Timings:
        def one(prompt: str) -> tuple[float, list[float]]:
            events: queue.Queue[Any] = queue.Queue()
            arrivals: list[float] = []
            t_sent = time.perf_counter()
            self.ref.tell(Stream(prompt, reply_to=events, max_tokens=max_tokens, temp=0, logit_bias=NO_EOG))
            while True:
                event = events.get(timeout=300)
                if isinstance(event, Token):
                    arrivals.append(time.perf_counter())
                elif isinstance(event, Done):
                    return t_sent, arrivals
                elif isinstance(event, Failed):
                    raise event.error

        return _in_threads(prompts, one)

    def stop(self) -> None:
        self.ref.stop()


class LockedLlama(System):
    """One ``llama_cpp.Llama`` behind a lock: what users do today."""

    name = "llama-lock"

    def start(self, concurrency: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(self.model_path, n_ctx=self.n_ctx, n_threads=self.n_threads, verbose=False)
        self.lock = threading.Lock()

    def _run(self, prompts: Sequence[str], max_tokens: int) -> Timings:
        def one(prompt: str) -> tuple[float, list[float]]:
            arrivals: list[float] = []
            t_sent = time.perf_counter()
            with self.lock:
                tokens = self.llm.tokenize(prompt.encode(), add_bos=True, special=True)
                for _token in self.llm.generate(tokens, temp=0.0, reset=True):
                    arrivals.append(time.perf_counter())  # EOG does not stop it: equal work
                    if len(arrivals) == max_tokens:
                        break
            return t_sent, arrivals

        return _in_threads(prompts, one)

    def stop(self) -> None:
        self.llm.close()


class BareLoop(System):
    """``llama_decode`` in a loop over the same batch shapes, no scheduler: the floor.

    All prompts go in one prefill batch, then one decode batch per step; sampling uses
    the engine's own sampler chain. Times are those of the loop itself.
    """

    name = "bare-loop"

    def start(self, concurrency: int) -> None:
        from actors.backend._llama import LlamaBackend
        from actors.backend._options import BackendOptions

        self.backend = LlamaBackend(
            BackendOptions(
                model_path=self.model_path,
                n_ctx=self.n_ctx,
                n_batch=min(self.n_ctx, 2048),
                n_ubatch=512,
                n_parallel=concurrency,
                n_threads=self.n_threads,
                n_threads_batch=self.n_threads,
            )
        )

    def _run(self, prompts: Sequence[str], max_tokens: int) -> Timings:
        from actors.contract import SamplingParams

        b = self.backend
        for seq in range(len(prompts)):
            b.kv.clear(seq)
        greedy = SamplingParams(temp=0)
        t0 = time.perf_counter()
        tokenized = [b.vocab.tokenize(p) for p in prompts]
        samplers = [b.sampling.make(greedy, dict(NO_EOG), t) for t in tokenized]
        row, last_rows = 0, []
        for seq, tokens in enumerate(tokenized):
            n = len(tokens)
            b.rows.tokens[row : row + n] = tokens
            b.rows.pos[row : row + n] = range(n)
            b.rows.seq_ids[row : row + n] = seq
            b.rows.logits[row : row + n] = 0
            b.rows.logits[row + n - 1] = 1
            last_rows.append(row + n - 1)
            row += n
        assert b.rows.decode(0, row) == 0
        arrivals: list[list[float]] = [[] for _ in prompts]
        current = []
        for seq, r in enumerate(last_rows):
            current.append(b.sampling.sample(samplers[seq], r))
            arrivals[seq].append(time.perf_counter())
        n_past = [len(t) for t in tokenized]
        k = len(prompts)
        for _step in range(max_tokens - 1):
            b.rows.tokens[:k] = current
            b.rows.pos[:k] = n_past
            b.rows.seq_ids[:k] = range(k)
            b.rows.logits[:k] = 1
            assert b.rows.decode(0, k) == 0
            for seq in range(k):
                current[seq] = b.sampling.sample(samplers[seq], seq)
                arrivals[seq].append(time.perf_counter())
                n_past[seq] += 1
        for sampler in samplers:
            b.sampling.free(sampler)
        return [(t0, a) for a in arrivals]

    def stop(self) -> None:
        self.backend.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(port: int, path: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server did not come up")


def _sse_request(port: int, path: str, body: dict[str, Any]) -> tuple[float, list[float]]:
    """POST ``body``, read the SSE stream; one arrival per event that carries a token."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t_sent = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"{path}: HTTP {response.status}: {response.read()[:300]!r}")
    arrivals: list[float] = []
    for raw in response:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if "choices" in event:  # OpenAI completions chunk
            if event["choices"] and event["choices"][0].get("finish_reason") is None:
                arrivals.append(time.perf_counter())
        elif not event.get("stop", False):  # llama-server /completion chunk
            arrivals.append(time.perf_counter())
    conn.close()
    return t_sent, arrivals


class LlamaServer(System):
    """llama.cpp's C++ ``llama-server`` (``LLAMA_SERVER_BIN``), streamed over HTTP."""

    name = "llama-server"

    def start(self, concurrency: int) -> None:
        self.port = _free_port()
        n_batch = min(self.n_ctx, 2048)
        command = [
            os.environ["LLAMA_SERVER_BIN"], "-m", self.model_path, "--host", "127.0.0.1",
            "--port", str(self.port), "-c", str(self.n_ctx), "-np", str(concurrency),
            "-b", str(n_batch), "-ub", "512", "-kvu", "-t", str(self.n_threads),
            "-tb", str(self.n_threads), "--no-webui",
        ]  # fmt: skip
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_http(self.port, "/health", self.proc)

    def _run(self, prompts: Sequence[str], max_tokens: int) -> Timings:
        def one(prompt: str) -> tuple[float, list[float]]:
            body = {
                "prompt": prompt,
                "n_predict": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            return _sse_request(self.port, "/completion", body)

        return _in_threads(prompts, one)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


class ExampleServer(System):
    """The Python server in the llama-cpp-python sdist (``LLAMA_CPP_PYTHON_EXAMPLE_SERVER``)."""

    name = "example-server"

    def start(self, concurrency: int) -> None:
        self.port = _free_port()
        config = {
            "server": {"host": "127.0.0.1", "port": self.port},
            "model": {
                "alias": "bench",
                "path": self.model_path,
                "n_ctx": self.n_ctx,
                "n_seq_max": concurrency,
                "n_batch": min(self.n_ctx, 2048),
                "n_ubatch": 512,
                "threads": self.n_threads,
                "threads_batch": self.n_threads,
                "kv_unified": True,
            },
        }
        self.config = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)  # noqa: SIM115
        json.dump(config, self.config)
        self.config.close()
        script = Path(os.environ["LLAMA_CPP_PYTHON_EXAMPLE_SERVER"])
        python = os.environ.get("LLAMA_CPP_PYTHON_EXAMPLE_PYTHON") or str(
            script.parent / "example-venv" / "bin" / "python"
        )
        if not Path(python).exists():
            python = sys.executable
        self.proc = subprocess.Popen(
            [python, str(script), "-C", self.config.name],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_http(self.port, "/v1/models", self.proc)

    def _run(self, prompts: Sequence[str], max_tokens: int) -> Timings:
        def one(prompt: str) -> tuple[float, list[float]]:
            body = {
                "model": "bench",
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "logit_bias": {str(t): -100 for t in EOG_IDS},  # it has no ignore_eos
            }
            return _sse_request(self.port, "/v1/completions", body)

        return _in_threads(prompts, one)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        os.unlink(self.config.name)


ALL: dict[str, type[System]] = {
    cls.name: cls for cls in (Engine, LockedLlama, BareLoop, LlamaServer, ExampleServer)
}


def available(requested: Sequence[str]) -> list[str]:
    """The requested systems whose peers are configured (the HTTP peers need env vars)."""
    names = []
    for name in requested:
        if name == "llama-server" and not os.environ.get("LLAMA_SERVER_BIN"):
            print("llama-server: LLAMA_SERVER_BIN is not set (make bench-peers builds it); skipped")
            continue
        if name == "example-server" and not os.environ.get("LLAMA_CPP_PYTHON_EXAMPLE_SERVER"):
            print("example-server: LLAMA_CPP_PYTHON_EXAMPLE_SERVER is not set; skipped")
            continue
        names.append(name)
    return names
