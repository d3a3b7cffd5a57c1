"""The formats by name, and which one a chat template's source speaks.

Each family writes its calls the way it was trained to (the template shows it): the
table :data:`FORMATS` holds their :class:`~actors.chat._syntax.Syntax`, and
:func:`syntax_of` finds a template's by the markers in its source, most specific
first (llama.cpp's ``common/chat.cpp`` detects the same way). A template that names
no known markers gets the generic format, which any model can follow under its
grammar.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from actors.chat._harmony import HARMONY_TOKENS
from actors.chat._syntax import Syntax, Tagged, XmlArgs

__all__ = ["FORMATS", "syntax_of"]

_THINK = ("<think>", "</think>")


def _ds(word: str) -> str:
    """A DeepSeek marker: ``word`` between fullwidth vertical bars (U+FF5C)."""
    return f"<\uff5c{word}\uff5c>"


_DS_SECTION = (_ds("tool▁calls▁begin"), _ds("tool▁calls▁end"))
_DS_CALL = (_ds("tool▁call▁begin"), _ds("tool▁call▁end"))
_DS_SEP = _ds("tool▁sep")


def _tagged(
    name: str,
    tagged: Tagged,
    *,
    think: tuple[str, str] | None = None,
    opened: bool = False,
    id_style: Literal["call", "alnum9"] = "call",
) -> Syntax:
    return Syntax(
        name,
        think=think,
        call_open=tagged.opener,
        body="tagged",
        tagged=tagged,
        opened=opened,
        id_style=id_style,
    )


_GLM = Tagged(
    open="<tool_call>",
    after_name="\n",
    xml=XmlArgs("<arg_key>", "</arg_key>\n", "<arg_value>", "</arg_value>\n"),
    close="</tool_call>",
    between="\n",
)
_GLM_COMPACT = Tagged(
    open="<tool_call>",
    xml=XmlArgs("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    close="</tool_call>",
)

FORMATS: dict[str, Syntax] = {
    "generic": Syntax("generic", json_reply=True),
    "hermes": Syntax("hermes", call_open="<tool_call>", call_close="</tool_call>", open_ws="\n"),
    "llama3": Syntax("llama3", call_open="", args_keys=("parameters", "arguments"), parallel=False),
    "mistral": Syntax("mistral", call_open="[TOOL_CALLS]", body="array", trailing_id="id", id_style="alnum9"),
    "granite": Syntax("granite", call_open="<|tool_call|>", body="array", drop=("<response>", "</response>")),
    "apriel": Syntax("apriel", call_open="<tool_calls>", call_close="</tool_calls>", body="array"),
    "nemotron_v2": Syntax("nemotron_v2", call_open="<TOOLCALL>", call_close="</TOOLCALL>", body="array"),
    "command_r7b": Syntax(
        "command_r7b",
        think=("<|START_THINKING|>", "<|END_THINKING|>"),
        call_open="<|START_ACTION|>",
        call_close="<|END_ACTION|>",
        body="array",
        name_key="tool_name",
        args_keys=("parameters",),
        id_key="tool_call_id",
        drop=("<|START_RESPONSE|>", "<|END_RESPONSE|>"),
    ),
    "functionary_v3_1": _tagged(
        "functionary_v3_1",
        Tagged(
            open="<function=",
            after_name=">",
            close="</function>",
            raw=("<|python_tag|>", "python", "code"),
            name_trigger=True,
        ),
    ),
    "functionary_v3_2": _tagged(
        "functionary_v3_2",
        Tagged(open=">>>", after_name="\n", content_name="all", name_trigger=True),
        opened=True,
    ),
    "deepseek_r1": _tagged(
        "deepseek_r1",
        Tagged(
            section=_DS_SECTION,
            open=_DS_CALL[0],
            before_name="function" + _DS_SEP,
            after_name="\n```json\n",
            after_args="\n```",
            close=_DS_CALL[1],
            between="\n",
        ),
        think=_THINK,
    ),
    "deepseek_v3_1": _tagged(
        "deepseek_v3_1",
        Tagged(section=_DS_SECTION, open=_DS_CALL[0], after_name=_DS_SEP, close=_DS_CALL[1]),
        think=_THINK,
    ),
    "kimi_k2": _tagged(
        "kimi_k2",
        Tagged(
            section=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
            open="<|tool_call_begin|>",
            before_name="functions.",
            index_sep=":",
            after_name="<|tool_call_argument_begin|>",
            close="<|tool_call_end|>",
        ),
    ),
    "glm": _tagged("glm", _GLM),
    "qwen3_coder": _tagged(
        "qwen3_coder",
        Tagged(
            open="<tool_call>",
            before_name="\n<function=",
            after_name=">\n",
            xml=XmlArgs("<parameter=", ">\n", "", "\n</parameter>\n", trim_newline=True),
            after_args="</function>\n",
            close="</tool_call>",
            between="\n",
            bare_open="<function=",
        ),
    ),
    "seed_oss": _tagged(
        "seed_oss",
        Tagged(
            open="<seed:tool_call>",
            before_name="\n<function=",
            after_name=">\n",
            xml=XmlArgs("<parameter=", ">", "", "</parameter>\n"),
            after_args="</function>\n",
            close="</seed:tool_call>",
            between="\n",
        ),
        think=("<seed:think>", "</seed:think>"),
    ),
    "mistral_small": _tagged(
        "mistral_small",
        Tagged(open="[TOOL_CALLS]", id_open="[CALL_ID]", after_name="[ARGS]"),
        id_style="alnum9",
    ),
    "devstral": _tagged("devstral", Tagged(open="[TOOL_CALLS]", after_name="[ARGS]"), id_style="alnum9"),
    "gpt_oss": Syntax(
        "gpt_oss",
        think=("<|channel|>analysis<|message|>", "<|end|>"),
        body="channels",
        parallel=False,  # <|call|> ends the generation
        specials=HARMONY_TOKENS,
    ),
}
"""The formats by name (each with thinking markers added where the template thinks)."""


def _family(source: str, rendered_call: str) -> str:
    """The name of the format whose markers ``source`` holds (most specific first)."""
    if "<|channel|>" in source:
        return "gpt_oss"
    if ">>>all" in source:
        return "functionary_v3_2"
    if "<|tool_calls_section_begin|>" in source:
        return "kimi_k2"
    if _DS_SECTION[0] in source and "dsml" not in source:
        return "deepseek_r1" if "```json" in source else "deepseek_v3_1"
    if "<|START_ACTION|>" in source and "<|START_TEXT|>" not in source and "<|START_THINKING|>" in source:
        return "command_r7b"
    if "[TOOL_CALLS]" in source:
        if "[ARGS]" not in source:
            return "mistral"
        return "mistral_small" if "[CALL_ID]" in source else "devstral"
    if "<seed:tool_call>" in source:
        return "seed_oss"
    if "<arg_key>" in source and "<tool_call>" in source:
        return "glm"
    if "<tool_call>" in source and "<function=" in source and "<parameter=" in source:
        return "qwen3_coder"
    if "<function=" in source and "</function>" in source and "<parameter" not in source:
        return "functionary_v3_1"
    if "<|tool_call|>" in source:
        return "granite"
    if "<tool_calls>[" in source:
        return "apriel"
    if "<TOOLCALL>" in source:
        return "nemotron_v2"
    if "<tool_call>" in source and "<invoke" not in source and "<function name=" not in source:
        return "hermes"
    if "<|python_tag|>" in source or ("ipython" in source and '"parameters": ' in source):
        return "llama3"
    return "generic"


def syntax_of(source: str, rendered_call: str = "") -> Syntax:
    """The syntax of the template whose text is ``source``; ``rendered_call`` is its
    rendering of an assistant's call (it tells variants apart: GLM 4.7 writes no
    newlines)."""
    syntax = FORMATS[_family(source, rendered_call)]
    if syntax.name == "glm" and "<arg_key>" in rendered_call and "\n<arg_key>" not in rendered_call:
        syntax = replace(syntax, tagged=_GLM_COMPACT)
    if syntax.think is None:
        if "[THINK]" in source and "[/THINK]" in source:
            syntax = replace(syntax, think=("[THINK]", "[/THINK]"))
        elif "<think>" in source or "</think>" in source:
            syntax = replace(syntax, think=_THINK)
    return syntax
