"""Chat formats without a model: every template's detection, round trips through each
family's own template, llama.cpp's test vectors, the reply parser's invariants, the
JSON reader, and the tool grammars (checked as llama.cpp parses them, and run on the
replies the templates write).

Pure Python: templates render with jinja2 (``actors.backend._template``), schemas
convert with llama-cpp-python's pure-Python converter, and grammars run on a small
simulation of llama.cpp's grammar stacks.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping
from typing import Any

import pytest
from templates import template, templates_dir

from actors.backend._template import ChatTemplate
from actors.chat import (
    FORMATS,
    JsonError,
    JsonReader,
    ReplyParser,
    ReplySpec,
    Syntax,
    detect,
    param_types,
    template_messages,
    template_tools,
    tool_grammar,
    write_calls,
)
from actors.contract import ToolCallDelta
from actors.contract._gbnf import _Parser, check_grammar
from actors.contract._gbnf_elements import (
    _ALT,
    _CHAR,
    _CHAR_ALT,
    _CHAR_ANY,
    _CHAR_NOT,
    _END,
    _REF,
    _RNG_UPPER,
)

pytestmark = pytest.mark.timeout(120)

BAR = "\uff5c"  # DeepSeek's markers sit between fullwidth bars


def ds(word: str) -> str:
    return f"<{BAR}{word}{BAR}>"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SPECIAL = {
    "type": "function",
    "function": {
        "name": "special_function",
        "description": "I'm special",
        "parameters": {"type": "object", "properties": {"arg1": {"type": "integer"}}, "required": ["arg1"]},
    },
}
SPECIAL_OPT = {
    "type": "function",
    "function": {
        "name": "special_function_with_opt",
        "parameters": {
            "type": "object",
            "properties": {"arg1": {"type": "integer"}, "arg2": {"type": "integer"}},
            "required": ["arg1"],
        },
    },
}
TOOLS = [WEATHER, SPECIAL, SPECIAL_OPT]


# -- helpers ---------------------------------------------------------------------------


def compiled(name: str) -> ChatTemplate:
    return ChatTemplate(template(name), bos_token="<s>", eos_token="</s>")


def render_with(chat: ChatTemplate) -> Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]:
    return lambda messages, tools: chat.render(messages, {}, add_generation_prompt=True, tools=tools)


def detected(name: str) -> Any:
    chat = compiled(name)
    return detect(chat.source, render_with(chat))


class Run:
    """A parser fed a reply in pieces, with what it released, checked as it goes."""

    def __init__(self, parser: ReplyParser) -> None:
        self.parser = parser
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.deltas: list[ToolCallDelta] = []

    def take(self, parsed: Any) -> None:
        self.content.append(parsed.content)
        self.reasoning.append(parsed.reasoning)
        self.deltas += parsed.tool_calls

    def check(self) -> None:
        """The invariants: pieces join to the parser's text, fragments to each call's
        arguments (JSON objects), the first delta of each call names it."""
        parser = self.parser
        assert "".join(self.content) == "".join(parser.content)
        assert "".join(self.reasoning) == "".join(parser.reasoning)
        calls = parser.tool_calls
        fragments: dict[int, list[str]] = {}
        for delta in self.deltas:
            if delta.index not in fragments:
                assert delta.id is not None and delta.name is not None
                fragments[delta.index] = []
            else:
                assert delta.id is None and delta.name is None
            fragments[delta.index].append(delta.arguments)
        assert sorted(fragments) == list(range(len(fragments)))
        indexes = []
        for call in calls:  # each complete call: its first delta, and its fragments joined
            first = next(d for d in self.deltas if d.id == call.id)
            assert first.name == call.name
            assert "".join(fragments[first.index]) == call.arguments
            assert isinstance(json.loads(call.arguments), dict)
            indexes.append(first.index)
        assert indexes == sorted(indexes)

    @property
    def text(self) -> str:
        return "".join(self.parser.content)

    @property
    def thought(self) -> str:
        return "".join(self.parser.reasoning)

    @property
    def calls(self) -> list[tuple[str, Any]]:
        return [(c.name, json.loads(c.arguments)) for c in self.parser.tool_calls]


def pieces(text: str, how: int | str) -> list[str]:
    """``text`` cut ``"whole"``, into ``"chars"``, or at random (1 to 8 characters, seed ``how``)."""
    if how == "whole":
        return [text] if text else []
    if how == "chars":
        return list(text)
    rng = random.Random(how)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 8)
        out.append(text[i : i + n])
        i += n
    return out


def parse(
    text: str,
    syntax: Syntax | str,
    *,
    how: int | str = 0,
    tools: bool = True,
    reasoning: bool = True,
    thinking: bool = False,
    types: Mapping[str, Mapping[str, str]] | None = None,
) -> Run:
    """``text`` fed to a fresh parser in pieces (see :func:`pieces`), then finished."""
    syntax = FORMATS[syntax] if isinstance(syntax, str) else syntax
    spec = ReplySpec(syntax, tools=tools, reasoning=reasoning, thinking=thinking, param_types=types)
    run = Run(spec.parser())
    for piece in pieces(text, how):
        run.take(run.parser.feed(piece))
    run.take(run.parser.finish())
    run.check()
    return run


def parse_all(text: str, syntax: Syntax | str, **options: Any) -> Run:
    """``text`` parsed whole, a character at a time, and cut at random three ways: the
    same content, thinking and calls every way; the whole run."""
    runs = [parse(text, syntax, how=how, **options) for how in ("whole", "chars", 1, 2, 3)]
    for run in runs[1:]:
        assert (run.text, run.thought, run.calls) == (runs[0].text, runs[0].thought, runs[0].calls)
    return runs[0]


# -- detection: every template --------------------------------------------------------

# Each template in llama.cpp's folder and the format it speaks, with whether it thinks.
# Templates of families with no format of ours stay generic (their grammar forces the
# generic JSON reply, which any model can follow).
DETECTED = {
    "Apertus-8B-Instruct": ("generic", False),
    "Apriel-1.6-15b-Thinker-fixed": ("apriel", False),
    "Bielik-11B-v3.0-Instruct": ("hermes", True),
    "ByteDance-Seed-OSS": ("seed_oss", True),
    "Cohere2MoE": ("generic", False),
    "CohereForAI-c4ai-command-r-plus-tool_use": ("generic", False),
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": ("command_r7b", True),
    "GLM-4.6": ("glm", True),
    "GLM-4.7-Flash": ("glm", True),
    "GigaChat3-10B-A1.8B": ("generic", False),
    "GigaChat3.1-10B-A1.8B": ("generic", False),
    "HuggingFaceTB-SmolLM3-3B": ("generic", True),  # this template knows no tools
    "Kimi-K2-Instruct": ("kimi_k2", False),
    "Kimi-K2-Thinking": ("kimi_k2", True),
    "Kimi-K3": ("generic", False),
    "LFM2-8B-A1B": ("generic", False),
    "LFM2.5-8B-A1B": ("generic", True),
    "LFM2.5-Instruct": ("generic", True),
    "MiMo-VL": ("hermes", False),
    "MiniMax-M1": ("generic", False),
    "MiniMax-M2": ("generic", True),
    "MiniMax-M3": ("generic", False),
    "Mistral-Small-3.2-24B-Instruct-2506": ("mistral_small", False),
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": ("qwen3_coder", True),
    "NVIDIA-Nemotron-Nano-v2": ("nemotron_v2", True),
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": ("hermes", False),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("hermes", False),
    "Qwen-QwQ-32B": ("hermes", True),
    "Qwen-Qwen2.5-7B-Instruct": ("hermes", False),
    "Qwen-Qwen3-0.6B": ("hermes", True),
    "Qwen3-Coder": ("qwen3_coder", False),
    "Qwen3.5-4B": ("qwen3_coder", True),
    "Reka-Edge": ("hermes", True),
    "Spark2.5": ("glm", True),
    "StepFun3.5-Flash": ("qwen3_coder", True),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": ("generic", True),  # no tools, no calls
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("deepseek_r1", True),
    "deepseek-ai-DeepSeek-V3.1": ("deepseek_v3_1", True),
    "deepseek-ai-DeepSeek-V3.2": ("generic", True),
    "deepseek-ai-DeepSeek-V4-Flash-0731": ("generic", True),
    "deepseek-ai-DeepSeek-V4": ("generic", True),
    "fireworks-ai-llama-3-firefunction-v2": ("generic", False),
    "google-gemma-2-2b-it": ("generic", False),
    "google-gemma-4-31B-it-interleaved": ("generic", False),
    "google-gemma-4-31B-it": ("generic", False),
    "ibm-granite-granite-3.3-2B-Instruct": ("granite", True),
    "ibm-granite-granite-4.0": ("hermes", False),
    "ibm-granite-granite-4.1": ("hermes", False),
    "inclusionai-ling-3.0-flash": ("glm", True),
    "llama-cpp-deepseek-r1": ("deepseek_r1", True),
    "llama-cpp-rwkv-world": ("generic", True),
    "meetkai-functionary-medium-v3.1": ("functionary_v3_1", False),
    "meetkai-functionary-medium-v3.2": ("functionary_v3_2", False),
    "meta-llama-Llama-3.1-8B-Instruct": ("llama3", False),
    "meta-llama-Llama-3.2-3B-Instruct": ("llama3", False),
    "meta-llama-Llama-3.3-70B-Instruct": ("llama3", False),
    "microsoft-Phi-3.5-mini-instruct": ("generic", False),
    "mistralai-Ministral-3-14B-Reasoning-2512": ("devstral", True),
    "mistralai-Mistral-Nemo-Instruct-2407": ("mistral", False),
    "moonshotai-Kimi-K2": ("kimi_k2", False),
    "muse-glimmer": ("generic", False),
    "openai-gpt-oss-120b": ("gpt_oss", True),
    "openbmb-MiniCPM5-1B": ("generic", True),
    "poolside-Laguna-S-2.1": ("glm", True),
    "poolside-Laguna-XS-2.1": ("glm", True),
    "poolside-Laguna-XS.2": ("glm", True),
    "tencent-Hy3": ("generic", False),
    "unsloth-Apriel-1.5": ("apriel", False),
    "unsloth-mistral-Devstral-Small-2507": ("devstral", False),
    "upstage-Solar-Open-100B": ("generic", False),
}


def test_the_table_covers_every_template() -> None:
    names = {path.stem for path in templates_dir().glob("*.jinja")}
    assert names == set(DETECTED), "a template was added or removed: give it its expected format"


def test_tojson_lists_what_a_filter_leaves_as_a_generator() -> None:
    # llama.cpp's own R1 template writes `tools | map(attribute='function') | tojson`.
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    prompt = compiled("llama-cpp-deepseek-r1").render([{"role": "user", "content": "hi"}], {}, tools=tools)
    assert '"name": "get_weather"' in prompt and "<generator" not in prompt


@pytest.mark.parametrize("name", sorted(DETECTED))
def test_detection_finds_each_templates_format(name: str) -> None:
    info = detected(name)
    fmt, thinks = DETECTED[name]
    assert (info.syntax.name, info.syntax.think is not None) == (fmt, thinks)
    assert info.syntax.name in FORMATS
    if info.syntax.name != "generic":
        assert info.tool_calls or info.tools  # made for tools: it renders calls or describes tools


def test_xml_templates_get_arguments_as_objects() -> None:
    # GLM and Qwen3-Coder write each parameter of an object, and refuse a JSON text.
    for name in ("GLM-4.6", "Qwen3-Coder", "Qwen3.5-4B", "ByteDance-Seed-OSS"):
        assert detected(name).object_arguments, name
    assert not detected("meetkai-functionary-medium-v3.2").object_arguments  # it concatenates text


# -- round trips through each family's own template ------------------------------------

_END_OF_TURN = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "</s>",
    ds("end▁of▁sentence"),
    "<|END_OF_TURN_TOKEN|>",
    "<|end_of_text|>",
    "<|observation|>",
    "<|role_end|>",
    "</assistant>",
    "<SPECIAL_12>",
    "<|end|>",
    "<|call|>",
    "[TOOL_RESULTS]",
    "<seed:eos>",
    "<sep>",
)

# Templates that write no content beside calls in the same turn.
_NO_CONTENT = {"llama-cpp-deepseek-r1", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "NVIDIA-Nemotron-Nano-v2"}

ROUND_TRIPS = sorted(n for n, (fmt, _) in DETECTED.items() if fmt != "generic")

ARGUMENTS = [{"city": 'Paris "x"', "days": 3}, {"city": "Rome"}]


def written(name: str, n_calls: int, content: str, reasoning: str | None) -> tuple[Any, str, bool]:
    """What ``name``'s template writes for an assistant turn that made ``n_calls``
    calls of get_weather: the template's info, the reply (as the model would have
    generated it after the prompt, up to its end of turn), and whether the prompt left
    the reply inside thinking."""
    chat = compiled(name)
    info = detect(chat.source, render_with(chat))
    user = {"role": "user", "content": "What is the weather?"}
    calls = [
        {
            "id": f"c{i:08d}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(a)},
        }
        for i, a in enumerate(ARGUMENTS[:n_calls])
    ]
    assistant: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": calls}
    if reasoning is not None:
        assistant["reasoning_content"] = reasoning
    history = template_messages([user, assistant], info, TOOLS, "auto")
    described = template_tools(TOOLS, info)
    prompt = chat.render(history[:-1], {}, add_generation_prompt=True, tools=described)
    full = chat.render(history, {}, add_generation_prompt=False, tools=described)
    start = 0
    while start < min(len(prompt), len(full)) and prompt[start] == full[start]:
        start += 1
    if start < len(prompt):  # the prompt's tail differs: cut where a marker or line ends
        while start and full[start - 1] not in ">\n":
            start -= 1
    syntax = info.syntax
    thinking = syntax.think is not None and full[:start].rstrip().endswith(syntax.think[0])
    reply = full[start:]
    own = set(syntax.markers(tools=True, reasoning=True)) - {"<|call|>"}
    ends = [i for end in _END_OF_TURN if end not in own and (i := reply.find(end)) >= 0]
    return info, reply[: min(ends)] if ends else reply, thinking


def written_calls(name: str, content: str, reasoning: str | None) -> tuple[Any, str, bool, int]:
    """:func:`written` with two calls, or one where the template takes only one."""
    info = detected(name)
    if info.syntax.parallel:
        try:
            return (*written(name, 2, content, reasoning), 2)
        except ValueError:  # the template's raise_exception: one call at a time
            pass
    return (*written(name, 1, content, reasoning), 1)


@pytest.mark.parametrize("name", ROUND_TRIPS)
def test_a_reply_written_by_the_template_parses_back(name: str) -> None:
    content = "" if name in _NO_CONTENT else "CONTENT"
    info, reply, thinking, n_calls = written_calls(name, content, "REASONING")
    assert "Rome" in reply or n_calls == 1
    run = parse_all(reply, info.syntax, thinking=thinking, types=param_types(TOOLS))
    assert run.calls == [("get_weather", a) for a in ARGUMENTS[:n_calls]]
    expected_content = "CONTENT" if content and "CONTENT" in reply else ""
    expected_thought = "REASONING" if "REASONING" in reply else ""
    if info.syntax.name == "gpt_oss":  # a turn with calls has one analysis: the thinking
        expected_content = ""
    if name == "Apriel-1.6-15b-Thinker-fixed":  # its thinking has no markers of ours: content
        expected_content, expected_thought = reply[: reply.index("<tool_calls>")].strip(), ""
    assert (run.text.strip(), run.thought) == (expected_content, expected_thought)
    # Without the types the XML formats guess, and get the same arguments here.
    assert parse(reply, info.syntax, thinking=thinking).calls == run.calls
    # Without tools, nothing is a call.
    assert parse(reply, info.syntax, tools=False, thinking=thinking).calls == []


@pytest.mark.parametrize("name", ROUND_TRIPS)
def test_each_format_writes_what_it_reads(name: str) -> None:
    syntax = detected(name).syntax
    calls = [("get_weather", ARGUMENTS[0]), ("special_function", {"arg1": 1})]
    calls = calls if syntax.parallel else calls[:1]
    text = write_calls(syntax, calls)
    if syntax.opened:
        text = text.removeprefix(syntax.call_open or "")
    assert parse_all(text, syntax, types=param_types(TOOLS)).calls == calls


def test_the_generic_format_reads_json_even_where_the_prompt_opened_thinking() -> None:
    # Its grammar holds the whole reply to the JSON document: no thinking comes first.
    syntax = detected("deepseek-ai-DeepSeek-R1-Distill-Llama-8B").syntax
    run = parse_all('{"tool_calls": [{"name": "f", "arguments": {}}]}', syntax, thinking=True)
    assert (run.calls, run.thought, run.text) == ([("f", {})], "", "")
    assert parse_all("I'm\nthinking</think>Hi", syntax, thinking=True, tools=False).thought == "I'm\nthinking"


def test_the_generic_format_round_trips() -> None:
    syntax = FORMATS["generic"]
    text = write_calls(syntax, [("get_weather", ARGUMENTS[0]), ("special_function", {"arg1": 1})])
    run = parse_all(text, syntax)
    assert run.calls == [("get_weather", ARGUMENTS[0]), ("special_function", {"arg1": 1})]
    assert run.text == ""
    answer = parse_all(json.dumps({"response": "Hello, world!\nWhat's up?"}), syntax)
    assert (answer.text, answer.calls) == ("Hello, world!\nWhat's up?", [])


# -- llama.cpp's test vectors (tests/test-chat.cpp) ------------------------------------

HELLO = "Hello, world!\nWhat's up?"
CALL = [("special_function", {"arg1": 1})]
TWO_CALLS = [("special_function", {"arg1": 1}), ("special_function_with_opt", {"arg1": 1, "arg2": 2})]
R1_CALL = (
    ds("tool▁calls▁begin") + ds("tool▁call▁begin") + "function" + ds("tool▁sep") + "special_function\n"
    '```json\n{"arg1": 1}```' + ds("tool▁call▁end") + ds("tool▁calls▁end")
)


def v31_call(name: str, args: str) -> str:
    return ds("tool▁call▁begin") + name + ds("tool▁sep") + args + ds("tool▁call▁end")


def kimi_call(name: str, index: int, args: str) -> str:
    return f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


def kimi(*calls: str) -> str:
    return "<|tool_calls_section_begin|>" + "".join(calls) + "<|tool_calls_section_end|>"


QWEN_CALL = (
    "<tool_call>\n<function=special_function>\n<parameter=arg1>\n1\n</parameter>\n</function>\n</tool_call>"
)
QWEN_OPT = (
    "<tool_call>\n<function=special_function_with_opt>\n<parameter=arg1>\n1\n</parameter>\n"
    "<parameter=arg2>\n2\n</parameter>\n</function>\n</tool_call>"
)
SEED_CALL = (
    "<seed:tool_call>\n<function=special_function>\n<parameter=arg1>1</parameter>\n</function>\n"
    "</seed:tool_call>"
)
SEED_OPT = (
    "<seed:tool_call>\n<function=special_function_with_opt>\n<parameter=arg1>1</parameter>\n"
    "<parameter=arg2>2</parameter>\n</function>\n</seed:tool_call>"
)

# (template, reply, thinking: the prompt opened thinking, content, reasoning, calls)
VECTORS: list[tuple[str, str, bool, str, str, list[tuple[str, Any]]]] = [
    ("Qwen-Qwen2.5-7B-Instruct", HELLO, False, HELLO, "", []),
    (
        "Qwen-Qwen2.5-7B-Instruct",
        '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>',
        False,
        "",
        "",
        CALL,
    ),
    (
        "Qwen-QwQ-32B",
        "Let me think about this...\n</think>\nThe answer is 42.",
        True,
        "The answer is 42.",
        "Let me think about this...",
        [],
    ),
    ("Qwen-QwQ-32B", "</think>Hello, world!", True, "Hello, world!", "", []),
    (
        "ibm-granite-granite-4.0",
        '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>',
        False,
        "",
        "",
        CALL,
    ),
    (
        "mistralai-Mistral-Nemo-Instruct-2407",
        '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}, "id": "123456789"}]',
        False,
        "",
        "",
        CALL,
    ),
    ("meta-llama-Llama-3.1-8B-Instruct", HELLO, False, HELLO, "", []),
    ("meta-llama-Llama-3.1-8B-Instruct", '```json\n"42"\n```', False, '```json\n"42"\n```', "", []),
    # Unlike llama.cpp, a reply without calls keeps its trailing whitespace.
    ("meta-llama-Llama-3.1-8B-Instruct", '"42"\n', False, '"42"\n', "", []),
    (
        "meta-llama-Llama-3.1-8B-Instruct",
        '{"name": "special_function", "parameters": {"arg1": 1}}',
        False,
        "",
        "",
        CALL,
    ),
    ("meetkai-functionary-medium-v3.1", HELLO, False, HELLO, "", []),
    (
        "meetkai-functionary-medium-v3.1",
        '<function=special_function>{"arg1": 1}</function>',
        False,
        "",
        "",
        CALL,
    ),
    ("meetkai-functionary-medium-v3.2", "all\n" + HELLO, False, HELLO, "", []),
    ("meetkai-functionary-medium-v3.2", 'special_function\n{"arg1": 1}', False, "", "", CALL),
    ("llama-cpp-deepseek-r1", "</think>" + HELLO, True, HELLO, "", []),
    ("llama-cpp-deepseek-r1", "I'm\nthinking</think>" + HELLO, True, HELLO, "I'm\nthinking", []),
    ("llama-cpp-deepseek-r1", "</think>" + R1_CALL, True, "", "", CALL),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", R1_CALL, False, "", "", CALL),
    (
        "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
        "I'm\nthinking</think>" + HELLO,
        True,
        HELLO,
        "I'm\nthinking",
        [],
    ),
    (
        "deepseek-ai-DeepSeek-V3.1",
        ds("tool▁calls▁begin") + v31_call("get_time", '{"city": "XYZCITY"}') + ds("tool▁calls▁end"),
        False,
        "",
        "",
        [("get_time", {"city": "XYZCITY"})],
    ),
    (
        "deepseek-ai-DeepSeek-V3.1",
        "REASONING</think>"
        + ds("tool▁calls▁begin")
        + v31_call("get_time", '{"city": "Tokyo"}')
        + ds("tool▁calls▁end"),
        True,
        "",
        "REASONING",
        [("get_time", {"city": "Tokyo"})],
    ),
    (
        "deepseek-ai-DeepSeek-V3.1",
        "REASONING</think>CONTENT"
        + ds("tool▁calls▁begin")
        + v31_call("get_time", '{"city": "Paris"}')
        + v31_call("get_weather", '{"city": "Paris"}')
        + ds("tool▁calls▁end"),
        True,
        "CONTENT",
        "REASONING",
        [("get_time", {"city": "Paris"}), ("get_weather", {"city": "Paris"})],
    ),
    ("deepseek-ai-DeepSeek-V3.1", "REASONING</think>\nCONTENT", True, "CONTENT", "REASONING", []),
    ("deepseek-ai-DeepSeek-V3.1", "CONTENT", False, "CONTENT", "", []),
    (
        "CohereForAI-c4ai-command-r7b-12-2024-tool_use",
        f"<|START_RESPONSE|>{HELLO}<|END_RESPONSE|>",
        False,
        HELLO,
        "",
        [],
    ),
    (
        "CohereForAI-c4ai-command-r7b-12-2024-tool_use",
        "<|START_THINKING|>I'm\nthinking<|END_THINKING|>"
        '<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "special_function", '
        '"parameters": {"arg1": 1}}\n]'
        "<|END_ACTION|>",
        False,
        "",
        "I'm\nthinking",
        CALL,
    ),
    ("ibm-granite-granite-3.3-2B-Instruct", HELLO, False, HELLO, "", []),
    (
        "ibm-granite-granite-3.3-2B-Instruct",
        "<think>I'm\nthinking</think>" + HELLO,
        False,
        HELLO,
        "I'm\nthinking",
        [],
    ),
    (
        "ibm-granite-granite-3.3-2B-Instruct",
        f"<think>I'm\nthinking</think><response>{HELLO}</response>",
        False,
        HELLO,
        "I'm\nthinking",
        [],
    ),
    (
        "ibm-granite-granite-3.3-2B-Instruct",
        '<|tool_call|>[{"name": "special_function", "arguments": {"arg1": 1}}]',
        False,
        "",
        "",
        CALL,
    ),
    ("Kimi-K2-Thinking", HELLO, False, HELLO, "", []),
    ("Kimi-K2-Thinking", kimi(kimi_call("special_function", 0, '{"arg1": 1}')), False, "", "", CALL),
    (
        "Kimi-K2-Thinking",
        "<think>I'm thinking about this</think>" + kimi(kimi_call("special_function", 0, '{"arg1": 1}')),
        False,
        "",
        "I'm thinking about this",
        CALL,
    ),
    (
        "Kimi-K2-Thinking",
        HELLO + kimi(kimi_call("special_function", 0, '{"arg1": 1}')),
        False,
        HELLO,
        "",
        CALL,
    ),
    (
        "Kimi-K2-Thinking",
        kimi(
            kimi_call("special_function", 0, '{"arg1": 1}'),
            kimi_call("special_function_with_opt", 1, '{"arg1": 1, "arg2": 2}'),
        ),
        False,
        "",
        "",
        TWO_CALLS,
    ),
    (
        "Kimi-K2-Thinking",
        "<think>I need to call two functions</think>"
        + kimi(
            kimi_call("special_function", 0, '{"arg1": 1}'),
            kimi_call("python", 1, '{"code": "print(\'hey\')"}'),
        ),
        False,
        "",
        "I need to call two functions",
        [("special_function", {"arg1": 1}), ("python", {"code": "print('hey')"})],
    ),
    (
        "moonshotai-Kimi-K2",
        kimi(
            kimi_call("python", 0, '{"code": "def hello():\\n    print(\\"Hello, world!\\")\\n\\nhello()"}')
        ),
        False,
        "",
        "",
        [("python", {"code": 'def hello():\n    print("Hello, world!")\n\nhello()'})],
    ),
    (
        "GLM-4.6",
        "<tool_call>special_function\n<arg_key>arg1</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
        False,
        "",
        "",
        CALL,
    ),
    ("GLM-4.7-Flash", HELLO, False, HELLO, "", []),
    ("GLM-4.7-Flash", "I'm\nthinking</think>" + HELLO, True, HELLO, "I'm\nthinking", []),
    (
        "GLM-4.7-Flash",
        "<tool_call>special_function<arg_key>arg1</arg_key><arg_value>1</arg_value></tool_call>",
        False,
        "",
        "",
        CALL,
    ),
    (
        "GLM-4.7-Flash",
        "I'm\nthinking</think><tool_call>special_function<arg_key>arg1</arg_key><arg_value>1"
        "</arg_value></tool_call>",
        True,
        "",
        "I'm\nthinking",
        CALL,
    ),
    ("Mistral-Small-3.2-24B-Instruct-2506", HELLO, False, HELLO, "", []),
    (
        "Mistral-Small-3.2-24B-Instruct-2506",
        '[TOOL_CALLS]special_function[CALL_ID]123456789[ARGS]{"arg1": 1}',
        False,
        "",
        "",
        CALL,
    ),
    (
        "Mistral-Small-3.2-24B-Instruct-2506",
        '[TOOL_CALLS]special_function[CALL_ID]000000001[ARGS]{"arg1": 1}'
        '[TOOL_CALLS]special_function_with_opt[CALL_ID]000000002[ARGS]{"arg1": 1, "arg2": 2}',
        False,
        "",
        "",
        TWO_CALLS,
    ),
    (
        "unsloth-mistral-Devstral-Small-2507",
        '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}',
        False,
        "",
        "",
        CALL,
    ),
    (
        "unsloth-mistral-Devstral-Small-2507",
        HELLO + '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}',
        False,
        HELLO,
        "",
        CALL,
    ),
    (
        "mistralai-Ministral-3-14B-Reasoning-2512",
        "[THINK]I'm\nthinking[/THINK]" + HELLO,
        False,
        HELLO,
        "I'm\nthinking",
        [],
    ),
    (
        "mistralai-Ministral-3-14B-Reasoning-2512",
        '[THINK]I\'m\nthinking[/THINK][TOOL_CALLS]special_function[ARGS]{"arg1":1}',
        False,
        "",
        "I'm\nthinking",
        CALL,
    ),
    (
        "mistralai-Ministral-3-14B-Reasoning-2512",
        '[TOOL_CALLS]special_function[ARGS]{"arg1": 1}'
        '[TOOL_CALLS]special_function_with_opt[ARGS]{"arg1": 1, "arg2": 2}',
        False,
        "",
        "",
        TWO_CALLS,
    ),
    ("Qwen3-Coder", HELLO, False, HELLO, "", []),
    ("Qwen3-Coder", QWEN_CALL, False, "", "", CALL),
    ("Qwen3-Coder", QWEN_CALL.removeprefix("<tool_call>\n"), False, "", "", CALL),  # its opener skipped
    (
        "Qwen3-Coder",
        "Let me call it.\n" + QWEN_CALL.removeprefix("<tool_call>\n"),
        False,
        "Let me call it.",
        "",
        CALL,
    ),
    ("Qwen3.5-4B", f"I'm\nthinking\n</think>\n\n{HELLO}", True, HELLO, "I'm\nthinking", []),
    ("Qwen3.5-4B", QWEN_CALL, False, "", "", CALL),
    ("Qwen3.5-4B", "I'm\nthinking\n</think>\n\n" + QWEN_CALL, True, "", "I'm\nthinking", CALL),
    ("Qwen3.5-4B", QWEN_CALL + "\n" + QWEN_OPT, False, "", "", TWO_CALLS),
    (
        "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
        f"I'm\nthinking\n</think>\n{HELLO}",
        True,
        HELLO,
        "I'm\nthinking",
        [],
    ),
    ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", QWEN_CALL + "\n", False, "", "", CALL),
    ("ByteDance-Seed-OSS", HELLO, False, HELLO, "", []),
    (
        "ByteDance-Seed-OSS",
        "<seed:think>I'm thinking about the answer</seed:think>\nHello, world!",
        False,
        "Hello, world!",
        "I'm thinking about the answer",
        [],
    ),
    ("ByteDance-Seed-OSS", SEED_CALL, False, "", "", CALL),
    ("ByteDance-Seed-OSS", SEED_CALL + "\n" + SEED_OPT, False, "", "", TWO_CALLS),
    ("unsloth-Apriel-1.5", HELLO, False, HELLO, "", []),
    (
        "unsloth-Apriel-1.5",
        '<tool_calls>[{"name": "special_function", "arguments": {"arg1": 1}}]</tool_calls>',
        False,
        "",
        "",
        CALL,
    ),
    (
        "NVIDIA-Nemotron-Nano-v2",
        'I\'m\nthinking\n</think>\n<TOOLCALL>[{"name": "special_function", '
        '"arguments": {"arg1": 1}}]</TOOLCALL>',
        True,
        "",
        "I'm\nthinking",
        CALL,
    ),
    (
        "NVIDIA-Nemotron-Nano-v2",
        'I\'m\nthinking\n</think>\n\n<TOOLCALL>[{"name": "special_function", '
        '"arguments": {"arg1": 1}}]</TOOLCALL>\n',
        True,
        "",
        "I'm\nthinking",
        CALL,
    ),
]


@pytest.mark.parametrize(("name", "reply", "thinking", "content", "reasoning", "calls"), VECTORS)
def test_llama_cpp_vectors(
    name: str, reply: str, thinking: bool, content: str, reasoning: str, calls: list[tuple[str, Any]]
) -> None:
    syntax = detected(name).syntax
    # A generic template's vectors are llama.cpp's without tools (its grammar would
    # hold a reply with tools to one JSON document).
    run = parse_all(reply, syntax, thinking=thinking, types=param_types(TOOLS), tools=not syntax.json_reply)
    assert (run.text, run.thought, run.calls) == (content, reasoning, calls)


GPT_OSS: list[tuple[str, bool, str, str, list[tuple[str, Any]]]] = [
    # (reply, reasoning on, content, reasoning, calls)
    (f"<|channel|>final<|message|>{HELLO}", True, HELLO, "", []),
    (f"<|channel|>commentary<|message|>{HELLO}", True, HELLO, "", []),
    (
        f"<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>final<|message|>{HELLO}",
        True,
        HELLO,
        "I'm\nthinking",
        [],
    ),
    (
        f"<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>final<|message|>{HELLO}",
        False,
        f"<|channel|>analysis<|message|>I'm\nthinking<|end|>{HELLO}",
        "",
        [],
    ),
    ("<|channel|>analysis<|message|>I'm\nthinking", True, "", "I'm\nthinking", []),
    (' to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}', True, "", "", CALL),
    ('<|channel|>analysis to=functions.special_function<|message|>{"arg1": 1}', True, "", "", CALL),
    (
        ' to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>{"arg1": 1}',
        True,
        "",
        "",
        CALL,
    ),
    ('<|channel|>commentary to=functions.special_function<|message|>{"arg1": 1}', True, "", "", CALL),
    (
        "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant to=functions.special_function"
        '<|channel|>analysis<|message|>{"arg1": 1}',
        True,
        "",
        "I'm\nthinking",
        CALL,
    ),
    (
        "<|channel|>analysis<|message|>Thinking about edit...<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.edit <|constrain|>json<|message|>"
        '{"oldString": "if (part < railCount - 1) {", "newString": '
        '"if (part < 4) {", "replaceAll": false}',
        True,
        "",
        "Thinking about edit...",
        [
            (
                "edit",
                {
                    "oldString": "if (part < railCount - 1) {",
                    "newString": "if (part < 4) {",
                    "replaceAll": False,
                },
            )
        ],
    ),
    (
        "<|channel|>analysis<|message|>I need to output the invoice details in JSON<|end|><|start|>assistant"
        '<|channel|>final <|constrain|>json<|message|>{"amount": 123.45, "date": "2025-12-03"}',
        True,
        '{"amount": 123.45, "date": "2025-12-03"}',
        "I need to output the invoice details in JSON",
        [],
    ),
    (
        "<|channel|>analysis<|message|>I will execute python to say hello<|end|>"
        "<|start|>assistant to=container.exec"
        "<|channel|>commentary<|message|>python3 -c 'print(\"hello\")'",
        True,
        "",
        "I will execute python to say hello",
        [],
    ),
    (
        "<|channel|>analysis<|message|>I will execute python to say hello<|end|><|start|>assistant<|channel|>"
        'commentary to=python <|constrain|>code<|message|>print("hello")',
        True,
        "",
        "I will execute python to say hello",
        [],
    ),
    (
        "<|channel|>commentary to=assistant<|channel|>analysis<|message|>I'm\nthinking<|end|>"
        "<|start|>assistant"
        f"<|channel|>final<|message|>{HELLO}",
        True,
        HELLO,
        "I'm\nthinking",
        [],
    ),
    (
        "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant"
        "<|channel|>commentary to=assistant"
        f"<|channel|>final<|message|>{HELLO}",
        True,
        HELLO,
        "I'm\nthinking",
        [],
    ),
    (HELLO, True, HELLO, "", []),  # no harmony at all: content
    (
        "<|channel|>analysis<|message|>I'm\nthinking<|start|>assistant<|channel|>final<|message|>Hi",
        True,
        "Hi",
        "I'm\nthinking",
        [],
    ),  # a message not ended
]


@pytest.mark.parametrize(("reply", "reasoning_on", "content", "reasoning", "calls"), GPT_OSS)
def test_llama_cpp_vectors_gpt_oss(
    reply: str, reasoning_on: bool, content: str, reasoning: str, calls: list[tuple[str, Any]]
) -> None:
    syntax = detected("openai-gpt-oss-120b").syntax
    run = parse_all(reply, syntax, reasoning=reasoning_on)
    assert (run.text, run.thought, run.calls) == (content, reasoning, calls)
    thinking = ReplySpec(syntax, tools=True, reasoning=True).parser()
    thinking.feed("<|channel|>analysis<|message|>I'm")
    assert thinking.thinking


# -- the parser's promises -------------------------------------------------------------


def plain_reply(syntax: Syntax) -> tuple[str, str]:
    """A reply that calls nothing in ``syntax``, and its content."""
    if syntax.json_reply:
        return json.dumps({"response": HELLO}), HELLO
    if syntax.body == "channels":
        return f"<|channel|>final<|message|>{HELLO}", HELLO
    if syntax.opened:
        return "all\n" + HELLO, HELLO
    return HELLO, HELLO


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_reply_without_a_call_stays_content(fmt: str) -> None:
    reply, content = plain_reply(FORMATS[fmt])
    for tools in (True, False):
        run = parse_all(reply, fmt, tools=tools)
        if not tools and FORMATS[fmt].json_reply:
            content = reply  # without tools the generic format is plain text
        assert (run.text, run.thought, run.calls) == (content, "", [])


@pytest.mark.parametrize("fmt", sorted(f for f, s in FORMATS.items() if s.call_open))
def test_a_marker_prefix_is_held_then_released_at_finish(fmt: str) -> None:
    syntax = FORMATS[fmt]
    opener = syntax.call_open or ""
    for k in range(1, len(opener)):
        text = "Look: " + opener[:k]
        parser = ReplySpec(syntax, tools=True, reasoning=True).parser()
        if syntax.opened:
            parser.feed("all\n")
        released = parser.feed(text).content
        assert text.startswith(released)
        assert len(released) <= len("Look:")  # the prefix (and the space before it) waits
        assert released + parser.finish().content == text
        assert "".join(parser.content) == text and parser.tool_calls == ()


@pytest.mark.parametrize("fmt", sorted(f for f, s in FORMATS.items() if s.has_calls))
def test_an_open_calls_json_arguments_offer_their_closing(fmt: str) -> None:
    # The engine closes a constrained call near max_tokens with this text: the call is
    # complete after it. Formats that write arguments as XML or in channels offer none
    # (their grammar leads the way).
    syntax = FORMATS[fmt]
    text = write_calls(syntax, [("python", {"code": "print(1)"})])
    cut = text.index("print(1") + len("print(1")
    parser = ReplySpec(syntax, tools=True, reasoning=True, thinking=False).parser()
    parser.feed(text[:cut])
    json_args = syntax.body != "channels" and (syntax.tagged is None or syntax.tagged.xml is None)
    assert parser.in_call or syntax.body == "channels"
    closing = parser.closing()
    if not json_args:
        assert closing is None
        return
    assert closing is not None and closing.startswith('"}')
    parser.feed(closing)
    parser.finish()
    assert [(c.name, json.loads(c.arguments)) for c in parser.tool_calls] == [("python", {"code": "print(1"})]
    assert "".join(parser.content).strip() == ""
    offered = 0
    for end in range(cut, len(text)):  # wherever it is offered, the call is complete after it
        parser = ReplySpec(syntax, tools=True, reasoning=True, thinking=False).parser()
        parser.feed(text[:end])
        closing = parser.closing()
        if closing is not None:
            offered += 1
            parser.feed(closing)
            parser.finish()
            assert [c.name for c in parser.tool_calls] == ["python"], (text[:end], closing)
            assert "code" in json.loads(parser.tool_calls[0].arguments)
    assert offered >= 2


BROKEN = {
    "hermes": '<tool_call>\n{"no": "call"}\n</tool_call> after',
    "apriel": "<tool_calls>[1, 2]</tool_calls>",
    "mistral": "[TOOL_CALLS] no list",
    "granite": "<|tool_call|>[1, 2",
    "command_r7b": "<|START_ACTION|>oops<|END_ACTION|>",
    "functionary_v3_1": "<function=get weather>{}</function>",
    "functionary_v3_2": "see >>>not a call at all",
    "deepseek_r1": ds("tool▁calls▁begin") + "plain words",
    "deepseek_v3_1": ds("tool▁calls▁begin") + ds("tool▁call▁begin") + "f" + ds("tool▁sep") + "[1]",
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>oops",
    "glm": '<tool_call>{"name": "f"}</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=f>\n{}\n</function>\n</tool_call>",
    "mistral_small": "[TOOL_CALLS]f[ARGS]not json",
    "devstral": "[TOOL_CALLS]f g[ARGS]{}",
}


@pytest.mark.parametrize("fmt", sorted(BROKEN))
def test_a_region_that_is_no_call_is_given_back_as_content(fmt: str) -> None:
    text = BROKEN[fmt]
    lead = "all\nBefore. " if FORMATS[fmt].opened else "Before. "  # the reply is a message to all
    run = parse_all(lead + text, fmt)
    assert run.calls == []
    assert run.text == "Before. " + text


def test_a_region_that_is_not_json_is_given_back_as_content() -> None:
    run = parse_all("<tool_call>\nnot json\n</tool_call> after", "hermes")
    assert (run.text, run.calls) == ("<tool_call>\nnot json\n</tool_call> after", [])


def test_text_after_a_broken_region_is_content_and_no_more_calls_are_read() -> None:
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    run = parse_all("<tool_call>oops</tool_call> then " + call, "hermes")
    assert run.calls == [] and run.text == "<tool_call>oops</tool_call> then " + call


@pytest.mark.parametrize("fmt", ["hermes", "deepseek_r1", "qwen3_coder", "gpt_oss"])
def test_a_reply_cut_inside_a_call_completes_no_call(fmt: str) -> None:
    syntax = FORMATS[fmt]
    text = write_calls(syntax, [("get_weather", {"city": "Paris", "days": 3})])
    cut = text[: text.index("Paris") + 3]
    run = parse_all(cut, fmt, types=param_types(TOOLS))
    assert run.calls == []
    assert any(d.name == "get_weather" for d in run.deltas)  # it was announced, and streamed


def test_argument_fragments_stream_before_the_call_ends() -> None:
    syntax = FORMATS["kimi_k2"]
    text = kimi(kimi_call("get_weather", 0, '{"city": "Paris", "days": 3}'))
    parser = ReplySpec(syntax, tools=True, reasoning=True).parser()
    released: list[ToolCallDelta] = []
    for piece in pieces(text, "chars"):
        released += parser.feed(piece).tool_calls
        if piece == "P":
            break
    assert released[0].name == "get_weather" and "".join(d.arguments for d in released) == '{"city": "P'


def test_xml_values_follow_the_parameter_types() -> None:
    text = (
        "<tool_call>\n<function=f>\n<parameter=code>\n  x = 1\n  y = '<a>'\n</parameter>\n"
        "<parameter=n>\n42\n</parameter>\n<parameter=flag>\nTrue\n</parameter>\n<parameter=zip>\n01234\n</parameter>\n"
        "<parameter=list>\n[1, 2]\n</parameter>\n</function>\n</tool_call>"
    )
    types = {"f": {"code": "string", "n": "integer", "flag": "boolean", "zip": "string"}}
    run = parse_all(text, "qwen3_coder", types=types)
    assert run.calls == [
        ("f", {"code": "  x = 1\n  y = '<a>'", "n": 42, "flag": True, "zip": "01234", "list": [1, 2]})
    ]
    guessed = parse_all(text, "qwen3_coder")  # without types: JSON when it parses
    assert guessed.calls[0][1]["n"] == 42 and guessed.calls[0][1]["flag"] == "True"


def test_thinking_tells_where_the_reply_is() -> None:
    syntax = detected("Qwen-Qwen3-0.6B").syntax
    parser = ReplySpec(syntax, tools=True, reasoning=True).parser()
    assert not parser.thinking
    parser.feed("<think>")
    assert parser.thinking
    parser.feed("hmm</think>Hello")
    assert not parser.thinking
    opened = ReplySpec(syntax, tools=True, reasoning=True, thinking=True).parser()
    assert opened.thinking


def test_markers_name_the_tokens_to_show() -> None:
    r1 = ReplySpec(FORMATS["deepseek_r1"], tools=True, reasoning=True).markers
    assert {
        ds("tool▁calls▁begin"),
        ds("tool▁call▁begin"),
        ds("tool▁sep"),
        ds("tool▁call▁end"),
        "<think>",
    } <= set(r1)
    assert "<think>" not in ReplySpec(FORMATS["deepseek_r1"], tools=True, reasoning=False).markers
    harmony = ReplySpec(FORMATS["gpt_oss"], tools=False, reasoning=False).markers
    assert {"<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|call|>"} <= set(harmony)
    assert ReplySpec(FORMATS["hermes"], tools=True, reasoning=False).markers == (
        "<tool_call>",
        "</tool_call>",
    )
    kimi_markers = ReplySpec(FORMATS["kimi_k2"], tools=True, reasoning=False).markers
    assert "<|tool_call_argument_begin|>" in kimi_markers


def test_param_types_reads_the_schemas() -> None:
    assert param_types(TOOLS)["get_weather"] == {"city": "string", "days": "integer"}
    assert param_types(None) == {}


def test_templates_that_cannot_write_calls_get_them_in_their_own_syntax() -> None:
    info = detected("ibm-granite-granite-3.3-2B-Instruct")
    assert not info.tool_calls
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
    }
    history = template_messages(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}],
        info,
        TOOLS,
        "auto",
    )
    assert history[-1]["content"] == '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Rome"}}]'


def test_a_template_that_does_not_describe_tools_gets_an_example_in_its_syntax() -> None:
    info = detected("deepseek-ai-DeepSeek-V3.1")
    assert not info.tools
    history = template_messages([{"role": "user", "content": "hi"}], info, TOOLS, "auto")
    assert history[0]["role"] == "system"
    assert ds("tool▁call▁begin") + "get_weather" + ds("tool▁sep") in history[0]["content"]


# -- the JSON reader -------------------------------------------------------------------


def random_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(7 if depth < 4 else 5)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.randint(-(10**6), 10**6)
    if kind == 2:
        return rng.choice([0.5, -1e-3, 12.25e10])
    if kind in (3, 4):
        return "".join(rng.choice('ab "\\\n\té😀/') for _ in range(rng.randint(0, 6)))
    if kind == 5:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {"k" + str(i) + rng.choice('x"é'): random_json(rng, depth + 1) for i in range(rng.randint(0, 3))}


def read(text: str, how: int | str) -> tuple[list[tuple[str, Any, Any]], dict[Any, str], JsonReader]:
    """Events of ``text`` fed in pieces: starts and ends, and each path's characters."""
    reader = JsonReader(decode=lambda path: True)
    marks: list[tuple[str, Any, Any]] = []
    chars: dict[Any, str] = {}
    for piece in pieces(text, how):
        for kind, path, value in reader.feed(piece):
            if kind == "chars":
                chars[path] = chars.get(path, "") + str(value)
            else:
                marks.append((kind, path, value))
    for kind, path, value in reader.finish():
        marks.append((kind, path, value))
    return marks, chars, reader


