"""``Router``: which replica of a ``ServerPool`` takes a request.

The rule, in order:

1. **Session.** A request with a ``session`` goes where that ``(cache_scope, session)``
   went last, while that replica is up: its slot holds the conversation.
2. **Prefix affinity.** Each replica remembers (LRU, ``memory_blocks``) the hashes of the
   prompt blocks it was sent: 16-character blocks of the text (for ``Chat``, of the
   messages' roles and contents in order) or 4-token blocks of token prompts, chained so
   a block's hash names its whole prefix, and seeded with ``cache_scope`` so scopes never
   match. The replica whose memory holds the longest run of leading blocks wins if that
   run is at least ``min_blocks`` long (the least loaded one among equals), unless it
   carries more than ``slack`` requests above the least loaded replica, or has no free
   slot while another replica does: queueing behind a full replica costs more than
   evaluating the prefix again, and its queued request would evict the KV of another
   conversation when it starts.
3. **Least loaded.** Otherwise the replica with the fewest requests in flight (its queue
   plus its active slots, as far as this pool sent them), then the one sent fewest
   requests so far.

Only replicas that are up are considered. A pure data structure guarded by one lock: it
runs in callers' threads, and ``finished`` runs in whatever thread ends a request.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

from actors.contract import (
    AdmittedMessage,
    Chat,
    Decide,
    Embed,
    EngineStopped,
    GenerateTokens,
    InvalidRequest,
    StreamChat,
    StreamTokens,
)

__all__ = ["Router"]

# Small blocks: a conversation's own text must fill whole blocks in its first turn (the
# tail of a prompt, a partial block, is not remembered), or its next turn would match
# every replica that saw the shared system prompt equally well.
BLOCK_CHARS = 16
BLOCK_TOKENS = 4
_MAX_SESSIONS = 100_000


def prefix_blocks(message: AdmittedMessage) -> list[int]:
    """Chained hashes of the message's whole leading blocks (hash i covers blocks 0..i);
    none for an ``Embed``, which reuses no cache."""
    units: str | tuple[int, ...]  # a slice of either is hashable
    if isinstance(message, Embed):
        return []
    if isinstance(message, Decide):  # its questions' prompts start with the state
        units, size = message.state, BLOCK_CHARS
    elif isinstance(message, GenerateTokens | StreamTokens):
        units, size = tuple(message.tokens), BLOCK_TOKENS
    elif isinstance(message, Chat | StreamChat):
        units, size = "".join(f"\x1e{m['role']}\x1f{m['content']}" for m in message.messages), BLOCK_CHARS
    else:
        units, size = message.prompt, BLOCK_CHARS
    h = hash(("scope", message.cache_scope))
    blocks = []
    for start in range(0, len(units) - size + 1, size):
        h = hash((h, units[start : start + size]))
        blocks.append(h)
    return blocks


class Router:
    """Routing state of one pool: loads, sessions and each replica's recent prefixes.

    Args:
        names: the replicas.
        capacity: slots per replica (``n_parallel``).
        min_blocks: the shortest shared prefix, in blocks, that routes by affinity.
        slack: how many more requests than the least loaded replica an affine one may
            carry; ``max(1, capacity // 2)`` by default.
        memory_blocks: prefix blocks remembered per replica.
    """

    def __init__(
        self,
        names: Iterable[str],
        *,
        capacity: int = 4,
        min_blocks: int = 8,
        slack: int | None = None,
        memory_blocks: int = 65536,
    ):
        self.names = tuple(names)
        self.capacity = capacity
        self.min_blocks = min_blocks
        self.slack = max(1, capacity // 2) if slack is None else slack
        self.memory_blocks = memory_blocks
        self._lock = threading.Lock()
        self._load = dict.fromkeys(self.names, 0)
        self._sent = dict.fromkeys(self.names, 0)
        self._memory: dict[str, OrderedDict[int, None]] = {n: OrderedDict() for n in self.names}
        self._sessions: OrderedDict[tuple[str | None, str], str] = OrderedDict()
        self._in_flight: dict[str, str] = {}
        self.decisions = {"session": 0, "prefix": 0, "least_loaded": 0}

    def choose(self, message: AdmittedMessage, up: Iterable[str]) -> str:
        """Pick a replica for ``message`` among ``up`` and count it in flight there.

        Raises:
            EngineStopped: no replica is up.
            InvalidRequest: a request with this ``request_id`` is in flight.
        """
        candidates = [n for n in self.names if n in set(up)]
        if not candidates:
            raise EngineStopped("no replica of the pool is up")
        blocks = prefix_blocks(message)
        with self._lock:
            if message.request_id in self._in_flight:
                raise InvalidRequest(f"request_id {message.request_id!r} is already in use")
            name, why = self._pick(message, blocks, candidates)
            self.decisions[why] += 1
            self._load[name] += 1
            self._sent[name] += 1
            self._in_flight[message.request_id] = name
            memory = self._memory[name]
            for h in blocks:
                memory[h] = None
                memory.move_to_end(h)
            while len(memory) > self.memory_blocks:
                memory.popitem(last=False)
            if message.session is not None:
                key = (message.cache_scope, message.session)
                self._sessions[key] = name
                self._sessions.move_to_end(key)
                if len(self._sessions) > _MAX_SESSIONS:
                    self._sessions.popitem(last=False)
        return name

    def _pick(self, message: AdmittedMessage, blocks: list[int], candidates: list[str]) -> tuple[str, str]:
        if message.session is not None:
            name = self._sessions.get((message.cache_scope, message.session))
            if name in candidates:
                return name, "session"
        least = min(self._load[n] for n in candidates)
        matched = {n: self._matched(n, blocks) for n in candidates}
        best = max(matched.values())
        if best >= self.min_blocks:
            name = min((n for n in candidates if matched[n] == best), key=self._order)
            load = self._load[name]
            if load <= least + self.slack and (load < self.capacity or least >= self.capacity):
                return name, "prefix"
        return min(candidates, key=self._order), "least_loaded"

    def _order(self, name: str) -> tuple[int, int]:
        return self._load[name], self._sent[name]

    def _matched(self, name: str, blocks: list[int]) -> int:
        memory = self._memory[name]
        n = 0
        for h in blocks:
            if h not in memory:
                break
            n += 1
        return n

    def finished(self, request_id: str) -> None:
        """The request ended (any outcome); idempotent."""
        with self._lock:
            name = self._in_flight.pop(request_id, None)
            if name is not None:
                self._load[name] -= 1

    def replica_of(self, request_id: str) -> str | None:
        """Where a request in flight runs, or None."""
        with self._lock:
            return self._in_flight.get(request_id)

    def forget(self, name: str) -> None:
        """A replica went down: its KV is gone, so forget its prefixes and sessions."""
        with self._lock:
            self._memory[name].clear()
            for key in [k for k, v in self._sessions.items() if v == name]:
                del self._sessions[key]

    def loads(self) -> dict[str, int]:
        """Requests in flight per replica."""
        with self._lock:
            return dict(self._load)
