"""The size limits of a GBNF grammar, each with the llama.cpp measurement behind it
(checked by :func:`actors.contract._gbnf.check_grammar`)."""

from __future__ import annotations

__all__ = [
    "MAX_GRAMMAR_BYTES",
    "MAX_GRAMMAR_DEPTH",
    "MAX_GRAMMAR_ELEMENTS",
    "MAX_GRAMMAR_REPEAT",
    "MAX_GRAMMAR_RULES",
]

MAX_GRAMMAR_BYTES = 65536
"""UTF-8 size of a grammar. llama.cpp's own grammars are under 2 KB, function-calling
schemas convert to a few KB, a 500-value enum to about 13 KB."""
MAX_GRAMMAR_DEPTH = 1024
"""Parentheses open at once. llama.cpp's parser recurses once per level: bisecting
``root ::= ((...("a")...))`` in subprocesses that call ``llama_sampler_init_grammar``
from a ``threading.Thread`` (8 MB default stack; 0.3.36, SmolLM2's vocabulary), 18,671
levels parsed and 18,750 segfaulted (the converter's ``(x (x ...)?)?`` shape alike).
18x below that (``tests/contract/test_grammar.py`` checks 8x still parses), and above the 1,000
levels llama.cpp's own rule limit lets a ``maxLength`` reach."""
MAX_GRAMMAR_REPEAT = 1000
"""``m`` and ``n`` in ``x{m}``, ``x{m,}``, ``x{m,n}``. llama.cpp refuses ``m > 2000`` and
silently drops ``n > 2000`` (the repetition becomes unbounded)."""
MAX_GRAMMAR_RULES = 8192
"""Rules after expansion (each group and each optional repetition is one): a
``maxLength`` of 1000 takes 2,000. Checking 8k rules takes this module about 0.1 s."""
MAX_GRAMMAR_ELEMENTS = 131072
"""llama.cpp grammar elements (8 bytes each) after repetitions are expanded: ``"..."{n}``
copies its string n times, so a short grammar could otherwise ask for gigabytes."""

# llama.cpp's MAX_REPETITION_THRESHOLD.
_LLAMA_REPEAT_LIMIT = 2000