@pytest.mark.parametrize("seed", range(40))
def test_the_json_reader_sees_the_same_values_however_the_text_is_cut(seed: int) -> None:
    rng = random.Random(seed)
    value = random_json(rng)
    text = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 2]))
    whole = read(text, "whole")
    for how in ("chars", seed, seed + 100):
        cut = read(text, how)
        assert cut[:2] == whole[:2]
    marks, chars, reader = whole
    assert reader.done and reader.consumed == len(text)
    assert marks[0] == ("start", (), 0) and marks[-1] == ("end", (), len(text))
    for kind, path, offset in marks:  # each reported value's text is valid JSON, decoded alike
        if kind == "end" and len(path) <= 2:
            start = next(o for k, p, o in marks if k == "start" and p == path)
            decoded = json.loads(text[start:offset])
            if isinstance(decoded, str):
                assert chars.get(path, "") == decoded


def test_the_json_reader_stops_at_the_end_of_the_value() -> None:
    reader = JsonReader()
    reader.feed('{"a": [1, 2]')
    assert not reader.done  # the object ends at its brace
    reader.feed("}")
    assert reader.done
    reader = JsonReader()
    reader.feed('{"a": [1, 2]} trailing text')
    assert reader.done and reader.consumed == len('{"a": [1, 2]}')
    number = JsonReader()
    number.feed("-12.5")
    assert not number.done
    assert number.finish() == [("end", (), 5)] and number.done


