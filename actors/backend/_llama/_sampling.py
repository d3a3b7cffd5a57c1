"""Samplers: one request's chain, sampling a row's logits, logprobs, grammars.

:class:`LlamaSampling` builds each request's :class:`SamplerChain` (or a numpy
:class:`~actors.backend._greedy.Greedy` for plain greedy), samples batch rows with it
in the engine thread, and checks grammars against the vocabulary in callers' threads
(:meth:`LlamaSampling.probe_grammar`). llama.cpp's grammar sampler aborts the process
when asked to accept a token it does not allow: every dead end is caught here first
(:class:`~actors.backend._greedy.DeadEnd`).
"""

from __future__ import annotations

import ctypes
import json
import math
import re
import time
from collections.abc import Callable
from typing import Any

import llama_cpp as _lc
import numpy as np
import numpy.typing as npt
from llama_cpp.llama_grammar import json_schema_to_gbnf

from actors.backend._faults import faults
from actors.backend._greedy import GREEDY_TEMP, DeadEnd, Greedy
from actors.backend._llama._vocab import LlamaVocab
from actors.backend._protocol import Triggers
from actors.contract import InvalidRequest, SamplingParams

__all__ = ["LlamaSampling", "SamplerChain", "json_strings_only"]


class LlamaSampling:
    """Samplers over one context's logits (engine thread, but :meth:`probe_grammar` and
    :meth:`json_schema_grammar`, which any thread may call).

    Args:
        vocab: the model's vocabulary (grammars are built on its handle, under its
            readers' lock: closing the model waits for them).
        row_logits: batch row ``index``'s logits, a writable view.
        n_ctx: the context's size (a penalty window past it means it).
    """

    def __init__(
        self, vocab: LlamaVocab, row_logits: Callable[[int], npt.NDArray[np.float32]], n_ctx: int
    ) -> None:
        self._vocab = vocab.handle
        self._readers = vocab.readers
        self._logits = row_logits
        self.n_ctx = n_ctx
        self.n_vocab = vocab.n_vocab
        self.eog_array = vocab.eog_array
        self._token_ids = np.arange(self.n_vocab, dtype=np.int32)
        self._candidates = _candidates(self.n_vocab)
        self._one = _candidates(1)

    def make(
        self,
        params: SamplingParams,
        logit_bias: dict[int, float] | None,
        history: list[int],
        triggers: Triggers | None = None,
    ) -> Greedy | SamplerChain:
        """Build a sampler for one request; raises ``InvalidRequest`` on a bad grammar.

        With ``triggers`` the grammar is lazy: it constrains nothing until the reply
        matches one of the trigger patterns or samples one of the trigger tokens, and
        everything from there (a tool call's marker on) after.

        ``history`` is the prompt: its tail feeds the repetition penalties. Plain greedy
        sampling (no penalties, no grammar) skips llama.cpp's sampler chain, which
        copies the whole vocabulary into a candidate array for every token: an argmax
        over a numpy view of the logits picks the same token (the first maximum).
        """
        penalties_off = (
            params.penalty_repeat == 1.0 and not params.penalty_freq and not params.penalty_present
        )
        # Below GREEDY_TEMP every logit / temp overflows a float in llama.cpp's temperature
        # sampler, which then picks among infinities: it is greedy in all but name.
        greedy = params.temp < GREEDY_TEMP
        if greedy and params.grammar is None and penalties_off:
            return Greedy(logit_bias)
        chain = SamplerChain()
        try:
            if logit_bias or not penalties_off:
                filters = chain.filters = _lc.llama_sampler_chain_init(
                    _lc.llama_sampler_chain_default_params()
                )
                if logit_bias:
                    _lc.llama_sampler_chain_add(filters, self._logit_bias_sampler(logit_bias))
                if not penalties_off:
                    # A window past the context means the context; llama.cpp allocates it.
                    last_n = (
                        self.n_ctx if params.penalty_last_n == -1 else min(params.penalty_last_n, self.n_ctx)
                    )
                    penalties = _lc.llama_sampler_init_penalties(
                        self.n_vocab,
                        last_n,
                        params.penalty_repeat,
                        params.penalty_freq,
                        params.penalty_present,
                    )
                    # Only the penalties see the prompt: accepting it on the whole chain
                    # would walk a grammar through tokens it never produced.
                    for token in history[-last_n:] if last_n > 0 else []:
                        _lc.llama_sampler_accept(penalties, token)
                    _lc.llama_sampler_chain_add(filters, penalties)
            if params.grammar is not None:
                chain.grammar = self._grammar_sampler(params.grammar, triggers)
            select = chain.select = _lc.llama_sampler_chain_init(_lc.llama_sampler_chain_default_params())
            if greedy:
                chain.greedy = True
                _lc.llama_sampler_chain_add(select, _lc.llama_sampler_init_greedy())
            else:
                seed = _lc.LLAMA_DEFAULT_SEED if params.seed is None else params.seed
                if params.top_k > 0:
                    _lc.llama_sampler_chain_add(select, _lc.llama_sampler_init_top_k(params.top_k))
                _lc.llama_sampler_chain_add(select, _lc.llama_sampler_init_top_p(params.top_p, 1))
                _lc.llama_sampler_chain_add(select, _lc.llama_sampler_init_min_p(params.min_p, 1))
                _lc.llama_sampler_chain_add(select, _lc.llama_sampler_init_temp(params.temp))
                _lc.llama_sampler_chain_add(select, _lc.llama_sampler_init_dist(seed))
        except BaseException:
            chain.free()
            raise
        return chain

    def _logit_bias_sampler(self, logit_bias: dict[int, float]) -> Any:
        biases: Any = (_lc.llama_logit_bias * len(logit_bias))()
        for i, (token, bias) in enumerate(logit_bias.items()):
            biases[i].token = token
            biases[i].bias = bias if math.isfinite(bias) else -math.inf
        return _lc.llama_sampler_init_logit_bias(self.n_vocab, len(logit_bias), biases)

    def _grammar_sampler(self, grammar: str, triggers: Triggers | None = None) -> Any:
        """A grammar sampler of an already checked grammar (any thread, vocab held open);
        lazy, waiting for one of ``triggers``, when given."""
        if triggers is not None:
            patterns, tokens = triggers
            c_patterns = (ctypes.c_char_p * max(len(patterns), 1))(*[p.encode() for p in patterns])
            c_tokens = (_lc.llama_token * max(len(tokens), 1))(*tokens)
            sampler = _lc.llama_sampler_init_grammar_lazy_patterns(
                self._vocab, grammar.encode(), b"root", c_patterns, len(patterns), c_tokens, len(tokens)
            )
        else:
            sampler = _lc.llama_sampler_init_grammar(self._vocab, grammar.encode(), b"root")
        if not sampler:
            raise InvalidRequest("grammar does not parse (llama.cpp logs the reason)")
        return sampler

    def probe_grammar(self, grammar: str, logit_bias: dict[int, float] | None) -> float:
        """Check a grammar against the vocabulary in the caller's thread; its cost in ms.

        Builds the grammar (with the request's logit biases) on its own, applies it once
        to the whole vocabulary as the first token of a request would, and frees it.
        Raises ``InvalidRequest`` when no token is allowed at the start: such a request
        could never produce anything (thread-safe; never touches the context).
        """
        with self._readers.reading():
            chain = _lc.llama_sampler_chain_init(_lc.llama_sampler_chain_default_params())
            try:
                if logit_bias:
                    _lc.llama_sampler_chain_add(chain, self._logit_bias_sampler(logit_bias))
                _lc.llama_sampler_chain_add(chain, self._grammar_sampler(grammar))
                candidates, array = _candidates(self.n_vocab)
                candidates["id"] = np.arange(self.n_vocab, dtype=np.int32)
                # CPU time of this thread, not wall time: a busy machine must not make
                # an ordinary grammar look costly.
                t0 = time.thread_time()
                _lc.llama_sampler_apply(chain, ctypes.byref(array))
                cost_ms = (time.thread_time() - t0) * 1000.0
            finally:
                _lc.llama_sampler_free(chain)
        if not (candidates["logit"] > -np.inf).any():
            raise InvalidRequest("the grammar (with this logit_bias) allows no token at the start")
        return cost_ms

    def sample(self, sampler: Greedy | SamplerChain, index: int, *, ban_eog: bool = False) -> int:
        """Sample (and accept) a token from the logits of batch row ``index``.

        ``ban_eog`` makes every end-of-generation token impossible (``min_tokens``,
        ``ignore_eos``). llama.cpp never sees a choice without an allowed token: its
        grammar sampler aborts the process when asked to accept one. Such a dead end
        raises :class:`DeadEnd` instead, and nothing is accepted.
        """
        if faults.sample is not None:
            faults.sample(index)
        logits = self._logits(index)
        if isinstance(sampler, Greedy):
            return sampler.pick(logits, self.eog_array if ban_eog else None)
        if sampler.greedy and sampler.grammar is not None:
            token = self._greedy_if_grammatical(sampler, logits, ban_eog)
            if token >= 0:
                return token
        # llama_sampler_sample's own steps, split: the filters (bias, penalties) and the
        # grammar mark what is allowed; the dead end is caught before the selection
        # (greedy, or top-k ... dist) picks; then each accepts the token.
        candidates, array = self._fill(logits)
        allowed = candidates["logit"]
        if sampler.filters is not None:
            _lc.llama_sampler_apply(sampler.filters, ctypes.byref(array))
        if sampler.grammar is not None:
            t0 = time.thread_time()  # CPU time: contention must not count against the grammar
            _lc.llama_sampler_apply(sampler.grammar, ctypes.byref(array))
            sampler.grammar_ms = (time.thread_time() - t0) * 1000.0
        eog_allowed = False
        if ban_eog:
            eog_allowed = bool((allowed[self.eog_array] > -np.inf).any())
            allowed[self.eog_array] = -np.inf
        if (sampler.filters is not None or sampler.grammar is not None or ban_eog) and not (
            allowed > -np.inf
        ).any():
            raise DeadEnd(eog_allowed)
        _lc.llama_sampler_apply(sampler.select, ctypes.byref(array))
        selected = int(array.selected)
        if not 0 <= selected < int(array.size) or not candidates["logit"][selected] > -np.inf:
            raise DeadEnd(False)
        token = int(candidates["id"][selected])
        sampler.accept(token)
        return token

    def force(self, sampler: Greedy | SamplerChain, token: int) -> bool:
        """Take ``token`` as sampled without sampling (a spent thinking budget's close):
        accepted by the sampler's grammar and penalties, if its grammar allows it (one
        it does not allow would abort llama.cpp); False, and nothing accepted, if not."""
        if not 0 <= token < self.n_vocab:
            return False
        if isinstance(sampler, SamplerChain) and sampler.grammar is not None:
            one, one_array = self._one
            one["id"][0], one["logit"][0], one["p"][0] = token, 0.0, 0.0
            one_array.size, one_array.selected, one_array.sorted = 1, -1, False
            _lc.llama_sampler_apply(sampler.grammar, ctypes.byref(one_array))
            if not one["logit"][0] > -np.inf:
                return False
        if isinstance(sampler, SamplerChain):
            sampler.accept(token)
        return True

    def _fill(self, logits: npt.NDArray[np.float32]) -> tuple[npt.NDArray[Any], Any]:
        """The shared candidate array, filled with every token's logit in id order."""
        candidates, array = self._candidates
        candidates["id"] = self._token_ids
        candidates["logit"] = logits
        array.size, array.selected, array.sorted = self.n_vocab, -1, False
        return candidates, array

    def _greedy_if_grammatical(
        self, sampler: SamplerChain, logits: npt.NDArray[np.float32], ban_eog: bool
    ) -> int:
        """Greedy with a grammar, llama.cpp's fast way: the argmax of the unconstrained
        logits, accepted if the grammar allows it (one candidate to check instead of the
        whole vocabulary); -1 when it does not, and the full path must run. The result
        is the same token: the argmax of the allowed ones."""
        if sampler.filters is not None:
            candidates, array = self._fill(logits)
            _lc.llama_sampler_apply(sampler.filters, ctypes.byref(array))
            allowed = candidates["logit"]
        else:  # nothing to filter: the logits themselves (a copy only to ban the end)
            allowed = logits.copy() if ban_eog else logits
        if ban_eog:
            allowed[self.eog_array] = -np.inf
        token = int(np.argmax(allowed))
        if not allowed[token] > -np.inf:
            return -1
        one, one_array = self._one
        one["id"][0], one["logit"][0], one["p"][0] = token, allowed[token], 0.0
        one_array.size, one_array.selected, one_array.sorted = 1, -1, False
        t0 = time.thread_time()
        _lc.llama_sampler_apply(sampler.grammar, ctypes.byref(one_array))
        sampler.grammar_ms = (time.thread_time() - t0) * 1000.0
        if not one["logit"][0] > -np.inf:
            return -1
        sampler.accept(token)
        return token

    def top_token(self, index: int) -> tuple[int, float]:
        """Batch row ``index``'s most likely token and its probability (the softmax of
        the raw logits): a draft model's greedy pick and its confidence."""
        logits = self._logits(index)
        token = int(np.argmax(logits))
        top = logits[token]
        if not np.isfinite(top):
            return token, 0.0
        return token, float(1.0 / np.exp(logits - top, dtype=np.float32).sum(dtype=np.float64))

    def logprobs(self, index: int, k: int) -> tuple[npt.NDArray[np.float64], list[tuple[int, float]]]:
        """Log-softmax of row ``index``'s raw logits, and its ``k`` largest entries.

        Call before :meth:`sample`, which may overwrite banned logits.
        """
        logits = self._logits(index).astype(np.float64)
        top = logits.max()
        log_softmax = logits - (top + np.log(np.exp(logits - top).sum()))
        best: list[tuple[int, float]] = []
        if k > 0:
            ids = np.argpartition(log_softmax, -k)[-k:]
            ids = ids[np.argsort(-log_softmax[ids], kind="stable")]
            best = [(int(i), float(log_softmax[i])) for i in ids]
        return log_softmax, best

    def sampled_probs(
        self, sampler: Greedy | SamplerChain, token: int, k: int
    ) -> tuple[float, list[tuple[int, float]]]:
        """The probability ``token`` had in the distribution the last :meth:`sample` with
        ``sampler`` drew it from, and that distribution's ``k`` likeliest tokens with a
        probability above 0 (llama-server's ``post_sampling_probs``).

        The distribution is the one after the whole chain: what llama.cpp's ``dist``
        sampler left in the candidate array (its samplers shrink and reorder the array in
        place, never moving its data). Greedy sampling is one-hot. Call right after
        :meth:`sample` (the actor thread).
        """
        if isinstance(sampler, Greedy) or sampler.greedy:
            return 1.0, [(token, 1.0)] if k > 0 else []
        candidates, array = self._candidates
        kept = candidates[: int(array.size)]
        ids, probs = kept["id"], kept["p"]
        chosen = probs[ids == token]
        order = np.argsort(-probs, kind="stable")[:k]
        top = [(int(ids[i]), float(probs[i])) for i in order if probs[i] > 0.0]
        return (float(chosen[0]) if chosen.size else 0.0), top

    @staticmethod
    def free(sampler: Greedy | SamplerChain) -> None:
        """Free a sampler made by :meth:`make`."""
        if isinstance(sampler, SamplerChain):
            sampler.free()

    @staticmethod
    def json_schema_grammar(schema: object) -> str:
        """A GBNF grammar that admits only JSON documents valid under ``schema``.

        llama-cpp-python's converter lets a string hold raw control characters (its
        ``char`` rule is any character but a quote or backslash, and a pattern's ``.``
        any but a line break), which is not JSON: a model then writes a raw newline
        inside a string and the document does not parse. :func:`json_strings_only`
        narrows both rules to what JSON allows unescaped, as llama.cpp's own converter
        does. Any thread.
        """
        try:
            grammar = str(json_schema_to_gbnf(json.dumps(schema)))
        except Exception as e:
            raise InvalidRequest(f"json_schema cannot be converted to a grammar: {e!r}") from None
        return json_strings_only(grammar)


