"""llama-cpp-actors: one llama.cpp model served to many callers by a pykka actor.

>>> from actors import ServerActor, generate
>>> ref = ServerActor.start(n_parallel=4)
>>> print(generate(ref, "Once upon a time", max_tokens=32).text)
>>> ref.stop()
"""

from __future__ import annotations

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
from actors._helpers import generate, stream
from actors._messages import (
    Cancel,
    Completion,
    Done,
    Failed,
    Generate,
    GenerateTokens,
    GetInfo,
    GetStats,
    ReplyTo,
    SamplingParams,
    StopReason,
    Stream,
    StreamTokens,
    Token,
)
from actors._model import default_model_path
from actors._server import ServerActor

__version__ = "0.1.0"

__all__ = [
    "Cancel",
    "Completion",
    "ConfigError",
    "DecodeError",
    "Done",
    "EngineError",
    "EngineStopped",
    "Failed",
    "Generate",
    "GenerateTokens",
    "GetInfo",
    "GetStats",
    "InvalidRequest",
    "ModelLoadError",
    "QueueFull",
    "ReplyTo",
    "RequestTimeout",
    "SamplingParams",
    "ServerActor",
    "StopReason",
    "StrategyError",
    "Stream",
    "StreamTokens",
    "Token",
    "__version__",
    "default_model_path",
    "generate",
    "stream",
]
