"""A prefix index: which cached token sequence shares most of a prompt, by cache scope.

Runs in the engine thread and is not thread-safe. A *holder* is any hashable key the
caller picks (a slot, a RAM cache entry) holding one token sequence in one scope. KV of
another scope is never reused, so each scope has its own root and they share nothing.

The index is a trie whose edges are blocks of ``block`` tokens. A node is found by
``(parent id, block tuple)`` in one dict: a match is tuple equality, never a hash that
may collide. Each node lists the holders of its whole prefix, so a common prefix is
stored once, and a node nobody holds is freed at once. A holder's trailing partial
block lives in its record; lengths are exact because the block or tail where a holder
leaves the prompt is compared token by token. A node groups its children and the
holders ending there by their next token, so a lookup compares only those sharing it.

Costs, ``B`` the block:

- ``put``: O(len(tokens)); ``extend``: O(len(tokens)) amortized, a completed block
  being one tuple and one dict lookup (earlier blocks are never hashed again).
- ``truncate``, ``remove``: O(B + blocks dropped).
- ``matches``: O(len(prompt)) to walk, then O(B) per child or ending holder leaving the
  prompt; each is in the answer, except at the block where ``min_length`` falls.
- ``best``: the walk, then O(B) per candidate at the deepest level that has one, plus
  each excluded holder skipped.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Collection, Hashable, Iterable, Iterator, Sequence, Set
from dataclasses import dataclass, field
from typing import TypeVar

__all__ = ["CacheScope", "PrefixIndex", "PrefixMatch"]

CacheScope = tuple[str | None, tuple[tuple[int, float], ...]]
"""Whose KV a cache holds: the request's ``cache_scope`` and the LoRA adapter set
(``strategies.AdapterSet``) that computed it. KV is reused only within one scope: KV
another adapter set computed is another model's."""

_G = TypeVar("_G")
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """A holder and how many tokens of the prompt it holds (exact)."""

    key: Hashable
    length: int


@dataclass(slots=True, eq=False)
class _Node:
    id: int
    parent: _Node | None
    block: tuple[int, ...]
    # Holders of the whole prefix up to here (an ordered set), children and holders
    # ending here (by their tail) under their first token; an empty tail is None.
    holders: dict[Hashable, None] = field(default_factory=dict)
    kids: dict[int, dict[_Node, None]] = field(default_factory=dict)
    ends: dict[int | None, dict[Hashable, None]] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class _Holder:
    scope: CacheScope
    path: list[_Node]  # path[k] is the node at depth k; path[0] is the scope's root
    tail: list[int]  # the tokens after path[-1], fewer than a block
    seq: int  # when it was put, for the order of ties


def _add(groups: dict[_G, dict[_T, None]], group: _G, item: _T) -> None:
    groups.setdefault(group, {})[item] = None


def _discard(groups: dict[_G, dict[_T, None]], group: _G, item: _T) -> None:
    members = groups[group]
    del members[item]
    if not members:
        del groups[group]


def _shared(tokens: Sequence[int], prompt: Sequence[int], start: int) -> int:
    """How many of ``tokens`` equal the prompt from ``start`` on."""
    n = 0
    for a, b in zip(tokens, prompt[start : start + len(tokens)], strict=False):
        if a != b:
            break
        n += 1
    return n


