"""``LLAMA_ARG_*``: llama-server's environment variables, read as it reads them.

An option not given on the command line is taken from its variable (a flag wins over
its variable); a variable of a llama-server flag we do not support is refused by name,
never ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from actors.http._cli_options import (
    _FALSEY,
    _OPTIONS,
    _OURS,
    _REFUSED_NEGATIONS,
    _TRUTHY,
    CliError,
    _llama_flag,
)
from actors.http._flags import LLAMA_SERVER_FLAGS

__all__: list[str] = []


def _with_environment(values: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """``values`` with each option not on the command line taken from its variable."""
    given = dict(values)
    for option in _OPTIONS:
        flag = _llama_flag(option)
        if flag.env is None or option.dest in given:
            continue
        negative = flag.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1) if flag.negations else None
        text = env.get(flag.env)
        where = f"environment variable {flag.env}={text!r}"
        if negative is not None and negative in env:  # any value, as llama-server
            given[option.dest] = False
            where = f"environment variable {negative}"
        elif text is None:
            continue
        elif option.convert is None and not flag.negations:  # a flag without a value
            if text in _TRUTHY:  # anything else leaves it unset, as llama-server
                given[option.dest] = True
        elif option.convert is None:
            if text not in _TRUTHY + _FALSEY:
                raise CliError(f"{where}: not a boolean (one of {', '.join(_TRUTHY + _FALSEY)})")
            given[option.dest] = text in _TRUTHY
        else:
            try:
                given[option.dest] = option.convert(text)
            except ValueError as e:
                raise CliError(f"{where}: {e}") from None
        if given.get(option.dest, True) is False and option.dest in _REFUSED_NEGATIONS:
            raise CliError(f"{where}: {_REFUSED_NEGATIONS[option.dest]}")
    supported = {n for option in _OPTIONS for n in _llama_flag(option).spellings}
    for flag in LLAMA_SERVER_FLAGS:
        # llama-server would act on these; so a set one is refused, not ignored. HF_TOKEN
        # and MTMD_BACKEND_DEVICE are not llama.cpp's own names: other tools set them.
        if flag.env is None or not flag.env.startswith("LLAMA_") or flag.spellings[0] in supported:
            continue
        for name in (
            flag.env,
            flag.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1) if flag.negations else None,
        ):
            if name is not None and name in env:
                raise CliError(
                    f"environment variable {name} sets {flag.spellings[-1]}, a llama-server flag "
                    "that llama-cpp-actors does not support"
                )
    dests = [option.dest for option in _OPTIONS] + [ours[1] for ours in _OURS]
    return {dest: given.get(dest) for dest in dests}
