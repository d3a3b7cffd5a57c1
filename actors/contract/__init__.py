"""The request contract: the frozen messages callers send, the results and events they
get back, and the one exception tree, each checked in the caller's thread.

It is the bottom layer: it imports nothing else from ``actors`` (the GBNF and JSON
Schema checks that messages run live here too, pure Python, without llama.cpp).
"""

from __future__ import annotations

from actors.contract._checks import (
    MAX_ID_LENGTH,
    checked_template_kwargs,
    checked_template_tools,
    checked_text,
    checked_tokens,
    is_int,
    template_variables,
)
from actors.contract._control import (
    AdmittedMessage,
    AskedMessage,
    Cancel,
    CancelExact,
    Drain,
    GetInfo,
    GetStats,
    GetTokenizer,
    Submit,
)
from actors.contract._decide import (
    MAX_LEVELS,
    MAX_OPTIONS,
    MAX_QUESTIONS,
    Answer,
    Decide,
    Decision,
    Question,
    QuestionType,
)
from actors.contract._embed import POOLINGS, Embed, Embeddings, Pooling
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
from actors.contract._gbnf import check_grammar
from actors.contract._handle import EngineHandle
from actors.contract._messages import (
    STREAMING,
    Chat,
    Generate,
    GenerateTokens,
    RequestMessage,
    Stream,
    StreamChat,
    StreamMessage,
    StreamTokens,
    SubmitMessage,
)
from actors.contract._names import did_you_mean, suggesting
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
from actors.contract._sampling import ReplyTo, SamplingParams, put_nowait
from actors.contract._schema import grammar_for_schema

__all__ = [
    "MAX_ID_LENGTH",
    "MAX_LEVELS",
    "MAX_OPTIONS",
    "MAX_QUESTIONS",
    "POOLINGS",
    "STREAMING",
    "AdmittedMessage",
    "Answer",
    "AskedMessage",
    "Cancel",
    "CancelExact",
    "Chat",
    "Completion",
    "ConfigError",
    "Decide",
    "Decision",
    "DecodeError",
    "Done",
    "Drain",
    "Embed",
    "Embeddings",
    "EngineError",
    "EngineHandle",
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
    "Pooling",
    "Progress",
    "PromptTooLong",
    "Question",
    "QuestionType",
    "QueueFull",
    "ReplyTo",
    "RequestMessage",
    "RequestTimeout",
    "SamplingParams",
    "StopReason",
    "StrategyError",
    "Stream",
    "StreamChat",
    "StreamMessage",
    "StreamTokens",
    "Submit",
    "SubmitMessage",
    "Token",
    "TokenLogprob",
    "ToolCall",
    "ToolCallDelta",
    "TopLogprob",
    "check_grammar",
    "checked_template_kwargs",
    "checked_template_tools",
    "checked_text",
    "checked_tokens",
    "did_you_mean",
    "grammar_for_schema",
    "is_int",
    "put_nowait",
    "suggesting",
    "template_variables",
]
