"""``python -m actors.http serve ...``: the ``llama-cpp-actors`` command line.

Runs :func:`actors.http._cli.main` in the main thread and exits with its code.
"""

from __future__ import annotations

import sys

from actors.http._cli import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
