"""MkDocs hooks: the benchmark plots in ``bench/results/`` become files of the site.

The benchmark pages include ``bench/results/*.md`` with pymdownx.snippets; their plots
are added here under ``benchmarks/results/``, so a page links ``results/NAME.png``
and nothing is copied by hand into ``docs/`` (where it would go stale).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


def on_files(files: Files, config: Any, **kwargs: Any) -> Files:
    """Add every ``bench/results/*.png`` as ``benchmarks/results/<name>.png``."""
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"benchmarks/results/{png.name}", abs_src_path=str(png)))
    return files
