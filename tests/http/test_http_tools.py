"""Tool calls, thinking, and the Anthropic and Responses APIs over HTTP, with the real
``openai`` and ``anthropic`` SDKs against one server on the default model.

Each API is an adapter over the same chat core, so each test checks the adapter's
shapes (what the SDK parses) and a whole round trip: a call, its result fed back, the
next answer. ``tool_choice`` "required" (Anthropic's "any") makes the 135M model call.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from http_server import Running

from actors import ServerActor
from actors.http import HttpSettings

pytestmark = pytest.mark.timeout(180)

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"location": {"type": "string"}},
    "required": ["location"],
}
OAI_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER_PARAMS},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def running(model_path: str) -> Iterator[Running]:
    with Running.ready(
        HttpSettings(model_ids=("smol",)),
        lambda: ServerActor.start(model_path=model_path, n_parallel=2, n_ctx=4096, seed=7),
    ) as server:
        yield server


@pytest.fixture
def client(running: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture
def claude(running: Running) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=running.url, api_key="none", max_retries=0)


# -- OpenAI chat completions --------------------------------------------------------


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_openai_tool_calls_and_a_round_trip(client: openai.OpenAI, choice: Any) -> None:
    first = client.chat.completions.create(
        model="smol", messages=ASK, tools=[OAI_TOOL], tool_choice=choice, temperature=0, max_tokens=100
    )
    choice0 = first.choices[0]
    assert choice0.finish_reason == "tool_calls"
    assert choice0.message.content is None
    call = choice0.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id
    assert "location" in json.loads(call.function.arguments)
    history = [
        *ASK,
        choice0.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]
    second = client.chat.completions.create(model="smol", messages=history, tools=[OAI_TOOL], max_tokens=30)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_openai_streamed_tool_calls_join_to_the_whole_call(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="smol",
        messages=ASK,
        tools=[OAI_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=100,
        stream=True,
    )
    name, arguments, call_id, reasons = None, "", None, []
    for chunk in stream:
        for choice in chunk.choices:
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                assert delta.index == 0
                if delta.id:
                    assert call_id is None
                    call_id, name = delta.id, delta.function.name
                arguments += delta.function.arguments or ""
    assert reasons == ["tool_calls"]
    assert name == "get_weather" and call_id
    assert "location" in json.loads(arguments)
    plain = client.chat.completions.create(
        model="smol", messages=ASK, tools=[OAI_TOOL], tool_choice="required", parallel_tool_calls=False,
        temperature=0, max_tokens=100,
    )  # fmt: skip
    assert plain.choices[0].message.tool_calls[0].function.arguments == arguments


def test_openai_tool_choice_none_answers_in_text(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="smol", messages=ASK, tools=[OAI_TOOL], tool_choice="none", temperature=0, max_tokens=16
    )
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"tools": [OAI_TOOL, OAI_TOOL]}, "unique"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "letters"),
        ({"tools": [OAI_TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}}, "not one of"),
        ({"tools": "x"}, "list"),
        ({"functions": [{"name": "f"}]}, "deprecated"),
        ({"tools": [OAI_TOOL], "reasoning_format": "fancy"}, "reasoning_format"),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{x"}}],
                    },
                ]
            },
            "JSON text of an object",
        ),
        ({"messages": [*ASK, {"role": "tool", "content": "r"}]}, "tool_call_id"),
        ({"tools": [{"type": "function", "function": {"name": f"t{i}"}} for i in range(3000)]}, "at most"),
    ],
)
def test_openai_hostile_tool_bodies_are_400s(running: Running, body: dict[str, Any], needle: str) -> None:
    reply = httpx.post(running.url + "/v1/chat/completions", json={"messages": ASK, **body}, timeout=60)
    assert reply.status_code == 400, reply.text
    assert needle in reply.json()["error"]["message"]


# -- Anthropic Messages --------------------------------------------------------------

CLAUDE_TOOL = {"name": "get_weather", "description": "Weather now", "input_schema": WEATHER_PARAMS}


def test_anthropic_messages_and_count_tokens(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model="smol", max_tokens=20, system="Be brief.", messages=[{"role": "user", "content": "Hello"}]
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.output_tokens > 0
    counted = claude.messages.count_tokens(
        model="smol", system="Be brief.", messages=[{"role": "user", "content": "Hello"}]
    )
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_anthropic_tool_use_round_trip(claude: anthropic.Anthropic) -> None:
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = claude.messages.create(
        model="smol", max_tokens=100, messages=question, tools=[CLAUDE_TOOL], tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    )  # fmt: skip
    assert first.stop_reason == "tool_use"
    use = next(block for block in first.content if block.type == "tool_use")
    assert use.name == "get_weather" and "location" in use.input
    history = [
        *question,
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}]},
    ]
    second = claude.messages.create(model="smol", max_tokens=30, messages=history, tools=[CLAUDE_TOOL])
    assert second.content


def test_anthropic_stream_events_and_final_message(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(
        model="smol", max_tokens=100, extra_body={"temperature": 0}, tools=[CLAUDE_TOOL],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
    ) as stream:  # fmt: skip
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert final.stop_reason == "tool_use"
    (use,) = [block for block in final.content if block.type == "tool_use"]
    assert use.name == "get_weather" and "location" in use.input


def test_anthropic_refused_features_are_400s(running: Running) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    for body in (
        {"messages": [{"role": "user", "content": [image]}]},
        {"messages": [{"role": "system", "content": "x"}]},
        {"messages": "hi"},
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "bash_20250124", "name": "bash"}],
        },
    ):
        reply = httpx.post(running.url + "/v1/messages", json={"max_tokens": 8, **body}, timeout=30)
        assert reply.status_code == 400, (body, reply.text)


# -- OpenAI Responses -----------------------------------------------------------------

RESP_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather now",
    "parameters": WEATHER_PARAMS,
}


def test_responses_create_stream_and_function_call_round_trip(client: openai.OpenAI) -> None:
    text = client.responses.create(model="smol", input="Say hello.", max_output_tokens=8)
    assert text.id.startswith("resp_") and text.output[0].id.startswith("msg_")
    assert text.output_text
    with client.responses.stream(model="smol", input="Say hello.", max_output_tokens=8) as stream:
        deltas = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text
    called = client.responses.create(
        model="smol",
        input="Weather in Rome?",
        tools=[RESP_TOOL],
        tool_choice="required",
        max_output_tokens=100,
    )
    (call,) = [item for item in called.output if item.type == "function_call"][:1]
    assert call.name == "get_weather" and "location" in json.loads(call.arguments)
    answer = client.responses.create(
        model="smol",
        input=[
            {"role": "user", "content": "Weather in Rome?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"},
        ],
        tools=[RESP_TOOL],
        max_output_tokens=20,
    )
    assert answer.output


def test_responses_refuse_stored_state_with_a_400(running: Running) -> None:
    reply = httpx.post(
        running.url + "/v1/responses", json={"input": "hi", "previous_response_id": "resp_1"}, timeout=30
    )
    assert reply.status_code == 400 and "previous_response_id" in reply.json()["error"]["message"]


# -- hostile bodies and leaving clients, on every chat API ----------------------------

CHAT_APIS = {
    "/v1/chat/completions": lambda extra: {"messages": ASK, "tools": [OAI_TOOL], **extra},
    "/v1/messages": lambda extra: {"max_tokens": 40, "messages": ASK, "tools": [CLAUDE_TOOL], **extra},
    "/v1/responses": lambda extra: {
        "input": "What is the weather in Paris?",
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMS}],
        **extra,
    },
}


def _raw(body: dict[str, Any], *, poison: str) -> bytes:
    """The body's JSON with a poison only raw JSON can carry put in its place."""
    return json.dumps(body).replace('"POISON"', poison).encode()


