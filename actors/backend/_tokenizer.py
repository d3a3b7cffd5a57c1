"""``Tokenizer``: the loaded model's vocabulary, usable from any caller's thread."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from actors.backend._infill import InfillText, infill_prompt
from actors.backend._protocol import FimTokens
from actors.contract import Chat, InvalidRequest, checked_template_tools

if TYPE_CHECKING:
    from actors.backend._llama import LlamaBackend

__all__ = ["Tokenizer"]


class Tokenizer:
    """Tokenize and detokenize with the engine's model, in the caller's thread.

    Get one with ``ref.ask(GetTokenizer())``. Calls never go through the actor's
    queue, so counting tokens or building ``GenerateTokens`` requests does not wait
    behind a tick. Thread-safe; after the engine stops, calls raise ``EngineStopped``.
    """

    def __init__(self, backend: LlamaBackend, n_ctx_slot: int | None = None) -> None:
        self._backend = backend
        self._n_ctx_slot = n_ctx_slot or backend.n_ctx  # the engine's slot context

    @property
    def n_vocab(self) -> int:
        """The vocabulary size: valid token ids are ``0 .. n_vocab - 1``."""
        return self._backend.vocab.n_vocab

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``, as the engine tokenizes a prompt by default.

        Args:
            text: the text.
            add_special: add a BOS token when the model's metadata asks for one.
            parse_special: turn special tokens written in the text (``<|im_start|>``)
                into their ids instead of tokenizing their characters.
        """
        return self._backend.vocab.tokenize(text, add_special=add_special, parse_special=parse_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` adds to generated text (a piece of a multi-byte
        character may be invalid UTF-8 alone; special tokens add none).

        Raises:
            InvalidRequest: the id is outside the vocabulary.
        """
        if type(token_id) is not int or not 0 <= token_id < self.n_vocab:
            raise InvalidRequest(f"token id {token_id!r} is outside the vocabulary (n_vocab={self.n_vocab})")
        return self._backend.vocab.piece(token_id)

    @property
    def eog_token_ids(self) -> frozenset[int]:
        """The model's end-of-generation tokens (EOS, EOT, ...): what ``ignore_eos`` bans."""
        return self._backend.vocab.eog_ids

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` (special tokens rendered; broken UTF-8 becomes U+FFFD)."""
        if not isinstance(ids, Sequence) or isinstance(ids, str | bytes):
            raise InvalidRequest(f"detokenize takes a list of token ids, got {type(ids).__name__}")
        return self._backend.vocab.detokenize(list(ids))

    @property
    def fim_tokens(self) -> FimTokens:
        """The model's fill-in-the-middle tokens (None where it has none): it can
        :meth:`infill` when ``fim_tokens.missing`` is empty."""
        return self._backend.vocab.fim

    def infill(
        self,
        prefix: InfillText,
        suffix: InfillText,
        *,
        extra: Sequence[tuple[str, str]] = (),
        prompt: str = "",
        n_ctx: int | None = None,
        n_batch: int | None = None,
        n_predict: int = -1,
        spm: bool = False,
    ) -> list[int]:
        """A fill-in-the-middle prompt, as llama-server's ``/infill`` builds it: token ids
        to generate from (``generate(ref, ids)``, ``GenerateTokens``), which the model
        answers with the code for the hole between ``prefix`` and ``suffix``.

        The layout is the model's FIM tokens around the parts, after the ``extra``
        context (``[FIM_REP]``, ``[FIM_SEP]`` per file when the model has them);
        the prefix keeps its end and the suffix its start within one batch, the extra
        context its end within what the slot has left (llama-server's budgets).

        Args:
            prefix: the code before the hole: text, or llama-server's list of text and
                token ids.
            suffix: the code after the hole, likewise.
            extra: more context, ``(filename, text)`` chunks (other files, oldest first).
            prompt: text already written after ``prefix``, which the model continues.
            n_ctx: the slot context to fit (default: this engine's ``n_ctx_per_slot``).
            n_batch: the batch the hole fits (default: this engine's ``n_batch``).
            n_predict: tokens the request will generate at most (-1: unknown); the
                extra context leaves room for twice as many.
            spm: the suffix before the prefix (llama-server's ``--spm-infill``).

        Raises:
            InvalidRequest: the model has no FIM prefix, suffix or middle token
                (:attr:`fim_tokens`), or an argument has the wrong type.
        """
        return infill_prompt(
            self._backend.vocab,
            prefix,
            suffix,
            extra=extra,
            prompt=prompt,
            n_ctx=self._n_ctx_slot if n_ctx is None else n_ctx,
            n_batch=self._backend.n_batch if n_batch is None else n_batch,
            n_predict=n_predict,
            spm=spm,
        )

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        template_kwargs: Mapping[str, Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text the chat template makes of ``messages``, as ``Chat`` renders it
        before tokenizing (in the caller's thread).

        Args:
            messages: the chat, as ``Chat`` takes it.
            template_kwargs: the template's variables, as ``Chat.template_kwargs``
                (over the server's ``chat_template_kwargs``).
            add_generation_prompt: open the assistant's turn, as
                ``Chat.add_generation_prompt``.
            tools: tool definitions: OpenAI function tools render as a ``Chat`` with
                ``tools`` renders them (the template's own description, or the generic
                format's system text); other JSON objects go to the template's ``tools``
                variable as they are, as llama-server's ``/apply-template`` renders them.

        Raises:
            InvalidRequest: the messages or variables are not valid for a ``Chat``, the
                tools are not a list of JSON objects within ``template_kwargs``' limits,
                the model has no chat template, or the template refused them.
        """
        # The same checks as a Chat request; function tools render as a Chat's do.
        try:
            chat = Chat(
                messages,
                template_kwargs=template_kwargs,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
            )
        except InvalidRequest:
            if tools is None:
                raise
            chat = None
        if chat is not None:
            return self._backend.chat.render_request(chat)
        chat = Chat(messages, template_kwargs=template_kwargs, add_generation_prompt=add_generation_prompt)
        checked = checked_template_tools(tools) if tools is not None else None
        return self._backend.chat.render(
            [dict(m) for m in chat.messages],
            chat.template_kwargs,
            add_generation_prompt=chat.add_generation_prompt,
            tools=checked,
        )

    def __repr__(self) -> str:
        return f"Tokenizer(n_vocab={self.n_vocab})"