_JSON_UNESCAPED = r'[^"\\\x7F\x00-\x1F]'
"""GBNF for the characters JSON allows unescaped in a string."""
_LOOSE_RULES = re.compile(r'^(char ::= )\[\^"\\\\\](?= \|)|^(dot ::= )\[\^\\x0A\\x0D\]$', re.M)
"""The converter's ``char`` and ``dot`` rules, up to the end of their loose class."""


def json_strings_only(grammar: str) -> str:
    """``grammar`` (llama-cpp-python's conversion of a JSON Schema) with its ``char``
    and ``dot`` rules admitting only what JSON allows unescaped in a string: no quote,
    backslash or control character. Any thread."""
    return _LOOSE_RULES.sub(lambda m: (m.group(1) or m.group(2)) + _JSON_UNESCAPED, grammar)


class SamplerChain:
    """One request's llama.cpp samplers: the filters (logit bias, penalties), the
    grammar, then the selection (greedy, or top-k, top-p, min-p, temperature and dist)."""

    __slots__ = ("filters", "grammar", "grammar_ms", "greedy", "select")

    def __init__(self) -> None:
        self.filters: Any = None
        self.grammar: Any = None
        self.select: Any = None
        self.greedy = False
        self.grammar_ms = 0.0  # CPU time of the grammar's last check

    @property
    def has_grammar(self) -> bool:
        return self.grammar is not None

    def accept(self, token: int) -> None:
        """Every sampler records the chosen token (penalties count it, the grammar moves)."""
        for sampler in (self.filters, self.grammar, self.select):
            if sampler:
                _lc.llama_sampler_accept(sampler, token)

    def free(self) -> None:
        for sampler in (self.filters, self.grammar, self.select):
            if sampler:
                _lc.llama_sampler_free(sampler)
        self.filters = self.grammar = self.select = None


_CANDIDATE = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
assert _CANDIDATE.itemsize == ctypes.sizeof(_lc.llama_token_data)


def _candidates(n_vocab: int) -> tuple[npt.NDArray[Any], Any]:
    """A zeroed ``llama_token_data`` array in numpy and the ``llama_token_data_array`` over it."""
    candidates = np.zeros(n_vocab, dtype=_CANDIDATE)
    array = _lc.llama_token_data_array(
        data=ctypes.cast(candidates.ctypes.data, _lc.llama_token_data_p),
        size=n_vocab,
        selected=-1,
        sorted=False,
    )
    return candidates, array
