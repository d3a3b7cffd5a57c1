"""Batch strategies: how one tick's token budget is split between decode and prefill.

``DecodeMaximal`` is the default. Write your own by subclassing ``BatchStrategy``;
see ``examples/custom_strategy.py``.
"""

from __future__ import annotations

from strategies._base import BatchPlan, BatchStrategy, SlotPlan, SlotState, SlotView
from strategies._builtin import Adaptive, Balanced, DecodeMaximal, PrefillPriority

__all__ = [
    "Adaptive",
    "Balanced",
    "BatchPlan",
    "BatchStrategy",
    "DecodeMaximal",
    "PrefillPriority",
    "SlotPlan",
    "SlotState",
    "SlotView",
]
