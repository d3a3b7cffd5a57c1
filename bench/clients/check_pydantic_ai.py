"""``pydantic-ai``: an Agent on OpenAIChatModel with an OpenAI-compatible provider pointed at
the server; a tool run to completion, the default (tool) structured output, both together,
and a streamed run.

The agents' settings are per step (pydantic-ai's callable ``model_settings``): the first step
requires a call, the ones after the tool ran forbid function tools (``tool_choice`` "none",
which keeps the output tool), because after a tool result the 135M model, offered the tool
again, calls it again rather than answering.
"""

from __future__ import annotations

from typing import Any

from _models import People, Weather
from _support import BASE_URL, MODEL, QUESTION, Steps, check, get_weather
from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import ToolCallPart, ToolReturnPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai_compatible import OpenAICompatibleProvider
from pydantic_ai.settings import ModelSettings

provider = OpenAICompatibleProvider("llama-cpp-actors", base_url=f"{BASE_URL}/v1", api_key="x")
model = OpenAIChatModel(MODEL, provider=provider)
BASE_SETTINGS: ModelSettings = {"temperature": 0, "max_tokens": 120}


def tool_ran(messages: list[Any]) -> bool:
    return any(
        isinstance(part, ToolReturnPart) for message in messages for part in getattr(message, "parts", [])
    )


def call_then_answer(ctx: RunContext[None]) -> ModelSettings:
    """Settings per step: a call first, then no more function tools."""
    return {**BASE_SETTINGS, "tool_choice": "none" if tool_ran(ctx.messages) else "required"}


def weather(location: str) -> str:
    """The weather now in a city."""
    return get_weather(location)


def tool_calls(messages: list[Any]) -> list[ToolCallPart]:
    return [
        part
        for message in messages
        for part in getattr(message, "parts", [])
        if isinstance(part, ToolCallPart)
    ]


steps = Steps()

with steps.step("Agent with a tool, run to completion"):
    agent = Agent(model, tools=[weather], instructions="Answer briefly.", model_settings=call_then_answer)
    result = agent.run_sync(QUESTION)
    calls = tool_calls(result.all_messages())
    check(any(call.tool_name == "weather" for call in calls), f"the tool never ran: {result.all_messages()}")
    check(tool_ran(result.all_messages()), "no tool return in the history")
    check(isinstance(result.output, str) and result.output, f"output {result.output!r}")
    steps.note(f"output: {result.output!r}")

with steps.step("output_type a pydantic model (default tool output)"):
    agent_out = Agent(model, output_type=Weather, model_settings=BASE_SETTINGS)
    report = agent_out.run_sync("It is 21 degrees Celsius in Paris. Report the weather.")
    check(isinstance(report.output, Weather), f"output {report.output!r}")
    steps.note(f"output: {report.output!r}")

with steps.step("output_type a nested model (a list of models)"):
    agent_nested = Agent(model, output_type=People, model_settings=BASE_SETTINGS)
    people = agent_nested.run_sync("Ann is 31 and Bob is 42. List them.")
    check(isinstance(people.output, People), f"output {people.output!r}")
    steps.note(f"output: {people.output!r}")

with steps.step("a tool, then the structured output"):
    agent_both = Agent(model, tools=[weather], output_type=Weather, model_settings=call_then_answer)
    both = agent_both.run_sync(QUESTION)
    check(tool_ran(both.all_messages()), f"the tool never ran: {both.all_messages()}")
    check(isinstance(both.output, Weather), f"output {both.output!r}")
    steps.note(f"output: {both.output!r}")

with steps.step("streamed run with a tool (run_stream_sync)"):
    with agent.run_stream_sync(QUESTION) as streamed:
        pieces = list(streamed.stream_text(delta=True))
        output = streamed.get_output()
    check(pieces and output and "".join(pieces) == output, f"{pieces!r} / {output!r}")
    check(tool_ran(streamed.all_messages()), "the tool never ran")
    steps.note(f"output: {output!r}")

with steps.step("run_stream_sync with a structured output"):
    with agent_out.run_stream_sync("It is 21 degrees Celsius in Paris. Report the weather.") as streamed_out:
        partials = list(streamed_out.stream_output(debounce_by=None))
        final_out = streamed_out.get_output()
    check(partials and isinstance(final_out, Weather), f"{partials!r} / {final_out!r}")
    steps.note(f"{len(partials)} partial outputs, then {final_out!r}")

steps.finish()
