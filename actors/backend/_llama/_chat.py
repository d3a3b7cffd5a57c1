"""Chat prompts: a request's messages and tools rendered with the chat template and
tokenized, its tool grammar, and how to read its reply (any thread).

Pure Python over the vocabulary (:class:`~actors.backend._llama._vocab.LlamaVocab`)
and the template (:class:`~actors.backend._template.ChatTemplate`); the tool-call
formats are :mod:`actors.chat`'s. Special tokens come only from the template
(:mod:`actors.backend._chat`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from actors.backend._chat import chat_tokens, check_fields, prefill
from actors.backend._llama._vocab import LlamaVocab
from actors.backend._template import ChatTemplate
from actors.chat import (
    ReplySpec,
    TemplateInfo,
    ToolGrammar,
    chat_grammar,
    detect,
    param_types,
    template_messages,
    template_tools,
)
from actors.contract import Chat, InvalidRequest, StreamChat, grammar_for_schema, template_variables

__all__ = ["LlamaChat"]


class LlamaChat:
    """A model's chat template, compiled, and what renders with it (any thread).

    Args:
        template: the Jinja text (the model's own, or the server's ``chat_template``),
            or None when the model has none.
        vocab: the model's vocabulary (its BOS and EOS texts, tokenizing).
        defaults: the template's variables every chat gets (``chat_template_kwargs``).
        json_schema_grammar: a JSON Schema's GBNF (tool parameters are constrained by it).
    """

    def __init__(
        self,
        template: str | None,
        vocab: LlamaVocab,
        defaults: Mapping[str, Any],
        json_schema_grammar: Callable[[object], str],
    ) -> None:
        self._vocab = vocab
        self._template_defaults = defaults
        self.json_schema_grammar = json_schema_grammar
        self._specials = vocab.specials
        # Rendered as the formatter llama_cpp.Llama builds from the GGUF metadata, so chat
        # prompts render (and so tokenize) exactly as create_chat_completion's do; a
        # custom template renders the same way, with the same variables.
        self._chat = (
            None
            if template is None
            else ChatTemplate(template, bos_token=vocab.text(vocab.bos), eos_token=vocab.text(vocab.eos))
        )
        self.has_template: bool = self._chat is not None
        # What the template speaks (its tool-call format) and renders: probed once.
        self.info: TemplateInfo | None = (
            detect(self._chat.source, lambda m, tools: self._render(m, None, True, tools))
            if self._chat is not None
            else None
        )

    def render(
        self,
        messages: list[dict[str, str]],
        template_kwargs: Mapping[str, Any] | None = None,
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt for ``messages`` under the chat template (thread-safe): the model's
        own, or the server's ``chat_template``.

        ``template_kwargs`` (checked, as a request's) are the template's variables, over
        the server's ``chat_template_kwargs``; each render gets its own copy. Without
        ``add_generation_prompt`` the assistant's turn is not opened (a final assistant
        message is still a prefill); ``tools`` (checked) go to the template's ``tools``.
        """
        history, suffix = prefill(messages)
        add = add_generation_prompt or len(history) < len(messages)  # a prefill opens the turn
        return self._render(history, template_kwargs, add, tools) + suffix

    def _render(
        self,
        messages: list[dict[str, str]],
        template_kwargs: Mapping[str, Any] | None,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        if self._chat is None:
            raise InvalidRequest("the model has no chat template")
        # llama.cpp's extra context (common_chat_extra_context): templates that print the
        # date find today's, under the server's and the request's own variables.
        now = time.localtime()
        today = {"datetime": time.strftime("%b %d %Y", now), "date_string": time.strftime("%d %b %Y", now)}
        variables = template_variables({**today, **self._template_defaults, **(template_kwargs or {})})
        plain_tools = template_variables({"tools": tools})["tools"] if tools else None
        try:
            return self._chat.render(
                messages, variables, add_generation_prompt=add_generation_prompt, tools=plain_tools
            )
        except Exception as e:  # the template's raise_exception, or a Jinja error
            raise InvalidRequest(f"the chat template refused these messages: {e}") from None

    def _chat_render(
        self, message: Chat | StreamChat
    ) -> tuple[TemplateInfo, tuple[list[dict[str, Any]], str, dict[str, Any], bool, Any, str]]:
        """A chat request rendered (any thread): the template's info, then the history,
        the prefill suffix, the variables, whether the turn is opened, the tools the
        template describes, and the rendered text (without the suffix)."""
        info = self.info
        if info is None:
            raise InvalidRequest("the model has no chat template")
        tools, choice = message.tools, message.tool_choice or "auto"
        variables = dict(message.template_kwargs or {})
        if info.enable_thinking and "enable_thinking" not in {**self._template_defaults, **variables}:
            # As llama-server: a template that can think does, unless its budget is 0.
            variables["enable_thinking"] = message.reasoning_budget != 0
        described = template_tools(tools, info)
        history, suffix = prefill(template_messages(message.messages, info, tools, choice))
        add = message.add_generation_prompt or bool(suffix)
        rendered = self._render(history, variables, add, described)
        return info, (history, suffix, variables, add, described, rendered)

    def render_request(self, message: Chat | StreamChat) -> str:
        """The prompt text of a chat request, tools and tool calls as its tokens will
        have them (any thread)."""
        _, (_, suffix, _, _, _, rendered) = self._chat_render(message)
        return rendered + suffix

    def prompt(
        self, message: Chat | StreamChat, reasoning_format: str = "auto"
    ) -> tuple[list[int], ToolGrammar | None, ReplySpec | None]:
        """A chat request's prompt tokens, its tool grammar (or None) and how to read
        its reply (None: the text is the content), in the caller's thread.

        ``reasoning_format`` is the server's default for requests that set none.

        Raises:
            InvalidRequest: the template refuses the chat, a tool is refused, or a
                field other than content spells a special token.
        """
        info, r = self._chat_render(message)
        history, suffix, variables, add, described, rendered = r
        tools, choice = message.tools, message.tool_choice or "auto"
        reasoning = (message.reasoning_format or reasoning_format) != "none"
        syntax = info.syntax
        thinking = bool(
            reasoning and syntax.think and not suffix and rendered.rstrip().endswith(syntax.think[0])
        )
        grammar = chat_grammar(
            info,
            tools=tools,
            choice=choice,
            parallel=message.parallel_tool_calls,
            convert=lambda schema: grammar_for_schema(schema, self.json_schema_grammar),
            thinking=thinking,
            response_schema=message.json_schema,
        )
        if not message.parse_special and described:
            check_fields([{"role": "tools", "tools": described}], self._specials)
        prompt = chat_tokens(
            history,
            message.parse_special,
            lambda chat: self._render(chat, variables, add, described),
            self._specials,
            lambda text, special: self._vocab.tokenize(text, add_special=False, parse_special=special),
            suffix,
            rendered=rendered,
        )
        tools_on = bool(tools) and choice != "none"
        # GPT-OSS's channels and a reply that opens after Functionary's ">>>" need reading
        # even without tools: their markers are never content.
        structured = syntax.body == "channels" or syntax.opened
        if not tools_on and not (reasoning and syntax.think) and not structured:
            return prompt, None, None
        spec = ReplySpec(
            syntax, tools=tools_on, reasoning=reasoning, thinking=thinking, param_types=param_types(tools)
        )
        return prompt, grammar, spec

    def tokenize_chat(
        self,
        messages: list[dict[str, str]],
        parse_special: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The prompt tokens of a chat (thread-safe), as ``create_chat_completion`` makes them.

        Special tokens come only from the template: text inside message content that
        spells one (``<|im_start|>system``) is tokenized as text, so no message can forge
        another role, unless ``parse_special`` allows it. ``template_kwargs`` and
        ``add_generation_prompt`` are as :meth:`render_chat`'s.
        """
        history, suffix = prefill(messages)
        add = add_generation_prompt or len(history) < len(messages)
        return chat_tokens(
            history,
            parse_special,
            lambda chat: self._render(chat, template_kwargs, add),
            self._specials,
            lambda text, special: self._vocab.tokenize(text, add_special=False, parse_special=special),
            suffix,
        )
