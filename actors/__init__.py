"""llama-cpp-actors: one llama.cpp model served to many callers by a pykka actor.

>>> from actors import ServerActor, generate
>>> ref = ServerActor.start(n_parallel=4)
>>> print(generate(ref, "Once upon a time", max_tokens=32).text)
>>> ref.stop()
"""

from __future__ import annotations

from actors.actor import ServerActor, Supervisor
from actors.backend import Tokenizer, default_model_path
from actors.client import (
    achat,
    agenerate,
    astream,
    astream_chat,
    astream_events,
    chat,
    generate,
    stream,
    stream_chat,
)
from actors.contract import (
    Cancel,
    Chat,
    Completion,
    ConfigError,
    DecodeError,
    Done,
    Drain,
    EngineError,
    EngineStopped,
    Failed,
    Generate,
    GenerateTokens,
    GetInfo,
    GetStats,
    GetTokenizer,
    InvalidRequest,
    ModelLoadError,
    Progress,
    PromptTooLong,
    QueueFull,
    ReplyTo,
    RequestTimeout,
    SamplingParams,
    StopReason,
    StrategyError,
    Stream,
    StreamChat,
    StreamTokens,
    Token,
    TokenLogprob,
    TopLogprob,
)
from actors.scale import ServerPool

__version__ = "0.1.0"

__all__ = [
    "Cancel",
    "Chat",
    "Completion",
    "ConfigError",
    "DecodeError",
    "Done",
    "Drain",
    "EngineError",
    "EngineStopped",
    "Failed",
    "Generate",
    "GenerateTokens",
    "GetInfo",
    "GetStats",
    "GetTokenizer",
    "InvalidRequest",
    "ModelLoadError",
    "Progress",
    "PromptTooLong",
    "QueueFull",
    "ReplyTo",
    "RequestTimeout",
    "SamplingParams",
    "ServerActor",
    "ServerPool",
    "StopReason",
    "StrategyError",
    "Stream",
    "StreamChat",
    "StreamTokens",
    "Supervisor",
    "Token",
    "TokenLogprob",
    "Tokenizer",
    "TopLogprob",
    "__version__",
    "achat",
    "agenerate",
    "astream",
    "astream_chat",
    "astream_events",
    "chat",
    "default_model_path",
    "generate",
    "stream",
    "stream_chat",
]
