"""Fairness over HTTP: what one client's pressure costs another client of ``serve``.

One ``llama-cpp-actors serve`` process (the default model, ``-t 1 -c 2048 -np 4``, as the
hostile review ran it); for each scenario a victim is measured alone, then while an
attacker keeps up the pressure:

- silent connections: 2,100 TCP connections that send nothing; the victim (another
  address) asks ``/health`` until it gets 200: the seconds that took.
- looping embeddings: a client sends ``/v1/embeddings`` (8 texts of ~80 tokens) without
  pause; the victim streams 30 greedy tokens: the stream's time, first token to last.
- choices: four ``/completion`` requests with ``n_cmpl: 4`` (the slots), 256 tokens each;
  the victim asks a 5-token chat answer: its latency. (``n_cmpl: 16`` is refused, 400.)
- a huge text piece: ``{"prompt": ["<3.9 MB of text>", 1]}`` on ``/completion``, sent
  again and again; the victim asks ``/health``: the slowest answer.

Runs in the bench's process; the server in its own. Used by ``bench/fairness.py``.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from actors import default_model_path

__all__ = ["SCENARIOS", "Scenario", "run_scenarios"]

_SERVE = ["-t", "1", "-c", "2048", "-np", "4", "--header-timeout", "10"]
_TEXTS = ["The quick brown fox jumps over the lazy dog again and again. " * 6 + f"({i})" for i in range(8)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _server() -> Iterator[str]:
    port = _free_port()
    serve = str(Path(sys.executable).parent / "llama-cpp-actors")
    command = [serve, "serve", "-m", str(default_model_path()), *_SERVE, "--port", str(port)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.2)
        else:
            raise RuntimeError("serve did not start")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _stream_ms(url: str) -> float:
    body = {"prompt": "Tell me a long story about a dragon.", "n_predict": 30, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    times = []
    with httpx.stream("POST", url + "/completion", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                times.append(time.perf_counter())
    return (times[-1] - times[0]) * 1000.0


def _chat_ms(url: str) -> float:
    start = time.perf_counter()
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 5}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=900)
    response.raise_for_status()
    return (time.perf_counter() - start) * 1000.0


def _health_worst_ms(url: str, seconds: float) -> float:
    worst, end = 0.0, time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        httpx.get(url + "/health", timeout=60)
        worst = max(worst, time.perf_counter() - start)
        time.sleep(0.02)
    return worst * 1000.0


def _served_after_s(url: str) -> float:
    client = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=30)
    start = time.monotonic()
    while time.monotonic() - start < 120:
        with contextlib.suppress(httpx.TransportError):
            if client.get(url + "/health").status_code == 200:
                return time.monotonic() - start
        time.sleep(0.1)
    return float("inf")


class Scenario:
    """A victim's measurement (``measure(url)``, in ``unit``), the pressure that may slow
    it (``press(url, stop)`` runs until ``stop`` is set) and the goal (``goal(alone,
    pressed)``)."""

    def __init__(
        self,
        victim: str,
        unit: str,
        measure: Callable[[str], float],
        press: Callable[[str, threading.Event], None],
        goal: Callable[[float, float], bool],
    ) -> None:
        self.victim, self.unit, self.measure, self.press, self.goal = victim, unit, measure, press, goal


def _silent(url: str, stop: threading.Event) -> None:
    port = int(url.rsplit(":", 1)[1])
    held = []
    with contextlib.suppress(OSError):
        for _ in range(2100):
            held.append(socket.create_connection(("127.0.0.1", port)))
    stop.wait()
    for sock in held:
        sock.close()


def _embeddings(url: str, stop: threading.Event) -> None:
    while not stop.is_set():
        httpx.post(url + "/v1/embeddings", json={"input": _TEXTS}, timeout=600)


def _choices(url: str, stop: threading.Event) -> None:
    body = {"prompt": "Count slowly:", "n_cmpl": 4, "n_predict": 256, "ignore_eos": True}
    assert httpx.post(url + "/completion", json={**body, "n_cmpl": 16}, timeout=60).status_code == 400
    threads = [threading.Thread(target=lambda: httpx.post(url + "/completion", json=body, timeout=900))
               for _ in range(4)]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stop.wait()


def _huge_piece(url: str, stop: threading.Event) -> None:
    text = "All work and no play makes Jack a dull boy. " * 88_000
    body = json.dumps({"prompt": [text, 1], "n_predict": 1})
    headers = {"content-type": "application/json"}
    while not stop.is_set():
        httpx.post(url + "/completion", content=body, headers=headers, timeout=600)


SCENARIOS: dict[str, Scenario] = {
    "2,100 silent connections": Scenario(
        "/health from another address: served after", "s", _served_after_s, _silent,
        lambda alone, pressed: pressed <= 10 + 3,  # the header timeout, and a little
    ),
    "a client looping /v1/embeddings (8 texts of ~80 tokens)": Scenario(
        "a 30-token stream, first token to last", "ms", _stream_ms, _embeddings,
        lambda alone, pressed: pressed <= 2 * alone,
    ),
    "four n_cmpl=4 requests of 256 tokens (n_cmpl=16: 400)": Scenario(
        "a 5-token chat answer", "ms", _chat_ms, _choices,
        lambda alone, pressed: pressed < 30_000,  # one 256-token choice at most: about 10 s
    ),
    "a 3.9 MB text piece on /completion, again and again": Scenario(
        "the slowest /health of 5 s", "ms", lambda url: _health_worst_ms(url, 5.0), _huge_piece,
        lambda alone, pressed: pressed < 100,
    ),
}  # fmt: skip


def run_scenarios(names: list[str] | None = None) -> list[list[str]]:
    """Each scenario's row: the victim, alone, under pressure, the ratio, the goal met."""
    rows = []
    with _server() as url:
        _chat_ms(url)  # warm up
        for name, scenario in SCENARIOS.items():
            if names is not None and name not in names:
                continue
            alone = scenario.measure(url)
            stop = threading.Event()
            attacker = threading.Thread(target=scenario.press, args=(url, stop), daemon=True)
            attacker.start()
            time.sleep(2.0)  # the pressure is on
            try:
                pressed = scenario.measure(url)
            finally:
                stop.set()
                attacker.join(timeout=900)
            met = "yes" if scenario.goal(alone, pressed) else "**no**"
            ratio = pressed / alone if alone else float("inf")
            unit = scenario.unit
            measured = [f"{alone:.1f} {unit}", f"{pressed:.1f} {unit}", f"{ratio:.2f}x"]
            rows.append([name, scenario.victim, *measured, met])
            print(f"{name:60s} alone {alone:9.1f} {unit}  pressed {pressed:9.1f}  {ratio:6.2f}x  {met}")
            time.sleep(12)  # what the pressure left (connections, queued work) is gone
    return rows
