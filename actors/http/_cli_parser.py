"""The ``argparse`` parser of ``llama-cpp-actors serve``, built from the option table.

Every flag of :data:`actors.http._cli_options._OPTIONS` and ``_OURS`` is an argument;
every other llama-server flag is an argument that refuses itself by name (exit code 2).
:func:`_normalized` reads ``argv`` as llama-server does before argparse sees it.
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

from actors import __version__
from actors.http._cli_options import (
    _ACCEPTED,
    _OPTIONS,
    _OURS,
    _REFUSED_NEGATIONS,
    CliError,
    _llama_flag,
)
from actors.http._flags import LLAMA_SERVER_FLAGS

__all__: list[str] = []

PROG = "llama-cpp-actors"
_DESCRIPTION = """\
Serve a llama.cpp model over HTTP with llama-server's endpoints and flags, from the
llama-cpp-actors engine (continuous batching, prompt caches, supervision, telemetry).

Every flag below is llama-server's, with its meaning and its environment variable
(LLAMA_ARG_*; a flag wins over its variable), unless marked as ours. A llama-server
flag not listed here is refused by name (exit code 2), never ignored."""
_EPILOG = """\
exit codes: 0 after SIGTERM/SIGINT drained the server, 1 if the engine could not start
(a bad option for it, a missing model), 2 for a bad command line or variable."""


def _refuse(message: str) -> type[argparse.Action]:
    """An argparse action that rejects its flag with ``message`` (``{flag}``: its spelling)."""

    class Refuse(argparse.Action):
        def __call__(
            self,
            parser: argparse.ArgumentParser,
            namespace: argparse.Namespace,
            values: Any,
            option_string: str | None = None,
        ) -> None:
            parser.error(message.replace("{flag}", option_string or self.option_strings[0]))

    return Refuse


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Help that never breaks a line inside a flag's name (``--no-kv-\\nunified``)."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing and exiting on a bad command line."""

    def error(self, message: str) -> Any:  # argparse's signature says NoReturn
        raise CliError(message)


_EXTENDED = frozenset({"api_key", "lora"})


class _Extend(argparse.Action):
    """Each occurrence's values added to the ones before (``--api-key a --api-key b,c``)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, (*getattr(namespace, self.dest, ()), *values))


def _serve_parser(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("-h", "--help", "--usage", action="help", help="print this help and exit")
    serve.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    supported = serve.add_argument_group("llama-server's flags")
    accepted = serve.add_argument_group("llama-server's flags accepted without effect")
    ours = serve.add_argument_group("llama-cpp-actors' own flags")
    covered = {"-h", "--help", "--usage", "--version"}
    unset = argparse.SUPPRESS  # absent from the namespace unless given: env vars fill the rest
    for option in _OPTIONS:
        flag = _llama_flag(option)
        group = accepted if option.dest in _ACCEPTED else supported
        text = option.help.replace("%", "%%")
        env = f" (env: {flag.env})" if flag.env else ""
        covered.update(flag.spellings, flag.negations)
        if option.convert is not None:
            group.add_argument(
                *flag.spellings,
                dest=option.dest,
                type=_argparse_type(option.convert),
                default=unset,
                metavar=option.metavar,
                help=text + env,
                # llama-server adds the keys of every --api-key and the adapters of every
                # --lora and --lora-scaled; any other flag's last wins.
                action=_Extend if option.dest in _EXTENDED else "store",
            )
            continue
        refused = _REFUSED_NEGATIONS.get(option.dest)
        says_it = refused or option.dest in _ACCEPTED  # its help already names the negations
        negated = f"; {', '.join(flag.negations)} to disable" if flag.negations and not says_it else ""
        group.add_argument(
            *flag.spellings, dest=option.dest, action="store_true", default=unset, help=text + negated + env
        )
        if refused:
            action = _refuse(f"{{flag}}: {refused}")
            group.add_argument(*flag.negations, nargs=0, action=action, help=argparse.SUPPRESS)
        elif flag.negations:
            group.add_argument(
                *flag.negations, dest=option.dest, action="store_false", default=unset, help=argparse.SUPPRESS
            )
    for spellings, dest, convert, metavar, help_text in _OURS:
        ours.add_argument(
            *spellings,
            dest=dest,
            type=_argparse_type(convert),
            default=unset,
            metavar=metavar,
            help=help_text,
        )
    for flag in LLAMA_SERVER_FLAGS:
        names = [n for n in (*flag.spellings, *flag.negations) if n not in covered]
        if not names:
            continue
        message = "{flag} is a llama-server flag that llama-cpp-actors does not support"
        serve.add_argument(*names, nargs=flag.n_values, action=_refuse(message), help=argparse.SUPPRESS)


def _argparse_type(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    def checked(text: str) -> Any:
        try:
            return convert(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    checked.__name__ = getattr(convert, "__name__", "value")
    return checked


def _build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    root = _Parser(
        prog=PROG, description="Serve a llama.cpp model over HTTP, as llama-server does.", allow_abbrev=False
    )
    root.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = root.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    serve = commands.add_parser(
        "serve",
        help="run the HTTP server (llama-server's flags)",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        allow_abbrev=False,
        add_help=False,
        formatter_class=_Formatter,
    )
    _serve_parser(serve)
    return root, serve


def _normalized(argv: Sequence[str], serve: argparse.ArgumentParser) -> list[str]:
    """``argv`` as llama-server reads it: ``--foo_bar`` is ``--foo-bar`` where that is a
    flag, and the token after a flag that takes one value is its value even if it starts
    with ``-`` (argparse would take it for a flag: it is passed as ``flag=value``)."""
    values = {name: a.nargs for a in serve._actions for name in a.option_strings}
    out: list[str] = []
    skip = 0
    for token in argv:
        if skip:
            if skip == 1 and token.startswith("-") and out[-1] in values and values[out[-1]] is None:
                out[-1] = f"{out[-1]}={token}"
            else:
                out.append(token)
            skip -= 1
            continue
        name, eq, rest = token.partition("=")
        if token.startswith("--") and name not in values and name.replace("_", "-") in values:
            name = name.replace("_", "-")
            token = name + eq + rest
        if token == "--":
            skip = len(argv)  # the rest is positional
        elif name in values and not eq:
            nargs = values[name]
            skip = 1 if nargs is None else nargs if isinstance(nargs, int) else 0
        out.append(token)
    return out
