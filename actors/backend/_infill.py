"""Fill-in-the-middle prompts, laid out as llama-server's ``/infill`` lays them out
(``format_prompt_infill`` in its ``server-common.cpp``), so that both servers send the
model the same tokens. Pure over a :class:`~actors.backend.Vocabulary`: any thread.

The layout (the repo-level pattern of https://arxiv.org/abs/2409.12186)::

    [FIM_REP]myproject\\n                 when the model has FIM_REP
    [FIM_SEP]{filename}\\n{text}          each extra chunk; without FIM_SEP,
                                         "\\n\\n--- snippet ---\\n\\n"{text}
    [FIM_SEP]filename\\n                  when the model has FIM_SEP (the file edited)
    [BOS][FIM_PRE]{prefix}{prompt}[FIM_SUF]{suffix}[FIM_MID]

``spm`` (llama-server's ``--spm-infill``, the suffix-prefix-middle order some models
were trained with) swaps the two framed parts: ``[FIM_SUF]{suffix}[FIM_PRE]{prefix}
{prompt}[FIM_MID]``. The BOS (when the model wants one) comes after the extra context,
as llama-server puts it. ``prompt`` is text the client has already written after the
cursor's prefix: the model continues from it.

Budgets, llama-server's: the hole and around it fit one batch at 3:1, the prefix
keeping its last ``3 * (n_batch // 4)`` tokens and the suffix its first
``n_batch // 4 - 2 - len(prompt)`` (none when that is negative); the extra context
keeps its last ``n_ctx - n_batch - 2 * n_predict`` tokens (none when negative), what is
left of the slot after a batch and twice the tokens to predict. One bound is ours:
the extra context also gives up what would leave no room in ``n_ctx`` for a generated
token (llama-server's budget overflows the slot by a few tokens when ``n_predict`` is -1
and every part is full; it then refuses the request). Only the extra tokens that fit are
tokenized: a long list costs its type checks, not its tokenizing.

Text is tokenized without special tokens (a ``<|fim_prefix|>`` written in the code stays
text), ``prompt`` with them, as llama-server does. The prefix and suffix may also be
llama-server's mixed lists of text and token ids.
"""

from __future__ import annotations

from collections.abc import Sequence

from actors.backend._protocol import Vocabulary
from actors.contract import InvalidRequest

__all__ = ["InfillText", "infill_prompt"]

InfillText = str | Sequence[str | int]
"""The prefix or suffix: text, or a list of text pieces and token ids (llama-server's
mixed prompt)."""

# llama-server's "TODO: make project name an input" and "TODO: current filename".
_REPO = "myproject\n"
_FILE = "filename\n"
# Between extra chunks when the model has no FIM_SEP.
_SNIPPET = "\n\n--- snippet ---\n\n"


def _text(vocab: Vocabulary, text: str) -> list[int]:
    return vocab.tokenize(text, add_special=False, parse_special=False)


def _mixed(vocab: Vocabulary, value: InfillText, name: str) -> list[int]:
    """``value``'s tokens: text without special tokens, token ids as they are."""
    if isinstance(value, str):
        return _text(vocab, value)
    if not isinstance(value, list | tuple):
        raise InvalidRequest(
            f"{name} must be a str or a list of str and token ids, not {type(value).__name__}"
        )
    tokens: list[int] = []
    for piece in value:
        if isinstance(piece, str):
            tokens.extend(_text(vocab, piece))
        elif type(piece) is int and 0 <= piece < vocab.n_vocab:
            tokens.append(piece)
        else:
            raise InvalidRequest(
                f"{name} takes text and token ids (0 to {vocab.n_vocab - 1}), got {piece!r:.40}"
            )
    return tokens


def _checked_extra(extra: Sequence[tuple[str, str]]) -> Sequence[tuple[str, str]]:
    if isinstance(extra, str) or not isinstance(extra, Sequence):
        raise InvalidRequest(f"extra must be a list of (filename, text) pairs, got {type(extra).__name__}")
    for i, chunk in enumerate(extra):
        if not (
            isinstance(chunk, tuple | list) and len(chunk) == 2 and all(isinstance(p, str) for p in chunk)
        ):
            raise InvalidRequest(f"extra[{i}] must be a (filename, text) pair of str, got {chunk!r:.40}")
    return extra


