"""Chat replies that think and call tools: formats, grammars and the reply parser.

Pure Python, no llama.cpp: a chat template's format is found by reading and rendering
it (:func:`detect`; the families are in :data:`FORMATS`: generic JSON, Hermes, Llama
3.x, Mistral, Functionary v3.1/v3.2, DeepSeek R1/V3.1, Command R7B, GPT-OSS, Granite,
Kimi K2, GLM, Qwen3-Coder, Mistral Small/Devstral and a few more), a chat with tools is
planned into the messages the template renders (:func:`template_messages`) and the
grammar that constrains the reply (:func:`chat_grammar`), and the reply is split into
content, thinking and tool calls as it streams (:class:`ReplyParser`, built from a
:class:`ReplySpec`).

It sits between the backend (which renders and tokenizes with it) and the contract
(whose ``ToolCall`` and ``ToolCallDelta`` it makes), and imports only the contract.
"""

from __future__ import annotations

from actors.chat._formats import FORMATS, TemplateInfo, detect, template_messages, tools_prompt
from actors.chat._grammar import ToolGrammar, call_schema, tool_grammar
from actors.chat._json_stream import JsonError, JsonReader
from actors.chat._parse import Parsed, ReplyParser, new_call_id
from actors.chat._plan import ReplySpec, chat_grammar, param_types, template_tools
from actors.chat._syntax import Syntax, Tagged, XmlArgs
from actors.chat._write import write_calls

__all__ = [
    "FORMATS",
    "JsonError",
    "JsonReader",
    "Parsed",
    "ReplyParser",
    "ReplySpec",
    "Syntax",
    "Tagged",
    "TemplateInfo",
    "ToolGrammar",
    "XmlArgs",
    "call_schema",
    "chat_grammar",
    "detect",
    "new_call_id",
    "param_types",
    "template_messages",
    "template_tools",
    "tool_grammar",
    "tools_prompt",
    "write_calls",
]
