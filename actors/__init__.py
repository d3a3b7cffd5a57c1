"""llama-cpp-actors: one llama.cpp model served to many callers by a pykka actor.

>>> from actors import ServerActor, generate
>>> ref = ServerActor.start(n_parallel=4)
>>> print(generate(ref, "Once upon a time", max_tokens=32).text)
>>> ref.stop()
"""

from __future__ import annotations

from actors._aio import achat, agenerate, astream, astream_chat
from actors._errors import (
    ConfigError,
    DecodeError,
    EngineError,
    EngineStopped,
    InvalidRequest,
    ModelLoadError,
    QueueFull,
    RequestTimeout,
    StrategyError,
)
from actors._helpers import chat, generate, stream, stream_chat
from actors._messages import (
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
from actors._model import default_model_path
from actors._pool import ServerPool
from actors._results import Completion, Done, Failed, StopReason, Token, TokenLogprob, TopLogprob
from actors._server import ServerActor
from actors._supervisor import Supervisor
from actors._tokenizer import Tokenizer

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
    "chat",
    "default_model_path",
    "generate",
    "stream",
    "stream_chat",
]
