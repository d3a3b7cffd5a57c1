"""Telemetry: blinker signals the engine sends from its own thread.

Subscribe with ``telemetry.tick.connect(receiver)``. Each receiver is called as
``receiver(sender, measurements={...}, metadata={...})`` where ``sender`` is the
server's ``pykka.ActorRef``. Receivers run **synchronously in the engine thread**:
a slow receiver slows every request, so hand heavy work to a queue. The engine calls
each receiver itself: one that raises (anything, ``SystemExit`` included) is logged
and skipped, the others still run.
blinker holds receivers weakly by default; connect a bound method or a closure with
``weak=False`` or keep a reference to it. Payloads are only built when a receiver is
connected.

=====================  ============================================  =======================
signal                 measurements                                  metadata
=====================  ============================================  =======================
``tick``               ``batch_size``, ``decode_tokens``,            ``slots``: a tuple of
                       ``prefill_tokens``, ``active_slots``,         ``SlotSample``, one
                       ``queue_depth``, ``eval_ms``,                 per slot
                       ``kv_cells_used``, ``kv_cells_total``,
                       ``drafts``, ``draft_tokens``,
                       ``draft_accepted``
``request_start``      ``prompt_tokens``, ``prefix_cache_tokens``    ``request_id``,
                                                                     ``seq_id``, ``mode``
``request_done``       ``prompt_tokens``, ``generated_tokens``,      ``request_id``,
                       ``duration_ms``, ``ttft_ms``,                 ``seq_id``, ``mode``,
                       ``prompt_eval_rate``, ``generation_rate``,    ``stop_reason``
                       ``prefix_cache_tokens``,
                       ``prefix_cache_ratio``, ``draft_tokens``,
                       ``draft_accepted``
``request_exception``  as ``request_done``                           as ``request_done``,
                                                                     ``stop_reason="error"``,
                                                                     ``reason``
``kv_pressure``        ``kv_cells_used``, ``kv_cells_total``, and    ``event`` (``purge``,
                       per event ``purged_slots``, ``batch_tokens``  ``split``, ``preempt``,
                       (split), ``preempted_tokens``,                ``context_shift``),
                       ``discarded_tokens`` (context shift)          ``request_id`` or None
``ram_cache``          ``tokens``, ``bytes`` (of the entry),         ``event`` (``save``,
                       ``entries``, ``bytes_used`` (of the cache)    ``restore``, ``evict``),
                                                                     ``scope``
``model_load``         ``progress`` (0..1), ``load_ms`` (None until   ``model_path``, and
                       the engine is ready)                          ``replica`` for a named
                                                                     engine (a model's name)
``model_unload``       ``loaded_ms`` (how long it was loaded),       ``model``, ``model_path``,
                       ``memory_mb`` (its estimate)                  ``reason`` (``idle``,
                                                                     ``evicted``, ``unloaded``,
                                                                     ``unregistered``,
                                                                     ``failed``, ``stopped``;
                                                                     sender: the ModelManager)
``server_restart``     ``restarts`` (so far), ``backoff_ms``         ``reason`` (sender: the
                                                                     ``Supervisor``)
=====================  ============================================  =======================

Units: ``*_ms`` are milliseconds (``eval_ms`` is the time inside ``llama_decode``);
rates are tokens per second; ``mode`` is ``"generate"`` or ``"stream"``;
``prefix_cache_ratio`` is ``prefix_cache_tokens / prompt_tokens``; ``reason`` is the
error's message. ``draft_tokens`` are draft tokens verified (speculative decoding; 0
without it) and ``draft_accepted`` those of them that were right; the tick's ``drafts``
counts the drafts verified (one per slot that had one); the tick's
``decode_tokens`` counts slots decoding, its ``batch_size`` their drafts too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from blinker import NamedSignal, Namespace

__all__ = [
    "NAMESPACE",
    "SlotSample",
    "Subscription",
    "emit",
    "kv_pressure",
    "model_load",
    "model_unload",
    "ram_cache",
    "request_done",
    "request_exception",
    "request_start",
    "server_restart",
    "tick",
]

_log = logging.getLogger("llama_cpp_actors.telemetry")

NAMESPACE = Namespace()
"""The namespace that holds every signal of the engine."""

tick = NAMESPACE.signal(
    "llama_cpp_actors.server.tick",
    doc="After every forward pass: batch composition and eval time.",
)
request_start = NAMESPACE.signal(
    "llama_cpp_actors.server.request.start",
    doc="A request got a slot and its prefix-cache match is known.",
)
request_done = NAMESPACE.signal(
    "llama_cpp_actors.server.request.done",
    doc="A request finished: eog, max_tokens, length or cancelled.",
)
request_exception = NAMESPACE.signal(
    "llama_cpp_actors.server.request.exception",
    doc="A request failed after it got a slot.",
)

kv_pressure = NAMESPACE.signal(
    "llama_cpp_actors.server.kv_pressure",
    doc="The KV cache ran out: idle caches purged, a batch split, a request preempted, a context shifted.",
)
model_load = NAMESPACE.signal(
    "llama_cpp_actors.server.model_load",
    doc="Model-load progress from llama.cpp, then the load time once the engine is ready.",
)
model_unload = NAMESPACE.signal(
    "llama_cpp_actors.manager.model_unload",
    doc="A ModelManager unloaded a model: idle past its keep_alive, evicted for room, unloaded or stopped.",
)
server_restart = NAMESPACE.signal(
    "llama_cpp_actors.server.restart",
    doc="A Supervisor restarted its crashed ServerActor.",
)
ram_cache = NAMESPACE.signal(
    "llama_cpp_actors.server.ram_cache",
    doc="The RAM prompt cache saved, restored or evicted a sequence's KV.",
)


@dataclass(frozen=True, slots=True)
class SlotSample:
    """One slot as the ``tick`` signal saw it after its forward pass.

    ``state`` is ``"idle"``, ``"prefilling"`` or ``"generating"``; ``request_id``,
    ``prompt_tokens`` and ``generated_tokens`` describe the request it serves (None and 0
    when idle); ``kv_tokens`` is how many positions the slot's sequence holds (a cell it
    shares with other slots counts for each of them; ``kv_cells_used`` counts it once).
    """

    seq_id: int
    state: str
    request_id: str | None
    prompt_tokens: int
    generated_tokens: int
    kv_tokens: int


class Subscription:
    """Receivers connected to their signals until :meth:`close`.

    blinker holds receivers weakly; a Subscription connects them strongly, so the bound
    methods of an object that keeps its Subscription need no other reference::

        subscription = telemetry.Subscription({telemetry.tick: on_tick, telemetry.request_done: on_done})
        ...
        subscription.close()

    Construct and close it in any thread; the receivers run in the sender's thread.
    """

    def __init__(self, receivers: Mapping[NamedSignal, Callable[..., None]]) -> None:
        self._receivers = list(receivers.items())
        for signal, receiver in self._receivers:
            signal.connect(receiver, weak=False)

    def close(self) -> None:
        """Disconnect every receiver; idempotent."""
        for signal, receiver in self._receivers:
            signal.disconnect(receiver)


def emit(signal: NamedSignal, sender: Any, measurements: dict[str, Any], metadata: dict[str, Any]) -> None:
    """Call every receiver of ``signal``; log and skip one that raises.

    Runs in the sender's thread (the engine thread for the built-in signals). blinker's
    own ``send`` stops at the first receiver that raises, so we call them one by one.
    """
    for receiver in signal.receivers_for(sender):
        try:
            receiver(sender, measurements=measurements, metadata=metadata)
        except BaseException:  # sys.exit() in a receiver too: pykka would stop every actor
            _log.exception("telemetry receiver %r raised on %s; skipped", receiver, signal.name)