@pytest.mark.parametrize("path", list(CHAT_APIS))
@pytest.mark.parametrize(
    "poison",
    ["NaN", "Infinity", "1e999", '"\\ud800"', "[" * 5000 + "]" * 5000, "-0"],
)
def test_poisoned_tool_schemas_are_400s_on_every_chat_api(running: Running, path: str, poison: str) -> None:
    params = {**WEATHER_PARAMS, "properties": {"location": {"type": "string", "maxLength": "POISON"}}}
    tool: dict[str, Any]
    if path == "/v1/chat/completions":
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": params}}
    elif path == "/v1/messages":
        tool = {"name": "get_weather", "input_schema": params}
    else:
        tool = {"type": "function", "name": "get_weather", "parameters": params}
    body = CHAT_APIS[path]({"tools": [tool], "tool_choice": _required(path)})
    reply = httpx.post(running.url + path, content=_raw(body, poison=poison), timeout=60)
    if poison == "-0":  # a valid, if odd, bound: a call with an empty location
        assert reply.status_code == 200, reply.text
        return
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["message"]


def _required(path: str) -> Any:
    return {"type": "any"} if path == "/v1/messages" else "required"


# Where each API takes text a person wrote: each gets a lone surrogate in turn.
TEXT_FIELDS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "POISON"}]}),
    (
        "/v1/chat/completions",
        {"messages": [*ASK, {"role": "tool", "tool_call_id": "POISON", "content": "r"}]},
    ),
    ("/v1/messages", {"messages": [{"role": "user", "content": "POISON"}]}),
    ("/v1/messages", {"system": "POISON"}),
    ("/v1/messages", {"stop_sequences": ["POISON"]}),
    ("/v1/responses", {"input": "POISON"}),
    ("/v1/responses", {"instructions": "POISON"}),
]


