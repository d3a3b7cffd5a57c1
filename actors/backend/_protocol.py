"""What the engine needs of a backend: :class:`Backend`, in five parts.

``LlamaBackend`` (llama.cpp) is one; the tests' scripted backend (logits chosen by the
test, KV bookkeeping checked) is another. The engine is typed against these protocols
only, so what it may call is exactly what is listed here. Every member runs in the
engine thread unless it says "any thread".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from actors.chat import ReplySpec, TemplateInfo, ToolGrammar
from actors.contract import Chat, LoraAdapter, SamplingParams, StreamChat

__all__ = [
    "Adapters",
    "Backend",
    "BatchRows",
    "ChatPrompts",
    "FimTokens",
    "KvIdentity",
    "KvSequences",
    "Sampler",
    "Samplers",
    "Triggers",
    "Vocabulary",
]

Triggers = tuple[tuple[str, ...], tuple[int, ...]]
"""What wakes a lazy grammar: regular expressions searched in the reply so far, and
token ids."""


@dataclass(frozen=True, slots=True)
class FimTokens:
    """A model's fill-in-the-middle tokens (llama.cpp's ``llama_vocab_fim_*``: from the
    GGUF's metadata, else found by their text, ``<|fim_prefix|>``, ``<PRE>``...), None
    where it has none.

    ``pre``, ``suf`` and ``mid`` frame the hole (a model needs all three to infill);
    ``rep`` opens a repository's name and ``sep`` each of its files, for the repo-level
    layout (Qwen2.5-Coder's); ``pad`` is the filler some models were trained with.
    """

    pre: int | None = None
    suf: int | None = None
    mid: int | None = None
    pad: int | None = None
    rep: int | None = None
    sep: int | None = None

    @property
    def missing(self) -> str:
        """What the model lacks to infill, in llama-server's words (``prefix token is
        missing. middle token is missing.``); empty when it has all three."""
        framing = (("prefix", self.pre), ("suffix", self.suf), ("middle", self.mid))
        return " ".join(f"{name} token is missing." for name, token in framing if token is None)


@dataclass(frozen=True, slots=True)
class KvIdentity:
    """What a saved KV state is valid for: a state another model, KV cache type or LoRA
    adapter computed is refused (llama.cpp would load one of the same shape silently).

    Attributes:
        model: the model file's content digest (``actors.backend._digest``).
        kv_types: ggml's type ids of the K and V caches (1: f16, llama.cpp's default).
        adapters: each loaded LoRA adapter's file digest, in id order.
    """

    model: str
    kv_types: tuple[int, int]
    adapters: tuple[str, ...] = ()


class Vocabulary(Protocol):
    """The model's tokens (any thread)."""

    n_vocab: int
    eog_ids: frozenset[int]
    fim: FimTokens

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text`` (a BOS when ``add_special`` and the model wants one)."""
        ...

    def is_single_token(self, piece: str) -> bool:
        """Whether ``piece`` is exactly one token."""
        ...

    def piece(self, token: int) -> bytes:
        """A token's bytes as generated text (special tokens render empty)."""
        ...

    def special_piece(self, token: int) -> bytes:
        """A token's bytes with special tokens spelled out."""
        ...

    def special_token(self, text: str) -> int | None:
        """The special token spelled ``text``, if any."""
        ...


