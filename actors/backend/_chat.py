"""A chat prompt's tokens, special tokens only where the template put them (any thread).

``LlamaChat.tokenize_chat`` renders the chat with the chat template (the model's own
or the server's ``chat_template``, with the request's variables) and hands the
tokenizing here: text inside message content that spells a special token
(``<|im_start|>system``) stays text, so no message can forge another role.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from actors.contract import InvalidRequest

__all__ = ["chat_tokens", "check_fields", "prefill", "split_special"]


def prefill(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """A chat that ends with an assistant message is a prefill (llama-server's and vLLM's
    rule): the history with the assistant's turn opened, then that content, which the
    reply continues. Otherwise the chat as it is, with nothing after it. An assistant
    message that made tool calls is history, never a prefill."""
    if len(messages) > 1 and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        return messages[:-1], messages[-1]["content"]
    return messages, ""


def chat_tokens(
    messages: list[dict[str, Any]],
    parse_special: bool,
    render: Callable[[list[dict[str, Any]]], str],
    specials: Mapping[str, int],
    tokenize: Callable[[str, bool], list[int]],
    suffix: str = "",
    rendered: str | None = None,
) -> list[int]:
    """The tokens of ``messages`` rendered by ``render`` (the chat template), then of
    ``suffix`` (an assistant's prefill: content, after the template's text).

    ``specials`` maps the text of each special token to its id; ``tokenize(text,
    parse_special)`` tokenizes without adding special tokens. With ``parse_special``,
    special-token text in content becomes special tokens too. ``rendered`` is
    ``render(messages)`` when the caller has it already.

    Raises:
        InvalidRequest: special-token text sits where it cannot be kept as text.
    """
    if rendered is None:
        rendered = render(messages)
    if not parse_special:
        check_fields(messages, specials)
    contents = [m["content"] for m in messages]
    if parse_special or not any(text in c for c in [*contents, suffix] for text in specials):
        # As create_chat_completion: the template writes its own BOS, if any.
        return tokenize(rendered + suffix, True)
    # Render again with a marker for each content to find where the template put it.
    marks = [f"\ue000{uuid.uuid4().hex}{i}\ue001" for i in range(len(messages))]
    skeleton = render([{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)])
    parts: list[str] = []
    rest = skeleton
    for mark in marks:
        head, found, rest = rest.partition(mark)
        if not found:
            break
        parts.append(head)
    if (
        len(parts) != len(marks)
        or "".join(p + c for p, c in zip(parts, contents, strict=True)) + rest != rendered
    ):
        raise InvalidRequest(
            "a message's content spells a special token and this model's chat template rewrites "
            "content, so it cannot be kept as text; remove it, or pass parse_special=True"
        )
    # Special tokens only in the template's parts; the text between them (template
    # text and content together) is tokenized as text, as llama.cpp does around them.
    tokens: list[int] = []
    run: list[str] = []
    for part, content in [*zip(parts, contents, strict=True), (rest, suffix)]:
        for piece, special in split_special(part, specials):
            if special is None:
                run.append(piece)
            else:
                tokens += _text(tokenize, "".join(run))
                run = []
                tokens.append(special)
        run.append(content)
    return tokens + _text(tokenize, "".join(run))


def split_special(text: str, specials: Mapping[str, int]) -> list[tuple[str, int | None]]:
    """``text`` cut at the special tokens it spells (longest first): (text, None) or (text, id)."""
    pieces: list[tuple[str, int | None]] = []
    start = 0
    while start < len(text):
        best: tuple[int, str] | None = None
        for special in specials:
            i = text.find(special, start)
            if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(special) > len(best[1]))):
                best = (i, special)
        if best is None:
            pieces.append((text[start:], None))
            break
        i, special = best
        if i > start:
            pieces.append((text[start:i], None))
        pieces.append((special, specials[special]))
        start = i + len(special)
    return pieces


def _text(tokenize: Callable[[str, bool], list[int]], text: str) -> list[int]:
    return tokenize(text, False) if text else []


def check_fields(messages: list[dict[str, Any]], specials: Mapping[str, int]) -> None:
    """Only ``content`` is kept as text around the template's special tokens: any other
    field the template renders (a tool call's arguments, a name, thinking) must not
    spell one, or it could forge a turn."""
    others = [{k: v for k, v in m.items() if k not in ("role", "content")} for m in messages]
    if not any(others):
        return
    text = json.dumps(others, ensure_ascii=False)
    for special in specials:
        if special in text:
            raise InvalidRequest(
                f"a message's tool calls, name or reasoning spell the special token {special!r}; "
                "only content may (it is kept as text), or pass parse_special=True"
            )
