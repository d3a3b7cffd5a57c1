"""The code's shape, for the notes of a refactoring: modules and lines per package, the
modules over 400 lines, import arrows between packages and into their private modules,
and the import circles inside packages (type-checking imports count).

    python bench/structure.py            # this checkout
    python bench/structure.py --tree DIR # another checkout (e.g. a worktree of an old commit)

Reads the files with ``grimp`` (import-linter's graph); imports nothing it measures.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import grimp

ROOTS = ("actors", "strategies", "telemetry")
LIMIT = 400


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "actors" and len(parts) > 1 else parts[0]


def _cycles(graph: grimp.ImportGraph, modules: set[str]) -> int:
    """Modules of one package that sit on an import circle with a sibling."""
    on_circle = 0
    for module in modules:
        parent = module.rsplit(".", 1)[0]
        siblings = {m for m in modules if m.rsplit(".", 1)[0] == parent and m != module}
        if any(
            graph.direct_import_exists(importer=module, imported=other)
            and graph.chain_exists(importer=other, imported=module)
            for other in siblings
        ):
            on_circle += 1
    return on_circle


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args()
    sys.path.insert(0, str(args.tree))
    graph = grimp.build_graph(*ROOTS, cache_dir=None)
    modules = {m for m in graph.modules if m.split(".")[0] in ROOTS}
    lines: dict[str, int] = {}
    for module in modules:
        base = args.tree / module.replace(".", "/")
        path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        lines[module] = len(path.read_text().splitlines())
    per_package: Counter[str] = Counter()
    package_lines: Counter[str] = Counter()
    for module, n in lines.items():
        per_package[_package(module)] += 1
        package_lines[_package(module)] += n
    arrows = private = 0
    for module in modules:
        for imported in graph.find_modules_directly_imported_by(module):
            if imported.split(".")[0] not in ROOTS or _package(imported) == _package(module):
                continue
            arrows += 1
            private += any(part.startswith("_") for part in imported.split(".")[2:])
    print("| package | modules | lines |\n|---|---|---|")
    for package in sorted(per_package):
        print(f"| `{package}` | {per_package[package]} | {package_lines[package]:,} |")
    big = sorted(((n, m) for m, n in lines.items() if n > LIMIT), reverse=True)
    print(f"\n{len(modules)} modules, {sum(lines.values()):,} lines; {len(big)} over {LIMIT} lines:")
    for n, module in big:
        print(f"- `{module}`: {n}")
    print(f"\nimport arrows between packages: {arrows}, of them into private modules: {private}")
    print(f"modules on an import circle with a sibling: {_cycles(graph, modules)}")


if __name__ == "__main__":
    main()
