"""``langchain-openai``'s ChatOpenAI: bind_tools with tool_choice required and by name,
invoke, run the tool, a ToolMessage back, a final invoke; a streamed tool call; the same
round trip on the Responses API (``use_responses_api=True``); with_structured_output.
Then the Decisions API (``POST /v1/decisions``), a yes/no, a choice and a score: the
native ``OpenAIDecisions`` on text, and ``OpenAIClassifier`` (langchain-core's
``BaseDecisionModel``) on a JSON object state, sent as an ``input_json`` part.

The final invoke is the model without tools: after a tool result the 135M model, offered
the tool again, calls it again rather than answering.
"""

from __future__ import annotations

from typing import Any

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
from langchain_core import decisions as core_decisions
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langchain_openai.decisions import Choice, OpenAIClassifier, OpenAIDecisions, Predicate, Score
from pydantic import BaseModel, Field


@tool("get_weather")
def weather_tool(location: str) -> str:
    """The weather now in a city."""
    return get_weather(location)


class Weather(BaseModel):
    """A weather report."""

    city: str = Field(description="the city")
    temperature_c: int = Field(description="the temperature in degrees Celsius")


def chat(**kwargs: Any) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=f"{BASE_URL}/v1",
        api_key="x",
        model=MODEL,
        temperature=0,
        max_tokens=100,
        max_retries=0,
        **kwargs,
    )


steps = Steps()


def round_trip(llm: ChatOpenAI, tool_choice: Any) -> None:
    messages: list[BaseMessage] = [HumanMessage(QUESTION)]
    ai = llm.bind_tools([weather_tool], tool_choice=tool_choice).invoke(messages)
    check(isinstance(ai, AIMessage) and ai.tool_calls, f"no tool call: {ai!r}")
    messages.append(ai)
    for call in ai.tool_calls:
        check(call["name"] == "get_weather", f"{call}")
        messages.append(weather_tool.invoke(call))  # a ToolMessage with the call's id
    check(isinstance(messages[-1], ToolMessage), f"{messages[-1]!r}")
    final = llm.invoke(messages)
    check(final.text, f"no final answer: {final!r}")
    steps.note(f"final answer: {final.text!r}")


with steps.step("bind_tools tool_choice required"):
    round_trip(chat(), "required")

with steps.step("bind_tools tool_choice by name"):
    round_trip(chat(), "get_weather")

with steps.step("streamed tool call"):
    chunks = list(chat().bind_tools([weather_tool], tool_choice="required").stream([HumanMessage(QUESTION)]))
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    check(isinstance(whole, AIMessage) and whole.tool_calls, f"no tool call in the chunks: {whole!r}")
    check(
        whole.tool_calls[0]["name"] == "get_weather" and "location" in whole.tool_calls[0]["args"], f"{whole}"
    )

with steps.step("Responses API round trip (use_responses_api)"):
    round_trip(chat(use_responses_api=True), "required")

with steps.step("with_structured_output (json_schema)"):
    report = (
        chat()
        .with_structured_output(Weather)
        .invoke("It is 21 degrees Celsius in Paris. Report the weather.")
    )
    check(isinstance(report, Weather), f"{report!r}")
    steps.note(f"{report!r}")

with steps.step("with_structured_output (function_calling)"):
    report = (
        chat()
        .with_structured_output(Weather, method="function_calling")
        .invoke("It is 21 degrees Celsius in Paris. Report the weather.")
    )
    check(isinstance(report, Weather), f"{report!r}")
    steps.note(f"{report!r}")

with steps.step("OpenAIDecisions.invoke (predicate, choice, score)"):
    decisions = OpenAIDecisions(model=MODEL, base_url=f"{BASE_URL}/v1", api_key="x", max_retries=0)
    decided = decisions.invoke(
        {
            "input": DECISION_STATE,
            "questions": {
                "refund": Predicate(instructions=REFUND_ASK),
                "team": Choice(instructions=TEAM_ASK, choices=dict(TEAMS)),
                "mood": Score(instructions=MOOD_ASK, levels=list(MOODS)),
            },
        }
    )
    check(list(decided.answers) == ["refund", "team", "mood"] and not decided.refusals, f"{decided!r}")
    refund, team, mood = decided.predicates["refund"], decided.choices["team"], decided.scores["mood"]
    check(probability(refund.probability), f"{refund!r}")
    check(team.choice in TEAMS and probability(team.confidence), f"{team!r}")
    check_distribution(team.probabilities, TEAMS, "choice")
    check(0 <= mood.score <= len(MOODS) - 1 and probability(mood.confidence), f"{mood!r}")
    check(mood.legend == dict(enumerate(MOODS)), f"legend {mood.legend!r}")
    check_distribution(mood.probabilities, range(len(MOODS)), "score")
    check((decided.usage.input_tokens or 0) > 0, f"usage {decided.usage!r}")
    steps.note(f"refund {refund.probability:.2f}, team {team.choice!r}, mood {mood.score:.2f}")

with steps.step("OpenAIClassifier.invoke (noul, choice, score), a JSON state"):
    classifier = OpenAIClassifier(model=MODEL, base_url=f"{BASE_URL}/v1", api_key="x", max_retries=0)
    classified = classifier.invoke(
        {
            "state": {"channel": "email", "message": DECISION_STATE},
            "questions": {
                "refund": core_decisions.Noul(instructions=REFUND_ASK),
                "team": core_decisions.Choice(instructions=TEAM_ASK, criteria=dict(TEAMS)),
                "mood": core_decisions.Score(instructions=MOOD_ASK, criteria=list(MOODS)),
            },
        }
    )
    check(list(classified.answers) == ["refund", "team", "mood"], f"{classified!r}")
    noul, picked, scored = classified.nouls["refund"], classified.choices["team"], classified.scores["mood"]
    check(probability(noul.noul), f"{noul!r}")
    check(picked.choice in TEAMS and probability(picked.confidence), f"{picked!r}")
    check_distribution(picked.probabilities, TEAMS, "choice")
    check(0 <= scored.score <= len(MOODS) - 1 and probability(scored.confidence), f"{scored!r}")
    check_distribution(scored.probabilities, range(len(MOODS)), "score")
    check(classified.usage is not None and classified.usage["input_tokens"] > 0, f"{classified.usage!r}")
    steps.note(f"refund {noul.noul:.2f}, team {picked.choice!r}, mood {scored.score:.2f}")

steps.finish()
