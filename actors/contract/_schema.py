"""Checking a JSON Schema before llama.cpp's converter sees it (any thread).

``check_schema`` bounds what ``llama_cpp.llama_grammar.json_schema_to_gbnf`` would
expand (repetition and nesting counts, ``enum`` and ``anyOf`` sizes, properties,
``$ref`` chains, size) before it runs, and ``grammar_for_schema`` converts a checked
schema and checks the grammar it becomes. All of it is pure Python, runs in the
caller's thread and raises ``InvalidRequest``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from actors.contract._errors import EngineError, InvalidRequest
from actors.contract._gbnf import _Parser
from actors.contract._gbnf_cost import MAX_GRAMMAR_ALTERNATIVES
from actors.contract._gbnf_elements import _Refused

__all__ = [
    "MAX_SCHEMA_ALTERNATIVES",
    "MAX_SCHEMA_BYTES",
    "MAX_SCHEMA_NESTING",
    "MAX_SCHEMA_NODES",
    "MAX_SCHEMA_PATTERN",
    "MAX_SCHEMA_PROPERTIES",
    "MAX_SCHEMA_REPEAT",
    "MAX_SCHEMA_REPEAT_TOTAL",
    "check_schema",
    "grammar_for_schema",
]

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
    ``LlamaSampling.json_schema_grammar`` (pure Python, safe in any thread).

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
