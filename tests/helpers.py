"""Test helpers shared by several test files."""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

import telemetry
from actors import Completion, Done, Failed, Generate

# Ban every end-of-generation token of the default model, so a request runs until
# max_tokens, a cancel or a stop: tests that need a busy slot must not race an EOG.
NO_EOG = {0: float("-inf"), 2: float("-inf"), 4: float("-inf")}

# Where this CPU's floor is not zero (raw_llama.floor: a sequence's logits move with its
# surroundings), greedy text is only defined away from near-ties: two runs may take
# either of two tokens whose logits are this close, and then go on differently. With the
# batch-invariant kernel the floor is zero and every comparison below is strict.
MARGIN = 0.25


@functools.cache
def cpu_floor() -> float:
    """This CPU's measured floor (raw llama.cpp, flash attention on; cached).

    Under pytest-xdist (``make test``) the first worker to ask measures it and the
    others read its file, under a lock: one measurement a run, not one a worker.
    """
    from raw_llama import floor

    from actors import default_model_path

    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        return floor(default_model_path())
    cache = Path(tempfile.gettempdir()) / f"llama-cpp-actors-floor-{run}"
    with open(f"{cache}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if cache.exists():
            return float(cache.read_text())
        value = floor(default_model_path())
        cache.write_text(repr(value))
        return value


SIGNALS = {
    "tick": telemetry.tick,
    "start": telemetry.request_start,
    "done": telemetry.request_done,
    "exception": telemetry.request_exception,
    "kv_pressure": telemetry.kv_pressure,
    "ram_cache": telemetry.ram_cache,
    "restart": telemetry.server_restart,
    "model_load": telemetry.model_load,
}


class Opaque:
    """An object that is no JSON value, with a repr that is the same in every process
    (test ids must be: pytest-xdist compares the workers' collections)."""

    def __repr__(self) -> str:
        return "<opaque>"


class Recorder:
    """Collects every signal of the engine (held strongly by the test)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
        self._lock = threading.Lock()
        for kind, signal in SIGNALS.items():
            signal.connect(self._receiver(kind))

    def _receiver(self, kind: str) -> Callable[..., None]:
        def receive(sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
            with self._lock:
                self.events.append((kind, measurements, metadata))

        setattr(self, f"_keep_{len(self.__dict__)}", receive)  # blinker holds receivers weakly
        return receive

    def of(self, kind: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        with self._lock:
            return [(m, md) for k, m, md in self.events if k == kind]


def drain(q: queue.Queue[Any], timeout: float = 60) -> list[Any]:
    """A stream's events up to and with its Done or Failed."""
    events = []
    while True:
        event = q.get(timeout=timeout)
        events.append(event)
        if isinstance(event, Done | Failed):
            return events


def wait_until(condition: Callable[[], bool], seconds: float = 60) -> None:
    """Poll ``condition`` until it holds; fail the test after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def compare(expected: Sequence[int], margins: Sequence[float], got: Sequence[int]) -> int:
    """Assert ``got`` equals ``expected`` up to a divergence at a near-tie; returns how many matched.

    ``margins[i]`` is the top-2 logit margin of the run that produced ``expected`` at step
    ``i``. A real bug (a wrong position, seq id or logits row) diverges at a confident step.
    ``got`` may end early (an end-of-generation token won the near-tie), never go on longer.
    """
    if cpu_floor() == 0.0:  # the same request, the same numbers: no near-tie to allow
        assert list(got) == list(expected), f"{list(expected)} != {list(got)}"
        return len(expected)
    pairs = enumerate(zip(expected, got, strict=False))
    diverged = next((i for i, (a, b) in pairs if a != b), None)
    if diverged is None:
        assert len(got) <= len(expected), f"{list(expected)} != {list(got)}"
        if len(got) == len(expected):
            return len(expected)
        diverged = len(got)
    assert margins[diverged] < MARGIN, (
        f"diverged at step {diverged} where the reference was confident "
        f"(margin {margins[diverged]:.3f}): {list(expected)} != {list(got)}"
    )
    return diverged


def trace(completion: Completion) -> list[tuple[int, float, tuple[tuple[int, float], ...]]]:
    """A completion's tokens with their log-probabilities and top alternatives."""
    assert completion.logprobs is not None
    return [
        (e.token_id, e.logprob, tuple((t.token_id, t.logprob) for t in e.top)) for e in completion.logprobs
    ]


def same_numbers(expected: Completion, got: Completion) -> float:
    """Assert ``got`` is ``expected`` token for token, each log-probability within what
    this CPU's floor allows (exactly equal where it is zero); returns the largest difference.

    Both must have asked for the same ``logprobs``. Where the floor is not zero the
    tokens are compared by :func:`compare` (up to a near-tie) and the log-probabilities
    up to the divergence.
    """
    # A log-probability moves by at most twice the largest logit move (its logit and the
    # log-sum-exp each by at most that).
    floor = 2 * cpu_floor()
    a, b = trace(expected), trace(got)
    n = compare([t for t, _, _ in a], margins(expected), [t for t, _, _ in b])
    largest = 0.0
    for step, (x, y) in enumerate(zip(a[:n], b[:n], strict=True)):
        values_x = [x[1]] + [v for _, v in x[2]]
        values_y = [y[1]] + [v for _, v in y[2]]
        assert [i for i, _ in x[2]] == [i for i, _ in y[2]] or floor > 0, f"step {step}: {x} != {y}"
        diff = max(abs(u - v) for u, v in zip(values_x, values_y, strict=False))
        assert diff <= floor, f"step {step}: log-probabilities moved by {diff} (floor {floor}): {x} != {y}"
        largest = max(largest, diff)
    return largest


def margins(completion: Completion) -> list[float]:
    """The top-2 log-probability gap (the logit margin) of each generated token.

    The request must have asked for ``logprobs`` >= 2.
    """
    assert completion.logprobs is not None
    return [e.top[0].logprob - e.top[1].logprob for e in completion.logprobs]


def same_greedy(expected: Completion, got: Sequence[int]) -> int:
    """:func:`compare` another run's greedy tokens with ``expected`` (which has logprobs >= 2)."""
    return compare(list(expected.token_ids), margins(expected), got)


def model_formatter(llm: Any) -> Any:
    """llama-cpp-python's ``Jinja2ChatFormatter`` for the model's own chat template, as
    ``create_chat_completion`` builds it (``llm``: a ``llama_cpp.Llama``)."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    return Jinja2ChatFormatter(
        template=llm.metadata["tokenizer.chat_template"],
        eos_token=llm._model.token_get_text(llm.token_eos()),
        bos_token=llm._model.token_get_text(llm.token_bos()),
    )


_REFERENCES: dict[tuple[Any, ...], Completion] = {}


def greedy_references(
    start_server: Callable[..., Any],
    prompts: Sequence[str],
    max_tokens: int,
    *,
    eog: bool = False,
    at_least: int = 0,
    alone: bool = False,
    **options: Any,
) -> list[Completion]:
    """Each prompt on an engine that reuses and shares nothing, greedy with margins
    (``logprobs=2``): the first ``max_tokens`` tokens, end-of-generation banned unless
    ``eog``.

    Runs are kept for the test session and cut to length: a slot with no reuse is the
    same computation however long the run, so its first ``n`` tokens are those of a run
    of ``n``. A run is made ``at_least`` tokens long, so that a module's tests share it.
    A cut run's ``text`` is its tokens' texts joined.

    Where this CPU's floor is zero a sequence's numbers do not depend on its neighbours
    in the batch (``tests/engine/test_invariance.py`` shows it against runs made
    ``alone``, one prompt at a time on a one-slot engine), so the missing runs share
    the batch, each in a slot the size of the one-slot engine's: the same numbers in a
    third of the time. Elsewhere, and with ``alone``, each runs by itself.
    """
    options = {"n_ctx": 2048, **options}
    # Runs made alone are kept apart: a test of batch invariance needs those.
    keys = {p: (p, eog, tuple(sorted(options.items())), alone) for p in prompts}
    missing = [p for p in prompts if _too_short(_REFERENCES.get(keys[p]), max_tokens)]
    if missing:
        together = 1 if alone or len(missing) == 1 or cpu_floor() != 0.0 else min(len(missing), 8)
        engine_options = dict(options)
        if together > 1:
            assert options["n_ctx"] <= 8192, "a one-slot engine's slot would be cut to n_ctx_train"
            engine_options["n_ctx_per_slot"] = options.get("n_ctx_per_slot") or options["n_ctx"]
            engine_options["n_ctx"] = options["n_ctx"] * together
        engine = start_server(n_parallel=together, cache_prompt=False, prefix_sharing=False, **engine_options)
        bias = {} if eog else {"logit_bias": NO_EOG}
        futures = {
            p: engine.ask(Generate(p, max_tokens=max(max_tokens, at_least), temp=0, logprobs=2, **bias))
            for p in dict.fromkeys(missing)
        }
        for p, future in futures.items():
            _REFERENCES[keys[p]] = future.get(timeout=240)
        engine.stop()
    return [_cut(_REFERENCES[keys[p]], max_tokens) for p in prompts]


def _too_short(run: Completion | None, max_tokens: int) -> bool:
    """Whether ``run`` is missing or stopped at its own ``max_tokens`` short of these
    (not at an end of generation)."""
    return run is None or (run.generated_tokens < max_tokens and run.stop_reason == "max_tokens")


def _cut(run: Completion, max_tokens: int) -> Completion:
    """``run`` as if it had been asked for ``max_tokens`` tokens."""
    if run.generated_tokens <= max_tokens:
        return run
    assert run.logprobs is not None
    logprobs = run.logprobs[:max_tokens]
    return dataclasses.replace(
        run,
        token_ids=run.token_ids[:max_tokens],
        logprobs=logprobs,
        generated_tokens=max_tokens,
        text="".join(entry.text for entry in logprobs),
        stop_reason="max_tokens",
        stop_string=None,
    )


N_TOKENS = 32
"""Greedy tokens a reference run makes (``reference``)."""


def reference(llm: Any, prompt: str | list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens of a fresh ``Llama`` run and the top-2 logit margin at each step."""
    llm.reset()
    if isinstance(prompt, str):
        prompt_tokens = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    else:
        prompt_tokens = prompt
    tokens: list[int] = []
    for token in llm.generate(prompt_tokens, temp=0.0, repeat_penalty=1.0):
        if llm.token_eos() == token or token in (0, 2, 4):
            break
        tokens.append(token)
        if len(tokens) == N_TOKENS:
            break
    margins = []
    for i in range(len(tokens)):
        top2 = np.sort(llm.scores[len(prompt_tokens) - 1 + i])[-2:]
        margins.append(float(top2[1] - top2[0]))
    return tokens, margins
