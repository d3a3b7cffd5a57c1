"""A chat template, compiled once and rendered from any thread (no llama.cpp here).

:class:`ChatTemplate` renders as llama-cpp-python's ``Jinja2ChatFormatter`` does (the
formatter ``Llama.create_chat_completion`` uses: the same sandboxed environment,
extensions, ``tojson`` filter and variables), so a chat's prompt, and so its tokens,
are what that call makes of it. Where that formatter has no rule and llama-server has
one, it follows llama-server:

- ``add_generation_prompt`` is chosen per render (the formatter fixes it when built);
- ``tools`` are passed when a render is given some (llama-server's ``/apply-template``);
- a string ``+`` None or an undefined variable is the string: llama.cpp's own Jinja
  engine concatenates so (``workaround_concat_null_with_str`` in
  ``common/jinja/runtime.cpp``), and templates rely on it: firefunction-v2 appends its
  ``functions``, which llama-server never sets. Python's Jinja raises there, so this
  only changes renders that would otherwise fail.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from actors.contract import ConfigError

__all__ = ["ChatTemplate", "check_chat_template"]


class _IgnoreGenerationTags(jinja2.ext.Extension):
    """HuggingFace's ``{% generation %}`` tag, passed through (as llama_cpp's formatter)."""

    tags = {"generation"}  # noqa: RUF012 (jinja reads it from the class)

    def parse(self, parser: Any) -> Any:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _Environment(ImmutableSandboxedEnvironment):
    """llama_cpp's sandbox, with llama.cpp's string + None/undefined concatenation."""

    intercepted_binops = frozenset({"+"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "+":
            left_null = left is None or isinstance(left, jinja2.Undefined)
            right_null = right is None or isinstance(right, jinja2.Undefined)
            if left_null and isinstance(right, str):
                return right
            if right_null and isinstance(left, str):
                return left
        return super().call_binop(context, operator, left, right)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Transformers' (and llama_cpp's) tojson: no HTML escaping, UTF-8 kept; what a
    # filter such as ``map`` leaves (a generator) is a list, as in minja and Jinja's JS.
    return json.dumps(
        x,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
        default=_listed,
    )


def _listed(x: Any) -> list[Any]:
    if isinstance(x, Iterator):
        return list(x)
    raise TypeError(f"{type(x).__name__} is not JSON serializable")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _raise_exception(message: str) -> None:
    raise ValueError(message)


class ChatTemplate:
    """A Jinja chat template with its BOS and EOS texts; thread-safe once built.

    Raises:
        jinja2.TemplateSyntaxError: the template does not compile (RecursionError for
            absurd nesting).
    """

    def __init__(self, template: str, bos_token: str, eos_token: str) -> None:
        environment = _Environment(
            loader=jinja2.BaseLoader(),
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_IgnoreGenerationTags, jinja2.ext.loopcontrols],
        )
        environment.filters["tojson"] = _tojson
        self._template = environment.from_string(template)
        self.source = template
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        variables: Mapping[str, Any],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text of ``messages`` under ``variables`` (any thread).

        Raises:
            Exception: whatever the template raises (its ``raise_exception`` raises
                ``ValueError``), or a Jinja error.
        """
        return self._template.render(
            {
                **variables,
                "messages": messages,
                "eos_token": self.eos_token,
                "bos_token": self.bos_token,
                "raise_exception": _raise_exception,
                "add_generation_prompt": add_generation_prompt,
                # As llama_cpp's formatter: the OpenAI function-calling names are defined, None.
                "functions": None,
                "function_call": None,
                "tools": list(tools) if tools else None,
                "tool_choice": None,
                "strftime_now": _strftime_now,
            }
        )


def check_chat_template(template: str) -> None:
    """Compile ``template`` as the backend will compile a custom chat template (any thread).

    Only compiling: a template is Jinja2 run in a sandbox, which bounds what it may touch
    but not how long its loops run, so a custom template is the operator's
    (``ServerActor(chat_template=...)``), never a caller's, and its size is bounded.

    Raises:
        ConfigError: it does not compile.
    """
    try:
        ChatTemplate(template, bos_token="", eos_token="")
    except Exception as e:  # TemplateSyntaxError; RecursionError for absurd nesting
        raise ConfigError(f"chat_template is not a valid Jinja2 template: {e}") from None
