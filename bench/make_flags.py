"""Write ``actors/http/_flags.py``: llama-server's flags, read from llama.cpp's ``arg.cpp``.

    python bench/make_flags.py            # after `make bench-peers` unpacked the sdist
    python bench/make_flags.py ARG_CPP    # another llama.cpp's common/arg.cpp

llama.cpp declares every flag of every tool in ``common_params_parser_init``, one
``add_opt(common_arg({spellings}, [{negations} | "VALUE"[, "VALUE2"]], help, handler)
.set_examples({...}).set_env("LLAMA_ARG_...")...)`` each; ``add_opt`` keeps an option for
an example when its examples name that example or ``LLAMA_EXAMPLE_COMMON`` (the
default), unless its excludes name the example. This script lexes just enough C++ to
find those calls (strings, raw strings, character literals, comments, nested brackets),
applies that rule for ``LLAMA_EXAMPLE_SERVER``, drops the preset-only options (they are
not command-line flags), and writes the result as a Python literal. Run by hand; the
output is committed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ARG_CPP = ROOT / "bench/.peers/llama_cpp_python-0.3.36/vendor/llama.cpp/common/arg.cpp"
OUTPUT = ROOT / "actors/http/_flags.py"
SERVER = "LLAMA_EXAMPLE_SERVER"
COMMON = "LLAMA_EXAMPLE_COMMON"


def _skip_literal(text: str, i: int) -> int:
    """The index just past the string, raw string, char literal or comment at ``i``, or ``i``."""
    if text.startswith("//", i):
        end = text.find("\n", i)
        return len(text) if end < 0 else end
    if text.startswith("/*", i):
        return text.index("*/", i) + 2
    if text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
        open_paren = text.index("(", i)
        delimiter = text[i + 2 : open_paren]
        return text.index(")" + delimiter + '"', open_paren) + len(delimiter) + 2
    if text[i] in "\"'":
        quote, j = text[i], i + 1
        while text[j] != quote:
            j += 2 if text[j] == "\\" else 1
        return j + 1
    return i


def _close(text: str, i: int) -> int:
    """The index of the bracket closing the one at ``i``."""
    depth, j = 0, i
    while True:
        k = _skip_literal(text, j)
        if k != j:
            j = k
            continue
        c = text[j]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return j
        j += 1


def _split(text: str) -> list[str]:
    """``text`` split at its top-level commas."""
    parts, depth, start, j = [], 0, 0, 0
    while j < len(text):
        k = _skip_literal(text, j)
        if k != j:
            j = k
            continue
        c = text[j]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:j].strip())
            start = j + 1
        j += 1
    parts.append(text[start:].strip())
    return parts


def _without_comments(text: str) -> str:
    out, j = [], 0
    while j < len(text):
        k = _skip_literal(text, j)
        if k == j:
            out.append(text[j])
            j += 1
        else:
            if not text.startswith(("//", "/*"), j):
                out.append(text[j:k])
            j = k
    return "".join(out)


def _strings(text: str) -> tuple[str, ...]:
    return tuple(re.findall(r'"((?:[^"\\]|\\.)*)"', _without_comments(text)))


def _named_lists(source: str) -> dict[str, set[str]]:
    """``static std::initializer_list<enum llama_example> name = {...};`` by name."""
    found = re.finditer(r"initializer_list<enum llama_example>\s+(\w+)\s*=\s*\{([^}]*)\}", source)
    return {m.group(1): set(re.findall(r"LLAMA_EXAMPLE_\w+", m.group(2))) for m in found}


def extract(source: str) -> list[tuple[tuple[str, ...], tuple[str, ...], int, str | None]]:
    """llama-server's options: (spellings, negations, values taken, env var) each."""
    lists = _named_lists(source)
    body = source[source.index("common_params_context common_params_parser_init(") :]
    options: list[tuple[tuple[str, ...], tuple[str, ...], int, str | None]] = []
    seen: set[str] = set()
    for match in re.finditer(r"\badd_opt\(\s*common_arg\(", body):
        open_arg = match.end() - 1
        close_arg = _close(body, open_arg)
        args = _split(body[open_arg + 1 : close_arg])
        chain = body[close_arg + 1 : _close(body, match.start() + len("add_opt"))]
        spellings = _strings(args[0])
        negations: tuple[str, ...] = ()
        if args[1].startswith("{"):  # (args, args_neg, help, handler(bool))
            negations, n_values = _strings(args[1]), 0
        else:  # 3 arguments: no value; 4: one; 5: two
            n_values = len(args) - 3
        examples, excludes = {COMMON}, set()
        for method, argument in re.findall(r"\.(set_\w+)\(([^()]*)\)", chain):
            if method in ("set_examples", "set_excludes"):
                named = set(re.findall(r"LLAMA_EXAMPLE_\w+", argument)) or lists[argument.strip()]
                if method == "set_examples":
                    examples = named
                else:
                    excludes = named
        env_match = re.search(r'\.set_env\("([^"]+)"\)', chain)
        preset_only = ".set_preset_only()" in chain
        if preset_only or SERVER in excludes or not ({SERVER, COMMON} & examples):
            continue
        key = spellings[0]
        if key in seen:  # -np is declared once per branch of an `if (ex == ...)`
            continue
        seen.add(key)
        options.append((spellings, negations, n_values, env_match.group(1) if env_match else None))
    return options


