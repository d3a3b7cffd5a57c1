"""Fill-in-the-middle prompts: llama-server's layout and budgets, over the scripted
vocabulary (no model): a letter is a token, the FIM tokens are ids of their own."""

from __future__ import annotations

from typing import Any

import pytest
from fake_backend import FakeVocab

from actors.backend import FimTokens, infill_prompt
from actors.contract import InvalidRequest

pytestmark = pytest.mark.timeout(10)

PRE, SUF, MID, REP, SEP = 60, 61, 62, 63, 59
FULL = FimTokens(pre=PRE, suf=SUF, mid=MID, rep=REP, sep=SEP)
ROOMY: dict[str, Any] = {"n_ctx": 4096, "n_batch": 2048}


def vocab(fim: FimTokens = FULL) -> FakeVocab:
    return FakeVocab(64, fim)


def t(text: str) -> list[int]:
    return vocab().tokenize(text, add_special=False, parse_special=False)


def test_the_hole_is_framed_by_the_fim_tokens_with_the_prompt_after_the_prefix() -> None:
    plain = vocab(FimTokens(pre=PRE, suf=SUF, mid=MID))
    got = infill_prompt(plain, "int main() {", "}", prompt="return", **ROOMY)
    assert got == [PRE, *t("int main() {"), *t("return"), SUF, *t("}"), MID]


def test_extra_files_come_first_each_after_a_separator_and_their_name() -> None:
    extra = [("a.h", "int a;"), ("b.h", "int b;")]
    got = infill_prompt(vocab(), "x", "y", extra=extra, **ROOMY)
    assert got == [
        *[REP, *t("myproject\n")],
        *[SEP, *t("a.h\n"), *t("int a;")],
        *[SEP, *t("b.h\n"), *t("int b;")],
        *[SEP, *t("filename\n")],  # the file being edited (llama-server's placeholder name)
        *[PRE, *t("x"), SUF, *t("y"), MID],
    ]


def test_without_a_separator_token_chunks_are_parted_by_a_snippet_line() -> None:
    # SmolLM2's case: llama.cpp finds <reponame> (FIM_REP) and no FIM_SEP.
    no_sep = vocab(FimTokens(pre=PRE, suf=SUF, mid=MID, rep=REP))
    got = infill_prompt(no_sep, "x", "y", extra=[("a.h", "int a;")], **ROOMY)
    snippet = t("\n\n--- snippet ---\n\n")
    assert got == [REP, *t("myproject\n"), *snippet, *t("int a;"), PRE, *t("x"), SUF, *t("y"), MID]


def test_spm_puts_the_suffix_first() -> None:
    got = infill_prompt(vocab(FimTokens(pre=PRE, suf=SUF, mid=MID)), "x", "y", prompt="z", spm=True, **ROOMY)
    assert got == [SUF, *t("y"), PRE, *t("x"), *t("z"), MID]


def test_the_prefix_keeps_its_end_and_the_suffix_its_start_in_one_batch_at_three_to_one() -> None:
    plain = vocab(FimTokens(pre=PRE, suf=SUF, mid=MID))
    prefix, suffix = "abcdefghijklmnopqrst", "uvwxyzabcdefgh"
    got = infill_prompt(plain, prefix, suffix, prompt="q", n_ctx=256, n_batch=16)
    # n_batch // 4 = 4: the prefix's last 12, the suffix's first 4 - 2 - len(prompt) = 1
    assert got == [PRE, *t(prefix[-12:]), *t("q"), SUF, *t(suffix[:1]), MID]
    long_prompt = infill_prompt(plain, prefix, suffix, prompt="qqq", n_ctx=256, n_batch=16)
    assert long_prompt == [PRE, *t(prefix[-12:]), *t("qqq"), SUF, MID]  # no room: no suffix


