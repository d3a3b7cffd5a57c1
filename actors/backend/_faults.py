"""Fault injection points, for tests only: every hook is None in production.

A test sets a hook, drives ordinary requests, and resets the hook (the ``faults``
fixture does). Each hook runs in the engine thread at one precise point:

- ``decode(call_number) -> int | None``: a return code to report instead of calling
  ``llama_decode`` (1 no KV space, -1 invalid batch, < -1 fatal), or None to decode.
- ``sample(seq_id)``: called before sampling a slot; raise to fail that sample.
- ``tick(tick_number)``: called at the start of every tick; raise to crash the tick.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Faults", "faults"]


@dataclass(slots=True)
class Faults:
    decode: Callable[[int], int | None] | None = None
    sample: Callable[[int], None] | None = None
    tick: Callable[[int], None] | None = None

    def reset(self) -> None:
        self.decode = self.sample = self.tick = None


faults = Faults()