def render(options: list[tuple[tuple[str, ...], tuple[str, ...], int, str | None]], origin: str) -> str:
    rows = "\n".join(f"    LlamaFlag({s!r}, {n!r}, {v}, {e!r})," for s, n, v, e in options)
    return f'''"""llama-server's command-line flags, as data: every spelling, its value count, its env var.

Generated by ``bench/make_flags.py`` from
{origin}
(``common_params_parser_init`` filtered for ``LLAMA_EXAMPLE_SERVER``: the server's own
options and the common ones, without the preset-only ones). Do not edit by hand: run the
script again for another llama.cpp. Pure data, importable from any thread.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import NamedTuple

__all__ = ["LLAMA_SERVER_FLAGS", "LlamaFlag", "by_spelling"]


class LlamaFlag(NamedTuple):
    """One llama-server option.

    Attributes:
        spellings: the names that set it (``-c``, ``--ctx-size``).
        negations: the names that unset a boolean one (``--no-context-shift``).
        n_values: how many values follow it on the command line (0, 1 or 2).
        env: the environment variable llama-server reads it from, if any; a boolean
            one is also unset by the same name with ``LLAMA_ARG_NO_`` for ``LLAMA_ARG_``.
    """

    spellings: tuple[str, ...]
    negations: tuple[str, ...]
    n_values: int
    env: str | None


LLAMA_SERVER_FLAGS: tuple[LlamaFlag, ...] = (
{rows}
)
"""Every option of llama-server, in the order of its ``--help``."""


def by_spelling() -> MappingProxyType[str, LlamaFlag]:
    """Each spelling and negation of every option -> its option."""
    table = {{name: flag for flag in LLAMA_SERVER_FLAGS for name in (*flag.spellings, *flag.negations)}}
    return MappingProxyType(table)
'''


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_ARG_CPP
    options = extract(path.read_text(encoding="utf-8"))
    names = [n for spellings, negations, _, _ in options for n in (*spellings, *negations)]
    if len(names) != len(set(names)):
        raise SystemExit(f"a spelling appears twice: {sorted({n for n in names if names.count(n) > 1})}")
    try:
        origin = f"``{path.resolve().relative_to(ROOT)}``"
    except ValueError:
        origin = f"``{path}``"
    cmake = (path.resolve().parent.parent / "CMakeLists.txt").read_text(encoding="utf-8")
    version = ".".join(re.findall(r"set\(LLAMA_VERSION_(?:MAJOR|MINOR|PATCH) (\d+)\)", cmake))
    origin += f" (llama.cpp {version})"
    OUTPUT.write_text(render(options, origin), encoding="utf-8")
    subprocess.run([str(ROOT / ".venv/bin/ruff"), "format", "-q", str(OUTPUT)], check=False)
    print(f"{len(options)} options, {sum(len(o[0]) + len(o[1]) for o in options)} spellings -> {OUTPUT}")


if __name__ == "__main__":
    main()
