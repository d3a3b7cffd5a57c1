"""Tenants with their own LoRA adapters at concurrency 8, against the same load on the
bare base model, ours and llama-server's, measured in one run.

llama.cpp applies one adapter set to the whole context, so a forward pass serves the
slots of one set; with N tenants each on its own adapter, a tick serves one tenant's
slots (``strategies.fair_adapters``: a set keeps the batch for ``adapter_quantum`` ticks
while it has work, then the set whose slot waited longest). What that costs:

- **throughput**: generated tokens per second over the run, and its ratio to the same
  load with no adapter in use (the base model, adapters loaded);
- **worst wait**: the longest gap between two tokens of any stream (a tenant waiting
  for the other sets' ticks), and the p50 gap;
- **fairness**: the slowest tenant's tokens per second over the fastest's.

Each of 8 clients sends ``--requests`` streamed requests one after another (client
``i`` is tenant ``i % N``), ``--max-tokens`` each, distinct prompts. llama-server runs
the same load with ``--lora`` per adapter and each request's ``lora`` field. Then a
micro-measurement of one switch of adapter set: a decode right after a change of set
against the same decode without one (raw llama.cpp, the cost ``llama_set_adapters_lora``
leaves to the next ``llama_decode``: it re-reserves the compute graph).

    python bench/lora.py                 # writes bench/results/lora.md
    LLAMA_SERVER_BIN=bench/.peers/llama-server python bench/lora.py
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parent.parent)
sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))

import http.client
import itertools

from tiny_lora import write_lora

from actors import Done, Failed, ServerActor, Stream, default_model_path
from bench._common import RESULTS, machine, markdown_table, prompts, write_result
from bench._systems import _free_port, _wait_http
from strategies import DecodeMaximal

CLIENTS = 8


class Run:
    """One load's token arrival times, by client."""

    def __init__(self) -> None:
        self.arrivals: dict[int, list[float]] = {}
        self.t0 = 0.0
        self.t1 = 0.0
        self.lock = threading.Lock()

    def add(self, client: int, times: list[float]) -> None:
        with self.lock:
            self.arrivals.setdefault(client, []).extend(times)

    def summary(self, tenants: int) -> dict[str, float]:
        tokens = sum(len(t) for t in self.arrivals.values())
        wall = self.t1 - self.t0
        gaps = [b - a for times in self.arrivals.values() for a, b in itertools.pairwise(times)]
        per_tenant: dict[int, int] = {}
        for client, times in self.arrivals.items():
            per_tenant[client % tenants] = per_tenant.get(client % tenants, 0) + len(times)
        clients_per = {t: sum(1 for c in self.arrivals if c % tenants == t) for t in per_tenant}
        rates = [per_tenant[t] / clients_per[t] / wall for t in per_tenant]
        return {
            "tok_s": tokens / wall,
            "gap_p50_ms": statistics.median(gaps) * 1000 if gaps else 0.0,
            "gap_max_ms": max(gaps) * 1000 if gaps else 0.0,
            "fairness": min(rates) / max(rates) if rates else 1.0,
        }


def run_load(one: Callable[[int, int, str], list[float]], texts: Sequence[str], requests: int) -> Run:
    run = Run()

    def client(i: int) -> None:
        for r in range(requests):
            run.add(i, one(i, r, texts[i * requests + r]))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    run.t0 = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    run.t1 = time.perf_counter()
    return run


def ours(
    model: str, files: Sequence[str], tenants: int, texts: Sequence[str], args: Any, quantum: int
) -> dict[str, float]:
    strategy = DecodeMaximal()
    strategy.adapter_quantum = quantum
    ref = ServerActor.start(
        model_path=model,
        n_parallel=CLIENTS,
        n_ctx=CLIENTS * 1024,
        n_threads=2,
        lora=[(f, 0.0) for f in files],
        batch_strategy=strategy,
    )

    def one(client: int, r: int, text: str) -> list[float]:
        q: queue.Queue[Any] = queue.Queue()
        lora = {client % tenants: 1.0} if tenants else None
        ref.tell(Stream(text, reply_to=q, max_tokens=args.max_tokens, temp=0.0, ignore_eos=True, lora=lora))
        times = []
        while True:
            event = q.get(timeout=600)
            if isinstance(event, Failed):
                raise RuntimeError(event)
            if isinstance(event, Done):
                return times
            times.append(time.perf_counter())

    try:
        one(0, 0, "warm up")
        return run_load(one, texts, args.requests).summary(max(tenants, 1))
    finally:
        ref.stop()


