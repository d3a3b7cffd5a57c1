"""The caller side: blocking helpers (``generate``, ``stream``, ``chat``...) and their
asyncio twins, which work on any engine handle (an actor ref, a supervisor, a pool).

They speak only the request contract, duck-typed against ``ask``/``tell``: this layer
imports nothing else from ``actors``.
"""

from __future__ import annotations

from actors.client._aio import achat, agenerate, astream, astream_chat, astream_events
from actors.client._decide import adecide, adecide_result, decide, decide_result
from actors.client._embed import aembed, aembed_result, embed, embed_result
from actors.client._helpers import chat, generate, stream, stream_chat

__all__ = [
    "achat",
    "adecide",
    "adecide_result",
    "aembed",
    "aembed_result",
    "agenerate",
    "astream",
    "astream_chat",
    "astream_events",
    "chat",
    "decide",
    "decide_result",
    "embed",
    "embed_result",
    "generate",
    "stream",
    "stream_chat",
]
