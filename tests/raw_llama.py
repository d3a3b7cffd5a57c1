"""Raw llama.cpp, no engine: one sequence's logits, step by step, against a fresh context.

The regression test of the flash-attention cell-order bug (``docs/design/invariance.md``)
and the measure of this CPU's floor: how far a sequence's logits move when only its
surroundings change (cells freed below it by another sequence, a batch of 70 rows beside
it, its prompt decoded in chunks). On a build with the batch-invariant kernel the floor
is 0.0 on every CPU seen so far; the tests read it rather than assume it.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

PROMPT = "Tell me a story about a brave knight and a small dragon who"
OTHER = "The history of the Roman empire is long and complicated, full of wars, emperors and " * 6
LAYOUTS = ("holes below", "beside 3", "70-row batch", "chunked prompt")


class _Raw:
    def __init__(self, model_path: str) -> None:
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(model_path.encode(), lc.llama_model_default_params())
        self.vocab = lc.llama_model_get_vocab(self.model)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.batch = lc.llama_batch_init(512, 0, 1)

    def tokens(self, text: str) -> list[int]:
        raw = text.encode()
        buf = (self.lc.llama_token * 512)()
        n = self.lc.llama_tokenize(self.vocab, raw, len(raw), buf, 512, True, False)
        return list(buf[:n])

    def context(self, flash: bool, n_threads: int, kv_f32: bool = False) -> Any:
        p = self.lc.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max, p.kv_unified = 1024, 512, 512, 4, True
        p.n_threads = p.n_threads_batch = n_threads
        p.flash_attn_type = 1 if flash else 0
        if kv_f32:
            p.type_k = p.type_v = self.lc.GGML_TYPE_F32
        return self.lc.llama_init_from_model(self.model, p)

    def decode(self, ctx: Any, rows: list[tuple[int, int, int, bool]]) -> None:
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(rows)
        assert self.lc.llama_decode(ctx, b) == 0

    def logits(self, ctx: Any, row: int) -> np.ndarray:
        out = np.ctypeslib.as_array(self.lc.llama_get_logits_ith(ctx, row), shape=(self.n_vocab,))
        return out.astype(np.float64)

    def trace(
        self,
        layout: str | None,
        flash: bool,
        n_threads: int,
        steps: int,
        forced: list[int],
        kv_f32: bool = False,
    ) -> list[np.ndarray]:
        """Seq 0 decodes PROMPT and then ``forced`` one token a step (greedy when empty),
        in ``layout``; the logits of each step."""
        lc, ctx = self.lc, self.context(flash, n_threads, kv_f32)
        prompt, other = self.tokens(PROMPT), self.tokens(OTHER)
        try:
            neighbours = []
            if layout in ("holes below", "beside 3", "70-row batch"):
                for seq in (1, 2, 3):  # others take the low cells first
                    part = other[: 20 + 7 * seq]
                    self.decode(ctx, [(t, p, seq, False) for p, t in enumerate(part)])
                    neighbours.append([seq, len(part)])
            if layout == "chunked prompt":
                for i in range(0, len(prompt), 4):
                    rows = [
                        (prompt[j], j, 0, j == len(prompt) - 1) for j in range(i, min(i + 4, len(prompt)))
                    ]
                    self.decode(ctx, rows)
                logits = self.logits(ctx, len(rows) - 1)
            else:
                self.decode(ctx, [(t, p, 0, p == len(prompt) - 1) for p, t in enumerate(prompt)])
                logits = self.logits(ctx, len(prompt) - 1)
            if layout == "holes below":  # their cells free up below seq 0's
                for seq, _ in neighbours:
                    lc.llama_memory_seq_rm(lc.llama_get_memory(ctx), seq, -1, -1)
                neighbours = []
            trace, pos = [], len(prompt)
            for step in range(steps):
                trace.append(logits.copy())
                token = forced[step] if forced else int(logits.argmax())
                rows = [(token, pos, 0, True)]
                if layout == "beside 3":
                    for n in neighbours:
                        rows.append((5, n[1], n[0], True))
                        n[1] += 1
                if layout == "70-row batch":
                    seq, at = neighbours[0]
                    rows += [(other[(at + j) % len(other)], at + j, seq, False) for j in range(70)]
                    neighbours[0][1] += 70
                self.decode(ctx, rows)
                logits, pos = self.logits(ctx, 0), pos + 1
            return trace
        finally:
            lc.llama_free(ctx)


@functools.cache
def _raw(model_path: str) -> _Raw:
    return _Raw(model_path)


@functools.cache
def largest_moves(
    model_path: str, *, flash: bool = True, n_threads: int = 1, steps: int = 12
) -> dict[str, float]:
    """Per layout, the largest |logit difference| of seq 0 against a fresh context alone,
    the same tokens fed in both (the fresh run's greedy ones). Kept for the session:
    ``floor`` and the invariance test ask for the same runs (13 s on 2 cores)."""
    raw = _raw(model_path)
    alone = raw.trace(None, flash, n_threads, steps, [])
    forced = [int(lg.argmax()) for lg in alone]
    moves = {}
    for layout in LAYOUTS:
        got = raw.trace(layout, flash, n_threads, steps, forced)
        moves[layout] = max(float(np.abs(a - b).max()) for a, b in zip(alone, got, strict=True))
    return moves


@functools.cache
def floor(model_path: str) -> float:
    """This CPU's floor: the largest move of a sequence's logits with its surroundings,
    flash attention on (the default), 1 and 2 threads."""
    return max(max(largest_moves(model_path, n_threads=t).values()) for t in (1, 2))


def attention_errors(model_path: str, steps: int = 12) -> dict[str, float]:
    """How far the default model's logits sit from an F32 KV cache without flash attention
    (the most precise attention llama.cpp has), with the F16 cache: flash attention on,
    and off. The mean over ``steps`` greedy steps of the largest |logit difference|."""
    raw = _raw(model_path)
    truth = raw.trace(None, False, 1, steps, [], kv_f32=True)
    forced = [int(lg.argmax()) for lg in truth]
    errors = {}
    for name, flash in (("flash", True), ("no flash", False)):
        got = raw.trace(None, flash, 1, steps, forced)
        errors[name] = float(np.mean([np.abs(a - b).max() for a, b in zip(truth, got, strict=True)]))
    return errors