def llama_server(
    binary: str, model: str, files: Sequence[str], tenants: int, texts: Sequence[str], args: Any
) -> dict[str, float]:
    port = _free_port()
    command = [
        binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", str(CLIENTS * 1024),
        "-np", str(CLIENTS), "-t", "2", "-tb", "2", "--no-webui", "--lora-init-without-apply",
    ]  # fmt: skip
    for f in files:
        command += ["--lora", f]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def one(client: int, r: int, text: str) -> list[float]:
        body: dict[str, Any] = {
            "prompt": text, "n_predict": args.max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "cache_prompt": True,
        }  # fmt: skip
        if tenants:
            body["lora"] = [{"id": client % tenants, "scale": 1.0}]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        times = []
        for raw in response:
            line = raw.strip()
            if line.startswith(b"data:"):
                event = json.loads(line[5:])
                if event.get("stop"):
                    break
                times.append(time.perf_counter())
        conn.close()
        return times

    try:
        _wait_http(port, "/health", proc)
        one(0, 0, "warm up")
        return run_load(one, texts, args.requests).summary(max(tenants, 1))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def switch_cost(model: str, files: Sequence[str], repeats: int = 12) -> dict[int, tuple[float, float]]:
    """The median ms of an n-row decode with the same set as the last, and right after a
    change of set (raw llama.cpp, one context of 8 sequences, 2 threads)."""
    import llama_cpp as lc
    import numpy as np

    params = lc.llama_model_default_params()
    llm = lc.llama_model_load_from_file(model.encode(), params)
    cparams = lc.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch, cparams.n_ubatch, cparams.n_seq_max = 4096, 512, 512, CLIENTS
    cparams.n_threads = cparams.n_threads_batch = 2
    cparams.kv_unified = True
    cparams.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
    ctx = lc.llama_init_from_model(llm, cparams)
    handles = [lc.llama_adapter_lora_init(llm, f.encode()) for f in files[:2]]
    memory = lc.llama_get_memory(ctx)

    def use(i: int) -> None:
        arr = (lc.llama_adapter_lora_p_ctypes * 1)(handles[i])
        scale = (ctypes.c_float * 1)(1.0)
        lc.llama_set_adapters_lora(ctx, arr, 1, scale)

    def decode(n: int, pos: int) -> float:
        batch = lc.llama_batch_init(n, 0, 1)
        for s in range(n):
            batch.token[s], batch.pos[s], batch.n_seq_id[s], batch.logits[s] = 100 + s, pos, 1, 1
            batch.seq_id[s][0] = s
        batch.n_tokens = n
        t0 = time.perf_counter()
        lc.llama_decode(ctx, batch)
        elapsed = (time.perf_counter() - t0) * 1000
        lc.llama_batch_free(batch)
        for s in range(n):
            lc.llama_memory_seq_rm(memory, s, pos, -1)
        return elapsed

    costs = {}
    use(0)
    decode(CLIENTS, 0)
    for n in (1, CLIENTS):
        same = [decode(n, 0) for _ in range(repeats)]
        switched = []
        for i in range(repeats):
            use((i + 1) % 2)
            switched.append(decode(n, 0))
        costs[n] = (float(np.median(same)), float(np.median(switched)))
        use(0)
    lc.llama_free(ctx)
    lc.llama_model_free(llm)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tenants", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--quanta", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--requests", type=int, default=3, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    model = default_model_path()
    folder = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    files = [write_lora(folder / f"tenant-{i}.gguf", seed=i, rank=8) for i in range(max(args.tenants))]
    binary = os.environ.get("LLAMA_SERVER_BIN")
    rows = []
    tag = 0

    def texts() -> list[str]:
        nonlocal tag
        tag += 1
        return prompts(CLIENTS * args.requests, f"lora{tag}")

    default_quantum = DecodeMaximal.adapter_quantum
    base = ours(model, files, 0, texts(), args, default_quantum)
    peer_base = llama_server(binary, model, files, 0, texts(), args) if binary else None

    def row(label: str, got: dict[str, float], reference: dict[str, float]) -> list[str]:
        return [
            label,
            f"{got['tok_s']:.1f}",
            f"{got['tok_s'] / reference['tok_s']:.2f}x",
            f"{got['gap_p50_ms']:.0f}",
            f"{got['gap_max_ms']:.0f}",
            f"{got['fairness']:.2f}",
        ]

    rows.append(row("ours, no adapter in use", base, base))
    if peer_base is not None:
        rows.append(row("llama-server, no adapter in use", peer_base, peer_base))
    for tenants in args.tenants:
        for quantum in args.quanta:
            label = f"ours, {tenants} tenants, quantum {quantum}" + (
                " (default)" if quantum == default_quantum else ""
            )
            rows.append(row(label, ours(model, files[:tenants], tenants, texts(), args, quantum), base))
        if binary:
            peer = llama_server(binary, model, files[:tenants], tenants, texts(), args)
            assert peer_base is not None
            rows.append(row(f"llama-server, {tenants} tenants", peer, peer_base))
    costs = switch_cost(model, files)
    switch_rows = [
        [str(n), f"{same:.1f}", f"{after:.1f}", f"{after - same:+.1f}"] for n, (same, after) in costs.items()
    ]
    text = (
        f"# LoRA tenants at concurrency {CLIENTS}\n\n{machine()}; SmolLM2-135M with rank-8 adapters "
        f"(attn_q, attn_v, ffn_up of every layer), {CLIENTS} clients x {args.requests} streamed requests "
        f"of {args.max_tokens} tokens, client i on tenant i % N's adapter. Ratios are to the same load "
        "with no adapter in use on the same server (adapters loaded).\n\n"
        + markdown_table(
            ["load", "tok/s", "vs no adapter", "gap p50 ms", "worst gap ms", "slowest/fastest tenant"], rows
        )
        + "\n\n## One switch of adapter set\n\nRaw llama.cpp, 2 threads: an n-row decode with the set of "
        "the last decode, and right after `llama_set_adapters_lora` changed it (median ms).\n\n"
        + markdown_table(["rows", "same set ms", "after a switch ms", "switch costs"], switch_rows)
    )
    print(text)
    write_result("lora", text, args.out)


if __name__ == "__main__":
    main()
