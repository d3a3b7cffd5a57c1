"""A scripted backend for engine tests without a model (``actors.backend.Backend``).

The test chooses the logits: ``model(tokens)`` is the next token's logits after a
sequence's tokens (by default a fixed rule: a token is the sum of the last three, plus
one, mod the vocabulary, never the end token 0), computed from the sequence's cells as
they are in the fake KV cache. So a request's output depends only on what its sequence
holds, as llama.cpp's does with the batch-invariant kernel: any cache path that keeps
the books right gives the solo run's tokens, and one that does not shows.

LoRA adapters change the model as llama.cpp's do: a row's logits are the base model's
rolled by an amount that depends on every adapter set that computed the sequence's
cells and the set in use (``adapted``), so KV reused across adapter sets, or a batch
decoded under another request's set, shows as tokens that differ from the solo run
(``solo(..., adapters=...)``).

The KV cache is checked as llama.cpp would abort or misbehave: a batch over ``n_batch``,
positions that do not follow on in a sequence, a copy onto positions the destination
holds, a logits row that did not ask for logits, a sequence id past ``n_seq_max``. A
decode with no free cell left answers 1, as llama.cpp does. Engine thread only, like
the real one.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from actors.backend import DeadEnd, FimTokens, KvIdentity
from actors.chat import ReplySpec, TemplateInfo, ToolGrammar
from actors.contract import Chat, InvalidRequest, LoraAdapter, SamplingParams, StreamChat

__all__ = ["EOG", "FakeAdapters", "FakeBackend", "adapted", "default_model", "solo"]

AdapterSet = tuple[tuple[int, float], ...]


def adapted(logits: npt.NDArray[np.float32], sets: set[AdapterSet]) -> npt.NDArray[np.float32]:
    """``logits`` as the adapter ``sets`` that computed a sequence (its cells' and the
    one in use) make them: unchanged for the base model alone, else rolled by an amount
    each distinct mix of sets gives its own."""
    if sets <= {()}:
        return logits
    shift = sum(1 + 7 * i + round(scale * 1000) for s in sets for i, scale in s) + 3 * len(sets)
    return np.roll(logits, shift % len(logits))


EOG = 0
Model = Callable[[Sequence[int]], npt.NDArray[np.float32]]


def default_model(n_vocab: int) -> Model:
    """Next token = (sum of the last three + 1) mod n_vocab, 0 (the end) skipped."""

    def model(tokens: Sequence[int]) -> npt.NDArray[np.float32]:
        logits = np.zeros(n_vocab, dtype=np.float32)
        token = (sum(tokens[-3:]) + 1) % n_vocab or 1
        logits[token] = 10.0
        logits[(token + 1) % n_vocab or 1] = 5.0  # a runner-up, for logprobs
        return logits

    return model


def solo(model: Model, prompt: Sequence[int], n: int, adapters: AdapterSet = ()) -> list[int]:
    """The greedy continuation of ``prompt`` alone, with the adapter set ``adapters``:
    what any cache path must give."""
    tokens = list(prompt)
    out: list[int] = []
    for _ in range(n):
        token = int(np.argmax(adapted(model(tokens), {adapters})))
        if token == EOG:
            break
        out.append(token)
        tokens.append(token)
    return out


class FakeVocab:
    """Token ``t`` is the letter ``chr(ord("a") + t % 26)`` (0 the end, which renders empty);
    ``fim``: the fill-in-the-middle tokens it claims (none by default)."""

    def __init__(self, n_vocab: int, fim: FimTokens | None = None) -> None:
        self.n_vocab = n_vocab
        self.eog_ids = frozenset({EOG})
        self.fim = fim or FimTokens()

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return [1 + (ord(c) - ord("a")) % (self.n_vocab - 1) for c in text]

    def is_single_token(self, piece: str) -> bool:
        return len(piece) == 1

    def piece(self, token: int) -> bytes:
        return b"" if token == EOG else chr(ord("a") + token % 26).encode()

    def special_piece(self, token: int) -> bytes:
        return b"</s>" if token == EOG else self.piece(token)

    def special_token(self, text: str) -> int | None:
        return EOG if text == "</s>" else None


class FakeKv:
    """``n_ctx`` cells shared by all sequences: a cell holds a position's token and the
    sequences that use it (llama.cpp's unified KV)."""

    can_shift = True

    def __init__(self, n_ctx: int, n_seq_max: int) -> None:
        self.n_ctx = n_ctx
        self.n_seq_max = n_seq_max
        self.cells: dict[int, tuple[int, int, set[int]]] = {}  # cell -> (pos, token, seq ids)
        self.cell_sets: dict[int, AdapterSet] = {}  # cell -> the adapter set that computed it
        self._next = 0
        self.copies = 0  # seq_cp calls: cells shared, none computed

    @property
    def used(self) -> int:
        return len(self.cells)

    def held(self, seq_id: int) -> dict[int, int]:
        """The sequence's tokens by position."""
        return {pos: token for pos, token, seqs in self.cells.values() if seq_id in seqs}

    def tokens_of(self, seq_id: int) -> list[int]:
        held = self.held(seq_id)
        assert sorted(held) == list(range(len(held))), f"seq {seq_id}: a gap in its positions"
        return [held[p] for p in range(len(held))]

    def sets_of(self, seq_id: int) -> set[AdapterSet]:
        """The adapter sets that computed the sequence's cells."""
        return {self.cell_sets[cell] for cell, (_, _, seqs) in self.cells.items() if seq_id in seqs}

    def add(self, seq_id: int, pos: int, token: int, adapters: AdapterSet = ()) -> bool:
        if self.used >= self.n_ctx:
            return False
        self.cells[self._next] = (pos, token, {seq_id})
        self.cell_sets[self._next] = adapters
        self._next += 1
        return True

    def _untag(self, seq_id: int, p0: int, p1: int) -> None:
        for cell, (pos, _, seqs) in list(self.cells.items()):
            if seq_id in seqs and p0 <= pos < p1:
                seqs.discard(seq_id)
                if not seqs:
                    del self.cells[cell], self.cell_sets[cell]

    def trim(self, seq_id: int, keep: int) -> bool:
        self._untag(seq_id, keep, 1 << 30)
        return True

    def remove(self, seq_id: int, p0: int, p1: int) -> bool:
        self._untag(seq_id, p0, p1)
        return True

    def copy(self, src: int, dst: int, p0: int, p1: int) -> None:
        self.copies += 1
        for pos, _, seqs in self.cells.values():
            if p0 <= pos < p1:
                assert dst not in seqs, "seq_cp onto positions the destination holds"
                if src in seqs:
                    seqs.add(dst)

    def pos_max(self, seq_id: int) -> int:
        return max(self.held(seq_id), default=-1)

    def clear(self, seq_id: int) -> None:
        self._untag(seq_id, 0, 1 << 30)

    def shift(self, seq_id: int, n_keep: int, n_discard: int, n_past: int) -> None:
        self._untag(seq_id, n_keep, n_keep + n_discard)
        for cell, (pos, token, seqs) in list(self.cells.items()):
            if seq_id in seqs and pos >= n_keep + n_discard:
                assert seqs == {seq_id}, "a shift of cells another sequence shares"
                self.cells[cell] = (pos - n_discard, token, seqs)

    def save(self, seq_id: int) -> bytes:
        cells = {pos: self.cell_sets[c] for c, (pos, _, seqs) in self.cells.items() if seq_id in seqs}
        return pickle.dumps((self.tokens_of(seq_id), [cells[p] for p in range(len(cells))]))

    def restore(self, seq_id: int, state: bytes) -> bool:
        assert self.pos_max(seq_id) == -1, "a restore into a sequence that holds cells"
        tokens, sets = pickle.loads(state)
        if self.n_ctx - self.used < len(tokens):
            return False
        for pos, (token, adapters) in enumerate(zip(tokens, sets, strict=True)):
            self.add(seq_id, pos, token, adapters)
        return True


class FakeRows:
    """The batch's columns and the forward pass over them (see the module's docstring)."""

    def __init__(self, kv: FakeKv, n_batch: int, model: Model, adapters: FakeAdapters) -> None:
        self._kv = kv
        self._model = model
        self._adapters = adapters
        self.n_batch = n_batch
        self.tokens = np.zeros(n_batch, dtype=np.int32)
        self.pos = np.zeros(n_batch, dtype=np.int32)
        self.seq_ids = np.zeros(n_batch, dtype=np.int32)
        self.logits = np.zeros(n_batch, dtype=np.int8)
        self.out: dict[int, npt.NDArray[np.float32]] = {}  # the last pass's rows with logits
        self.passes: list[list[tuple[int, int]]] = []  # each pass's (seq id, token) rows
        self.fail_next: list[int] = []  # codes to answer instead of decoding (fault injection)

    def decode(self, start: int, end: int) -> int:
        assert 0 <= start < end <= self.n_batch, "llama.cpp aborts on a batch past n_batch"
        if self.fail_next:
            return self.fail_next.pop(0)
        rows = range(start, end)
        expect: dict[int, int] = {}
        for row in rows:  # llama.cpp refuses a batch whose positions do not follow on
            seq = int(self.seq_ids[row])
            assert 0 <= seq < self._kv.n_seq_max, f"seq id {seq} past n_seq_max"
            p = expect.get(seq, self._kv.pos_max(seq) + 1)
            assert int(self.pos[row]) == p, f"seq {seq}: position {int(self.pos[row])}, expected {p}"
            expect[seq] = p + 1
        if self._kv.n_ctx - self._kv.used < end - start:
            return 1  # no KV space: nothing written
        self.out = {}
        self.passes.append([(int(self.seq_ids[r]), int(self.tokens[r])) for r in rows])
        current = self._adapters.current
        for row in rows:
            seq = int(self.seq_ids[row])
            self._kv.add(seq, int(self.pos[row]), int(self.tokens[row]), current)
            if self.logits[row]:
                logits = self._model(self._kv.tokens_of(seq))
                self.out[row - start] = adapted(logits, self._kv.sets_of(seq) | {current})
        return 0

    def decode_embeddings(self, n_rows: int) -> tuple[int, npt.NDArray[np.float32] | None]:
        return -1, None  # no embedding model

    def time_passes(self, sizes: Sequence[int], seq_id: int, repeats: int = 1) -> dict[int, float]:
        return {n: 1.0 + 0.01 * n for n in sizes if 1 <= n <= self.n_batch}

    def row(self, index: int) -> npt.NDArray[np.float32]:
        return self.out[index]  # KeyError: a row without logits (llama.cpp aborts)


class FakeSampler:
    has_grammar = False
    grammar_ms = 0.0

    def __init__(self, logit_bias: dict[int, float] | None) -> None:
        self.bias = dict(logit_bias or {})
        self.freed = False


class FakeSampling:
    """Greedy over the chosen logits (with the request's logit bias); no grammars."""

    def __init__(self, rows: FakeRows) -> None:
        self._rows = rows
        self.live: set[int] = set()  # samplers made and not freed

    def make(
        self,
        params: SamplingParams,
        logit_bias: dict[int, float] | None,
        history: list[int],
        triggers: Any = None,
    ) -> FakeSampler:
        if params.grammar is not None:
            raise InvalidRequest("the fake backend has no grammars")
        sampler = FakeSampler(logit_bias)
        self.live.add(id(sampler))
        return sampler

    def _biased(self, sampler: FakeSampler, index: int) -> npt.NDArray[np.float32]:
        logits = self._rows.row(index).copy()
        for token, bias in sampler.bias.items():
            logits[token] += bias if math.isfinite(bias) else -np.inf
        return logits

    def sample(self, sampler: Any, index: int, *, ban_eog: bool = False) -> int:
        assert not sampler.freed, "a freed sampler sampled"
        logits = self._biased(sampler, index)
        eog_allowed = bool(logits[EOG] > -np.inf)
        if ban_eog:
            logits[EOG] = -np.inf
        token = int(np.argmax(logits))
        if not logits[token] > -np.inf:
            raise DeadEnd(eog_allowed)
        return token

    def force(self, sampler: Any, token: int) -> bool:
        return True

    def free(self, sampler: Any) -> None:
        assert not sampler.freed, "a sampler freed twice"
        sampler.freed = True
        self.live.discard(id(sampler))

    def logprobs(self, index: int, k: int) -> tuple[npt.NDArray[np.float64], list[tuple[int, float]]]:
        logits = self._rows.row(index).astype(np.float64)
        log_softmax = logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))
        best = sorted(range(len(logits)), key=lambda t: -log_softmax[t])[:k]
        return log_softmax, [(t, float(log_softmax[t])) for t in best]

    def sampled_probs(self, sampler: Any, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
        return 1.0, [(token, 1.0)] if k > 0 else []

    def top_token(self, index: int) -> tuple[int, float]:
        logits = self._rows.row(index)
        return int(np.argmax(logits)), 1.0

    def probe_grammar(self, grammar: str, logit_bias: dict[int, float] | None) -> float:
        raise InvalidRequest("the fake backend has no grammars")

    def json_schema_grammar(self, schema: object) -> str:
        raise InvalidRequest("the fake backend has no grammars")


class FakeAdapters:
    """Adapters by name (their files are never read), and the set in use."""

    def __init__(self, names: Sequence[str] = (), scales: Sequence[float] | None = None) -> None:
        given = scales if scales is not None else [1.0] * len(names)
        self.loaded = tuple(LoraAdapter(f"/fake/{n}.gguf", s, n) for n, s in zip(names, given, strict=True))
        self.current: AdapterSet = ()
        self.n_switches = 0
        self.used: list[AdapterSet] = []  # the set of each change, in order

    def use(self, adapters: Sequence[tuple[int, float]]) -> None:
        key = tuple(adapters)
        assert all(0 <= i < len(self.loaded) and s != 0.0 for i, s in key), f"bad adapter set {key}"
        if key != self.current:
            self.current, self.n_switches = key, self.n_switches + 1
            self.used.append(key)


class FakeChat:
    """No chat template: chats are refused, as a model without one refuses them."""

    info: TemplateInfo | None = None

    def prompt(
        self, message: Chat | StreamChat, reasoning_format: str = "auto"
    ) -> tuple[list[int], ToolGrammar | None, ReplySpec | None]:
        raise InvalidRequest("the model has no chat template")


class FakeBackend:
    """A backend of ``n_seq_max`` slots over ``n_ctx`` cells (see the module's docstring)."""

    def __init__(
        self,
        *,
        n_ctx: int = 256,
        n_batch: int = 64,
        n_seq_max: int = 4,
        n_vocab: int = 32,
        model: Model | None = None,
        adapters: Sequence[str] = (),
        adapter_scales: Sequence[float] | None = None,
    ) -> None:
        self.n_ctx, self.n_batch, self.n_seq_max = n_ctx, n_batch, n_seq_max
        self.n_ctx_train = 0
        self.n_embd = 8
        self.pooling: str | None = None
        self.embed_seq_ids: tuple[int, ...] = ()
        self.model = model or default_model(n_vocab)
        self.vocab = FakeVocab(n_vocab)
        self.kv = FakeKv(n_ctx, n_seq_max)
        self.adapters = FakeAdapters(adapters, adapter_scales)
        self.rows = FakeRows(self.kv, n_batch, self.model, self.adapters)
        self.sampling = FakeSampling(self.rows)
        self.chat = FakeChat()
        self.closed = False
        # What a saved KV state is valid for: a test makes "another model" by changing it.
        self.kv_identity = KvIdentity(
            "fake-model", (1, 1), tuple(f"fake:{a.name}" for a in self.adapters.loaded)
        )

    def identity(self) -> KvIdentity:
        return self.kv_identity

    def close(self) -> None:
        assert not self.closed, "closed twice"
        self.closed = True
