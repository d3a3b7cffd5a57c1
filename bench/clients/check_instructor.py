"""``instructor`` in its default TOOLS mode over the ``openai`` SDK: ``response_model``
gives a validated pydantic object (a flat model, a nested one with a list), sync and
async, and ``create_with_completion``.
"""

from __future__ import annotations

import asyncio

import instructor
import openai
from _models import People, Person, Weather
from _support import BASE_URL, MODEL, Steps, check

client = instructor.from_openai(openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="x", max_retries=0))
aclient = instructor.from_openai(openai.AsyncOpenAI(base_url=f"{BASE_URL}/v1", api_key="x", max_retries=0))
TEXT = "It is 21 degrees Celsius and sunny in Paris. Report the weather."


steps = Steps()

with steps.step("response_model (TOOLS mode)"):
    check(client.mode == instructor.Mode.TOOLS, f"mode {client.mode}")
    weather = client.chat.completions.create(
        model=MODEL,
        response_model=Weather,
        messages=[{"role": "user", "content": TEXT}],
        temperature=0,
        max_tokens=100,
    )
    check(isinstance(weather, Weather), f"{weather!r}")
    steps.note(f"{weather!r}")

with steps.step("nested response_model with a list"):
    people = client.chat.completions.create(
        model=MODEL,
        response_model=People,
        messages=[{"role": "user", "content": "Ann is 31 and Bob is 42."}],
        temperature=0,
        max_tokens=150,
    )
    check(isinstance(people, People) and all(isinstance(p, Person) for p in people.people), f"{people!r}")
    steps.note(f"{people!r}")

with steps.step("create_with_completion"):
    weather, completion = client.chat.completions.create_with_completion(
        model=MODEL,
        response_model=Weather,
        messages=[{"role": "user", "content": TEXT}],
        temperature=0,
        max_tokens=100,
    )
    check(isinstance(weather, Weather), f"{weather!r}")
    check(completion.choices[0].message.tool_calls, f"no tool call in {completion}")

with steps.step("create_partial (streamed tool call)"):
    partials = list(
        client.chat.completions.create_partial(
            model=MODEL,
            response_model=Weather,
            messages=[{"role": "user", "content": TEXT}],
            temperature=0,
            max_tokens=100,
        )
    )
    check(partials and isinstance(partials[-1], Weather), f"{partials!r}")
    check(partials[-1].city and partials[-1].temperature_c is not None, f"the last partial {partials[-1]!r}")
    steps.note(f"{len(partials)} partials, the last {partials[-1]!r}")

with steps.step("async response_model"):

    async def ask() -> Weather:
        return await aclient.chat.completions.create(
            model=MODEL,
            response_model=Weather,
            messages=[{"role": "user", "content": TEXT}],
            temperature=0,
            max_tokens=100,
        )

    check(isinstance(asyncio.run(ask()), Weather), "not a Weather")

steps.finish()
