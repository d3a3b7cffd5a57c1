"""Custom chat templates and template variables, on the default model.

``ServerActor(chat_template=...)`` replaces the model's own template (checked at start),
``chat_template_kwargs=`` are variables every chat gets, and a request's
``template_kwargs`` go over them into the template's render.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable
from typing import Any

import pykka
import pytest
from helpers import model_formatter

from actors import (
    Chat,
    ConfigError,
    Done,
    Failed,
    GetInfo,
    GetTokenizer,
    InvalidRequest,
    StreamChat,
    Tokenizer,
    achat,
    astream_events,
    chat,
    stream_chat,
)

pytestmark = pytest.mark.timeout(120)
Start = Callable[..., pykka.ActorRef[Any]]
HI = [{"role": "user", "content": "hi"}]
# ChatML as SmolLM2's own template writes it, without its default system prompt, plus
# two variables: ``persona`` (a system line) and ``boom`` (raise while rendering).
TEMPLATE = (
    "{% if boom %}{{ raise_exception('boom was set') }}{% endif %}"
    "{% if persona %}<|im_start|>system\n{{ persona }}{% if facts is defined %} {{ facts | tojson }}"
    "{% endif %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer(ref: pykka.ActorRef[Any]) -> Tokenizer:
    result: Tokenizer = ref.ask(GetTokenizer())
    return result


def test_a_custom_template_replaces_the_models_own(start_server: Start) -> None:
    own = start_server(n_parallel=1)
    custom = start_server(n_parallel=1, chat_template=TEMPLATE)
    own_prompt = tokenizer(own).apply_chat_template(HI)
    assert "You are a helpful AI assistant named SmolLM" in own_prompt  # SmolLM2's default system
    assert (
        tokenizer(custom).apply_chat_template(HI) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert custom.ask(GetInfo())["has_chat_template"] is True
    a = own.ask(Chat(HI, max_tokens=1, temp=0)).get(timeout=60)
    b = custom.ask(Chat(HI, max_tokens=1, temp=0)).get(timeout=60)
    assert b.prompt_tokens < a.prompt_tokens
    # The template's <|im_start|> are special tokens, as with the model's template:
    # the prompt is as many tokens as its text tokenized with special tokens parsed.
    text = tokenizer(custom).apply_chat_template(HI)
    assert b.prompt_tokens == len(tokenizer(custom).tokenize(text, add_special=False))


def test_template_kwargs_reach_the_template(start_server: Start) -> None:
    ref = start_server(n_parallel=2, chat_template=TEMPLATE)
    tok = tokenizer(ref)
    prompt = tok.apply_chat_template(HI, template_kwargs={"persona": "You are Ada.", "facts": {"n": [1, 2]}})
    assert prompt.startswith('<|im_start|>system\nYou are Ada. {"n": [1, 2]}<|im_end|>\n<|im_start|>user\nhi')
    plain = ref.ask(Chat(HI, max_tokens=1, temp=0)).get(timeout=60)
    with_persona = ref.ask(Chat(HI, max_tokens=1, temp=0, template_kwargs={"persona": "Ada"})).get(timeout=60)
    assert with_persona.prompt_tokens > plain.prompt_tokens
    expected = len(tok.tokenize(tok.apply_chat_template(HI, {"persona": "Ada"}), add_special=False))
    assert with_persona.prompt_tokens == expected
    events: queue.Queue[Any] = queue.Queue()
    ref.tell(StreamChat(HI, reply_to=events, max_tokens=1, temp=0, template_kwargs={"persona": "Ada"}))
    while not isinstance(event := events.get(timeout=60), Done | Failed):
        pass
    assert isinstance(event, Done) and event.completion.prompt_tokens == expected


def test_the_helpers_pass_template_kwargs_through(start_server: Start) -> None:
    ref = start_server(n_parallel=2, chat_template=TEMPLATE)
    kwargs = {"persona": "Ada"}
    expected = chat(ref, HI, max_tokens=1, temp=0, template_kwargs=kwargs, timeout=60).prompt_tokens
    assert expected > chat(ref, HI, max_tokens=1, temp=0, timeout=60).prompt_tokens
    with pytest.raises(InvalidRequest, match="boom was set"):
        "".join(stream_chat(ref, HI, max_tokens=1, template_kwargs={"boom": True}, timeout=60))

    async def run() -> tuple[int, int]:
        completion = await achat(ref, HI, max_tokens=1, temp=0, template_kwargs=kwargs, timeout=60)
        last: Any = None
        async for event in astream_events(ref, messages=HI, max_tokens=1, temp=0, template_kwargs=kwargs):
            last = event
        assert isinstance(last, Done)
        return completion.prompt_tokens, last.completion.prompt_tokens

    assert asyncio.run(run()) == (expected, expected)


def test_server_defaults_go_under_each_requests_variables(start_server: Start) -> None:
    ref = start_server(n_parallel=1, chat_template=TEMPLATE, chat_template_kwargs={"persona": "Bob"})
    tok = tokenizer(ref)
    assert tok.apply_chat_template(HI).startswith("<|im_start|>system\nBob<|im_end|>")
    assert tok.apply_chat_template(HI, {"persona": "Ada"}).startswith("<|im_start|>system\nAda<|im_end|>")
    assert tok.apply_chat_template(HI, {"persona": ""}).startswith("<|im_start|>user")  # a request's wins


def test_the_models_own_template_gets_the_variables_too(start_server: Start) -> None:
    # SmolLM2's template ignores enable_thinking: the prompt is the same with and without.
    ref = start_server(n_parallel=1)
    tok = tokenizer(ref)
    assert tok.apply_chat_template(HI, {"enable_thinking": False}) == tok.apply_chat_template(HI)


def test_a_template_that_raises_fails_only_its_request(start_server: Start) -> None:
    ref = start_server(n_parallel=2, chat_template=TEMPLATE)
    with pytest.raises(InvalidRequest, match="the chat template refused these messages: boom was set"):
        ref.ask(Chat(HI, max_tokens=1, template_kwargs={"boom": True}))
    events: queue.Queue[Any] = queue.Queue()
    ref.tell(StreamChat(HI, reply_to=events, max_tokens=1, template_kwargs={"boom": True}))
    failed = events.get(timeout=60)
    assert isinstance(failed, Failed) and isinstance(failed.error, InvalidRequest)
    with pytest.raises(InvalidRequest, match="boom was set"):
        tokenizer(ref).apply_chat_template(HI, {"boom": True})
    # A template error of another kind (an undefined value serialized) is the same.
    broken = start_server(n_parallel=1, chat_template="{{ nothing | tojson }}{{ messages[0].content }}")
    with pytest.raises(InvalidRequest, match="the chat template refused"):
        broken.ask(Chat(HI, max_tokens=1))
    # Both engines serve on.
    assert ref.ask(Chat(HI, max_tokens=2, temp=0)).get(timeout=60).generated_tokens >= 1
    assert broken.ask(GetInfo())["has_chat_template"] is True


def test_a_broken_template_is_a_config_error_at_start(start_server: Start) -> None:
    with pytest.raises(ConfigError, match="chat_template is not a valid Jinja2 template"):
        start_server(chat_template="{% for m in messages %}{{ m.content }}")
    with pytest.raises(ConfigError, match="chat_template_kwargs key 'messages'"):
        start_server(chat_template_kwargs={"messages": []})


# -- the render: llama_cpp's formatter, with llama-server's rules where it has none -------------

# A conversation every template in the comparison below can take.
TALK = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is today?"},
    {"role": "assistant", "content": "Monday."},
    {"role": "user", "content": "And tomorrow? {{ not a tag }} <|im_end|>"},
]
TEMPLATES = [
    TEMPLATE,
    "{% for m in messages %}{% generation %}{{ m.content | tojson }}{% endgeneration %}{% endfor %}",
    "{{ bos_token }}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
    "[{{ m.role | upper }}] {{ m.content }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}{{ strftime_now('%Y') }}",
    "{% if functions is none and tools is none %}none{% endif %}{{ persona }}",
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("template", TEMPLATES)
def test_a_chat_renders_as_llama_cpps_formatter_renders_it(
    template: str, add_generation_prompt: bool
) -> None:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from actors.backend._template import ChatTemplate

    ours = ChatTemplate(template, bos_token="<s>", eos_token="</s>")
    theirs = Jinja2ChatFormatter(
        template=template, eos_token="</s>", bos_token="<s>", add_generation_prompt=add_generation_prompt
    )
    variables = {"persona": "Ada", "datetime": "Jan 01 2026"}
    expected = theirs(messages=TALK, **variables).prompt
    assert ours.render(TALK, variables, add_generation_prompt=add_generation_prompt) == expected


def test_the_models_own_template_renders_as_create_chat_completion_does(
    start_server: Start, reference_llama: Any
) -> None:
    llm = reference_llama
    formatter = model_formatter(llm)
    assert tokenizer(start_server(n_parallel=1)).apply_chat_template(TALK) == formatter(messages=TALK).prompt


def test_add_generation_prompt_false_leaves_the_assistants_turn_closed(start_server: Start) -> None:
    ref = start_server(n_parallel=1, chat_template=TEMPLATE)
    tok = tokenizer(ref)
    closed = tok.apply_chat_template(HI, add_generation_prompt=False)
    assert closed == "<|im_start|>user\nhi<|im_end|>\n"
    assert tok.apply_chat_template(HI) == closed + "<|im_start|>assistant\n"
    prefill = [*HI, {"role": "assistant", "content": "Hel"}]  # a prefill opens the turn either way
    assert (
        tok.apply_chat_template(prefill, add_generation_prompt=False) == closed + "<|im_start|>assistant\nHel"
    )
    reply = ref.ask(Chat(HI, max_tokens=1, temp=0, add_generation_prompt=False)).get(timeout=60)
    assert reply.prompt_tokens == len(tok.tokenize(closed, add_special=False))
    events: queue.Queue[Any] = queue.Queue()
    ref.tell(StreamChat(HI, reply_to=events, max_tokens=1, temp=0, add_generation_prompt=False))
    while not isinstance(event := events.get(timeout=60), Done | Failed):
        pass
    assert isinstance(event, Done) and event.completion.prompt_tokens == reply.prompt_tokens
    with pytest.raises(InvalidRequest, match="add_generation_prompt must be a bool"):
        tok.apply_chat_template(HI, add_generation_prompt=0)  # type: ignore[arg-type]


def test_tools_reach_the_template_and_null_concatenates_as_in_llama_cpp(start_server: Start) -> None:
    # firefunction-v2's template appends `functions`, which llama-server never sets: its
    # Jinja (and now ours) treats a string + None or undefined as the string.
    template = (
        "{{ 'Functions:' + functions + '|' + undefined_name }}"
        "{% if tools %}{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% endif %}"
        "{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    ref = start_server(n_parallel=1, chat_template=template)
    tok = tokenizer(ref)
    assert tok.apply_chat_template(HI) == "Functions:|nullhi"
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    assert tok.apply_chat_template(HI, tools=[tool]).startswith("Functions:|[get_time][{")
    assert tok.apply_chat_template(HI, tools=[]) == "Functions:|nullhi"
    assert chat(ref, HI, max_tokens=1, temp=0).prompt_tokens > 0  # a Chat renders it too
    for bad in (
        "x",
        [1],
        [{"a": object()}],
        [{"deep": [[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]}],
        [{"s": "x" * 70000}],
    ):
        with pytest.raises(InvalidRequest):
            tok.apply_chat_template(HI, tools=bad)  # type: ignore[arg-type]
