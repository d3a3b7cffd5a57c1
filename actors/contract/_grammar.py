"""Checking GBNF grammars and JSON Schemas before llama.cpp sees them (any thread).

llama.cpp trusts a grammar: its recursive-descent parser overflows the C stack on deep
nesting (a segfault), it prints parse errors straight to stderr, it loops forever on
``x{3,2}`` or on left recursion hidden behind rules that can match nothing, its
left-recursion check and its first step are exponential in some small grammars, and
every alternative open at once costs time for every token of every tenant. So
``check_grammar`` parses GBNF the way the vendored llama.cpp does (same syntax, same
rule expansion, same errors) and bounds what a grammar may cost, and ``check_schema``
bounds what ``llama_cpp.llama_grammar.json_schema_to_gbnf`` would expand before it runs.
All of it is pure Python, runs in the caller's thread and raises ``InvalidRequest``.

What the vendored parser accepts and these functions refuse (everything else they
refuse, llama.cpp refuses too): the limits below; an empty grammar (llama.cpp then
constrains nothing); NUL (llama.cpp would read a shorter grammar); ``x{m,n}`` with
``m > n`` (llama.cpp never returns); ``[]`` and ``[z-a]`` (llama.cpp reads them as
matching nothing or everything); escapes past U+10FFFF; ``<piece>`` tokens when no
``is_single_token`` is given; left recursion through rules that can match the empty
string (llama.cpp misses it and may loop forever).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from actors.contract._errors import EngineError, InvalidRequest

__all__ = [
    "MAX_GRAMMAR_ALTERNATIVES",
    "MAX_GRAMMAR_BYTES",
    "MAX_GRAMMAR_CHAIN",
    "MAX_GRAMMAR_DEPTH",
    "MAX_GRAMMAR_ELEMENTS",
    "MAX_GRAMMAR_INIT_STEPS",
    "MAX_GRAMMAR_REPEAT",
    "MAX_GRAMMAR_RULES",
    "MAX_SCHEMA_ALTERNATIVES",
    "MAX_SCHEMA_BYTES",
    "MAX_SCHEMA_NESTING",
    "MAX_SCHEMA_NODES",
    "MAX_SCHEMA_PATTERN",
    "MAX_SCHEMA_PROPERTIES",
    "MAX_SCHEMA_REPEAT",
    "MAX_SCHEMA_REPEAT_TOTAL",
    "check_grammar",
    "check_schema",
    "grammar_for_schema",
]

MAX_GRAMMAR_BYTES = 65536
"""UTF-8 size of a grammar. llama.cpp's own grammars are under 2 KB, function-calling
schemas convert to a few KB, a 500-value enum to about 13 KB."""
MAX_GRAMMAR_DEPTH = 1024
"""Parentheses open at once. llama.cpp's parser recurses once per level: bisecting
``root ::= ((...("a")...))`` in subprocesses that call ``llama_sampler_init_grammar``
from a ``threading.Thread`` (8 MB default stack; 0.3.36, SmolLM2's vocabulary), 18,671
levels parsed and 18,750 segfaulted (the converter's ``(x (x ...)?)?`` shape alike).
18x below that (``tests/test_grammar.py`` checks 8x still parses), and above the 1,000
levels llama.cpp's own rule limit lets a ``maxLength`` reach."""
MAX_GRAMMAR_CHAIN = 4096
"""Rules that each begin with the next: llama.cpp's left-recursion check recurses along
such a chain; ``r0 ::= r1``, ``r1 ::= r2``... parsed with 65,387 rules and segfaulted
with 65,581 (same measurement). 16x below that."""
MAX_GRAMMAR_REPEAT = 1000
"""``m`` and ``n`` in ``x{m}``, ``x{m,}``, ``x{m,n}``. llama.cpp refuses ``m > 2000`` and
silently drops ``n > 2000`` (the repetition becomes unbounded)."""
MAX_GRAMMAR_RULES = 8192
"""Rules after expansion (each group and each optional repetition is one): a
``maxLength`` of 1000 takes 2,000. Checking 8k rules takes this module about 0.1 s."""
MAX_GRAMMAR_ELEMENTS = 131072
"""llama.cpp grammar elements (8 bytes each) after repetitions are expanded: ``"..."{n}``
copies its string n times, so a short grammar could otherwise ask for gigabytes."""
MAX_GRAMMAR_INIT_STEPS = 1 << 20
"""Elements llama.cpp's left-recursion check may scan. It re-walks shared rules without
memo, so ``r1 ::= r2 | r2``, ``r2 ::= r3 | r3``... doubles per rule (22 rules: 0.1 s)."""
MAX_GRAMMAR_ALTERNATIVES = 512
"""Parse stacks one step may open: the alternatives reachable without consuming a
character (an enum of n values opens n). Each costs about 0.4 ms per token with a
49k-token vocabulary (0.3.36): a 20,000-value enum took 8 s per token for every tenant."""

MAX_SCHEMA_BYTES = 65536
"""Size of a JSON Schema as compact JSON."""
MAX_SCHEMA_NODES = 4096
"""Schemas visited, counting a ``$ref``'s target once per reference (the converter
re-converts a target whose name it escapes, so shared refs can cost exponential time)."""
MAX_SCHEMA_NESTING = 64
"""Levels of JSON nesting the converter recurses through, following ``$ref``s."""
MAX_SCHEMA_ALTERNATIVES = MAX_GRAMMAR_ALTERNATIVES
"""Values in one ``enum``, schemas in one ``anyOf``/``oneOf``."""
MAX_SCHEMA_PROPERTIES = 128
"""Properties of one object (optional ones cost the converter quadratic time)."""
MAX_SCHEMA_REPEAT = 1000
"""``minLength``, ``maxLength``, ``minItems``, ``maxItems`` and regex ``{m,n}`` in a
``pattern``: the converter writes ``maxLength - minLength`` nested groups, which
llama.cpp refuses past 1,000 anyway (``minimum``/``maximum`` and ``*Properties`` are
ignored by the 0.3.36 converter, so they are not bounded here)."""
MAX_SCHEMA_REPEAT_TOTAL = 4 * MAX_SCHEMA_REPEAT
"""The sum of those counts over a schema (the converter's output grows with it)."""
MAX_SCHEMA_PATTERN = 1024
"""Characters in one ``pattern``."""

# llama.cpp's llama_gretype, and its MAX_REPETITION_THRESHOLD.
_END, _ALT, _REF, _CHAR, _CHAR_NOT, _RNG_UPPER, _CHAR_ALT, _CHAR_ANY, _TOKEN, _TOKEN_NOT = range(10)
_TERMINALS = frozenset({_CHAR, _CHAR_NOT, _CHAR_ANY, _TOKEN, _TOKEN_NOT})
_LLAMA_REPEAT_LIMIT = 2000
_SATURATE = 1 << 62

_SPACE = re.compile(r"(?:[ \t]+|#[^\r\n]*)*")
_SPACE_NL = re.compile(r"(?:[ \t\r\n]+|#[^\r\n]*)*")
_NAME = re.compile(r"[A-Za-z0-9-]+")
_DIGITS = re.compile(r"[0-9]+")
_PLAIN = re.compile(r'[^"\\]+')
_HEX = frozenset("0123456789abcdefABCDEF")
_OPERATORS: dict[str, tuple[int, int | None]] = {"*": (0, None), "+": (1, None), "?": (0, 1)}
_SIMPLE_ESCAPES = {"t": 9, "r": 13, "n": 10, "\\": 92, '"': 34, "[": 91, "]": 93, "-": 45}

_Rule = list[tuple[int, int]]


class _Refused(Exception):
    """A reason to refuse; ``llama`` says whether llama.cpp refuses it too (tests use it)."""

    def __init__(self, message: str, *, llama: bool) -> None:
        super().__init__(message)
        self.llama = llama


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


def check_schema(schema: Mapping[str, Any]) -> None:
    """Refuse a JSON Schema whose conversion to GBNF would be huge or never work.

    Runs in the caller's thread, in time proportional to the schema, before the
    converter: it bounds the counts ``json_schema_to_gbnf`` expands into repetition
    or nesting, ``enum`` and ``anyOf`` sizes, properties, ``$ref`` chains and size.

    Raises:
        InvalidRequest: the message names the keyword and where it is.
    """
    try:
        _SchemaCheck(schema).run()
    except _Refused as e:
        raise InvalidRequest(f"json_schema {e}") from None


def grammar_for_schema(schema: Mapping[str, Any], convert: Callable[[Mapping[str, Any]], str]) -> str:
    """``check_schema``, then ``convert(schema)``, then ``check_grammar`` on the result.

    Runs in the caller's thread. ``convert`` is the JSON-Schema-to-GBNF converter, e.g.
    ``LlamaBackend.json_schema_grammar`` (pure Python, safe in any thread).

    Returns:
        The GBNF grammar, checked.

    Raises:
        InvalidRequest: the schema, its conversion or the grammar it became is refused.
    """
    check_schema(schema)
    try:
        grammar = convert(schema)
    except EngineError:
        raise
    except Exception as e:
        raise InvalidRequest(f"json_schema cannot be converted to a grammar: {e!r}") from None
    try:
        _Parser(grammar, None).parse()
    except _Refused as e:
        raise InvalidRequest(f"json_schema converts to a grammar that is refused ({e})") from None
    return grammar


class _Parser:
    """llama_grammar_parser, iterative, with budgets; ``parse()`` raises ``_Refused``."""

    def __init__(self, text: object, is_single_token: Callable[[str], bool] | None) -> None:
        self.s = text if isinstance(text, str) else ""
        self.text = text
        self.n = len(self.s)
        self.is_single_token = is_single_token
        self.pieces: dict[str, bool] = {}
        self.symbols: dict[str, int] = {}
        self.rules: list[_Rule | None] = []
        self.generated: dict[int, str] = {}
        self.n_elements = 0

    # -- helpers ---------------------------------------------------------------------

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

    def number(self, pos: int) -> tuple[int, int]:
        match = _DIGITS.match(self.s, pos)
        if match is None:
            raise self.fail(pos, "expecting an integer")
        digits = match.group().lstrip("0")
        # Past 20 digits no uint64 fits (std::stoull throws) and int() would refuse.
        return (int(digits or "0") if len(digits) <= 20 else 1 << 64), match.end()

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
        _Analysis(self).run()

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


class _Analysis:
    """What llama_grammar_init_impl does after parsing: left recursion, then the stacks.

    Nullable means can match the empty string. llama.cpp only treats a rule as nullable
    when one of its alternatives is literally empty, so it misses left recursion hidden
    behind ``x?``-like rules and then loops; we use true nullability (a superset of its
    edges, hence also an upper bound on the work of its check).
    """

    def __init__(self, parser: _Parser) -> None:
        self.p = parser
        self.rules: list[_Rule] = [r for r in parser.rules if r is not None]
        self.alts: list[list[tuple[int, int]]] = []
        for rule in self.rules:
            cuts = [i for i, (kind, _) in enumerate(rule) if kind <= _ALT]  # _END or _ALT
            self.alts.append(list(zip([0, *(c + 1 for c in cuts[:-1])], cuts, strict=True)))

    def run(self) -> None:
        literal_empty = [any(a == b for a, b in spans) for spans in self.alts]
        nullable = self.nullable(literal_empty)
        graph = self.left_graph(nullable)
        order, cycle = _post_order(graph)
        if cycle is not None:
            _, llama_cycle = _post_order(self.left_graph(literal_empty))
            hidden = "" if llama_cycle is not None else " through rules that can match nothing"
            raise _Refused(
                f"grammar: rule {self.p.name_of(cycle)} is left-recursive{hidden}",
                llama=llama_cycle is not None,
            )
        chain = [0] * len(self.rules)
        steps = [0] * len(self.rules)
        fanout = [0] * len(self.rules)
        for r in order:
            chain[r] = 1 + max((chain[c] for c in graph[r]), default=0)
            steps[r] = min(_SATURATE, len(self.rules[r]) + sum(steps[c] for c in graph[r]))
            fanout[r] = min(_SATURATE, sum(self.first_fanout(r, a, fanout, nullable) for a in self.alts[r]))
        worst = max(range(len(chain)), key=chain.__getitem__)
        if chain[worst] > MAX_GRAMMAR_CHAIN:
            raise _Refused(
                f"grammar: {chain[worst]} rules begin with one another from rule "
                f"{self.p.name_of(worst)}, more than {MAX_GRAMMAR_CHAIN}",
                llama=False,
            )
        if self.init_steps(graph, steps) > MAX_GRAMMAR_INIT_STEPS:
            raise _Refused(
                "grammar: rules share alternatives so often that llama.cpp's left-recursion check "
                f"would take more than {MAX_GRAMMAR_INIT_STEPS} steps",
                llama=False,
            )
        widest, where = self.widest(fanout, nullable)
        if widest > MAX_GRAMMAR_ALTERNATIVES:
            raise _Refused(
                f"grammar: rule {self.p.name_of(where)} opens {widest} alternatives at once, more than "
                f"{MAX_GRAMMAR_ALTERNATIVES} (each one costs time on every token)",
                llama=False,
            )

    def nullable(self, literal_empty: list[bool]) -> list[bool]:
        result = list(literal_empty)
        remaining: list[int] = []
        owner: list[int] = []
        users: list[list[int]] = [[] for _ in self.rules]
        for r, spans in enumerate(self.alts):
            for a, b in spans:
                elements = self.rules[r][a:b]
                if a == b or any(kind != _REF for kind, _ in elements):
                    continue
                for _, ref in elements:
                    users[ref].append(len(owner))
                remaining.append(b - a)
                owner.append(r)
        todo = [r for r, flag in enumerate(result) if flag]
        while todo:
            for alt in users[todo.pop()]:
                remaining[alt] -= 1
                if remaining[alt] == 0 and not result[owner[alt]]:
                    result[owner[alt]] = True
                    todo.append(owner[alt])
        return result

    def left_graph(self, nullable: list[bool]) -> list[list[int]]:
        """Edges r -> c where c can start r (with multiplicity, as llama.cpp recurses)."""
        graph: list[list[int]] = []
        for r, spans in enumerate(self.alts):
            children: list[int] = []
            rule = self.rules[r]
            for a, b in spans:
                for kind, value in rule[a:b]:
                    if kind != _REF:
                        break
                    children.append(value)
                    if not nullable[value]:
                        break
            graph.append(children)
        return graph

    def first_fanout(self, r: int, span: tuple[int, int], fanout: list[int], nullable: list[bool]) -> int:
        total = 0
        for kind, value in self.rules[r][span[0] : span[1]]:
            if kind != _REF:
                return total + 1
            total += fanout[value]
            if not nullable[value]:
                return total
        return total

    def init_steps(self, graph: list[list[int]], steps: list[int]) -> int:
        """llama.cpp runs its check from each rule not yet visited, in id order."""
        visited = [False] * len(graph)
        total = 0
        for r in range(len(graph)):
            if visited[r]:
                continue
            total = min(_SATURATE, total + steps[r])
            todo = [r]
            visited[r] = True
            while todo:
                for c in graph[todo.pop()]:
                    if not visited[c]:
                        visited[c] = True
                        todo.append(c)
        return total

    def widest(self, fanout: list[int], nullable: list[bool]) -> tuple[int, int]:
        """The most stacks one advance can open, from any position, and where."""
        best, where = fanout[0], 0
        for r, spans in enumerate(self.alts):
            rule = self.rules[r]
            best_here = fanout[r]
            for a, b in spans:
                after = 0
                for kind, value in reversed(rule[a:b]):
                    if kind == _REF:
                        after = min(_SATURATE, fanout[value] + (after if nullable[value] else 0))
                    elif kind in _TERMINALS:
                        after = 1
                    best_here = max(best_here, after)
            if best_here > best:
                best, where = best_here, r
        return best, where


def _post_order(graph: list[list[int]]) -> tuple[list[int], int | None]:
    """Children before parents, or the first node found on a cycle."""
    state = [0] * len(graph)  # 0 new, 1 on the path, 2 done
    order: list[int] = []
    for root in range(len(graph)):
        if state[root]:
            continue
        state[root] = 1
        path = [(root, 0)]
        while path:
            node, i = path[-1]
            if i < len(graph[node]):
                path[-1] = (node, i + 1)
                child = graph[node][i]
                if state[child] == 1:
                    return order, child
                if state[child] == 0:
                    state[child] = 1
                    path.append((child, 0))
            else:
                state[node] = 2
                order.append(node)
                path.pop()
    return order, None


class _SchemaCheck:
    """Walks a schema the way ``SchemaConverter.visit`` does, following ``$ref``s."""

    _REPEATS = (("minLength", "maxLength"), ("minItems", "maxItems"))

    def __init__(self, schema: object) -> None:
        self.root = schema
        self.n_nodes = 0
        self.repeat_total = 0

    def run(self) -> None:
        if not isinstance(self.root, Mapping):
            raise _Refused("must be a dict (a JSON Schema)", llama=False)
        todo: list[tuple[object, str, int, frozenset[str]]] = [(self.root, "#", 1, frozenset())]
        while todo:
            node, path, depth, refs = todo.pop()
            if isinstance(node, Mapping):
                todo.extend(self.visit(node, path, depth, refs))
        try:
            size = len(json.dumps(self.root, separators=(",", ":")))
        except (TypeError, ValueError, RecursionError) as e:
            raise _Refused(f"is not JSON: {e}", llama=False) from None
        if size > MAX_SCHEMA_BYTES:
            raise _Refused(f"is {size} bytes as JSON, more than {MAX_SCHEMA_BYTES}", llama=False)

    def visit(
        self, node: Mapping[Any, Any], path: str, depth: int, refs: frozenset[str]
    ) -> list[tuple[object, str, int, frozenset[str]]]:
        self.n_nodes += 1
        if self.n_nodes > MAX_SCHEMA_NODES:
            raise _Refused(f"has more than {MAX_SCHEMA_NODES} schemas (counting each $ref use)", llama=False)
        if depth > MAX_SCHEMA_NESTING:
            raise _Refused(f"nests deeper than {MAX_SCHEMA_NESTING} levels at {path}", llama=False)
        if "$ref" in node:  # the converter looks at nothing else in this node
            ref = node["$ref"]
            target = self.resolve(ref, path)
            return [] if ref in refs else [(target, str(ref), depth + 1, refs | {ref})]
        children: list[tuple[object, str, int, frozenset[str]]] = []
        prefix = path
        for key in ("anyOf", "oneOf", "allOf", "prefixItems", "items"):
            value = node.get(key)
            if isinstance(value, list):
                if len(value) > MAX_SCHEMA_ALTERNATIVES:
                    raise _Refused(
                        f"{key} at {path} has {len(value)} entries, more than {MAX_SCHEMA_ALTERNATIVES}",
                        llama=False,
                    )
                children += [(v, f"{prefix}/{key}/{i}", depth + 2, refs) for i, v in enumerate(value)]
            elif key == "items" and isinstance(value, Mapping):
                children.append((value, f"{prefix}/{key}", depth + 1, refs))
        properties = node.get("properties")
        if isinstance(properties, Mapping):
            if len(properties) > MAX_SCHEMA_PROPERTIES:
                raise _Refused(
                    f"object at {path} has {len(properties)} properties, more than {MAX_SCHEMA_PROPERTIES}",
                    llama=False,
                )
            children += [(v, f"{prefix}/properties/{k}", depth + 2, refs) for k, v in properties.items()]
        extra = node.get("additionalProperties")
        if isinstance(extra, Mapping):
            children.append((extra, f"{prefix}/additionalProperties", depth + 1, refs))
        enum = node.get("enum")
        if enum is not None:
            if not isinstance(enum, list):
                raise _Refused(f"enum at {path} must be a list", llama=False)
            if len(enum) > MAX_SCHEMA_ALTERNATIVES:
                raise _Refused(
                    f"enum at {path} has {len(enum)} values, more than {MAX_SCHEMA_ALTERNATIVES}", llama=False
                )
        for low_key, high_key in self._REPEATS:
            low = self.count(node, low_key, path)
            high = self.count(node, high_key, path)
            if low is not None and high is not None and low > high:
                raise _Refused(f"{low_key} {low} is more than {high_key} {high} at {path}", llama=False)
            self.add_repeats(high if high is not None else (low or 0), path)
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            self.pattern(pattern, path)
        return children

    def resolve(self, ref: object, path: str) -> object:
        if not isinstance(ref, str) or not ref.startswith("#/"):
            raise _Refused(f"$ref at {path} must be a local reference like '#/$defs/name'", llama=False)
        target: object = self.root
        for key in ref.split("#")[-1].split("/")[1:]:  # as the converter splits it
            if not isinstance(target, Mapping) or key not in target:
                raise _Refused(f"$ref {ref!r} at {path} points nowhere", llama=False)
            target = target[key]
        return target

    def count(self, node: Mapping[Any, Any], key: str, path: str) -> int | None:
        value = node.get(key)
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_SCHEMA_REPEAT:
            raise _Refused(
                f"{key} at {path} must be an integer from 0 to {MAX_SCHEMA_REPEAT} "
                f"(the grammar spells out every repetition), not {value!r:.40}",
                llama=False,
            )
        return value

    def add_repeats(self, n: int, path: str) -> None:
        self.repeat_total += n
        if self.repeat_total > MAX_SCHEMA_REPEAT_TOTAL:
            raise _Refused(
                f"asks for more than {MAX_SCHEMA_REPEAT_TOTAL} repetitions in all "
                f"(minLength, maxLength, minItems, maxItems, {{m,n}}), reached at {path}",
                llama=False,
            )

    def pattern(self, pattern: str, path: str) -> None:
        if len(pattern) > MAX_SCHEMA_PATTERN:
            raise _Refused(f"pattern at {path} is longer than {MAX_SCHEMA_PATTERN} characters", llama=False)
        i, depth, n = 0, 0, len(pattern)
        while i < n:
            c = pattern[i]
            if c == "\\":
                i += 2
                continue
            if c == "[":  # the converter copies a class up to the first unescaped ]
                i += 1
                while i < n and pattern[i] != "]":
                    i += 2 if pattern[i] == "\\" else 1
            elif c == "(":
                depth += 1
                if depth > MAX_SCHEMA_NESTING:
                    raise _Refused(
                        f"pattern at {path} nests groups deeper than {MAX_SCHEMA_NESTING}", llama=False
                    )
            elif c == ")":
                depth = max(0, depth - 1)
            elif c == "{":
                close = pattern.find("}", i)
                if close < 0:
                    return  # the converter refuses it
                self.quantifier(pattern[i : close + 1], path)
                i = close
            i += 1

    def quantifier(self, text: str, path: str) -> None:
        parts = [part.strip() for part in text[1:-1].split(",")]
        try:
            # As the converter reads it: {m} is {m,m}, an empty side is 0 or unbounded.
            numbers = [int(part) if part else None for part in parts]
        except ValueError:
            return  # the converter refuses it
        if len(numbers) > 2:
            return
        low, high = (numbers[0], numbers[0]) if len(numbers) == 1 else (numbers[0] or 0, numbers[1])
        for value in (low, high):
            if value is not None and not 0 <= value <= MAX_SCHEMA_REPEAT:
                raise _Refused(
                    f"pattern at {path}: {text} must count from 0 to {MAX_SCHEMA_REPEAT}", llama=False
                )
        if low is not None and high is not None and low > high:
            raise _Refused(f"pattern at {path}: {text} has its maximum below its minimum", llama=False)
        self.add_repeats(high if high is not None else (low or 0), path)
