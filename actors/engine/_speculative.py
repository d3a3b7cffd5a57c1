"""Speculative decoding's parts that need no model: drafters' interface, the n-gram
drafter, the measured cost of a forward pass, and each request's acceptance rate.

Runs in the engine's thread only. A drafter proposes tokens that would continue a
slot's tokens; the strategy picks how many to verify (``BatchStrategy.plan_drafts``);
the forward pass verifies them in the tick's one batch (``OutputStage._verify``).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from strategies import DecodeCost

__all__ = ["Acceptance", "Acceptances", "CostModel", "Draft", "DraftWant", "Drafter", "NgramDrafter"]


@dataclass(frozen=True, slots=True)
class DraftWant:
    """One slot's call for a draft.

    Attributes:
        seq_id: the slot.
        owner: the request (identity only): a drafter's state for the slot is rebuilt
            when it changes.
        prompt: the request's prompt tokens.
        generated: its tokens so far, the pending one last.
        limit: the most draft tokens wanted.
    """

    seq_id: int
    owner: object
    prompt: Sequence[int]
    generated: Sequence[int]
    limit: int


@dataclass(frozen=True, slots=True)
class Draft:
    """Proposed tokens, and what kind of evidence made them (the n-gram drafter: the
    size of the match): a request's acceptance is learned per kind, as a 4-token match
    says more than a 2-token one. ``room``: the most tokens a later call in the same
    tick could make it, asked for more (None: as many as asked); a costly drafter's
    draft that ended at an end of generation or an unsure token has no more than its
    own tokens, so the plan must not count on more."""

    tokens: list[int]
    kind: int = 0
    room: int | None = None


_NONE = Draft([])


class Drafter(abc.ABC):
    """Proposes draft tokens for slots (engine thread).

    A ``costly`` drafter (one that runs a model) is asked for one token before the plan
    and, for the slots the plan verifies more of, again after it: a second call in the
    same tick extends the drafts of the first. A free one (the n-gram drafter) is asked
    once, before the plan, for all it has.
    """

    costly: bool = False

    @abc.abstractmethod
    def propose(self, wants: Sequence[DraftWant]) -> list[Draft]:
        """A draft for each want, in order: at most its ``limit`` tokens, maybe none."""

    def retain(self, live: Mapping[int, object]) -> None:  # noqa: B027 (a drafter with state overrides it)
        """Called each tick before ``propose`` with each busy slot's request (seq_id to
        owner): what the drafter keeps for any other request may go."""

    def close(self) -> None:  # noqa: B027 (a drafter with resources overrides it)
        """Free what the drafter holds."""


class _History:
    """One request's tokens and, for each n-gram size, where each n-gram's latest
    occurrence that has a continuation ends."""

    __slots__ = ("last", "owner", "tokens")

    def __init__(self, owner: object, sizes: Sequence[int]) -> None:
        self.owner = owner
        self.tokens: list[int] = []
        self.last: list[tuple[int, dict[tuple[int, ...], int]]] = [(n, {}) for n in sizes]

    def extend(self, new: Sequence[int]) -> None:
        """Append ``new``, indexing each n-gram that now has a next token: O(len(new))."""
        tokens = self.tokens
        start = len(tokens)
        tokens.extend(new)
        # The n-gram ending just before position e gets e as its continuation; the
        # n-gram ending at the last token has none yet and waits for the next call.
        for n, last in self.last:
            for e in range(max(start, n), len(tokens)):
                last[tuple(tokens[e - n : e])] = e

    def propose(self, limit: int) -> Draft:
        """The continuation of the longest indexed n-gram that ends the tokens."""
        tokens = self.tokens
        for n, last in self.last:
            if len(tokens) < n:
                continue
            e = last.get(tuple(tokens[-n:]))
            if e is not None:
                return Draft(tokens[e : e + limit], n)
        return _NONE


class NgramDrafter(Drafter):
    """Prompt lookup (llama.cpp's ``ngram-simple`` idea): the draft is what followed the
    latest earlier occurrence of the slot's last ``n`` tokens in its own prompt and
    output, for the largest ``n`` of ``sizes`` that occurs.

    Each slot keeps a hash of its n-grams, updated with the tokens added since the last
    tick: a tick costs O(new tokens + draft), never a scan of the context. A request
    that moves to another slot (a preemption) is indexed once more there.
    """

    def __init__(self, sizes: Sequence[int] = (4, 3, 2)) -> None:
        if not sizes or any(n < 1 for n in sizes):
            raise ValueError("n-gram sizes must be >= 1")
        self.sizes = tuple(sorted(set(sizes), reverse=True))
        self._histories: dict[int, _History] = {}

    def retain(self, live: Mapping[int, object]) -> None:
        """Forget the histories of requests that left their slots."""
        gone = [seq_id for seq_id, h in self._histories.items() if live.get(seq_id) is not h.owner]
        for seq_id in gone:
            del self._histories[seq_id]

    def propose(self, wants: Sequence[DraftWant]) -> list[Draft]:
        """Each want's draft (see the class); its kind is the size of the match."""
        drafts = []
        for want in wants:
            history = self._histories.get(want.seq_id)
            known = len(want.prompt) + len(want.generated)
            if history is None or history.owner is not want.owner or len(history.tokens) > known:
                history = self._histories[want.seq_id] = _History(want.owner, self.sizes)
            have = len(history.tokens)
            if have < len(want.prompt):
                history.extend(want.prompt[have:])
                have = len(want.prompt)
            history.extend(want.generated[have - len(want.prompt) :])
            drafts.append(history.propose(want.limit) if want.limit > 0 else _NONE)
        return drafts


class CostModel:
    """The cost of a forward pass by its batch size (engine thread).

    A speculating engine times passes of a few sizes before its first tick
    (:meth:`calibrate`). Measured so (a 2-core AMD EPYC: 1 row 8.9 ms, 2 rows 16.1,
    4 rows 25.0, 8 rows 42.0, 17 rows 86.9), a pass of two or more rows is a line in
    its size, within 6%, but a one-row pass takes llama.cpp's matrix-vector path and
    costs much less than the line says. So the model keeps two things, each on its own
    evidence:

    - one-row passes: the ticks' own times (from the calibration's until there are any);
    - larger passes: the calibration's line, scaled by how the ticks of those sizes
      compare with it now (the shape from a quiet moment, the level from the ticks: one
      slow tick moves the level a little, and cannot bend the line).

    Without a calibration (fewer than two sizes over one row timed) it falls back on a
    line fitted to the ticks by least squares that forget old ticks, assuming
    ``fixed_ms == per_token_ms`` until the ticks span two sizes.
    """

    CALIBRATE = (1, 2, 4, 8, 17)
    """The sizes timed before the first tick (about 30 rows' work)."""
    SIZES = 64
    """Sizes ``DecodeCost.measured_ms`` lists (larger ones: ``per_token_ms`` a row more)."""

    def __init__(self, decay: float = 0.98, alpha: float = 0.1) -> None:
        self.decay = decay
        self.alpha = alpha  # each tick's weight in the one-row time and the level
        self._w = self._n = self._nn = self._t = self._nt = 0.0
        self._one = 0.0  # ms of a one-row pass; 0: unknown
        self._shape: tuple[float, float] | None = None  # the calibration's line over 2+ rows
        self._level = 1.0  # the ticks over that line

    def calibrate(self, timings: Mapping[int, float]) -> None:
        """Passes of these sizes took these ms (``LlamaRows.time_passes``)."""
        points = [(n, ms) for n, ms in timings.items() if n >= 1 and ms > 0]
        self._one = next((ms for n, ms in points if n == 1), self._one)
        larger = [(float(n), ms) for n, ms in points if n >= 2]
        if len(larger) < 2:  # no line to keep: the timings start the fallback's
            for n, ms in points:
                self._fit(n, ms)
        else:
            mean_n = sum(n for n, _ in larger) / len(larger)
            mean_t = sum(t for _, t in larger) / len(larger)
            var = sum((n - mean_n) ** 2 for n, _ in larger)
            slope = sum((n - mean_n) * (t - mean_t) for n, t in larger) / var
            slope = max(slope, 0.1 * mean_t / mean_n)  # a noisy calibration must not make rows free
            self._shape = (max(mean_t - slope * mean_n, 0.0), slope)

    def observe(self, n_tokens: int, eval_ms: float) -> None:
        """One forward pass of ``n_tokens`` (decode rows only) took ``eval_ms``."""
        if n_tokens < 1 or not eval_ms > 0:
            return
        if self._shape is None:  # once calibrated, cost() reads no fitted line
            self._fit(n_tokens, eval_ms)
        if n_tokens == 1:
            self._one = eval_ms if self._one == 0.0 else self._one + self.alpha * (eval_ms - self._one)
        elif self._shape is not None:
            fixed, per = self._shape
            ratio = min(max(eval_ms / (fixed + per * n_tokens), 0.25), 4.0)  # a stall is one tick's noise
            self._level += self.alpha * (ratio - self._level)

    def _fit(self, n_tokens: int, eval_ms: float) -> None:
        d = self.decay
        self._w = self._w * d + 1.0
        self._n = self._n * d + n_tokens
        self._nn = self._nn * d + n_tokens * n_tokens
        self._t = self._t * d + eval_ms
        self._nt = self._nt * d + n_tokens * eval_ms

    def cost(self) -> DecodeCost:
        """The cost as a strategy sees it (``measured_ms`` when calibrated)."""
        if self._shape is None:
            return DecodeCost(*self._line())
        fixed, per = self._shape[0] * self._level, self._shape[1] * self._level
        one = self._one or fixed + per
        curve = [one, *(max(fixed + per * n, one) for n in range(2, self.SIZES + 1))]
        return DecodeCost(fixed, per, measured_ms=tuple(curve))

    def _line(self) -> tuple[float, float]:
        if self._w == 0.0:
            return 1.0, 1.0
        mean_n, mean_t = self._n / self._w, self._t / self._w
        var_n = self._nn / self._w - mean_n * mean_n
        prior = mean_t / (1.0 + mean_n)  # fixed == per-token, through the mean
        if var_n < 0.5:
            return prior, prior
        slope = (self._nt / self._w - mean_n * mean_t) / var_n
        # Noise (another tenant's burst) can tilt the line; keep both parts sane.
        slope = min(max(slope, 0.1 * prior), mean_t / mean_n)
        return max(mean_t - slope * mean_n, 0.0), slope


class Acceptance:
    """A request's chance that its next draft token is right: accepted over tried draft
    tokens (counting the first rejected one), the last few dozen tried tokens weighing
    most, under a prior worth ``PRIOR_WEIGHT`` tries.

    A draft the plan did not verify is tried too, for free: its first token against the
    token the request made next (``Engine._propose``). So a request whose drafts were
    poor starts drafting again as soon as they would be right, and one at a busy tick
    (where a draft token must be right about 9 times in 10 to pay) learns that they are
    without paying for a single wrong one.
    """

    __slots__ = ("_hits", "_tries")

    PRIOR = 0.6
    PRIOR_WEIGHT = 2.0
    DECAY = 0.93  # per tried token: a long accepted run must not outweigh the failures after it

    def __init__(self) -> None:
        self._hits = 0.0
        self._tries = 0.0

    @property
    def rate(self) -> float:
        """The estimate, 0 to 1."""
        return (self._hits + self.PRIOR * self.PRIOR_WEIGHT) / (self._tries + self.PRIOR_WEIGHT)

    def verified(self, drafted: int, accepted: int) -> None:
        """``accepted`` of ``drafted`` draft tokens were right (the rest from the first wrong one)."""
        tried = accepted + (1 if accepted < drafted else 0)
        keep = self.DECAY**tried
        self._hits = self._hits * keep + accepted
        self._tries = self._tries * keep + tried


class Acceptances:
    """A request's :class:`Acceptance` for each kind of draft."""

    __slots__ = ("_by_kind",)

    def __init__(self) -> None:
        self._by_kind: dict[int, Acceptance] = {}

    def of(self, kind: int) -> Acceptance:
        """The estimate for drafts of ``kind`` (new ones start at the prior)."""
        found = self._by_kind.get(kind)
        if found is None:
            found = self._by_kind[kind] = Acceptance()
        return found
