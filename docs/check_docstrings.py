"""Every public name has a docstring of its own: ``python docs/check_docstrings.py``.

Public names are the names in ``__all__`` of ``actors``, ``strategies`` and
``telemetry`` (dunder names such as ``__version__`` aside), the public classes of
``telemetry.logging`` and ``telemetry.prometheus``, and the public methods and
properties of those classes, inherited ones included (checked where they are defined).

The check reads the source with griffe, as mkdocstrings does for the API reference, so
it sees what the site shows: a docstring inherited from a base class, or the
``Name(field, ...)`` text that ``@dataclass`` writes into a class without one, is not
in the source and does not count. A blinker signal's docstring is its ``doc=``
(``docs/griffe_docstrings.py``). ``make docs`` runs this script; ``tests/project/test_docs.py``
runs it too, and checks that it catches each kind of gap.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import griffe

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from griffe_docstrings import SignalDocs  # noqa: E402

PACKAGES = ("actors", "strategies", "telemetry")
"""The packages whose ``__all__`` is the public API."""
MODULES = ("telemetry.logging", "telemetry.prometheus")
"""Public modules whose public classes are part of the API too."""


def _own_docstring(obj: griffe.Object | griffe.Alias) -> str:
    text = obj.docstring.value.strip() if obj.docstring else ""
    # A pasted signature is no description (what @dataclass writes when a class has none).
    if text.startswith(f"{obj.name}(") and text.endswith(")") and "\n" not in text:
        return ""
    return text


def _public_members(cls: griffe.Class) -> Iterator[tuple[str, griffe.Object | griffe.Alias]]:
    for name, member in cls.all_members.items():
        if name.startswith("_"):
            continue
        target = member.final_target if member.is_alias else member
        if target.is_function or (target.is_attribute and "property" in target.labels):
            yield name, target


def _check(path: str, obj: griffe.Object | griffe.Alias) -> Iterator[str]:
    target = obj.final_target if obj.is_alias else obj
    if not _own_docstring(target):
        yield f"{path}: no docstring (defined at {target.path})"
    if target.is_class:
        assert isinstance(target, griffe.Class)
        for name, member in _public_members(target):
            if not _own_docstring(member):
                yield f"{path}.{name}: no docstring of its own (defined at {member.path})"


def find_problems(
    packages: Iterable[str] = PACKAGES,
    modules: Iterable[str] = MODULES,
    search_paths: Iterable[str | Path] = (ROOT,),
) -> list[str]:
    """One line per public name or member without a docstring of its own."""
    loader = griffe.GriffeLoader(
        extensions=griffe.load_extensions(SignalDocs()),
        search_paths=[str(p) for p in search_paths],
        docstring_parser=griffe.Parser.google,
    )
    packages, modules = list(packages), list(modules)
    loaded = {name: loader.load(name) for name in packages}
    loader.resolve_aliases(implicit=False, external=False)
    problems: list[str] = []
    for name, package in loaded.items():
        exports = [str(e) for e in (package.exports or [])]
        if not exports:
            problems.append(f"{name}: no __all__")
        for export in exports:
            if export.startswith("__") and export.endswith("__"):
                continue
            try:
                member = package[export]
            except KeyError:
                problems.append(f"{name}.{export}: in __all__ but not defined")
                continue
            problems.extend(_check(f"{name}.{export}", member))
    for module_path in modules:
        module = loaded[module_path.split(".")[0]][module_path.split(".", 1)[1]]
        for cls_name, cls in module.classes.items():
            if not cls_name.startswith("_") and not cls.is_alias:
                problems.extend(_check(f"{module_path}.{cls_name}", cls))
    return problems


def main() -> int:
    """Print every problem; exit 1 if there is any."""
    problems = find_problems()
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print(f"{len(problems)} public names lack a docstring of their own", file=sys.stderr)
        return 1
    print("every public name has a docstring of its own")
    return 0


if __name__ == "__main__":
    sys.exit(main())
