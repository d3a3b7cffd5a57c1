"""llama.cpp's grammar elements as the GBNF and JSON Schema checks hold them (any thread).

A parsed rule is a list of ``(kind, value)`` pairs, as ``llama_grammar_element``s are
in the vendored llama.cpp (``src/llama-grammar.h``); every check refuses with
``_Refused``, which the public functions turn into ``InvalidRequest``.
"""

from __future__ import annotations

__all__: list[str] = []

# llama.cpp's llama_gretype.
_END, _ALT, _REF, _CHAR, _CHAR_NOT, _RNG_UPPER, _CHAR_ALT, _CHAR_ANY, _TOKEN, _TOKEN_NOT = range(10)
_TERMINALS = frozenset({_CHAR, _CHAR_NOT, _CHAR_ANY, _TOKEN, _TOKEN_NOT})
_SATURATE = 1 << 62

_Rule = list[tuple[int, int]]


class _Refused(Exception):
    """A reason to refuse; ``llama`` says whether llama.cpp refuses it too (tests use it)."""

    def __init__(self, message: str, *, llama: bool) -> None:
        super().__init__(message)
        self.llama = llama
