"""The ``openai`` SDK: chat completions with tools (each ``tool_choice``, streamed calls),
the Responses API (create, stream, a function_call round trip, a streamed call) and
``decisions.create`` (a predicate, a choice and a score; text input, then message items).

The final turn of each round trip asks with ``tool_choice="none"``: after a tool result
the 135M model, offered the tool again, calls it again rather than answering.
"""

from __future__ import annotations

import json
from typing import Any

import openai
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
    WEATHER_SCHEMA,
    Steps,
    check,
    check_distribution,
    get_weather,
    probability,
)
from openai.types import Decision
from openai.types.decision import (
    AnswerAnswerResourceChoice,
    AnswerAnswerResourcePredicate,
    AnswerAnswerResourceScore,
)
from pydantic import BaseModel

client = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="x", max_retries=0)
CHAT_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now in a city",
        "parameters": WEATHER_SCHEMA,
    },
}
RESPONSES_TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather now in a city",
    "parameters": WEATHER_SCHEMA,
    "strict": False,
}
ASK: list[Any] = [{"role": "user", "content": QUESTION}]
DECISION_QUESTIONS: list[Any] = [
    {"type": "predicate", "name": "refund", "instructions": REFUND_ASK},
    {
        "type": "choice",
        "name": "team",
        "instructions": TEAM_ASK,
        "choices": [{"value": value, "description": meaning} for value, meaning in TEAMS.items()],
    },
    {"type": "score", "name": "mood", "instructions": MOOD_ASK, "levels": [{"label": m} for m in MOODS]},
]


class GetWeather(BaseModel):
    """The weather now in a city."""

    location: str


class Report(BaseModel):
    city: str
    temperature_c: int


steps = Steps()


def check_decision(decision: Decision) -> None:
    """The SDK parsed one answer per question, in order, of the question's type."""
    check(isinstance(decision, Decision), f"{decision!r}")
    check([a.name for a in decision.answers] == ["refund", "team", "mood"], f"{decision.answers}")
    refund, team, mood = decision.answers
    check(isinstance(refund, AnswerAnswerResourcePredicate) and probability(refund.probability), f"{refund}")
    check(isinstance(team, AnswerAnswerResourceChoice) and team.choice in TEAMS, f"{team}")
    check(probability(team.confidence), f"{team}")
    check_distribution({p.value: p.probability for p in team.probabilities}, TEAMS, "choice")
    check(isinstance(mood, AnswerAnswerResourceScore) and 0 <= mood.score <= len(MOODS) - 1, f"{mood}")
    check(probability(mood.confidence) and [p.label for p in mood.probabilities] == MOODS, f"{mood}")
    check_distribution({p.value: p.probability for p in mood.probabilities}, range(len(MOODS)), "score")
    usage = decision.usage
    check(usage.input_tokens > 0 and usage.input_tokens_details.cached_tokens >= 0, f"{usage}")
    check(usage.output_tokens_details.reasoning_tokens == 0 and usage.total_tokens >= 0, f"{usage}")
    steps.note(
        f"refund {refund.probability:.2f}, team {team.choice!r}, mood {mood.score:.2f}, "
        f"{usage.input_tokens} input tokens"
    )


def run_call(name: str, arguments: str) -> str:
    check(name == "get_weather", f"the model called {name!r}")
    args = json.loads(arguments)
    check(isinstance(args, dict) and isinstance(args.get("location"), str), f"arguments {arguments!r}")
    return get_weather(args["location"])


def answer_after(history: list[Any], calls: list[tuple[str, str, str]], *, stream: bool = False) -> str:
    """Run ``calls`` (id, name, arguments), feed their results after ``history`` (which
    ends with the calling message), and get the text answer (streamed or whole)."""
    history = [*history]
    for call_id, name, arguments in calls:
        history.append({"role": "tool", "tool_call_id": call_id, "content": run_call(name, arguments)})
    ask: Any = {"model": MODEL, "messages": history, "tools": [CHAT_TOOL], "tool_choice": "none"}
    if stream:
        chunks = client.chat.completions.create(**ask, temperature=0, max_tokens=60, stream=True)
        text = "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)
    else:
        final = client.chat.completions.create(**ask, temperature=0, max_tokens=60)
        check(not final.choices[0].message.tool_calls, "tool_choice none, and yet a call")
        text = final.choices[0].message.content or ""
    check(text, "no final answer")
    return text


def finish_chat(question: list[Any], message: Any) -> None:
    """Run the calls of ``message``, feed the results back, and get a text answer."""
    calls = [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls]
    text = answer_after([*question, message.model_dump(exclude_none=True)], calls)
    steps.note(f"final answer: {text!r}")


def chat_round_trip(tool_choice: Any) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[CHAT_TOOL], tool_choice=tool_choice, temperature=0, max_tokens=100
    )
    choice = first.choices[0]
    if tool_choice == "auto" and not choice.message.tool_calls:
        check(choice.message.content, f"neither a call nor text: {choice}")
        steps.note(f"auto: the model answered without a call: {choice.message.content!r}")
        return
    check(choice.finish_reason == "tool_calls", f"finish_reason {choice.finish_reason!r}")
    check(choice.message.tool_calls, f"no tool_calls: {choice.message}")
    finish_chat(ASK, choice.message)


for label, choice in (
    ("auto", "auto"),
    ("required", "required"),
    ("named function", {"type": "function", "function": {"name": "get_weather"}}),
):
    with steps.step(f"chat tool_choice {label}"):
        chat_round_trip(choice)