def test_the_json_reader_joins_surrogate_pairs() -> None:
    reader = JsonReader(decode=lambda path: True)
    events = [e for piece in pieces('"a\\ud83d\\ude00b\\ud83dc\\ude00"', "chars") for e in reader.feed(piece)]
    assert "".join(str(v) for k, _, v in events if k == "chars") == "a\U0001f600b\ufffdc\ufffd"


@pytest.mark.parametrize("seed", range(40))
def test_the_json_readers_closing_completes_every_prefix_it_can(seed: int) -> None:
    # What closes a constrained call near max_tokens: at any cut, the text it offers
    # must finish the value, or it offers None.
    rng = random.Random(seed)
    value = {"a": random_json(rng), "b": [random_json(rng)]}
    text = json.dumps(value, ensure_ascii=rng.random() < 0.5)
    offered = 0
    for cut in range(1, len(text) + 1):
        reader = JsonReader()
        reader.feed(text[:cut])
        closing = reader.closing()
        if closing is None:
            continue
        offered += 1
        json.loads(text[:cut] + closing)  # parses
        if reader.done:
            assert closing == ""
    assert offered > 0


@pytest.mark.parametrize(
    ("prefix", "closing"),
    [
        ('{"code": "print(1', '"}'),
        ('{"a": {"b": [1, 2', "]}}"),
        ('{"a": {"b": [', "]}}"),
        ("{", "}"),
        ('{"a": 1', "}"),
        ('{"a": tr', None),  # a literal half written
        ('{"a": 1.', None),
        ('{"a": 1,', None),  # a key is due
        ('{"a', None),
        ('{"a":', None),  # a value is due
        ('{"a": "x\\', None),  # an escape half written
        ('{"a": "x\\u12', None),
        ("", None),
        ('{"a": 1}', ""),
    ],
)
def test_the_json_readers_closing_in_each_state(prefix: str, closing: str | None) -> None:
    reader = JsonReader()
    reader.feed(prefix)
    assert reader.closing() == closing