@pytest.mark.parametrize(("path", "extra"), TEXT_FIELDS)
def test_lone_surrogates_in_chat_bodies_are_400s(running: Running, path: str, extra: dict[str, Any]) -> None:
    body = CHAT_APIS[path](extra)
    reply = httpx.post(running.url + path, content=_raw(body, poison='"\\udfff x"'), timeout=60)
    assert reply.status_code == 400, reply.text
    assert "lone surrogate" in reply.json()["error"]["message"]


@pytest.mark.parametrize("path", list(CHAT_APIS))
def test_a_client_that_leaves_a_tool_stream_frees_its_slot(running: Running, path: str) -> None:
    from helpers import wait_until
    from http_server import idle

    body = CHAT_APIS[path]({"stream": True, "tool_choice": _required(path)})
    body["max_tokens" if path != "/v1/responses" else "max_output_tokens"] = 2000
    with httpx.stream("POST", running.url + path, json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # held: a dropped iterator closes the connection
        next(lines)
        wait_until(lambda: not idle(running), seconds=10)
    wait_until(lambda: idle(running), seconds=10)
    after = httpx.post(running.url + path, json=CHAT_APIS[path]({"tool_choice": _required(path)}), timeout=60)
    assert after.status_code == 200  # and the server serves on


# -- thinking, on each API (DeepSeek R1's template opens the reply's thinking) ------------


@pytest.fixture(scope="module")
def thinking(model_path: str) -> Iterator[Running]:
    from templates import template

    with Running.ready(
        HttpSettings(model_ids=("smol",)),
        lambda: ServerActor.start(
            model_path=model_path, n_parallel=1, n_ctx=4096, chat_template=template("llama-cpp-deepseek-r1")
        ),
    ) as server:
        yield server


SUM = [{"role": "user", "content": "What's the sum of 102 and 7?"}]


def test_thinking_is_reasoning_content_in_openai_chat(thinking: Running) -> None:
    client = openai.OpenAI(base_url=thinking.url + "/v1", api_key="none", max_retries=0)
    whole = client.chat.completions.create(model="smol", messages=SUM, temperature=0, max_tokens=24)
    message = whole.model_dump()["choices"][0]["message"]
    assert message["reasoning_content"] and "</think>" not in message["reasoning_content"]
    streamed = ""
    for chunk in client.chat.completions.create(
        model="smol", messages=SUM, temperature=0, max_tokens=24, stream=True
    ):
        for choice in chunk.model_dump()["choices"]:
            streamed += choice["delta"].get("reasoning_content") or ""
    assert streamed == message["reasoning_content"]
    kept = client.chat.completions.create(
        model="smol", messages=SUM, temperature=0, max_tokens=24, extra_body={"reasoning_format": "none"}
    )
    assert "reasoning_content" not in kept.choices[0].message.model_dump(exclude_none=True)
    budget = client.chat.completions.create(
        model="smol", messages=SUM, temperature=0, max_tokens=24, extra_body={"reasoning_budget_tokens": 4}
    )
    assert budget.choices[0].message.content  # the thinking was closed: the reply answered


def test_thinking_is_a_thinking_block_in_anthropic_messages(thinking: Running) -> None:
    claude = anthropic.Anthropic(base_url=thinking.url, api_key="none", max_retries=0)
    message = claude.messages.create(model="smol", max_tokens=24, messages=SUM)
    assert message.content[0].type == "thinking" and message.content[0].thinking
    with claude.messages.stream(model="smol", max_tokens=24, messages=SUM) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "thinking" in kinds or any(block.type == "thinking" for block in final.content)
    assert final.content[0].type == "thinking"


def test_thinking_is_a_reasoning_item_in_responses(thinking: Running) -> None:
    client = openai.OpenAI(base_url=thinking.url + "/v1", api_key="none", max_retries=0)
    response = client.responses.create(
        model="smol", input="What's the sum of 102 and 7?", max_output_tokens=24
    )
    assert response.output[0].type == "reasoning"
    with client.responses.stream(
        model="smol", input="What's the sum of 102 and 7?", max_output_tokens=24
    ) as s:
        kinds = {event.type for event in s}
        final = s.get_final_response()
    assert "response.reasoning_text.delta" in kinds and final.output[0].type == "reasoning"
