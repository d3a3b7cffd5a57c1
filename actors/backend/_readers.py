"""``Readers``: callers' threads read the vocabulary at once; closing waits for them.

``LlamaBackend`` tokenizes and probes grammars in callers' threads while the actor
thread owns the model; ``close`` frees the model only once no reader is inside.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from actors.contract import EngineStopped

__all__ = ["Readers"]


class Readers:
    """Any number of readers of the vocabulary at once; ``close`` waits for them."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._n = 0
        self._closed = False

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        with self._cv:
            if self._closed:
                raise EngineStopped("the model was unloaded (its engine stopped)")
            self._n += 1
        try:
            yield
        finally:
            with self._cv:
                self._n -= 1
                if not self._n:
                    self._cv.notify_all()

    def close(self, free: Callable[[], None]) -> None:
        with self._cv:
            self._closed = True
            while self._n:
                self._cv.wait()
            free()
