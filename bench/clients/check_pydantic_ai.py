"""``pydantic-ai``: an Agent on OpenAIChatModel with an OpenAI-compatible provider pointed at
the server; a tool run to completion, the default (tool) structured output, both together,
and a streamed run. Then the decision models, each ``decide`` a yes/no, a choice and a
score: ``SystemOneModel`` (``POST /v1/systemone``) and ``OpenAIDecisionsModel``
(``POST /v1/decisions``), which check the answers against the questions themselves.

The agents' settings are per step (pydantic-ai's callable ``model_settings``): the first step
requires a call, the ones after the tool ran forbid function tools (``tool_choice`` "none",
which keeps the output tool), because after a tool result the 135M model, offered the tool
again, calls it again rather than answering.
"""

from __future__ import annotations

import asyncio
from typing import Any

from _models import People, Weather
from _support import (
    BASE_URL,
    DECISION_STATE,
    MODEL,
    MOOD_ASK,
    MOODS,
    QUESTION,
    REFUND_ASK,
    TEAM_ASK,
    TEAMS,
    Steps,
    check,
    check_distribution,
    get_weather,
    probability,
)
from pydantic_ai import Agent, RunContext
from pydantic_ai.messages import ToolCallPart, ToolReturnPart
from pydantic_ai.models.decision import (
    ChoiceAnswer,
    ChoiceQuestion,
    DecisionModel,
    DecisionRequest,
    NoulAnswer,
    NoulQuestion,
    ScoreAnswer,
    ScoreQuestion,
)
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.models.openai_decisions import OpenAIDecisionsModel
from pydantic_ai.models.system_one import SystemOneModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.providers.openai_compatible import OpenAICompatibleProvider
from pydantic_ai.providers.system_one import SystemOneProvider
from pydantic_ai.settings import ModelSettings

provider = OpenAICompatibleProvider("llama-cpp-actors", base_url=f"{BASE_URL}/v1", api_key="x")
model = OpenAIChatModel(MODEL, provider=provider)
BASE_SETTINGS: ModelSettings = {"temperature": 0, "max_tokens": 120}
DECISION = DecisionRequest(
    state=DECISION_STATE,
    questions={
        "refund": NoulQuestion(instructions=REFUND_ASK),
        "team": ChoiceQuestion(instructions=TEAM_ASK, criteria=dict(TEAMS)),
        "mood": ScoreQuestion(instructions=MOOD_ASK, criteria=list(MOODS)),
    },
)


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


def decide(decision_model: DecisionModel[Any]) -> None:
    """One ``decide`` of the three questions; the answers as pydantic-ai parsed them."""
    response = asyncio.run(decision_model.decide(DECISION, {}))
    check(response.answers.keys() == DECISION.questions.keys(), f"{response.answers!r}")
    refund, team, mood = (response.answers[name] for name in ("refund", "team", "mood"))
    check(isinstance(refund, NoulAnswer) and probability(refund.noul), f"{refund!r}")
    check(isinstance(team, ChoiceAnswer) and team.choice in TEAMS, f"{team!r}")
    check(probability(team.confidence), f"{team!r}")
    check_distribution(team.probabilities, TEAMS, "choice")
    check(isinstance(mood, ScoreAnswer) and 0 <= mood.score <= len(MOODS) - 1, f"{mood!r}")
    check(probability(mood.confidence), f"{mood!r}")
    check_distribution(mood.probabilities, range(len(MOODS)), "score")
    check(response.usage.input_tokens > 0, f"usage {response.usage!r}")
    steps.note(f"refund {refund.noul:.2f}, team {team.choice!r}, mood {mood.score:.2f}, {response.usage!r}")


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

with steps.step("SystemOneModel.decide (noul, choice, score)"):
    decide(SystemOneModel(MODEL, provider=SystemOneProvider(base_url=BASE_URL, api_key="x")))

with steps.step("OpenAIDecisionsModel.decide (predicate, choice, score)"):
    decide(OpenAIDecisionsModel(MODEL, provider=OpenAIProvider(base_url=f"{BASE_URL}/v1", api_key="x")))

steps.finish()
