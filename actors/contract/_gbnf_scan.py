"""The characters of a GBNF text as llama.cpp reads them (any thread): whitespace and
``#`` comments, escapes, numbers, ``<token>``s, and the line and column of an error.

``_Parser`` (``actors.contract._gbnf``) builds rules on top of it.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from actors.contract._gbnf_elements import _Refused

__all__: list[str] = []

_SPACE = re.compile(r"(?:[ \t]+|#[^\r\n]*)*")
_SPACE_NL = re.compile(r"(?:[ \t\r\n]+|#[^\r\n]*)*")
_DIGITS = re.compile(r"[0-9]+")
_HEX = frozenset("0123456789abcdefABCDEF")
_SIMPLE_ESCAPES = {"t": 9, "r": 13, "n": 10, "\\": 92, '"': 34, "[": 91, "]": 93, "-": 45}


class _Scanner:
    """The text of a grammar and how to read its smallest pieces; raises ``_Refused``."""

    def __init__(self, text: object, is_single_token: Callable[[str], bool] | None) -> None:
        self.s = text if isinstance(text, str) else ""
        self.text = text
        self.n = len(self.s)
        self.is_single_token = is_single_token
        self.pieces: dict[str, bool] = {}

    def where(self, pos: int) -> str:
        line = self.s.count("\n", 0, pos) + 1
        column = pos - (self.s.rfind("\n", 0, pos) + 1) + 1
        return f"line {line}, column {column}"

    def fail(self, pos: int, message: str, *, llama: bool = True) -> _Refused:
        snippet = self.s[pos : pos + 24]
        near = f" near {snippet!r}" if snippet else " at the end"
        return _Refused(f"grammar: {message} at {self.where(pos)}{near}", llama=llama)

    def space(self, pos: int, newline_ok: bool) -> int:
        match = (_SPACE_NL if newline_ok else _SPACE).match(self.s, pos)
        assert match is not None  # both patterns match the empty string
        return match.end()

    def number(self, pos: int) -> tuple[int, int]:
        match = _DIGITS.match(self.s, pos)
        if match is None:
            raise self.fail(pos, "expecting an integer")
        digits = match.group().lstrip("0")
        # Past 20 digits no uint64 fits (std::stoull throws) and int() would refuse.
        return (int(digits or "0") if len(digits) <= 20 else 1 << 64), match.end()

    def parse_char(self, pos: int) -> tuple[int, int]:
        s = self.s
        if s[pos] != "\\":
            return ord(s[pos]), pos + 1
        e = s[pos + 1] if pos + 1 < self.n else ""
        if e in ("x", "u", "U"):
            size = {"x": 2, "u": 4, "U": 8}[e]
            digits = s[pos + 2 : pos + 2 + size]
            if len(digits) != size or not _HEX.issuperset(digits):
                raise self.fail(pos, f"escape \\{e} needs {size} hex digits")
            value = int(digits, 16)
            if value > 0x10FFFF:
                raise self.fail(pos, f"escape {s[pos : pos + 2 + size]} is past U+10FFFF", llama=False)
            return value, pos + 2 + size
        if e and e in _SIMPLE_ESCAPES:
            return _SIMPLE_ESCAPES[e], pos + 2
        raise self.fail(pos, "unknown escape")

    def parse_token(self, pos: int) -> tuple[int, int]:
        s, n = self.s, self.n
        if pos >= n or s[pos] != "<":
            raise self.fail(pos, "expecting '<' (a token) after '!'")
        if pos + 1 < n and s[pos + 1] == "[":
            token, end = self.number(pos + 2)
            if token > 0xFFFFFFFF:
                raise self.fail(pos, "token id is too big")
            if not s.startswith("]>", end):
                raise self.fail(end, "expecting ']>'")
            return token, end + 2
        end = s.find(">", pos + 1)
        if end < 0:
            raise self.fail(pos, "expecting '>'")
        piece = s[pos : end + 1]
        if self.is_single_token is None:
            raise self.fail(pos, f"token {piece} needs the model's vocabulary: write <[id]>", llama=False)
        single = self.pieces.get(piece)
        if single is None:
            single = self.pieces[piece] = bool(self.is_single_token(piece))
        if not single:
            raise self.fail(pos, f"{piece} is not exactly one token of the model")
        return 0, end + 1