@pytest.mark.parametrize(
    "text",
    [
        '{"a" 1}',
        '{"a": tru}',
        "[1,]",
        '{"a": "\x01"}',
        "{,}",
        '"\\x"',
        '"\\u12G4"',
        "]",
        "{'a': 1}",
        "[1 2]",
        "01x",
    ],
)
def test_the_json_reader_rejects_what_is_not_json(text: str) -> None:
    for how in ("whole", "chars"):
        reader = JsonReader()
        with pytest.raises(JsonError):
            for piece in pieces(text, how):
                reader.feed(piece)
            reader.finish()


# -- grammars ----------------------------------------------------------------------------


class Gbnf:
    """A GBNF grammar run on text as llama.cpp runs it: its rules as llama.cpp's parser
    builds them (``actors.contract._gbnf``), and the stacks of ``llama_grammar_accept``."""

    def __init__(self, text: str) -> None:
        parser = _Parser(text, None)
        parser.parse()
        self.rules = parser.rules
        self.root = parser.symbols["root"]

    def _end(self, rule: int, pos: int) -> bool:
        rules = self.rules[rule]
        assert rules is not None
        return rules[pos][0] in (_END, _ALT)

    def _advance(self, stack: tuple[tuple[int, int], ...], out: set[tuple[tuple[int, int], ...]]) -> None:
        if not stack:
            out.add(stack)
            return
        rule, pos = stack[-1]
        elements = self.rules[rule]
        assert elements is not None
        kind, value = elements[pos]
        if kind != _REF:
            out.add(stack)
            return
        base = stack[:-1] + (() if self._end(rule, pos + 1) else ((rule, pos + 1),))
        sub = self.rules[value]
        assert sub is not None
        start = 0
        while True:
            self._advance(base + (() if self._end(value, start) else ((value, start),)), out)
            while not self._end(value, start):
                start += 1
            if sub[start][0] != _ALT:
                break
            start += 1

    def _match(self, rule: int, pos: int, c: int) -> tuple[bool, int]:
        elements = self.rules[rule]
        assert elements is not None
        positive = elements[pos][0] in (_CHAR, _CHAR_ANY)
        assert elements[pos][0] in (_CHAR, _CHAR_NOT, _CHAR_ANY)
        found = False
        while True:
            kind, value = elements[pos]
            if elements[pos + 1][0] == _RNG_UPPER:
                found = found or value <= c <= elements[pos + 1][1]
                pos += 2
            elif kind == _CHAR_ANY:
                found, pos = True, pos + 1
            else:
                found, pos = found or value == c, pos + 1
            if elements[pos][0] != _CHAR_ALT:
                return found == positive, pos

    def accepts(self, text: str) -> bool:
        root = self.rules[self.root]
        assert root is not None
        stacks: set[tuple[tuple[int, int], ...]] = set()
        start = 0
        while True:  # each alternative of root
            self._advance(() if self._end(self.root, start) else ((self.root, start),), stacks)
            while not self._end(self.root, start):
                start += 1
            if root[start][0] != _ALT:
                break
            start += 1
        for c in text:
            new: set[tuple[tuple[int, int], ...]] = set()
            for stack in stacks:
                if not stack:
                    continue
                rule, pos = stack[-1]
                ok, after = self._match(rule, pos, ord(c))
                if ok:
                    self._advance(stack[:-1] + (() if self._end(rule, after) else ((rule, after),)), new)
            stacks = new
            if not stacks:
                return False
        return () in stacks


