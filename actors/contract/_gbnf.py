"""Checking a GBNF grammar before llama.cpp sees it (any thread).

llama.cpp trusts a grammar: its recursive-descent parser overflows the C stack on deep
nesting (a segfault), it prints parse errors straight to stderr, it loops forever on
``x{3,2}`` or on left recursion hidden behind rules that can match nothing, its
left-recursion check and its first step are exponential in some small grammars, and
every alternative open at once costs time for every token of every tenant. So
``check_grammar`` parses GBNF the way the vendored llama.cpp does (same syntax, same
rule expansion, same errors), with the size limits below, then hands the rules to
``actors.contract._gbnf_cost`` to bound what they may cost. All of it is pure Python,
runs in the caller's thread and raises ``InvalidRequest``.

What the vendored parser accepts and this module refuses (everything else it refuses,
llama.cpp refuses too): the limits here and in ``_gbnf_cost``; an empty grammar
(llama.cpp then constrains nothing); NUL (llama.cpp would read a shorter grammar);
``x{m,n}`` with ``m > n`` (llama.cpp never returns); ``[]`` and ``[z-a]`` (llama.cpp
reads them as matching nothing or everything); escapes past U+10FFFF; ``<piece>``
tokens when no ``is_single_token`` is given; left recursion through rules that can
match the empty string (llama.cpp misses it and may loop forever).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from actors.contract._errors import InvalidRequest
from actors.contract._gbnf_cost import _Analysis
from actors.contract._gbnf_elements import (
    _ALT,
    _CHAR,
    _CHAR_ALT,
    _CHAR_ANY,
    _CHAR_NOT,
    _END,
    _REF,
    _RNG_UPPER,
    _TOKEN,
    _TOKEN_NOT,
    _Refused,
    _Rule,
)
from actors.contract._gbnf_limits import (
    _LLAMA_REPEAT_LIMIT,
    MAX_GRAMMAR_BYTES,
    MAX_GRAMMAR_DEPTH,
    MAX_GRAMMAR_ELEMENTS,
    MAX_GRAMMAR_REPEAT,
    MAX_GRAMMAR_RULES,
)
from actors.contract._gbnf_scan import _Scanner

# The limits this checker enforces are part of its interface (defined in _gbnf_limits).
__all__ = [
    "MAX_GRAMMAR_BYTES",
    "MAX_GRAMMAR_DEPTH",
    "MAX_GRAMMAR_ELEMENTS",
    "MAX_GRAMMAR_REPEAT",
    "MAX_GRAMMAR_RULES",
    "check_grammar",
]

_NAME = re.compile(r"[A-Za-z0-9-]+")
_PLAIN = re.compile(r'[^"\\]+')
_OPERATORS: dict[str, tuple[int, int | None]] = {"*": (0, None), "+": (1, None), "?": (0, 1)}


class _Frame:
    """One ``parse_alternates`` call in progress: a rule body or a parenthesized group."""

    __slots__ = ("last_sym_start", "n_prev_rules", "n_rules_before", "nested", "open_pos", "rule", "rule_id")

    def __init__(self, rule_id: int, nested: bool, n_rules_before: int, open_pos: int) -> None:
        self.rule_id = rule_id
        self.rule: _Rule = []
        self.nested = nested
        self.n_rules_before = n_rules_before
        self.open_pos = open_pos
        self.last_sym_start = 0
        self.n_prev_rules = 1


def check_grammar(text: str, *, is_single_token: Callable[[str], bool] | None = None) -> None:
    """Refuse a GBNF grammar that llama.cpp would not parse, or that would cost too much.

    Runs in the caller's thread (any thread; no model needed). Mirrors the parser of the
    vendored llama.cpp (``src/llama-grammar.cpp``): rules ``name ::= alternatives``
    (names of letters, digits and ``-``), string literals and character classes with
    the escapes ``\\xHH \\uHHHH \\UHHHHHHHH \\t \\n \\r \\\\ \\" \\[ \\] \\-``, negated
    classes and ranges, ``.``, groups, ``* + ? {m} {m,} {m,n}``, ``#`` comments, tokens
    ``<[id]>``, ``!<[id]>``, ``<piece>``, ``!<piece>``, and a ``root`` rule.

    Args:
        text: the grammar.
        is_single_token: tells whether a token piece such as ``"<|im_end|>"`` (with its
            angle brackets) tokenizes to exactly one token (``parse_special=True``,
            ``add_special=False``), as llama.cpp requires; called once per distinct
            piece, and what it raises propagates. Without it, ``<piece>`` tokens are
            refused; ``<[id]>`` tokens need no vocabulary.

    Raises:
        InvalidRequest: the message names the problem and its line and column.
    """
    try:
        _Parser(text, is_single_token).parse()
    except _Refused as e:
        raise InvalidRequest(str(e)) from None


class _Parser(_Scanner):
    """llama_grammar_parser, iterative, with budgets; ``parse()`` raises ``_Refused``."""

    def __init__(self, text: object, is_single_token: Callable[[str], bool] | None) -> None:
        super().__init__(text, is_single_token)
        self.symbols: dict[str, int] = {}
        self.rules: list[_Rule | None] = []
        self.generated: dict[int, str] = {}
        self.n_elements = 0

    # -- helpers ---------------------------------------------------------------------

    def name_of(self, rule_id: int) -> str:
        base = self.generated.get(rule_id)
        if base is not None:
            return f"'{base}_{rule_id}' (a group or repetition in rule '{base}')"
        for name, i in self.symbols.items():
            if i == rule_id:
                return f"'{name}'"
        return f"#{rule_id}"

    def count(self, n: int, pos: int) -> None:
        self.n_elements += n
        if self.n_elements > MAX_GRAMMAR_ELEMENTS:
            raise self.fail(pos, f"expands to more than {MAX_GRAMMAR_ELEMENTS} elements", llama=False)

    def symbol(self, name: str, pos: int) -> int:
        rule_id = self.symbols.setdefault(name, len(self.symbols))
        if len(self.symbols) > MAX_GRAMMAR_RULES:
            raise self.fail(pos, f"has more than {MAX_GRAMMAR_RULES} rules", llama=False)
        return rule_id

    def generate(self, base: str, pos: int) -> int:
        # "<rule>_<id>", as llama.cpp names it: "_" cannot occur in a name in the text.
        rule_id = len(self.symbols)
        self.symbols[f"{base}_{rule_id}"] = rule_id
        self.generated[rule_id] = base
        if len(self.symbols) > MAX_GRAMMAR_RULES:
            raise self.fail(pos, f"has more than {MAX_GRAMMAR_RULES} rules", llama=False)
        return rule_id

    def add_rule(self, rule_id: int, rule: _Rule) -> None:
        if len(self.rules) <= rule_id:
            self.rules.extend([None] * (rule_id + 1 - len(self.rules)))
        self.rules[rule_id] = rule

    # -- llama_grammar_parser --------------------------------------------------------

    def parse(self) -> None:
        if not isinstance(self.text, str):
            raise _Refused("grammar must be a string (GBNF)", llama=False)
        if self.n == 0:
            raise _Refused("grammar is empty (llama.cpp would then constrain nothing)", llama=False)
        if self.n > MAX_GRAMMAR_BYTES:
            raise _Refused(f"grammar is longer than {MAX_GRAMMAR_BYTES} bytes", llama=False)
        nul = self.s.find("\x00")
        if nul >= 0:
            raise self.fail(nul, "NUL character (llama.cpp would stop reading there)", llama=False)
        try:
            size = len(self.s.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise self.fail(e.start, "lone surrogate, not valid Unicode", llama=False) from None
        if size > MAX_GRAMMAR_BYTES:
            raise _Refused(f"grammar is {size} bytes of UTF-8, more than {MAX_GRAMMAR_BYTES}", llama=False)
        pos = self.space(0, True)
        while pos < self.n:
            pos = self.parse_rule(pos)
        self.validate()
        _Analysis(self.rules, self.name_of).run()

    def parse_rule(self, pos: int) -> int:
        match = _NAME.match(self.s, pos)
        if match is None:
            raise self.fail(pos, "expecting a rule name")
        name = match.group()
        rule_id = self.symbol(name, pos)
        pos = self.space(match.end(), False)
        if not self.s.startswith("::=", pos):
            raise self.fail(pos, "expecting ::=")
        pos = self.parse_alternates(self.space(pos + 3, True), name, rule_id)
        if self.s.startswith("\r\n", pos):
            pos += 2
        elif pos < self.n and self.s[pos] in "\r\n":
            pos += 1
        elif pos < self.n:
            raise self.fail(pos, "expecting newline or end")
        return self.space(pos, True)

    def parse_alternates(self, pos: int, rule_name: str, rule_id: int) -> int:
        # llama.cpp recurses parse_alternates -> parse_sequence per group; an explicit
        # stack of frames keeps Python's recursion limit out of the way.
        frames = [_Frame(rule_id, False, 0, pos)]
        while True:
            frame = frames[-1]
            pos = self.parse_sequence(pos, rule_name, frame, frames)
            if frames[-1] is not frame:
                continue  # a group opened
            if pos < self.n and self.s[pos] == "|":
                frame.rule.append((_ALT, 0))
                self.count(1, pos)
                pos = self.space(pos + 1, True)
                frame.last_sym_start, frame.n_prev_rules = len(frame.rule), 1
                continue
            frame.rule.append((_END, 0))
            self.count(1, pos)
            self.add_rule(frame.rule_id, frame.rule)
            frames.pop()
            if not frames:
                return pos
            parent = frames[-1]
            parent.n_prev_rules = max(1, len(self.symbols) - frame.n_rules_before)
            parent.last_sym_start = len(parent.rule)
            parent.rule.append((_REF, frame.rule_id))
            self.count(1, pos)
            if pos >= self.n or self.s[pos] != ")":
                raise self.fail(pos, f"expecting ')' to close the '(' at {self.where(frame.open_pos)}")
            pos = self.space(pos + 1, parent.nested)

    def parse_sequence(self, pos: int, rule_name: str, f: _Frame, frames: list[_Frame]) -> int:
        s, n, rule = self.s, self.n, f.rule
        while pos < n:
            c = s[pos]
            if c == '"':
                start = pos
                pos += 1
                f.last_sym_start, f.n_prev_rules = len(rule), 1
                while True:
                    if pos >= n:
                        raise self.fail(start, "unterminated string literal")
                    if s[pos] == '"':
                        break
                    plain = _PLAIN.match(s, pos)
                    if plain is not None:
                        rule.extend([(_CHAR, ord(ch)) for ch in plain.group()])
                        pos = plain.end()
                        continue
                    value, pos = self.parse_char(pos)
                    rule.append((_CHAR, value))
                self.count(len(rule) - f.last_sym_start, start)
                pos = self.space(pos + 1, f.nested)
            elif c == "[":
                start = pos
                pos += 1
                start_type = _CHAR
                if pos < n and s[pos] == "^":
                    pos += 1
                    start_type = _CHAR_NOT
                f.last_sym_start, f.n_prev_rules = len(rule), 1
                while True:
                    if pos >= n:
                        raise self.fail(start, "unterminated character class")
                    if s[pos] == "]":
                        break
                    value, pos = self.parse_char(pos)
                    rule.append((_CHAR_ALT if f.last_sym_start < len(rule) else start_type, value))
                    if pos < n and s[pos] == "-" and (pos + 1 >= n or s[pos + 1] != "]"):
                        if pos + 1 >= n:
                            raise self.fail(start, "unterminated character class")
                        upper, end = self.parse_char(pos + 1)
                        if upper < value:
                            raise self.fail(pos - 1, "character range runs backwards", llama=False)
                        rule.append((_RNG_UPPER, upper))
                        pos = end
                if len(rule) == f.last_sym_start:
                    raise self.fail(
                        start, "empty character class (llama.cpp would match nothing there)", llama=False
                    )
                self.count(len(rule) - f.last_sym_start, start)
                pos = self.space(pos + 1, f.nested)
            elif c in "<!":
                kind = _TOKEN_NOT if c == "!" else _TOKEN
                value, end = self.parse_token(pos + 1 if c == "!" else pos)
                f.last_sym_start, f.n_prev_rules = len(rule), 1
                rule.append((kind, value))
                self.count(1, pos)
                pos = self.space(end, f.nested)
            elif c == "(":
                if len(frames) > MAX_GRAMMAR_DEPTH:
                    raise self.fail(pos, f"parentheses nest deeper than {MAX_GRAMMAR_DEPTH}", llama=False)
                open_pos = pos
                pos = self.space(pos + 1, True)
                n_rules_before = len(self.symbols)
                frames.append(_Frame(self.generate(rule_name, open_pos), True, n_rules_before, open_pos))
                return pos
            elif c == ".":
                f.last_sym_start, f.n_prev_rules = len(rule), 1
                rule.append((_CHAR_ANY, 0))
                self.count(1, pos)
                pos = self.space(pos + 1, f.nested)
            elif c in "*+?":
                self.repeat(f, rule_name, *_OPERATORS[c], pos)
                pos = self.space(pos + 1, f.nested)
            elif c == "{":
                brace = pos
                low, pos = self.number(self.space(pos + 1, f.nested))
                pos = self.space(pos, f.nested)
                high: int | None = low
                if pos < n and s[pos] == ",":
                    pos = self.space(pos + 1, f.nested)
                    high = None
                    if pos < n and s[pos].isascii() and s[pos].isdigit():
                        high, pos = self.number(pos)
                        pos = self.space(pos, f.nested)
                elif pos >= n or s[pos] != "}":
                    raise self.fail(pos, "expecting ',' or '}'")
                if pos >= n or s[pos] != "}":
                    raise self.fail(pos, "expecting '}'")
                pos = self.space(pos + 1, f.nested)
                if low > _LLAMA_REPEAT_LIMIT:
                    raise self.fail(brace, f"repetition count {low} is more than {_LLAMA_REPEAT_LIMIT}")
                if low > MAX_GRAMMAR_REPEAT or (high is not None and high > MAX_GRAMMAR_REPEAT):
                    raise self.fail(brace, f"repetition count is more than {MAX_GRAMMAR_REPEAT}", llama=False)
                if high is not None and high < low:
                    raise self.fail(
                        brace, f"repetition {{{low},{high}}} has its maximum below its minimum", llama=False
                    )
                self.repeat(f, rule_name, low, high, brace)
            elif c.isascii() and (c.isalnum() or c == "-"):
                match = _NAME.match(s, pos)
                assert match is not None
                ref_id = self.symbol(match.group(), pos)
                f.last_sym_start, f.n_prev_rules = len(rule), 1
                rule.append((_REF, ref_id))
                self.count(1, pos)
                pos = self.space(match.end(), f.nested)
            else:
                break
        return pos

    def repeat(self, f: _Frame, rule_name: str, low: int, high: int | None, pos: int) -> None:
        """llama.cpp's handle_repetitions: S{m,n} -> S (m times) S'(n-m), S'(x) ::= S S'(x-1) |"""
        rule = f.rule
        if f.last_sym_start == len(rule):
            raise self.fail(pos, "nothing to repeat")
        prev = rule[f.last_sym_start :]
        total = high if high is not None and high > 0 else (low if low > 0 else 1)
        if f.n_prev_rules * total > _LLAMA_REPEAT_LIMIT:
            raise self.fail(pos, f"repeats {f.n_prev_rules} rules {total} times, past llama.cpp's limit")
        n_opt = 1 if high is None else high - low
        self.count(len(prev) * max(low - 1, 0) + n_opt * (len(prev) + 3) + 1, pos)
        if len(self.symbols) + n_opt > MAX_GRAMMAR_RULES:
            raise self.fail(pos, f"has more than {MAX_GRAMMAR_RULES} rules", llama=False)
        if low == 0:
            del rule[f.last_sym_start :]
        else:
            rule.extend(prev * (low - 1))
        last = 0
        for i in range(n_opt):
            rec = list(prev)
            rec_id = self.generate(rule_name, pos)
            if i > 0 or high is None:
                rec.append((_REF, rec_id if high is None else last))
            rec += [(_ALT, 0), (_END, 0)]
            self.add_rule(rec_id, rec)
            last = rec_id
        if n_opt > 0:
            rule.append((_REF, last))
        f.n_prev_rules *= total

    def validate(self) -> None:
        if not self.rules:
            raise _Refused("grammar defines no rules", llama=True)
        n_rules = len(self.rules)
        for rule_id, rule in enumerate(self.rules):
            if rule is None:
                raise _Refused(f"grammar: rule {self.name_of(rule_id)} is used but never defined", llama=True)
            for kind, value in rule:
                if kind == _REF and (value >= n_rules or self.rules[value] is None):
                    raise _Refused(
                        f"grammar: rule {self.name_of(value)} is used in {self.name_of(rule_id)} "
                        "but never defined",
                        llama=True,
                    )
        if "root" not in self.symbols:
            raise _Refused("grammar has no 'root' rule", llama=True)
        root = self.symbols["root"]
        if root >= n_rules or self.rules[root] is None:
            # Named only where it is repeated zero times (``x ::= root{0}``): llama.cpp
            # finds the symbol, reads a rule that does not exist and dies (SIGSEGV).
            raise _Refused("grammar names 'root' but never defines it", llama=False)
