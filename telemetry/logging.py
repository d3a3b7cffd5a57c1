"""A telemetry subscriber that logs one line per finished request through ``logging``.

    from telemetry.logging import RequestLogger
    request_log = RequestLogger()      # subscribes now
    ...
    request_log.close()                # unsubscribes

Runs in the engine thread (as every receiver): it formats one line and hands it to
``logging``; configure handlers as usual. The library itself never prints.
"""

from __future__ import annotations

import logging
from typing import Any

import telemetry

__all__ = ["RequestLogger"]


class RequestLogger:
    """Logs ``request_done`` at ``level`` and ``request_exception`` at WARNING.

    Args:
        logger: where to log; ``llama_cpp_actors.requests`` by default.
        level: the level of normal completions.
    """

    def __init__(self, logger: logging.Logger | None = None, level: int = logging.INFO) -> None:
        self.logger = logger or logging.getLogger("llama_cpp_actors.requests")
        self.level = level
        self._subscription = telemetry.Subscription(
            {telemetry.request_done: self._done, telemetry.request_exception: self._failed}
        )

    def close(self) -> None:
        """Stop logging."""
        self._subscription.close()

    def _line(self, measurements: dict[str, Any], metadata: dict[str, Any]) -> str:
        return (
            f"{metadata['request_id']} {metadata['mode']} {metadata['stop_reason']}: "
            f"{measurements['prompt_tokens']} prompt ({measurements['prefix_cache_tokens']} cached) + "
            f"{measurements['generated_tokens']} generated tokens, ttft {measurements['ttft_ms']:.0f} ms, "
            f"total {measurements['duration_ms']:.0f} ms, {measurements['generation_rate']:.1f} tok/s"
        )

    def _done(self, sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        self.logger.log(self.level, "%s", self._line(measurements, metadata))

    def _failed(self, sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
        self.logger.warning("%s (%s)", self._line(measurements, metadata), metadata.get("reason"))