def convert(schema: Mapping[str, Any]) -> str:
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    return str(json_schema_to_gbnf(json.dumps(schema)))


def test_the_grammar_runner_runs_grammars() -> None:
    grammar = Gbnf('root ::= "a" [b-d]+ ( "x" | [^y] )? item*\nitem ::= "." [0-9]{1,2}')
    assert grammar.accepts("ab") and grammar.accepts("abcdx.1.22") and grammar.accepts("abz")
    assert not grammar.accepts("a") and not grammar.accepts("aby") and not grammar.accepts("ab.123")


CHOICES: list[Any] = ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}]


@pytest.mark.parametrize("name", sorted(DETECTED))
def test_every_templates_grammars_parse_as_llama_cpp_parses(name: str) -> None:
    syntax = detected(name).syntax
    for choice in CHOICES:
        for parallel in (True, False):
            for thinking in (True, False):
                grammar = tool_grammar(
                    syntax, TOOLS, choice, parallel=parallel, convert=convert, thinking=thinking
                )
                assert grammar is not None
                check_grammar(grammar.grammar)
                assert grammar.lazy == (choice == "auto" and not syntax.json_reply)
                assert bool(grammar.trigger_patterns or grammar.trigger_words) == grammar.lazy


def written_calls_only(name: str) -> tuple[Syntax, str, bool, int]:
    """A template's reply that is only calls (and thinking, where the format thinks)."""
    thinks = detected(name).syntax.think is not None
    info, reply, thinking, n_calls = written_calls(name, "", "REASONING" if thinks else None)
    reply = reply.rstrip().removesuffix("<|call|>")
    reply = reply if info.syntax.body == "channels" else reply.lstrip()  # " to=functions..."
    if info.syntax.body == "channels":
        reply = reply.replace(" json<|message|>", " <|constrain|>json<|message|>")
    return info.syntax, reply, thinking, n_calls