class PrefixIndex:
    """Holders' token sequences by scope, and which of them share most of a prompt.

    Every method runs on the engine thread; the class is not thread-safe. Unknown keys
    raise ``KeyError``, except in :meth:`remove`.

    ``_visits`` (for tests only) counts the nodes a lookup walks and the children and
    ending holders it compares with the prompt.
    """

    def __init__(self, block: int = 16) -> None:
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be a positive int, not {block!r}")
        self._block = block
        self._nodes: dict[tuple[int, tuple[int, ...]], _Node] = {}
        self._roots: dict[CacheScope, _Node] = {}
        self._holders: dict[Hashable, _Holder] = {}
        self._ids = itertools.count()
        self._seqs = itertools.count()
        self._visits = 0

    def put(self, key: Hashable, scope: CacheScope, tokens: Sequence[int]) -> None:
        """Hold ``tokens`` for ``key`` in ``scope``, replacing what ``key`` held."""
        held = list(map(operator.index, tokens))
        self.remove(key)
        root = self._roots.get(scope)
        if root is None:
            root = self._roots[scope] = _Node(next(self._ids), None, ())
        root.holders[key] = None
        _add(root.ends, None, key)
        holder = self._holders[key] = _Holder(scope, [root], [], next(self._seqs))
        self._append(key, holder, held)

    def extend(self, key: Hashable, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to what ``key`` holds; others sharing its prefix are untouched."""
        holder = self._holders[key]
        if tokens:
            self._append(key, holder, list(map(operator.index, tokens)))

    def truncate(self, key: Hashable, n: int) -> None:
        """Keep the first ``n`` tokens ``key`` holds (no-op when it holds no more)."""
        holder = self._holders[key]
        if n < 0:
            raise ValueError(f"cannot keep {n} tokens")
        if n >= (len(holder.path) - 1) * self._block + len(holder.tail):
            return
        depth, rest = divmod(n, self._block)
        path = holder.path
        tail = list(path[depth + 1].block[:rest]) if depth + 1 < len(path) else holder.tail[:rest]
        self._drop(key, holder, depth + 1)
        holder.tail = tail
        _add(path[-1].ends, tail[0] if tail else None, key)

    def remove(self, key: Hashable) -> None:
        """Forget ``key`` and free the nodes only it held (unknown key: no-op)."""
        holder = self._holders.pop(key, None)
        if holder is not None:
            self._drop(key, holder, 0)

    def tokens(self, key: Hashable) -> list[int]:
        """A copy of the tokens held for ``key``."""
        holder = self._holders[key]
        return [t for node in holder.path[1:] for t in node.block] + holder.tail

    def scope(self, key: Hashable) -> CacheScope:
        """The cache scope ``key`` was put in."""
        return self._holders[key].scope

    def __contains__(self, key: object) -> bool:
        return key in self._holders

    def __len__(self) -> int:
        """The number of holders."""
        return len(self._holders)

    def matches(self, scope: CacheScope, prompt: Sequence[int], *, min_length: int = 1) -> list[PrefixMatch]:
        """Every holder of ``scope`` sharing at least ``min_length`` tokens with ``prompt``.

        Longest first; ties in the order the holders were put (a re-put counts as new).
        ``min_length=0`` lists every holder of the scope.
        """
        if min_length < 0:
            raise ValueError(f"min_length must be >= 0, not {min_length}")
        path = self._walk(scope, prompt)
        found: list[tuple[int, int, Hashable]] = []
        for depth, node in enumerate(path):
            start = depth * self._block
            # A holder leaving the prompt here shares fewer than start + block tokens.
            if min(start + self._block - 1, len(prompt)) < min_length:
                continue
            nxt = path[depth + 1] if depth + 1 < len(path) else None
            first = None if start >= min_length else prompt[start]
            for length, keys in self._leaving(node, first, nxt, prompt, start):
                if length >= min_length:
                    found.extend((length, self._holders[key].seq, key) for key in keys)
        found.sort(key=lambda m: (-m[0], m[1]))
        return [PrefixMatch(key, length) for length, _, key in found]

    def best(
        self, scope: CacheScope, prompt: Sequence[int], *, exclude: Collection[Hashable] = ()
    ) -> PrefixMatch | None:
        """The holder of ``scope`` sharing most of ``prompt``, ignoring ``exclude``.

        None when none shares a token. Of several equally long, the first found (not
        necessarily the first of :meth:`matches`).
        """
        skip = exclude if isinstance(exclude, Set) else frozenset(exclude)
        path = self._walk(scope, prompt)
        for depth in reversed(range(len(path))):
            node, start = path[depth], depth * self._block
            nxt = path[depth + 1] if depth + 1 < len(path) else None
            top: PrefixMatch | None = None
            if start < len(prompt):  # first those sharing one more token, the longest
                for length, keys in self._leaving(node, prompt[start], nxt, prompt, start):
                    if top is None or length > top.length:
                        key = next((k for k in keys if k not in skip), None)
                        top = top if key is None else PrefixMatch(key, length)
            if top is None and start > 0:  # then any: the rest share exactly `start` tokens
                for length, keys in self._leaving(node, None, nxt, prompt, start):
                    key = next((k for k in keys if k not in skip), None)
                    if key is not None:
                        return PrefixMatch(key, length)
            if top is not None:
                return top
        return None

    def _walk(self, scope: CacheScope, prompt: Sequence[int]) -> list[_Node]:
        """The nodes of ``scope`` whose prefix the prompt starts with, root first."""
        node = self._roots.get(scope)
        if node is None:
            return []
        path = [node]
        for start in range(0, len(prompt) - self._block + 1, self._block):
            found = self._nodes.get((node.id, tuple(prompt[start : start + self._block])))
            if found is None:
                break
            path.append(node := found)
        self._visits += len(path)
        return path

    def _leaving(
        self, node: _Node, first: int | None, nxt: _Node | None, prompt: Sequence[int], start: int
    ) -> Iterator[tuple[int, Iterable[Hashable]]]:
        """The holders of ``node`` leaving the prompt at ``start``, by child or ending, and
        how much they share: all, or (``first`` given) those whose next token is ``first``."""
        chain = itertools.chain.from_iterable
        kids = chain(node.kids.values()) if first is None else node.kids.get(first, ())
        ends = chain(node.ends.values()) if first is None else node.ends.get(first, ())
        for child in kids:
            if child is not nxt:
                self._visits += 1
                yield start + _shared(child.block, prompt, start), child.holders
        for key in ends:
            self._visits += 1
            yield start + _shared(self._holders[key].tail, prompt, start), (key,)

    def _append(self, key: Hashable, holder: _Holder, tokens: list[int]) -> None:
        node, tail = holder.path[-1], holder.tail
        _discard(node.ends, tail[0] if tail else None, key)
        i = 0
        while i < len(tokens):
            take = self._block - len(tail)
            tail.extend(tokens[i : i + take])
            i += take
            if len(tail) == self._block:
                block = tuple(tail)
                child = self._nodes.get((node.id, block))
                if child is None:
                    child = self._nodes[node.id, block] = _Node(next(self._ids), node, block)
                    _add(node.kids, block[0], child)
                child.holders[key] = None
                holder.path.append(node := child)
                tail.clear()
        _add(node.ends, tail[0] if tail else None, key)

    def _drop(self, key: Hashable, holder: _Holder, keep: int) -> None:
        """Take ``key`` off its ending and off ``path[keep:]``, freeing emptied nodes."""
        _discard(holder.path[-1].ends, holder.tail[0] if holder.tail else None, key)
        for node in reversed(holder.path[keep:]):
            del node.holders[key]
            if node.holders:
                continue
            if node.parent is None:
                del self._roots[holder.scope]
            else:
                del self._nodes[node.parent.id, node.block]
                _discard(node.parent.kids, node.block[0], node)
        del holder.path[keep:]
