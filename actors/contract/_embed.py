"""The embeddings request and its result: ``Embed`` in, ``Embeddings`` out.

``Embed`` is checked on creation, in the caller's thread, as the generation messages
are (types, sizes, lone surrogates, the options); what needs the model (token ids
against the vocabulary, each text against the context) is checked when the texts are
tokenized, still in the sender's thread when the engine is loaded. ``ref.ask(Embed(...))``
gives a future of the ``Embeddings``; a ``ServerPool`` and a ``Supervisor`` take it too.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from actors.contract._checks import (
    MAX_ID_LENGTH,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKENS,
    _require,
    _show,
    checked_deadline,
    checked_request_id,
    checked_text,
    checked_tokens,
)

__all__ = ["MAX_EMBED_TEXTS", "POOLINGS", "Embed", "Embeddings", "Pooling"]

Pooling = Literal["mean", "cls", "last"]
"""How one text's per-token vectors become one: their mean, the first token's, the last's."""
POOLINGS: tuple[Pooling, ...] = ("mean", "cls", "last")
MAX_EMBED_TEXTS = 2048
"""Texts per ``Embed`` at most (OpenAI's limit for one embeddings request)."""


def _new_id() -> str:
    return uuid.uuid4().hex


def _rebuild(values: dict[str, Any]) -> Embed:
    return Embed(**values)


@dataclass(frozen=True, slots=True, kw_only=True)
class Embed:
    """Embed ``texts``: ``ref.ask(Embed(texts))`` gives a future of the ``Embeddings``.

    Each text is a non-empty ``str`` or a non-empty list of token ids (OpenAI's API
    allows both); ``texts`` holds 1 to ``MAX_EMBED_TEXTS`` of them, with at most
    ``MAX_PROMPT_CHARS`` characters and ``MAX_PROMPT_TOKENS`` ids in all.

    Attributes:
        texts: the texts (stored as a tuple of ``str`` and tuples of ids).
        pooling: ``"mean"``, ``"cls"`` or ``"last"``; None takes the model's own
            (its GGUF metadata), else ``"mean"``.
        normalize: scale each vector to unit length (L2).
        model: which model, for a handle that serves several; an engine ignores it.
        request_id: names the request for ``Cancel``.
        deadline_s: fail with ``RequestTimeout`` if not done this many seconds after
            admission.
    """

    texts: Sequence[str | Sequence[int]] = field(kw_only=False)
    pooling: Pooling | None = None
    normalize: bool = True
    model: str | None = None
    request_id: str = field(default_factory=_new_id)
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        texts = self.texts
        _require(
            isinstance(texts, Sequence) and not isinstance(texts, str | bytes),
            f"texts must be a list of str (or of token id lists), got {type(texts).__name__}",
        )
        _require(len(texts) > 0, "texts must not be empty")
        _require(
            len(texts) <= MAX_EMBED_TEXTS, f"texts may hold at most {MAX_EMBED_TEXTS} texts, got {len(texts)}"
        )
        checked: list[str | tuple[int, ...]] = []
        n_chars = n_ids = 0
        for i, text in enumerate(tuple(texts)):
            if isinstance(text, str):
                value = checked_text(f"texts[{i}]", text, MAX_PROMPT_CHARS)
                _require(value != "", f"texts[{i}] is empty")
                n_chars += len(value)
                checked.append(value)
            else:
                _require(
                    isinstance(text, Sequence) and not isinstance(text, bytes),
                    f"texts[{i}] must be a str or a list of token ids, got {type(text).__name__}",
                )
                _require(len(text) > 0, f"texts[{i}] is empty")
                ids = checked_tokens(text)
                n_ids += len(ids)
                checked.append(ids)
        _require(n_chars <= MAX_PROMPT_CHARS, f"texts may have at most {MAX_PROMPT_CHARS} characters in all")
        _require(n_ids <= MAX_PROMPT_TOKENS, f"texts may hold at most {MAX_PROMPT_TOKENS} token ids in all")
        object.__setattr__(self, "texts", tuple(checked))
        _require(
            self.pooling is None or (isinstance(self.pooling, str) and self.pooling in POOLINGS),
            f"pooling must be one of {list(POOLINGS)} or None, got {_show(self.pooling)}",
        )
        _require(isinstance(self.normalize, bool), f"normalize must be a bool, got {_show(self.normalize)}")
        if self.model is not None:
            object.__setattr__(self, "model", checked_text("model", self.model, MAX_ID_LENGTH))
        object.__setattr__(self, "request_id", checked_request_id(self.request_id))
        object.__setattr__(self, "deadline_s", checked_deadline(self.deadline_s))

    def __reduce__(self) -> tuple[Any, ...]:
        # Picklable (a ServerPool's Ray replicas): rebuilt, and checked again, over there.
        return (_rebuild, ({f.name: getattr(self, f.name) for f in fields(self)},))

    # What routing reads of every request (a ServerPool's router, the engine's table):
    # an embedding is one outcome, shares no cache and belongs to no session.
    @property
    def n(self) -> int:
        """One outcome: ``Embeddings`` or an error."""
        return 1

    @property
    def cache_scope(self) -> None:
        """Embeddings reuse no cached prefix."""
        return None

    @property
    def session(self) -> None:
        """Embeddings belong to no session."""
        return None

    @property
    def priority(self) -> int:
        """Embeddings queue first come, first served."""
        return 0


@dataclass(frozen=True, slots=True)
class Embeddings:
    """The result of an ``Embed``, made in the engine thread.

    Attributes:
        request_id: the request's id.
        vectors: float32, shape ``(len(texts), n_embd)``, read-only; row ``i`` is
            ``texts[i]``'s vector.
        prompt_tokens: how many tokens each text was.
        pooling: the pooling used.
        normalized: whether each row was scaled to unit length.
        duration_ms: from admission to the result.
    """

    request_id: str
    vectors: npt.NDArray[np.float32]
    prompt_tokens: tuple[int, ...]
    pooling: Pooling
    normalized: bool
    duration_ms: float

    @property
    def total_tokens(self) -> int:
        """Tokens of every text together (OpenAI's ``usage.prompt_tokens``)."""
        return sum(self.prompt_tokens)