def _check_sizes(n_ctx: int, n_batch: int, n_predict: int) -> None:
    for name, value, low in (("n_ctx", n_ctx, 1), ("n_batch", n_batch, 1), ("n_predict", n_predict, -1)):
        if type(value) is not int or value < low:
            raise InvalidRequest(f"{name} must be an int >= {low}, got {value!r:.40}")


def _extra_tail(vocab: Vocabulary, extra: Sequence[tuple[str, str]], take: int) -> list[int]:
    """The last ``take`` tokens of the extra context, tokenizing from its end only what
    they need (each piece is tokenized alone, so the tail is the same either way)."""
    if take <= 0:
        return []
    fim = vocab.fim
    parts: list[list[int]] = []  # from the end
    n = 0
    if fim.sep is not None:
        parts.append([fim.sep, *_text(vocab, _FILE)])
        n += len(parts[-1])
    for filename, text in reversed(extra):
        if n >= take:
            break
        opening = [fim.sep, *_text(vocab, filename + "\n")] if fim.sep is not None else _text(vocab, _SNIPPET)
        parts.append(opening + _text(vocab, text))
        n += len(parts[-1])
    if n < take and fim.rep is not None:
        parts.append([fim.rep, *_text(vocab, _REPO)])
    tokens = [t for part in reversed(parts) for t in part]
    return tokens[len(tokens) - take :] if len(tokens) > take else tokens


def infill_prompt(
    vocab: Vocabulary,
    prefix: InfillText,
    suffix: InfillText,
    *,
    extra: Sequence[tuple[str, str]] = (),
    prompt: str = "",
    n_ctx: int,
    n_batch: int,
    n_predict: int = -1,
    spm: bool = False,
) -> list[int]:
    """The infill prompt's tokens (see the module's docstring for the layout and budgets).

    Args:
        vocab: the model's vocabulary.
        prefix: the code before the hole.
        suffix: the code after it.
        extra: more context, (filename, text) chunks, oldest first.
        prompt: text after the prefix that the model continues from.
        n_ctx: a slot's context (the prompt leaves room in it for one generated token).
        n_batch: the batch size (the prefix, prompt and suffix fit one).
        n_predict: the server's token limit (-1: none), which the extra context leaves
            room for twice.
        spm: the suffix before the prefix.

    Raises:
        InvalidRequest: the model has no FIM prefix, suffix or middle token (llama-server's
            message), or an argument has the wrong type or range.
    """
    missing = vocab.fim.missing
    if missing:
        raise InvalidRequest(f"Infill is not supported by this model: {missing}")
    if not isinstance(prompt, str):
        raise InvalidRequest(f"prompt must be a str, got {type(prompt).__name__}")
    _check_sizes(n_ctx, n_batch, n_predict)
    extra = _checked_extra(extra)
    fim = vocab.fim
    assert fim.pre is not None and fim.suf is not None and fim.mid is not None
    before = _mixed(vocab, prefix, "prefix")
    after = _mixed(vocab, suffix, "suffix")
    written = vocab.tokenize(prompt, add_special=False, parse_special=True) if prompt else []
    quarter = n_batch // 4
    n_prefix = min(len(before), 3 * quarter)
    n_suffix = min(len(after), max(0, quarter - (2 + len(written))))
    framed_prefix = [fim.pre, *before[len(before) - n_prefix :], *written]
    framed_suffix = [fim.suf, *after[:n_suffix]]
    first, second = (framed_suffix, framed_prefix) if spm else (framed_prefix, framed_suffix)
    bos = vocab.tokenize("", add_special=True, parse_special=False)  # [BOS] if the model adds one
    hole = [*bos, *first, *second, fim.mid]
    take = min(max(0, n_ctx - n_batch - 2 * n_predict), max(0, n_ctx - 1 - len(hole)))
    return _extra_tail(vocab, extra, take) + hole
