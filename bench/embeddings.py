"""Embeddings throughput (texts/s): 16 concurrent callers, the engine against its peers.

Each caller embeds ``--texts`` short texts, one request each, as soon as the last one
came back; every round uses fresh texts and the systems take turns, in an order that
rotates every round. Systems:

- ``engine``: a ServerActor, ``embed()`` from each caller's thread;
- ``llama-lock``: one ``llama_cpp.Llama(embedding=True)`` behind a lock;
- ``llama-server``: llama.cpp's C++ server (``LLAMA_SERVER_BIN``, built by
  ``make bench-peers``) with ``--embedding``, ``POST /v1/embeddings``.

``--design`` measures instead what decided how the engine serves embeddings: on a raw
context, 8 generating sequences' decode rows and 16 texts, either as two decodes (the
generation batch, then an embedding pass of its own) or as one decode with embeddings on
(the texts' rows beside generation's).

    python bench/embeddings.py [--callers 16] [--texts 8] [--rounds 3] [--out DIR] [--design]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parent.parent)

from actors import ServerActor, default_model_path, embed
from bench._common import RESULTS, machine, run_threads, write_result
from bench._systems import _free_port, _wait_http

_TOPICS = [
    "a dragon who learned to bake bread", "the history of the printing press", "how volcanoes form",
    "ten tips for a good night's sleep", "the rules of chess", "a lighthouse keeper and a storm",
    "why the sky is blue", "the life of a honeybee", "building a wooden boat", "cities in the year 3000",
]  # fmt: skip


def texts(n: int, tag: str) -> list[str]:
    """``n`` distinct texts of 20 to 40 tokens."""
    return [
        f"[{tag}.{i}] A short note on {_TOPICS[i % len(_TOPICS)]}, written for a search index "
        f"so that it can be found again later, number {i}."
        for i in range(n)
    ]


Embedder = Callable[[str], Any]


def _engine(model_path: str, n_threads: int, pooling: str) -> tuple[Embedder, Callable[[], None]]:
    ref = ServerActor.start(model_path=model_path, n_parallel=4, n_ctx=4096, n_threads=n_threads)
    embed(ref, texts(8, "warm-up"), timeout=300)  # the first full pass allocates llama.cpp's buffers
    return (lambda text: embed(ref, [text], pooling=pooling, timeout=300)), ref.stop  # type: ignore[arg-type]


def _llama_lock(model_path: str, n_threads: int, pooling: str) -> tuple[Embedder, Callable[[], None]]:
    import llama_cpp

    kinds = {"mean": 1, "cls": 2, "last": 3}
    llm = llama_cpp.Llama(
        model_path, embedding=True, pooling_type=kinds[pooling], n_ctx=4096, n_batch=512,
        n_threads=n_threads, n_threads_batch=n_threads, flash_attn=True, verbose=False,
    )  # fmt: skip
    lock = threading.Lock()
    llm.embed(texts(8, "warm-up"))

    def one(text: str) -> Any:
        with lock:
            return llm.embed(text, normalize=True)

    return one, llm.close


def _llama_server(model_path: str, n_threads: int, pooling: str) -> tuple[Embedder, Callable[[], None]]:
    import http.client  # here: bench/http.py would shadow it at the top, before sys.path is fixed

    port = _free_port()
    proc = subprocess.Popen(
        [os.environ["LLAMA_SERVER_BIN"], "-m", model_path, "--host", "127.0.0.1", "--port", str(port),
         "--embedding", "--pooling", pooling, "-np", "4", "-c", "4096", "-t", str(n_threads),
         "-tb", str(n_threads)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    _wait_http(port, "/health", proc)

    def one(text: str) -> Any:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        try:
            connection.request("POST", "/v1/embeddings", json.dumps({"input": text}),
                               {"Content-Type": "application/json"})  # fmt: skip
            response = connection.getresponse()
            body = response.read()
            if response.status != 200:
                raise RuntimeError(f"llama-server answered {response.status}: {body[:200]!r}")
            return json.loads(body)["data"][0]["embedding"]
        finally:
            connection.close()

    def stop() -> None:
        proc.terminate()
        proc.wait(timeout=30)

    for text in texts(8, "warm-up"):
        one(text)
    return one, stop


SYSTEMS = {"engine": _engine, "llama-lock": _llama_lock, "llama-server": _llama_server}


def throughput(one: Embedder, callers: int, per_caller: int, tag: str) -> float:
    """Texts per second of ``callers`` threads, each embedding ``per_caller`` texts in turn."""
    work = [texts(per_caller, f"{tag}.{c}") for c in range(callers)]
    t0 = time.perf_counter()
    run_threads([lambda mine=mine: [one(t) for t in mine] for mine in work])
    return callers * per_caller / (time.perf_counter() - t0)


def run(
    systems: list[str],
    callers: int,
    per_caller: int,
    rounds: int,
    n_threads: int,
    pooling: str,
    out: Path | None,
) -> None:
    model_path = default_model_path()
    results: dict[str, list[float]] = {s: [] for s in systems}
    for r in range(rounds):
        for name in systems[r % len(systems) :] + systems[: r % len(systems)]:
            one, stop = SYSTEMS[name](model_path, n_threads, pooling)
            try:
                results[name].append(throughput(one, callers, per_caller, f"{name}.{r}"))
            finally:
                stop()
            print(f"round {r + 1}: {name}: {results[name][-1]:.1f} texts/s", flush=True)
    medians = {name: statistics.median(values) for name, values in results.items()}
    print(f"\n{callers} callers x {per_caller} texts, pooling {pooling}, median of {rounds} rounds:")
    for name, value in medians.items():
        print(f"  {name:13s} {value:7.1f} texts/s")
    lines = [
        "# Embeddings throughput",
        "",
        f"{machine()}; SmolLM2-135M-Instruct Q4_1, {callers} concurrent callers x {per_caller} texts of "
        f"20 to 40 tokens, one text a request, pooling {pooling}, n_threads={n_threads}; median of "
        f"{rounds} interleaved rounds.",
        "",
        "| system | texts/s |",
        "|---|---|",
        *(f"| {n} | {v:.1f} |" for n, v in medians.items()),
        "",
    ]
    for peer in ("llama-lock", "llama-server"):
        if "engine" in medians and peer in medians:
            print(f"  engine / {peer}: {medians['engine'] / medians[peer]:.2f}x")
            lines.append(f"engine / {peer}: {medians['engine'] / medians[peer]:.2f}x  ")
    if out is not None:
        write_result("embeddings", "\n".join(lines) + "\n", out)


def design(repeats: int, n_threads: int) -> None:
    """Two decodes (generation, then an embedding pass) against one with embeddings on."""
    import llama_cpp as lc

    model = lc.llama_model_load_from_file(default_model_path().encode(), lc.llama_model_default_params())
    params = lc.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 4096, 512, 512, 40
    params.kv_unified, params.no_perf = True, True
    params.n_threads = params.n_threads_batch = n_threads
    ctx = lc.llama_init_from_model(model, params)
    memory = lc.llama_get_memory(ctx)
    batch = lc.llama_batch_init(512, 0, 1)
    n_gen, n_texts, text_len = 8, 16, 24

    def decode(rows: list[tuple[int, int, int]]) -> None:
        for i, (token, pos, seq) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0] = token, pos, 1, seq
            batch.logits[i] = 1
        batch.n_tokens = len(rows)
        assert lc.llama_decode(ctx, batch) == 0

    for seq in range(n_gen):  # 100 tokens of context each
        decode([(100 + i, i, seq) for i in range(100)])
    gen = [(500, 100, seq) for seq in range(n_gen)]
    emb = [(200 + j, j, n_gen + k) for k in range(n_texts) for j in range(text_len)]

    def clear() -> None:
        for seq in range(n_gen):
            lc.llama_memory_seq_rm(memory, seq, 100, -1)
        for k in range(n_texts):
            lc.llama_memory_seq_rm(memory, n_gen + k, -1, -1)

    def own_pass() -> None:
        decode(gen)
        lc.llama_set_embeddings(ctx, True)
        decode(emb)
        lc.llama_set_embeddings(ctx, False)

    def beside() -> None:
        lc.llama_set_embeddings(ctx, True)
        decode(gen + emb)
        lc.llama_set_embeddings(ctx, False)

    def generation_only() -> None:
        decode(gen)

    times: dict[str, list[float]] = {"generation only": [], "own pass": [], "beside": []}
    for _ in range(repeats):
        for name, step in (("generation only", generation_only), ("own pass", own_pass), ("beside", beside)):
            t0 = time.perf_counter()
            step()
            times[name].append((time.perf_counter() - t0) * 1000.0)
            clear()
    print(f"{n_gen} decode rows + {n_texts} texts of {text_len} tokens, median of {repeats}:")
    for name, values in times.items():
        print(f"  {name:16s} {statistics.median(values):7.1f} ms")
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument("--texts", type=int, default=8, help="texts per caller")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n-threads", type=int, default=2)
    parser.add_argument("--pooling", choices=("mean", "cls", "last"), default="mean")
    parser.add_argument("--systems", default="engine,llama-lock,llama-server")
    parser.add_argument("--design", action="store_true", help="measure own pass against beside")
    parser.add_argument("--quick", action="store_true", help="2 callers, 1 text, 1 round (a smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="a directory for embeddings.md")
    args = parser.parse_args()
    if args.quick:
        args.callers, args.texts, args.rounds = 2, 1, 1
    if args.design:
        design(max(args.rounds, 5), args.n_threads)
        return
    systems = [s for s in args.systems.split(",") if s]
    if "llama-server" in systems and not os.environ.get("LLAMA_SERVER_BIN"):
        print("llama-server: LLAMA_SERVER_BIN is not set (make bench-peers builds it); skipped")
        systems.remove("llama-server")
    run(systems, args.callers, args.texts, args.rounds, args.n_threads, args.pooling, args.out)


if __name__ == "__main__":
    main()
