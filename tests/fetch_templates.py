"""Extract llama.cpp's chat templates from the pinned llama-cpp-python sdist (once).

``make install`` runs it: the templates land in
``~/.cache/llama-cpp-actors/templates/<version>/`` (see ``tests/templates.py``). The
sdist comes from the package index (pip download), or from ``bench/.peers`` when
``make bench-peers`` already fetched it.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from templates import REPO, _version


def main() -> int:
    version = _version()
    target = Path.home() / ".cache" / "llama-cpp-actors" / "templates" / version
    if any(target.glob("*.jinja")):
        return 0
    with tempfile.TemporaryDirectory() as work:
        sdist = REPO / "bench" / ".peers" / f"llama_cpp_python-{version}.tar.gz"
        if not sdist.exists():
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                 "-d", work, f"llama-cpp-python=={version}"],
                check=True,
            )  # fmt: skip
            sdist = next(Path(work).glob("llama_cpp_python-*.tar.gz"))
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/models/templates/"
        partial = target.with_name(target.name + ".partial")
        partial.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                if (
                    member.isfile()
                    and member.name.startswith(prefix)
                    and "/" not in member.name[len(prefix) :]
                ):
                    data = tar.extractfile(member)
                    assert data is not None
                    (partial / Path(member.name).name).write_bytes(data.read())
        partial.replace(target)
    print(f"chat templates in {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
