"""What a parsed GBNF grammar would cost llama.cpp, bounded before it runs (any thread).

After parsing, llama.cpp checks every rule for left recursion and builds the parse
stacks of the first step; both walk the rules without memo, and every alternative open
at once costs time on every token. ``_Analysis`` computes what those walks would do
(nullable rules, left recursion, chains of rules, init steps, the widest step) and
refuses, as ``_Refused``, a grammar over the limits below.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from actors.contract._gbnf_elements import _ALT, _REF, _SATURATE, _TERMINALS, _Refused, _Rule

__all__ = [
    "MAX_GRAMMAR_ALTERNATIVES",
    "MAX_GRAMMAR_CHAIN",
    "MAX_GRAMMAR_INIT_STEPS",
]

MAX_GRAMMAR_CHAIN = 4096
"""Rules that each begin with the next: llama.cpp's left-recursion check recurses along
such a chain; ``r0 ::= r1``, ``r1 ::= r2``... parsed with 65,387 rules and segfaulted
with 65,581 (same measurement). 16x below that."""
MAX_GRAMMAR_INIT_STEPS = 1 << 20
"""Elements llama.cpp's left-recursion check may scan. It re-walks shared rules without
memo, so ``r1 ::= r2 | r2``, ``r2 ::= r3 | r3``... doubles per rule (22 rules: 0.1 s)."""
MAX_GRAMMAR_ALTERNATIVES = 512
"""Parse stacks one step may open: the alternatives reachable without consuming a
character (an enum of n values opens n). Each costs about 0.4 ms per token with a
49k-token vocabulary (0.3.36): a 20,000-value enum took 8 s per token for every tenant."""


class _Analysis:
    """What llama_grammar_init_impl does after parsing: left recursion, then the stacks.

    Nullable means can match the empty string. llama.cpp only treats a rule as nullable
    when one of its alternatives is literally empty, so it misses left recursion hidden
    behind ``x?``-like rules and then loops; we use true nullability (a superset of its
    edges, hence also an upper bound on the work of its check).
    """

    def __init__(self, rules: Sequence[_Rule | None], name_of: Callable[[int], str]) -> None:
        self.name_of = name_of  # a rule's name, by its id
        self.rules: list[_Rule] = [r for r in rules if r is not None]
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
                f"grammar: rule {self.name_of(cycle)} is left-recursive{hidden}",
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
                f"{self.name_of(worst)}, more than {MAX_GRAMMAR_CHAIN}",
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
                f"grammar: rule {self.name_of(where)} opens {widest} alternatives at once, more than "
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