# Templates whose whitespace between XML arguments differs from GLM's own template.
_OWN_WHITESPACE = {"inclusionai-ling-3.0-flash"}


@pytest.mark.parametrize("name", [n for n in ROUND_TRIPS if n not in _OWN_WHITESPACE])
def test_the_required_grammar_takes_what_the_template_writes(name: str) -> None:
    syntax, reply, thinking, n_calls = written_calls_only(name)
    required = tool_grammar(syntax, TOOLS, "required", parallel=True, convert=convert, thinking=thinking)
    named = tool_grammar(syntax, TOOLS, CHOICES[2], parallel=True, convert=convert, thinking=thinking)
    assert required is not None and named is not None
    assert Gbnf(required.grammar).accepts(reply), reply
    if n_calls == 1 or syntax.json_reply:
        assert Gbnf(named.grammar).accepts(reply)
    assert not Gbnf(required.grammar).accepts(reply.replace("get_weather", "get_weathex"))
    assert reply.count("3") == 1 and not Gbnf(required.grammar).accepts(reply.replace("3", "three"))  # "days"
    single = tool_grammar(syntax, TOOLS, "required", parallel=False, convert=convert, thinking=thinking)
    assert single is not None and Gbnf(single.grammar).accepts(reply) == (n_calls == 1)


