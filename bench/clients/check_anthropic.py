"""The ``anthropic`` SDK on the Messages API: create, stream, a tool_use round trip (plain
and streamed) and count_tokens.

This SDK's ``messages.create`` takes no ``temperature``: it goes in ``extra_body``. The final
turn of a round trip asks with ``tool_choice`` ``none``: after a tool result the 135M model,
offered the tool again, calls it again rather than answering.
"""

from __future__ import annotations

from typing import Any

import anthropic
from _support import BASE_URL, MODEL, QUESTION, WEATHER_SCHEMA, Steps, check, get_weather

client = anthropic.Anthropic(base_url=BASE_URL, api_key="x", max_retries=0)
TOOL: Any = {
    "name": "get_weather",
    "description": "The weather now in a city",
    "input_schema": WEATHER_SCHEMA,
}
ASK: list[Any] = [{"role": "user", "content": QUESTION}]
GREEDY = {"temperature": 0}
steps = Steps()


def results_for(message: Any) -> list[Any]:
    """Run every tool_use block of ``message``; the tool_result blocks to send back."""
    uses = [block for block in message.content if block.type == "tool_use"]
    check(uses, f"no tool_use block in {message.content}")
    results = []
    for use in uses:
        check(use.name == "get_weather" and isinstance(use.input.get("location"), str), f"{use}")
        results.append(
            {"type": "tool_result", "tool_use_id": use.id, "content": get_weather(use.input["location"])}
        )
    return results


def history_after(message: Any) -> list[Any]:
    return [
        *ASK,
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in message.content]},
        {"role": "user", "content": results_for(message)},
    ]


with steps.step("messages.create"):
    message = client.messages.create(
        model=MODEL,
        max_tokens=30,
        # System blocks with cache_control, metadata and stop sequences, as agents send them.
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        metadata={"user_id": "bench"},
        stop_sequences=["\n\n\n"],
        messages=[{"role": "user", "content": "Hello"}],
        extra_body=GREEDY,
    )
    check(message.type == "message" and message.role == "assistant", f"{message}")
    check(message.content and message.content[0].type == "text" and message.content[0].text, f"{message}")
    check(message.stop_reason in ("end_turn", "max_tokens"), f"stop_reason {message.stop_reason}")

with steps.step("messages.stream + get_final_message"):
    with client.messages.stream(
        model=MODEL, max_tokens=30, messages=[{"role": "user", "content": "Say hello."}], extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    check(text and final.content[0].type == "text" and final.content[0].text == text, f"{text!r} / {final}")

with steps.step("tool_use round trip (tool_choice any)"):
    first = client.messages.create(
        model=MODEL,
        max_tokens=100,
        messages=ASK,
        tools=[TOOL],
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    )
    check(first.stop_reason == "tool_use", f"stop_reason {first.stop_reason}")
    answer = client.messages.create(
        model=MODEL, max_tokens=60, messages=history_after(first), tools=[TOOL], tool_choice={"type": "none"},
        extra_body=GREEDY,
    )  # fmt: skip
    texts = [block.text for block in answer.content if block.type == "text"]
    check(texts and texts[0], f"no final text: {answer.content}")
    steps.note(f"final answer: {texts[0]!r}")

with steps.step("tool_use round trip (tool_choice auto)"):
    first = client.messages.create(model=MODEL, max_tokens=100, messages=ASK, tools=[TOOL], extra_body=GREEDY)
    if first.stop_reason != "tool_use":
        steps.note(f"auto: the model answered without a call: {first.content}")
    else:
        answer = client.messages.create(
            model=MODEL, max_tokens=60, messages=history_after(first), tools=[TOOL],
            tool_choice={"type": "none"}, extra_body=GREEDY,
        )  # fmt: skip
        check(any(block.type == "text" and block.text for block in answer.content), f"{answer.content}")

with steps.step("streamed tool_use round trip (tool_choice tool)"):
    with client.messages.stream(
        model=MODEL, max_tokens=100, messages=ASK, tools=[TOOL], extra_body=GREEDY,
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    ) as stream:  # fmt: skip
        kinds = [event.type for event in stream]
        called = stream.get_final_message()
    check(kinds[0] == "message_start" and kinds[-1] == "message_stop", f"events {kinds}")
    check("input_json" in kinds or "content_block_delta" in kinds, f"events {kinds}")
    check(called.stop_reason == "tool_use", f"stop_reason {called.stop_reason}")
    with client.messages.stream(
        model=MODEL, max_tokens=60, messages=history_after(called), tools=[TOOL],
        tool_choice={"type": "none"}, extra_body=GREEDY,
    ) as stream:  # fmt: skip
        text = "".join(stream.text_stream)
    check(text, "no streamed final answer")
    steps.note(f"streamed final answer: {text!r}")

with steps.step("count_tokens"):
    counted = client.messages.count_tokens(model=MODEL, messages=ASK, tools=[TOOL], system="Be brief.")
    check(counted.input_tokens > 0, f"{counted}")
    plain = client.messages.count_tokens(model=MODEL, messages=ASK)
    check(counted.input_tokens > plain.input_tokens, f"the tools count nothing: {counted} vs {plain}")

steps.finish()
