"""Batch strategies: how one tick's token budget is split between decode and prefill.

``DecodeMaximal`` is the default. Write your own by subclassing ``BatchStrategy``;
see ``examples/custom_strategy.py``. With speculative decoding, ``plan_drafts`` (by
default ``add_drafts``) spends what the plan leaves on draft tokens. With LoRA adapters,
``choose_adapters`` (by default ``fair_adapters``) picks the one adapter set a tick serves.
"""

from __future__ import annotations

from strategies._adapters import fair_adapters
from strategies._base import BatchStrategy
from strategies._builtin import Adaptive, Balanced, DecodeMaximal, PrefillPriority
from strategies._drafts import add_drafts
from strategies._types import AdapterSet, BatchPlan, DecodeCost, EmbedBudget, SlotPlan, SlotState, SlotView

__all__ = [
    "AdapterSet",
    "Adaptive",
    "Balanced",
    "BatchPlan",
    "BatchStrategy",
    "DecodeCost",
    "DecodeMaximal",
    "EmbedBudget",
    "PrefillPriority",
    "SlotPlan",
    "SlotState",
    "SlotView",
    "add_drafts",
    "fair_adapters",
]