@pytest.mark.parametrize("name", [n for n in ROUND_TRIPS if n not in _OWN_WHITESPACE])
def test_the_lazy_grammar_wakes_on_the_call_and_takes_it(name: str) -> None:
    import re

    syntax, reply, thinking, _ = written_calls_only(name)
    lazy = tool_grammar(syntax, TOOLS, "auto", parallel=True, convert=convert, thinking=thinking)
    assert lazy is not None and lazy.lazy
    text = (
        reply if syntax.opened or syntax.body == "channels" or syntax.call_open == "" else "Sure.\n" + reply
    )
    found = [m for p in lazy.trigger_patterns if (m := re.search(p, text))]
    starts = [
        next((m.start(g) for g in range(1, (m.lastindex or 0) + 1) if m.group(g)), m.start()) for m in found
    ]
    words = [text.index(w) for w in lazy.trigger_words if w in text]
    start = min(starts + words)
    assert Gbnf(lazy.grammar).accepts(text[start:]), text[start:]
    assert not any(re.search(p, HELLO) for p in lazy.trigger_patterns)


SCRAPS = [
    '{"name": "f", "arguments": {"a": [1, "x"]}}',
    '{"a": 1}',
    "get_weather",
    "\n",
    " ",
    "all\n",
    ">>>",
    "f\n",
    "<arg_key>k</arg_key><arg_value>v</arg_value>",
    "<parameter=k>\n1\n</parameter>",
    "[",
    "]",
    "{",
    '"',
    "<|channel|>final<|message|>",
    " to=functions.f",
    "<|message|>",
    "hello",
    "<",
    "<|",
    "```json\n",
]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_random_replies_parse_alike_however_they_are_cut(fmt: str) -> None:
    """Text made of the format's markers, whole calls and scraps of JSON and XML: never
    an exception, the invariants hold, and every way of cutting it reads the same."""
    syntax = FORMATS[fmt]
    call = write_calls(syntax, [("get_weather", {"city": 'P"a<', "days": 3})])
    words = [
        call,
        call,
        *syntax.markers(tools=True, reasoning=True),
        *(syntax.think or ()),
        *syntax.drop,
        *SCRAPS,
    ]
    for seed in range(40):
        rng = random.Random(seed)
        text = "".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        for thinking in (False, True):
            parse_all(text, fmt, thinking=thinking, types=param_types(TOOLS))
        parse_all(text, fmt, tools=False, reasoning=False)