def test_the_extra_context_keeps_its_end_within_the_slot_after_a_batch_and_twice_n_predict() -> None:
    extra = [(f"f{i}", "abcdefgh") for i in range(40)]
    whole = infill_prompt(vocab(), "x", "y", extra=extra, **ROOMY)
    hole = [PRE, *t("x"), SUF, *t("y"), MID]
    assert whole[-len(hole) :] == hole
    for n_predict in (8, 20):
        got = infill_prompt(vocab(), "x", "y", extra=extra, n_ctx=128, n_batch=32, n_predict=n_predict)
        take = 128 - 32 - 2 * n_predict  # llama-server's n_extra_take
        assert got == whole[len(whole) - len(hole) - take :]


def test_the_prompt_always_leaves_room_for_a_generated_token() -> None:
    # llama-server's budget with n_predict -1 is n_ctx - n_batch + 2: with every part
    # full the prompt would overflow the slot; the extra context gives up the excess.
    extra = [("f", "abcdefgh" * 40)]
    prefix, suffix = "abcdefghij" * 10, "klmnopqrst" * 10
    got = infill_prompt(vocab(), prefix, suffix, extra=extra, n_ctx=96, n_batch=32, n_predict=-1)
    assert len(got) == 95 and got[-1] == MID
    assert got.index(PRE) == 95 - (1 + 24 + 1 + 6 + 1)  # the hole whole: 24 + 6 tokens of code


def test_a_long_extra_list_is_tokenized_only_as_far_as_it_is_taken() -> None:
    calls: list[str] = []
    counting = vocab()
    tokenize = counting.tokenize

    def tokenize_counted(text: str, **kwargs: Any) -> list[int]:
        calls.append(text)
        return tokenize(text, **kwargs)

    counting.tokenize = tokenize_counted  # type: ignore[method-assign]
    extra = [(f"f{i}", "abcdefgh") for i in range(10_000)]
    got = infill_prompt(counting, "x", "y", extra=extra, n_ctx=128, n_batch=32)
    assert len(got) == 5 + 128 - 32 + 2 and len(calls) < 30  # the hole, and the extra budget


def test_prefix_and_suffix_take_llama_servers_mixed_lists_of_text_and_token_ids() -> None:
    plain = vocab(FimTokens(pre=PRE, suf=SUF, mid=MID))
    got = infill_prompt(plain, ["ab", 7, "c"], [9], **ROOMY)
    assert got == [PRE, *t("ab"), 7, *t("c"), SUF, 9, MID]


def test_a_model_without_fim_tokens_is_refused_in_llama_servers_words() -> None:
    with pytest.raises(InvalidRequest) as caught:
        infill_prompt(vocab(FimTokens(rep=REP)), "x", "y", **ROOMY)
    assert str(caught.value) == (
        "Infill is not supported by this model: prefix token is missing. suffix token is missing. "
        "middle token is missing."
    )
    assert FimTokens(pre=1, suf=2).missing == "middle token is missing."
    assert FULL.missing == ""


@pytest.mark.parametrize(
    ("change", "word"),
    [
        ({"prefix": 5}, "prefix"),
        ({"suffix": [1, True]}, "suffix"),
        ({"prefix": ["a", 64]}, "prefix"),
        ({"prefix": ["a", -1]}, "prefix"),
        ({"extra": "a.h"}, "extra"),
        ({"extra": [("a.h", 5)]}, "extra[0]"),
        ({"extra": [("a.h",)]}, "extra[0]"),
        ({"prompt": ["a"]}, "prompt"),
        ({"n_batch": 0}, "n_batch"),
        ({"n_ctx": 1.5}, "n_ctx"),
        ({"n_predict": -2}, "n_predict"),
    ],
)
def test_wrong_arguments_are_invalid_requests_that_name_them(change: dict[str, Any], word: str) -> None:
    arguments: dict[str, Any] = {"prefix": "x", "suffix": "y", **ROOMY, **change}
    with pytest.raises(InvalidRequest, match=word.replace("[", r"\[")):
        infill_prompt(vocab(), **arguments)