with steps.step("chat parallel tool calls"):
    two = [{"role": "user", "content": "What is the weather in Paris and in London?"}]
    first = client.chat.completions.create(
        model=MODEL, messages=two, tools=[CHAT_TOOL], tool_choice="required", parallel_tool_calls=True,
        temperature=0, max_tokens=150,
    )  # fmt: skip
    message = first.choices[0].message
    check(
        message.tool_calls and len({call.id for call in message.tool_calls}) == len(message.tool_calls),
        f"{message}",
    )
    steps.note(f"{len(message.tool_calls)} calls: {[call.function.arguments for call in message.tool_calls]}")
    finish_chat(two, message)

with steps.step("chat tool_choice none"):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[CHAT_TOOL], tool_choice="none", temperature=0, max_tokens=40
    )
    check(reply.choices[0].message.content and not reply.choices[0].message.tool_calls, f"{reply.choices[0]}")

with steps.step("chat streamed tool calls"):
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[CHAT_TOOL], tool_choice="required", temperature=0, max_tokens=100,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        for c in chunk.choices:
            reasons += [c.finish_reason] if c.finish_reason else []
            for delta in c.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                if delta.function:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
    check(reasons == ["tool_calls"], f"finish reasons {reasons}")
    check(calls and all(call["id"] for call in calls.values()), f"calls {calls}")
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": call["name"], "arguments": call["arguments"]},
            }
            for call in calls.values()
        ],
    }
    text = answer_after(
        [*ASK, message], [(c["id"], c["name"], c["arguments"]) for c in calls.values()], stream=True
    )
    steps.note(f"streamed final answer: {text!r}")

with steps.step("responses create"):
    response = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=20, temperature=0)
    check(response.status in ("completed", "incomplete") and response.output_text, f"{response}")

with steps.step("responses stream"):
    with client.responses.stream(
        model=MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=20, temperature=0
    ) as events:
        deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
        final_response = events.get_final_response()
    check(deltas and deltas == final_response.output_text, f"{deltas!r} != {final_response.output_text!r}")

with steps.step("responses function_call round trip"):
    items: list[Any] = [{"role": "user", "content": QUESTION}]
    called = client.responses.create(
        model=MODEL,
        input=items,
        tools=[RESPONSES_TOOL],
        tool_choice="required",
        max_output_tokens=100,
        temperature=0,
    )
    function_calls = [item for item in called.output if item.type == "function_call"]
    check(function_calls, f"no function_call in {called.output}")
    items += called.output  # the SDK's own output items go back as input, as OpenAI's guide does
    for call in function_calls:
        items.append(
            {
                "type": "function_call_output",
                "call_id": call.call_id,
                "output": run_call(call.name, call.arguments),
            }
        )
    answer = client.responses.create(
        model=MODEL,
        input=items,
        tools=[RESPONSES_TOOL],
        tool_choice="none",
        max_output_tokens=60,
        temperature=0,
    )
    check(answer.output_text, f"no final answer: {answer.output}")
    steps.note(f"final answer: {answer.output_text!r}")

with steps.step("responses streamed function_call"):
    with client.responses.stream(
        model=MODEL, input=QUESTION, tools=[RESPONSES_TOOL],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=100, temperature=0,
    ) as events:  # fmt: skip
        arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        streamed = events.get_final_response()
    (call,) = [item for item in streamed.output if item.type == "function_call"][:1]
    check(call.arguments == arguments, f"{call.arguments!r} != deltas {arguments!r}")
    run_call(call.name, call.arguments)

with steps.step("chat.completions.parse, pydantic_function_tool (strict)"):
    parsed = client.chat.completions.parse(
        model=MODEL,
        messages=ASK,
        tools=[openai.pydantic_function_tool(GetWeather, name="get_weather")],
        tool_choice="required",
        temperature=0,
        max_tokens=100,
    )
    parsed_call = parsed.choices[0].message.tool_calls[0]
    check(isinstance(parsed_call.function.parsed_arguments, GetWeather), f"{parsed_call}")

with steps.step("chat.completions.parse, response_format a pydantic model"):
    report = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "It is 21 degrees Celsius in Paris. Report the weather."}],
        response_format=Report,
        temperature=0,
        max_tokens=100,
    )
    check(isinstance(report.choices[0].message.parsed, Report), f"{report.choices[0].message}")

with steps.step("responses.parse, text_format a pydantic model"):
    parsed_response = client.responses.parse(
        model=MODEL,
        input="It is 21 degrees Celsius in Paris. Report the weather.",
        text_format=Report,
        temperature=0,
        max_output_tokens=100,
    )
    check(isinstance(parsed_response.output_parsed, Report), f"{parsed_response.output}")

with steps.step("decisions.create (predicate, choice, score)"):
    check_decision(client.decisions.create(model=MODEL, input=DECISION_STATE, questions=DECISION_QUESTIONS))

with steps.step("decisions.create, message items, the body validated strictly"):
    raw = client.decisions.with_raw_response.create(
        model=MODEL,
        input=[{"role": "user", "content": [{"type": "input_text", "text": DECISION_STATE}]}],
        questions=DECISION_QUESTIONS,
    )
    check_decision(raw.parse())
    # What pydantic-ai does with the body, as the SDK builds its models without validating.
    check_decision(Decision.model_validate(json.loads(raw.content), strict=True))

steps.finish()
