"""What to say of a keyword that is not an option: the option it most likely meant
(any thread).

Callers arrive with the names of the library or server they used before
(``temperature``, ``n_predict``, ``stop_sequences``...): a table of those names comes
first, then the closest spelling of a real option.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Collection, Mapping
from typing import Any

__all__ = ["REQUEST_ALIASES", "did_you_mean", "suggesting"]

REQUEST_ALIASES: Mapping[str, str] = {
    "temperature": "temp", "n_predict": "max_tokens", "max_new_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens", "stop_sequences": "stop", "presence_penalty": "penalty_present",
    "frequency_penalty": "penalty_freq", "repeat_penalty": "penalty_repeat",
    "repetition_penalty": "penalty_repeat", "repeat_last_n": "penalty_last_n",
    "top_logprobs": "logprobs", "response_format": "json_schema", "schema": "json_schema",
    "id": "request_id", "timeout_s": "deadline_s", "num_choices": "n",
}  # fmt: skip
"""Names other libraries and APIs give the request options."""


def did_you_mean(name: str, names: Collection[str], aliases: Mapping[str, str] | None = None) -> str | None:
    """The option ``name`` most likely meant: from ``aliases``, else the closest of
    ``names``; None when nothing is close."""
    meant = (aliases or {}).get(name)
    if meant is not None and meant in names:
        return meant
    return next(iter(difflib.get_close_matches(name, sorted(names), n=1)), None)


def suggesting(
    cls: type[Any], where: str, aliases: Mapping[str, str] | None = None, elsewhere: str = ""
) -> type[Any]:
    """``cls`` (a dataclass) whose constructor, given a keyword it does not take, raises
    ``TypeError`` naming the option it likely meant ("did you mean ``temp``?") instead of
    Python's bare message. ``where`` names the call in the message; ``elsewhere`` is said
    when nothing is close (where to look)."""
    init: Callable[..., None] = cls.__init__
    names = frozenset(cls.__dataclass_fields__)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        for name in kwargs:
            if name not in names:
                guess = did_you_mean(name, names, aliases)
                hint = f"; did you mean {guess!r}?" if guess else elsewhere
                raise TypeError(f"{name!r} is not an option of {where}{hint}")
        init(self, *args, **kwargs)

    __init__.__doc__, __init__.__wrapped__ = init.__doc__, init  # type: ignore[attr-defined]
    cls.__init__ = __init__
    return cls
