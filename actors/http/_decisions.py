"""Typed decisions over HTTP, each request served by one ``Decide``:

- ``POST /v1/systemone``: the System One shape. ``state`` (text, or a JSON object or
  list), ``questions`` keyed by name (``noul``, ``choice``, ``score``); ``answers``
  keyed by the same names, ``usage``.
- ``POST /v1/decisions``: the OpenAI-compatible shape hosted providers serve.
  ``input`` (text, or message items), ``questions`` as a list (``predicate``,
  ``choice``, ``score``, each optionally named); ``answers`` in the same order,
  ``usage`` with its details.

Every answer also carries ``option_mass`` (see :class:`actors.Answer`); numbers are
rounded to 6 decimals. Nothing is
refused as a ``refusal`` answer: a question this model cannot answer (a label that is
not one token, a thinking template, a state past the context, too many options) is a
400 that names why, as every other malformed request is.

Runs on the event loop; the request is checked and built in a work thread, and its
questions rendered in the sending thread of ``adecide_result`` (a worker thread).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from actors import Answer, Decide, Decision, adecide_result
from actors.http._access import access_of
from actors.http._errors import HttpError
from actors.http._native import json_response
from actors.http._params import echoed_model
from actors.http._service import Service, routed

__all__ = ["decisions", "systemone"]


async def _decide(
    request: Request, build: Callable[[Mapping[str, Any]], tuple[Any, Any]]
) -> tuple[Service, Decision]:
    """Check the body, make its ``Decide`` (``build`` gives its state and questions) in
    a work thread, and await the ``Decision``; the service that answered it too."""
    service = await routed(request)
    body = request.state.json
    if not isinstance(body, Mapping):
        raise HttpError(400, "the request body must be a JSON object")
    kwargs = body.get("chat_template_kwargs")
    access = access_of(request)
    request_id = access.engine_id() if access is not None else None

    def make() -> Decide:
        state, questions = build(body)
        options: dict[str, Any] = {} if request_id is None else {"request_id": request_id}
        if kwargs is not None:
            options["template_kwargs"] = kwargs
        if body.get("lora") is not None:
            options["lora"] = body["lora"]
        return Decide(state, questions, **options)

    message = await service.run(make)
    decision = await adecide_result(service.handle(), message)
    if access is not None:
        access.prompt_tokens = decision.prompt_tokens
    return service, decision


# -- System One ---------------------------------------------------------------------


def _systemone_parts(body: Mapping[str, Any]) -> tuple[Any, Any]:
    if "state" not in body or body["state"] is None:
        raise HttpError(400, "'state' is required: text, or a JSON object or list")
    questions = body.get("questions")
    if not isinstance(questions, Mapping):
        raise HttpError(400, "'questions' must be an object of names to questions")
    return body["state"], questions


def _systemone_answer(answer: Answer, legend: tuple[Any, ...]) -> dict[str, Any]:
    """An answer in Jev's shape; a score's ``legend`` echoes its levels as given."""
    if answer.type == "noul":  # the probability it holds is the answer
        return {"type": "noul", "noul": _wire(answer.noul), "option_mass": _wire(answer.option_mass)}
    out: dict[str, Any] = {"type": answer.type}
    if answer.type == "choice":
        out["choice"] = answer.choice
    else:
        out["score"] = _wire(answer.score)
        out["legend"] = {str(i): level for i, level in enumerate(legend)}
    out["probabilities"] = {key: _wire(p) for key, p in answer.probabilities.items()}
    return _with_measures(out, answer)


def _with_measures(out: dict[str, Any], answer: Answer) -> dict[str, Any]:
    """``out`` with the answer's ``confidence`` and ``option_mass``."""
    out["confidence"] = _wire(answer.confidence)
    out["option_mass"] = _wire(answer.option_mass)
    return out


def _wire(value: float | None) -> float:
    """A number as the wire carries it: 6 decimals. Clients check that a score is what
    the probabilities shown give and that they sum to 1 within the digits shown
    (pydantic-ai's does, with no other tolerance): 17 digits leave no room for the
    float error of the sums, 6 do. ``actors.Answer`` keeps the unrounded values."""
    assert value is not None
    return round(value, 6)


async def systemone(request: Request) -> Response:
    """``POST /v1/systemone``: answers keyed by the questions' names."""
    service, decision = await _decide(request, _systemone_parts)
    body = request.state.json
    questions = body["questions"]
    answers = {}
    for name, answer in decision.answers.items():
        criteria = questions[name].get("criteria") if isinstance(questions[name], Mapping) else None
        legend = tuple(criteria) if answer.type == "score" and isinstance(criteria, list) else ()
        answers[name] = _systemone_answer(answer, legend)
    return json_response(
        {
            "model": echoed_model(body, service.model_ids[0]),
            "answers": answers,
            "usage": {"input_tokens": decision.prompt_tokens, "output_tokens": 0},
        }
    )


# -- OpenAI's Decisions ---------------------------------------------------------------

_PREDICATE_TYPES = {"predicate": "noul", "choice": "choice", "score": "score"}