class KvSequences(Protocol):
    """The KV cache's sequences: one per slot, plus embedding lanes."""

    can_shift: bool

    def trim(self, seq_id: int, keep: int) -> bool:
        """Drop positions from ``keep`` on; False if refused."""
        ...

    def remove(self, seq_id: int, p0: int, p1: int) -> bool:
        """Drop positions ``[p0, p1)``, later ones staying where they are; False if refused."""
        ...

    def copy(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Share ``src``'s cells at positions ``[p0, p1)`` with ``dst``."""
        ...

    def pos_max(self, seq_id: int) -> int:
        """The largest position the sequence holds, -1 for none."""
        ...

    def clear(self, seq_id: int) -> None:
        """Drop the whole sequence."""
        ...

    def shift(self, seq_id: int, n_keep: int, n_discard: int, n_past: int) -> None:
        """Drop ``[n_keep, n_keep + n_discard)`` and move the rest back over the gap."""
        ...

    def save(self, seq_id: int) -> bytes:
        """The sequence's state, in host memory."""
        ...

    def restore(self, seq_id: int, state: bytes) -> bool:
        """Load a state :meth:`save` made; False if refused."""
        ...


class BatchRows(Protocol):
    """The batch's columns (numpy arrays the engine writes, a row per token) and the
    forward pass over them."""

    tokens: npt.NDArray[np.int32]
    pos: npt.NDArray[np.int32]
    seq_ids: npt.NDArray[np.int32]
    logits: npt.NDArray[np.int8]

    def decode(self, start: int, end: int) -> int:
        """One forward pass of rows ``[start, end)``: llama_decode's code (0 ok, 1 no KV
        space, 2 aborted, -1 invalid batch, below -1 fatal)."""
        ...

    def decode_embeddings(self, n_rows: int) -> tuple[int, npt.NDArray[np.float32] | None]:
        """A pass of rows ``[0, n_rows)`` with embeddings: its code and, when 0, the rows'."""
        ...

    def time_passes(self, sizes: Sequence[int], seq_id: int, repeats: int = 1) -> dict[int, float]:
        """The least ms of forward passes of each size (``seq_id`` cleared after each)."""
        ...


class Sampler(Protocol):
    """One request's sampler (opaque to the engine but for its grammar's cost)."""

    @property
    def has_grammar(self) -> bool:
        """Whether a grammar constrains it."""
        ...

    @property
    def grammar_ms(self) -> float:
        """CPU ms its grammar's last check took."""
        ...


class Samplers(Protocol):
    """Samplers over the last pass's logits rows."""

    def make(
        self,
        params: SamplingParams,
        logit_bias: dict[int, float] | None,
        history: list[int],
        triggers: Triggers | None = None,
    ) -> Sampler:
        """A request's sampler (``history``, the prompt, feeds its penalties)."""
        ...

    def sample(self, sampler: Any, index: int, *, ban_eog: bool = False) -> int:
        """Sample and accept a token of row ``index`` (raises ``DeadEnd``)."""
        ...

    def force(self, sampler: Any, token: int) -> bool:
        """Accept ``token`` as sampled, if the grammar allows it."""
        ...

    def free(self, sampler: Any) -> None:
        """Free a sampler :meth:`make` made."""
        ...

    def logprobs(self, index: int, k: int) -> tuple[npt.NDArray[np.float64], list[tuple[int, float]]]:
        """Row ``index``'s log-softmax and its ``k`` best entries."""
        ...

    def sampled_probs(self, sampler: Any, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
        """The probability ``token`` had where the last sample drew it, and the ``k`` best."""
        ...

    def top_token(self, index: int) -> tuple[int, float]:
        """Row ``index``'s likeliest token and its probability."""
        ...

    def probe_grammar(self, grammar: str, logit_bias: dict[int, float] | None) -> float:
        """Check a grammar against the vocabulary (any thread); its cost in ms."""
        ...

    def json_schema_grammar(self, schema: object) -> str:
        """A JSON Schema's grammar (any thread)."""
        ...


class ChatPrompts(Protocol):
    """Chat requests rendered with the chat template (any thread)."""

    info: TemplateInfo | None

    def prompt(
        self, message: Chat | StreamChat, reasoning_format: str = "auto"
    ) -> tuple[list[int], ToolGrammar | None, ReplySpec | None]:
        """A chat's prompt tokens, its tool grammar, and how to read its reply."""
        ...


class Adapters(Protocol):
    """The LoRA adapters loaded with the model, and the one set the context applies."""

    loaded: tuple[LoraAdapter, ...]
    """In id order, each with its default scale (any thread)."""
    current: tuple[tuple[int, float], ...]
    """The set in use: ``(id, scale)`` pairs, ``()`` for none."""
    n_switches: int
    """How many times the set changed."""

    def use(self, adapters: Sequence[tuple[int, float]]) -> None:
        """Apply ``adapters`` to every decode from the next on (a no-op when in use)."""
        ...


class Backend(Protocol):
    """A model and its context, as the engine uses them (see the module's docstring)."""

    n_ctx: int
    n_batch: int
    n_seq_max: int
    n_ctx_train: int
    n_embd: int
    pooling: str | None
    embed_seq_ids: tuple[int, ...]

    @property
    def vocab(self) -> Vocabulary: ...

    @property
    def kv(self) -> KvSequences: ...

    @property
    def adapters(self) -> Adapters: ...

    @property
    def rows(self) -> BatchRows: ...

    @property
    def sampling(self) -> Samplers: ...

    @property
    def chat(self) -> ChatPrompts: ...

    def identity(self) -> KvIdentity:
        """What this context's saved KV states are valid for (engine thread; the files
        are read at the first call only)."""
        ...

    def close(self) -> None:
        """Free the model and context (engine thread, once)."""
        ...
