"""PrefixIndex: the longest cached prefix of a prompt, by scope, exact to the token.

No model: each method and edge case by hand, then random put/extend/truncate/remove
sequences against a brute-force reference (hypothesis, small alphabets so prefixes
collide, block sizes 1, 2, 3 and 16). ``_nodes``, ``_roots`` and ``_visits`` are read
to show that nodes are shared and freed, and that a lookup's work follows the prompt.
"""

from __future__ import annotations

import random
import types
from collections.abc import Hashable

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from actors.engine import _prefix
from actors.engine._prefix import PrefixIndex, PrefixMatch


def seq(n: int, offset: int = 0) -> list[int]:
    return [offset + i for i in range(n)]


def node_count(index: PrefixIndex) -> int:
    return len(index._nodes) + len(index._roots)


def test_all_lists_the_public_names() -> None:
    mine = {
        name
        for name, value in vars(_prefix).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and getattr(value, "__module__", _prefix.__name__) == _prefix.__name__
    }
    # CacheScope is a type alias (its __module__ is typing's): listed, not found above.
    assert mine | {"CacheScope"} == set(_prefix.__all__) == {"CacheScope", "PrefixIndex", "PrefixMatch"}


@pytest.mark.parametrize("block", [0, -1, 1.5, "16"])
def test_the_block_is_a_positive_int(block: object) -> None:
    with pytest.raises(ValueError, match="block"):
        PrefixIndex(block)  # type: ignore[arg-type]


def test_an_empty_index_matches_nothing() -> None:
    index = PrefixIndex()
    assert len(index) == 0 and "a" not in index
    assert index.matches(None, seq(40)) == [] and index.best(None, seq(40)) is None


def test_put_holds_a_copy_under_its_key_and_scope() -> None:
    index = PrefixIndex(block=4)
    tokens = seq(10)
    index.put(("slot", 0), "a", tokens)
    tokens.append(99)
    assert index.tokens(("slot", 0)) == seq(10) and index.scope(("slot", 0)) == "a"
    assert ("slot", 0) in index and ("slot", 1) not in index and len(index) == 1
    index.tokens(("slot", 0)).append(99)
    assert index.tokens(("slot", 0)) == seq(10)


def test_tokens_may_be_numpy_and_must_be_integers() -> None:
    index = PrefixIndex(block=4)
    index.put("k", None, np.arange(10))  # type: ignore[arg-type]
    assert index.tokens("k") == seq(10) and all(type(t) is int for t in index.tokens("k"))
    assert index.best(None, np.arange(6)) == PrefixMatch("k", 6)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        index.put("k", None, [1.5])  # type: ignore[list-item]
    assert index.tokens("k") == seq(10)


def test_unknown_keys_raise_except_in_remove() -> None:
    index = PrefixIndex()
    index.remove("nobody")
    for call in (index.tokens, index.scope, lambda k: index.extend(k, [1]), lambda k: index.truncate(k, 0)):
        with pytest.raises(KeyError):
            call("nobody")


def test_an_empty_holder_or_prompt_shares_nothing() -> None:
    index = PrefixIndex(block=4)
    index.put("empty", None, [])
    index.put("full", None, seq(9))
    assert index.tokens("empty") == []
    assert index.matches(None, []) == [] and index.best(None, []) is None
    assert index.matches(None, seq(3)) == [PrefixMatch("full", 3)]
    assert index.matches(None, [], min_length=0) == [PrefixMatch("empty", 0), PrefixMatch("full", 0)]


def test_a_prompt_shorter_than_a_block_matches_to_the_token() -> None:
    index = PrefixIndex()
    index.put("a", None, seq(40))
    index.put("b", None, seq(5))
    assert index.matches(None, seq(3)) == [PrefixMatch("a", 3), PrefixMatch("b", 3)]
    assert index.matches(None, [0, 1, 9]) == [PrefixMatch("a", 2), PrefixMatch("b", 2)]
    assert index.best(None, [9]) is None


@pytest.mark.parametrize("block", [1, 2, 3, 16])
def test_a_match_ends_mid_block_exactly(block: int) -> None:
    index = PrefixIndex(block)
    index.put("long", None, seq(40))
    index.put("short", None, seq(21))
    prompt = [*seq(37), -1, *seq(5)]
    assert index.matches(None, prompt) == [PrefixMatch("long", 37), PrefixMatch("short", 21)]
    assert index.best(None, prompt) == PrefixMatch("long", 37)
    assert index.best(None, seq(100)) == PrefixMatch("long", 40)
    assert index.best(None, prompt, exclude={"long"}) == PrefixMatch("short", 21)
    assert index.best(None, prompt, exclude=["long", "short"]) is None