def _part_text(part: object, where: str) -> str:
    """One content part's text: ``input_text``/``output_text`` as is, ``input_json`` as JSON."""
    if isinstance(part, str):
        return part
    if not isinstance(part, Mapping):
        raise HttpError(400, f"{where}: a content part must be an object")
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
        return str(part["text"])
    if kind == "input_json":
        return json.dumps(part.get("data"), ensure_ascii=False)
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        return str(part["refusal"])
    if kind == "input_image":
        raise HttpError(400, f"{where}: this server takes text only (an input_image part was sent)")
    raise HttpError(400, f"{where}: unknown content part type {kind!r}")


def _content(value: object, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(_part_text(part, where) for part in value)
    raise HttpError(400, f"{where} must be a string or a list of content parts")


def _input_state(value: object) -> Any:
    """``input`` as a state: text as it is; message items as a JSON list of turns."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise HttpError(400, "'input' must be a string or a non-empty list of input items")
    turns: list[Any] = []
    for i, item in enumerate(value):
        if not isinstance(item, Mapping):
            raise HttpError(400, f"input[{i}] must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            turns.append({"role": item.get("role"), "content": _content(item.get("content"), f"input[{i}]")})
        elif kind in ("function_call", "custom_tool_call"):
            keys = ("type", "call_id", "name", "arguments", "input")
            turns.append({k: item.get(k) for k in keys if k in item})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = _content(item.get("output"), f"input[{i}].output")
            turns.append({"type": kind, "call_id": item.get("call_id"), "output": output})
        else:
            raise HttpError(400, f"input[{i}] has an unknown type {kind!r}")
    return turns


def _value_text(value: object, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    raise HttpError(400, f"{where}: a choice's value must be a string or a boolean")


def _openai_question(question: object, i: int) -> dict[str, Any]:
    where = f"questions[{i}]"
    if not isinstance(question, Mapping):
        raise HttpError(400, f"{where} must be an object")
    kind = _PREDICATE_TYPES.get(str(question.get("type")))
    if kind is None:
        raise HttpError(400, f"{where}.type must be predicate, choice or score, got {question.get('type')!r}")
    out: dict[str, Any] = {"type": kind, "instructions": _content(question.get("instructions"), where)}
    if kind == "choice":
        choices = question.get("choices")
        if not isinstance(choices, list):
            raise HttpError(400, f"{where}.choices must be a list of {{value, description}}")
        criteria: dict[str, Any] = {}
        for j, choice in enumerate(choices):
            if not isinstance(choice, Mapping) or "value" not in choice:
                raise HttpError(400, f"{where}.choices[{j}] must be an object with a value")
            text = _value_text(choice["value"], f"{where}.choices[{j}]")
            if text in criteria:
                raise HttpError(
                    400, f"{where}: the choice {text!r} is given twice (each must differ in text)"
                )
            criteria[text] = choice.get("description")
        out["criteria"] = criteria
    elif kind == "score":
        levels = question.get("levels")
        if not isinstance(levels, list):
            raise HttpError(400, f"{where}.levels must be a list of {{label, description}}")
        texts = []
        for j, level in enumerate(levels):
            if not isinstance(level, Mapping) or not isinstance(level.get("label"), str):
                raise HttpError(400, f"{where}.levels[{j}] must be an object with a string label")
            description = level.get("description")
            texts.append(level["label"] + (f" - {description}" if isinstance(description, str) else ""))
        out["criteria"] = texts
    return out


def _decisions_parts(body: Mapping[str, Any]) -> tuple[Any, Any]:
    if "input" not in body:
        raise HttpError(400, "'input' is required: a string or a list of input items")
    questions = body.get("questions")
    if not isinstance(questions, list):
        raise HttpError(400, "'questions' must be a list of questions")
    return _input_state(body["input"]), {f"q{i}": _openai_question(q, i) for i, q in enumerate(questions)}


def _openai_answer(answer: Answer, question: Mapping[str, Any]) -> dict[str, Any]:
    name = question.get("name") if isinstance(question.get("name"), str) else None
    if answer.type == "noul":
        mass = _wire(answer.option_mass)
        return {"type": "predicate", "name": name, "probability": _wire(answer.noul), "option_mass": mass}
    out: dict[str, Any] = {"type": answer.type, "name": name}
    if answer.type == "choice":
        values = [c["value"] for c in question["choices"]]
        out["choice"] = values[list(answer.probabilities).index(str(answer.choice))]
        out["probabilities"] = [
            {"value": v, "probability": _wire(p)}
            for v, p in zip(values, answer.probabilities.values(), strict=True)
        ]
    else:
        labels = [level["label"] for level in question["levels"]]
        out["score"] = _wire(answer.score)
        out["probabilities"] = [
            {"value": i, "label": label, "probability": _wire(p)}
            for i, (label, p) in enumerate(zip(labels, answer.probabilities.values(), strict=True))
        ]
    return _with_measures(out, answer)


async def decisions(request: Request) -> Response:
    """``POST /v1/decisions``: answers in the questions' order (OpenAI's shape)."""
    service, decision = await _decide(request, _decisions_parts)
    body = request.state.json
    pairs = zip(decision.answers.values(), body["questions"], strict=True)
    answers = [_openai_answer(answer, question) for answer, question in pairs]
    n, cached = decision.prompt_tokens, decision.cached_tokens
    return json_response(
        {
            "model": echoed_model(body, service.model_ids[0]),
            "answers": answers,
            "usage": {
                "input_tokens": n,
                "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                "output_tokens": 0,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": n,
            },
        }
    )
