"""``openai-agents``: an Agent with a ``@function_tool`` on the default model API (Responses),
through ``set_default_openai_client`` and an explicit ``OpenAIResponsesModel``; run to a
final output with ``Runner.run_sync`` and ``Runner.run_streamed``; ``stop_on_first_tool``;
and the same agent on ``OpenAIChatCompletionsModel``.

The first turn has ``tool_choice="required"``; the SDK then resets it (``reset_tool_choice``,
the default), and the tool is enabled only until it has run once (``is_enabled``): after a
tool result the 135M model, offered the tool again, calls it again rather than answering,
and the run would end in MaxTurnsExceeded.
"""

from __future__ import annotations

import asyncio
from typing import Any

from _support import BASE_URL, MODEL, QUESTION, TOOL_RESULT, Steps, check, get_weather
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_default_openai_client,
    set_tracing_disabled,
)
from agents.items import ToolCallItem, ToolCallOutputItem
from openai import AsyncOpenAI
from pydantic import BaseModel


class Report(BaseModel):
    city: str
    temperature_c: int


set_tracing_disabled(True)
set_default_openai_client(
    AsyncOpenAI(base_url=f"{BASE_URL}/v1", api_key="x", max_retries=0), use_for_tracing=False
)
SETTINGS = ModelSettings(tool_choice="required", temperature=0, max_tokens=120)
ran = {"calls": 0}


def not_yet_called(ctx: Any, agent: Any) -> bool:
    return ran["calls"] == 0


@function_tool(is_enabled=not_yet_called)
def weather(location: str) -> str:
    """The weather now in a city.

    Args:
        location: the city.
    """
    ran["calls"] += 1
    return get_weather(location)


def fresh() -> AsyncOpenAI:
    """A client per run: its connections belong to the event loop of the run that made them."""
    return AsyncOpenAI(base_url=f"{BASE_URL}/v1", api_key="x", max_retries=0)


def make_agent(model: Any, **kwargs: Any) -> Agent:
    ran["calls"] = 0
    return Agent(
        name="weather",
        instructions="Answer briefly.",
        model=model,
        tools=[weather],
        model_settings=SETTINGS,
        **kwargs,
    )


def check_run(result: Any) -> None:
    kinds = [type(item).__name__ for item in result.new_items]
    check(any(isinstance(item, ToolCallItem) for item in result.new_items), f"no tool call: {kinds}")
    check(any(isinstance(item, ToolCallOutputItem) for item in result.new_items), f"no tool output: {kinds}")
    check(isinstance(result.final_output, str) and result.final_output, f"final {result.final_output!r}")
    steps.note(f"items {kinds}; final output {result.final_output!r}")


steps = Steps()

with steps.step("Runner.run_sync, default client (Responses)"):
    check_run(Runner.run_sync(make_agent(MODEL), QUESTION, max_turns=4))

with steps.step("Runner.run_sync, OpenAIResponsesModel"):
    check_run(Runner.run_sync(make_agent(OpenAIResponsesModel(MODEL, fresh())), QUESTION, max_turns=4))

with steps.step("tool_use_behavior stop_on_first_tool"):
    agent = make_agent(OpenAIResponsesModel(MODEL, fresh()), tool_use_behavior="stop_on_first_tool")
    result = Runner.run_sync(agent, QUESTION, max_turns=2)
    check(TOOL_RESULT in str(result.final_output), f"final {result.final_output!r}")

with steps.step("Runner.run_streamed (Responses)"):

    async def streamed() -> Any:
        run = Runner.run_streamed(make_agent(OpenAIResponsesModel(MODEL, fresh())), QUESTION, max_turns=4)
        kinds = [event.type async for event in run.stream_events()]
        check("raw_response_event" in kinds and "run_item_stream_event" in kinds, f"events {set(kinds)}")
        return run

    check_run(asyncio.run(streamed()))

with steps.step("Runner.run_sync, OpenAIChatCompletionsModel"):
    check_run(Runner.run_sync(make_agent(OpenAIChatCompletionsModel(MODEL, fresh())), QUESTION, max_turns=4))

with steps.step("output_type a pydantic model (Responses text.format)"):
    reporter = Agent(
        name="reporter",
        instructions="Report the weather.",
        model=OpenAIResponsesModel(MODEL, fresh()),
        output_type=Report,
        model_settings=ModelSettings(temperature=0, max_tokens=120),
    )
    reported = Runner.run_sync(reporter, "It is 21 degrees Celsius in Paris.", max_turns=2)
    check(isinstance(reported.final_output, Report), f"final {reported.final_output!r}")
    steps.note(f"final output {reported.final_output!r}")

steps.finish()