def test_matches_are_longest_first_ties_in_put_order() -> None:
    index = PrefixIndex(block=4)
    for key, n in [("c", 10), ("a", 30), ("b", 10), ("d", 3)]:
        index.put(key, None, seq(n))
    assert [(m.key, m.length) for m in index.matches(None, seq(20))] == [
        ("a", 20),
        ("c", 10),
        ("b", 10),
        ("d", 3),
    ]
    assert [m.key for m in index.matches(None, seq(20), min_length=10)] == ["a", "c", "b"]
    index.put("c", None, seq(10))  # a re-put counts as new
    assert [m.key for m in index.matches(None, seq(20), min_length=10)] == ["a", "b", "c"]
    with pytest.raises(ValueError, match="min_length"):
        index.matches(None, seq(20), min_length=-1)


def test_scopes_never_share() -> None:
    index = PrefixIndex(block=4)
    index.put("none", None, seq(20))
    index.put("a", "a", seq(30))
    index.put("empty", "", seq(25))
    assert index.matches(None, seq(30)) == [PrefixMatch("none", 20)]
    assert index.matches("a", seq(30)) == [PrefixMatch("a", 30)]
    assert index.best("", seq(30)) == PrefixMatch("empty", 25)
    assert index.best("b", seq(30)) is None
    assert len(index._roots) == 3 and len(index._nodes) == 5 + 7 + 6


def test_shared_prefixes_share_nodes() -> None:
    index = PrefixIndex()
    common = seq(1000)
    index.put(1, None, [*common, 1, 2, 3])
    index.put(2, None, [*common, *seq(40, 5000)])
    assert len(index._nodes) == 1000 // 16 + 40 // 16 + 1  # + the block split by the tails
    index.put(3, None, common)
    assert len(index._nodes) == 1000 // 16 + 40 // 16 + 1


def test_extend_one_token_at_a_time_joins_and_leaves_others_alone() -> None:
    index = PrefixIndex(block=4)
    index.put("a", None, seq(12))
    index.put("b", None, seq(6))
    for t in range(6, 14):
        index.extend("b", [t])
    assert index.tokens("a") == seq(12) and index.tokens("b") == seq(14)
    assert len(index._nodes) == 3  # b reuses a's blocks, its 2 extra tokens are a tail
    index.extend("a", [-1, -2, -3, -4, -5])
    assert index.tokens("b") == seq(14)
    assert index.matches(None, seq(20)) == [PrefixMatch("b", 14), PrefixMatch("a", 12)]
    index.extend("b", [])
    assert index.tokens("b") == seq(14)


def test_truncate_into_a_block_and_into_a_shared_prefix() -> None:
    index = PrefixIndex(block=4)
    index.put("a", None, seq(20))
    index.put("b", None, seq(20))
    index.truncate("a", 25)
    index.truncate("a", 20)
    assert index.tokens("a") == seq(20)
    index.truncate("a", 10)
    assert index.tokens("a") == seq(10) and index.tokens("b") == seq(20)
    assert index.matches(None, seq(30)) == [PrefixMatch("b", 20), PrefixMatch("a", 10)]
    assert index.matches(None, [*seq(9), -1]) == [PrefixMatch("a", 9), PrefixMatch("b", 9)]
    index.remove("b")
    assert len(index._nodes) == 2  # a keeps 2 blocks and a 2-token tail
    index.truncate("a", 0)
    assert index.tokens("a") == [] and len(index._nodes) == 0 and len(index._roots) == 1
    with pytest.raises(ValueError):
        index.truncate("a", -1)


def test_extend_after_truncate_takes_the_new_tokens() -> None:
    index = PrefixIndex(block=4)
    index.put("a", None, seq(10))
    index.put("b", None, seq(10))
    index.truncate("a", 6)
    index.extend("a", [-1, -2, -3])
    assert index.tokens("a") == [*seq(6), -1, -2, -3] and index.tokens("b") == seq(10)
    assert index.best(None, seq(10)) == PrefixMatch("b", 10)
    assert index.best(None, [*seq(6), -1, -2]) == PrefixMatch("a", 8)


def test_re_put_replaces_tokens_and_scope() -> None:
    index = PrefixIndex(block=4)
    index.put("a", None, seq(20))
    index.put("a", "s", seq(9, 100))
    assert index.tokens("a") == seq(9, 100) and index.scope("a") == "s" and len(index) == 1
    assert index.best(None, seq(20)) is None and index.best("s", seq(20, 100)) == PrefixMatch("a", 9)
    assert len(index._roots) == 1 and len(index._nodes) == 2


def test_churn_frees_every_node() -> None:
    rng = random.Random(0)
    index = PrefixIndex(block=3)
    for i in range(500):
        key = i % 37
        index.put(key, rng.choice([None, "a"]), [rng.randrange(3) for _ in range(rng.randrange(60))])
        if rng.random() < 0.5:
            index.extend(key, [rng.randrange(3) for _ in range(rng.randrange(10))])
        if rng.random() < 0.3:
            index.truncate(key, rng.randrange(60))
        index.remove(rng.randrange(37))
    for key in range(37):
        index.remove(key)
    assert len(index) == 0 and node_count(index) == 0


