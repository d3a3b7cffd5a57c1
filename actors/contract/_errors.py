"""The exceptions the engine raises, all in one tree.

::

    EngineError                      every error of this package
    ├── InvalidRequest (ValueError)  a message the engine will not run: checked in the
    │                                caller's thread where no model is needed, else at
    │                                admission in the actor thread
    │   └── PromptTooLong            the prompt cannot fit a slot's context
    ├── QueueFull                    every slot is busy and ``max_queue`` requests wait
    ├── ConfigError (ValueError)     a bad option to ``ServerActor.start()``
    ├── ModelLoadError               the model file is missing, unreadable or not a model
    │   ├── MemoryBudgetExceeded     a ModelManager cannot fit the model in its budget
    │   └── ModelFailedLately        its engine failed lately: a ModelManager will not
    │                                unload a working model to try it again yet
    ├── StrategyError                a batch strategy raised or returned an invalid plan
    ├── DecodeError                  ``llama_decode`` failed for this request
    ├── EngineStopped                the engine stopped (or died) with the request pending
    └── RequestTimeout (TimeoutError) a helper's timeout passed; the request was cancelled

A request that fails after admission reaches a ``generate`` caller as the exception
raised from ``Future.get()`` and a ``stream`` caller as ``Failed(request_id, error)``.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DecodeError",
    "EngineError",
    "EngineStopped",
    "InvalidRequest",
    "MemoryBudgetExceeded",
    "ModelFailedLately",
    "ModelLoadError",
    "PromptTooLong",
    "QueueFull",
    "RequestTimeout",
    "StrategyError",
]


class EngineError(Exception):
    """Base class of every error raised by llama-cpp-actors."""


class InvalidRequest(EngineError, ValueError):
    """The request is invalid and was never queued."""


class PromptTooLong(InvalidRequest):
    """The prompt cannot fit a slot's context (and ``truncate`` is off).

    Attributes:
        n_prompt_tokens: the prompt's length in tokens.
        n_ctx: a slot's context, in tokens (``n_ctx_per_slot``).
        truncatable: whether the request could have asked to be truncated (a
            generation's ``truncate``; an embedding's text cannot be).
    """

    def __init__(self, message: str, n_prompt_tokens: int, n_ctx: int, truncatable: bool = True) -> None:
        super().__init__(message)
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx
        self.truncatable = truncatable

    def __reduce__(self) -> tuple[object, ...]:
        # Picklable with its numbers (a ServerPool's Ray replicas send it back).
        return (type(self), (str(self), self.n_prompt_tokens, self.n_ctx, self.truncatable))


class QueueFull(EngineError):
    """Every slot is busy and the wait queue holds ``max_queue`` requests."""


class ConfigError(EngineError, ValueError):
    """An option given to ``ServerActor.start()`` is out of range."""


class ModelLoadError(EngineError):
    """The model could not be found or loaded."""


class MemoryBudgetExceeded(ModelLoadError):
    """A ``ModelManager`` cannot load the model within its memory budget, even after
    unloading every idle model.

    Attributes:
        needed_mb: the model's estimated host memory, in MiB.
        budget_mb: the manager's budget.
        held_mb: what the models it could not unload hold (in use or pinned).
    """

    def __init__(self, message: str, needed_mb: float, budget_mb: float, held_mb: float) -> None:
        super().__init__(message)
        self.needed_mb = needed_mb
        self.budget_mb = budget_mb
        self.held_mb = held_mb

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.needed_mb, self.budget_mb, self.held_mb))


class ModelFailedLately(ModelLoadError):
    """A ``ModelManager`` will not unload a working model to load again a model whose
    engine failed (a load, a crash) less than a minute ago: it loads where there is room
    without that, or after the minute. Its stats' ``last_error`` says what failed."""


class StrategyError(EngineError):
    """The batch strategy raised, or returned a plan the engine refused."""


class DecodeError(EngineError):
    """``llama_decode`` failed for this request (no KV space, or a fatal error)."""


class EngineStopped(EngineError):
    """The engine stopped or died before the request finished."""


class RequestTimeout(EngineError, TimeoutError):
    """A helper's timeout passed before the request finished; it was cancelled."""


# Tracebacks and reprs name them as users import them (``actors.ConfigError``), not by
# the private module that defines them; pickle finds them there too.
for _error in (
    EngineError, InvalidRequest, PromptTooLong, QueueFull, ConfigError, ModelLoadError,
    MemoryBudgetExceeded, ModelFailedLately, StrategyError, DecodeError, EngineStopped, RequestTimeout,
):  # fmt: skip
    _error.__module__ = "actors"
