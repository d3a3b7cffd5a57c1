"""The request contract: the frozen messages callers send, the results and events they
get back, and the one exception tree, each checked in the caller's thread.

It is the bottom layer: it imports nothing else from ``actors`` (the GBNF and JSON
Schema checks that messages run live here too, pure Python, without llama.cpp).
"""

from __future__ import annotations

from actors.contract._embed import Embed, Embeddings
from actors.contract._errors import (
    ConfigError,
    DecodeError,
    EngineError,
    EngineStopped,
    InvalidRequest,
    MemoryBudgetExceeded,
    ModelFailedLately,
    ModelLoadError,
    PromptTooLong,
    QueueFull,
    RequestTimeout,
    StrategyError,
)
from actors.contract._messages import (
    Cancel,
    Chat,
    Drain,
    Generate,
    GenerateTokens,
    GetInfo,
    GetStats,
    GetTokenizer,
    ReplyTo,
    SamplingParams,
    Stream,
    StreamChat,
    StreamTokens,
)
from actors.contract._results import (
    Completion,
    Done,
    Failed,
    Progress,
    StopReason,
    Token,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
)

__all__ = [
    "Cancel",
    "Chat",
    "Completion",
    "ConfigError",
    "DecodeError",
    "Done",
    "Drain",
    "Embed",
    "Embeddings",
    "EngineError",
    "EngineStopped",
    "Failed",
    "Generate",
    "GenerateTokens",
    "GetInfo",
    "GetStats",
    "GetTokenizer",
    "InvalidRequest",
    "MemoryBudgetExceeded",
    "ModelFailedLately",
    "ModelLoadError",
    "Progress",
    "PromptTooLong",
    "QueueFull",
    "ReplyTo",
    "RequestTimeout",
    "SamplingParams",
    "StopReason",
    "StrategyError",
    "Stream",
    "StreamChat",
    "StreamTokens",
    "Token",
    "TokenLogprob",
    "ToolCall",
    "ToolCallDelta",
    "TopLogprob",
]