def test_a_lookup_works_in_proportion_to_the_prompt_not_the_holders() -> None:
    rng = random.Random(1)
    common = [rng.randrange(50_000) for _ in range(2000)]
    held = [[*common, *(rng.randrange(50_000) for _ in range(2000))] for _ in range(64)]
    index = PrefixIndex()
    for key, tokens in enumerate(held):
        index.put(key, None, tokens)
    # Brute force would compare up to 64 x 4,000 tokens; the index touches a node a block.
    prompt = [*held[17][:3000], -1, *range(500)]
    index._visits = 0
    assert index.best(None, prompt) == PrefixMatch(17, 3000)
    assert index._visits <= len(prompt) // 16 + 4
    index._visits = 0
    found = index.matches(None, prompt)
    assert found[0] == PrefixMatch(17, 3000) and {m.length for m in found[1:]} == {2000}
    assert index._visits <= len(prompt) // 16 + 64 + 4
    index._visits = 0
    assert index.best(None, [-1, *common]) is None and index._visits <= 1


# -- against a brute-force reference ----------------------------------------------------

KEYS = st.sampled_from([("slot", 0), ("slot", 1), ("slot", 2), ("ram", 0), ("ram", 1)])
SCOPES = st.sampled_from([None, "a"])
TOKENS = st.lists(st.integers(0, 2), max_size=40)


def shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class IndexAgainstReference(RuleBasedStateMachine):
    """Random edits to a PrefixIndex and to a dict of key -> (scope, tokens, put order)."""

    @initialize(block=st.sampled_from([1, 2, 3, 16]))
    def start(self, block: int) -> None:
        self.block = block
        self.index = PrefixIndex(block)
        self.model: dict[Hashable, tuple[str | None, list[int], int]] = {}
        self.puts = 0

    @rule(key=KEYS, scope=SCOPES, tokens=TOKENS)
    def put(self, key: Hashable, scope: str | None, tokens: list[int]) -> None:
        self.index.put(key, scope, tokens)
        self.model[key] = (scope, list(tokens), self.puts)
        self.puts += 1

    def held(self, data: st.DataObject) -> Hashable:
        return data.draw(st.sampled_from(sorted(self.model, key=repr)))

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), max_size=20))
    def extend(self, data: st.DataObject, tokens: list[int]) -> None:
        key = self.held(data)
        self.index.extend(key, tokens)
        self.model[key][1].extend(tokens)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(0, 60))
    def truncate(self, data: st.DataObject, n: int) -> None:
        key = self.held(data)
        self.index.truncate(key, n)
        del self.model[key][1][n:]

    @precondition(lambda self: self.model)
    @rule(key=KEYS)
    def remove(self, key: Hashable) -> None:
        self.index.remove(key)
        self.model.pop(key, None)

    @precondition(lambda self: self.model)
    @rule(
        data=st.data(), suffix=TOKENS, min_length=st.integers(0, 20), exclude=st.frozensets(KEYS, max_size=2)
    )
    def lookup(
        self, data: st.DataObject, suffix: list[int], min_length: int, exclude: frozenset[Hashable]
    ) -> None:
        scope, prompt = data.draw(SCOPES), suffix
        # Mostly a held sequence's scope and part of it, then anything: prefixes collide.
        if data.draw(st.integers(0, 3)):
            scope, base, _ = data.draw(st.sampled_from(list(self.model.values())))
            prompt = base[: data.draw(st.integers(0, len(base)))] + suffix
        mine = [(key, shared(t, prompt), order) for key, (s, t, order) in self.model.items() if s == scope]
        expected = sorted((m for m in mine if m[1] >= min_length), key=lambda m: (-m[1], m[2]))
        got = self.index.matches(scope, prompt, min_length=min_length)
        assert got == [PrefixMatch(key, length) for key, length, _ in expected]
        open_ = [(key, length) for key, length, _ in mine if length >= 1 and key not in exclude]
        top = self.index.best(scope, prompt, exclude=exclude)
        if not open_:
            assert top is None
        else:
            longest = max(length for _, length in open_)
            assert top is not None and top.length == longest
            assert top.key in {key for key, length in open_ if length == longest}

    @invariant()
    def holds_what_the_reference_holds(self) -> None:
        assert len(self.index) == len(self.model)
        for key, (scope, tokens, _) in self.model.items():
            assert key in self.index and self.index.scope(key) == scope and self.index.tokens(key) == tokens
        # One node per distinct (scope, whole-block prefix): shared, and freed when unheld.
        prefixes = {
            (scope, tuple(tokens[:end]))
            for scope, tokens, _ in self.model.values()
            for end in range(self.block, len(tokens) + 1, self.block)
        }
        assert len(self.index._nodes) == len(prefixes)
        assert set(self.index._roots) == {scope for scope, _, _ in self.model.values()}


def test_the_index_agrees_with_brute_force() -> None:
    run_state_machine_as_test(
        IndexAgainstReference,
        settings=settings(max_examples=300, stateful_step_count=40, deadline=None, database=None),
    )
