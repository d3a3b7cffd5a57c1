"""Sampling that needs no llama.cpp (actor thread): greedy picks in numpy, and
``DeadEnd``, what every sampler raises when no token may be sampled.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["GREEDY_TEMP", "DeadEnd", "Greedy"]

GREEDY_TEMP = 1e-6
"""Temperatures below this sample greedily (logit / temp would overflow in llama.cpp)."""


class DeadEnd(Exception):
    """No token may be sampled: every one is banned by the grammar, biases or ``min_tokens``.

    ``eog_allowed``: an end-of-generation token was allowed and only the request's
    ``min_tokens``/``ignore_eos`` banned it (the grammar is complete).
    """

    def __init__(self, eog_allowed: bool) -> None:
        super().__init__(eog_allowed)
        self.eog_allowed = eog_allowed


class Greedy:
    """Greedy sampling with optional logit biases, in numpy (no llama.cpp state)."""

    __slots__ = ("_bias_ids", "_bias_values")

    has_grammar = False
    grammar_ms = 0.0  # no grammar: it never costs

    def __init__(self, logit_bias: dict[int, float] | None) -> None:
        self._bias_ids = np.fromiter(logit_bias or (), dtype=np.intp)
        self._bias_values = np.fromiter((logit_bias or {}).values(), dtype=np.float32)

    def pick(self, logits: npt.NDArray[np.float32], ban: npt.NDArray[np.intp] | None = None) -> int:
        """The first most likely token; ``ban`` lists token ids that may not be picked."""
        eog_allowed = False
        if self._bias_ids.size or ban is not None:
            logits = logits.copy()
            logits[self._bias_ids] += self._bias_values
            if ban is not None:
                eog_allowed = bool((logits[ban] > -np.inf).any())
                logits[ban] = -np.inf
        token = int(np.argmax(logits))
        if not logits[token] > -np.inf:
            raise DeadEnd(eog_allowed)
        return token
