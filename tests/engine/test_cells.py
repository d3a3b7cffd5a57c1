"""CellLedger: the KV cells each sequence holds when sequences share a prefix (no model).

Each operation is shown on its own, then the scenario it exists for (a system prompt
shared by eight slots), then random operation sequences against a brute-force model in
which every cell is an integer id and every sequence a list of ids by position.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engine import _cells
from actors.engine._cells import CellLedger


def _ledger(*lengths: int) -> CellLedger:
    """Sequences 0, 1, ... each computing its own cells."""
    ledger = CellLedger()
    for seq, n in enumerate(lengths):
        ledger.compute(seq, n)
    return ledger


def test_the_module_exports_the_ledger_only() -> None:
    assert _cells.__all__ == ["CellLedger"]


def test_an_unknown_sequence_holds_nothing() -> None:
    ledger = CellLedger()
    assert (ledger.length(3), ledger.private(3), ledger.used) == (0, 0, 0)
    assert not ledger.shared(3) and ledger.sharers(3) == set()
    ledger.trim(3, 0)
    ledger.clear(3)
    ledger.check()


def test_compute_adds_private_cells_and_a_decoding_sequence_grows_one_run() -> None:
    ledger = _ledger(100)
    for _ in range(50):
        ledger.compute(0, 1)
    ledger.compute(0, 0)
    assert (ledger.length(0), ledger.private(0), ledger.used) == (150, 150, 150)
    assert not ledger.shared(0) and len(ledger._runs) == 1
    ledger.check()


def test_compute_rejects_negative_ids_and_counts() -> None:
    ledger = CellLedger()
    with pytest.raises(ValueError):
        ledger.compute(-1, 5)
    with pytest.raises(ValueError):
        ledger.compute(0, -5)


def test_copy_shares_cells_without_making_any() -> None:
    ledger = _ledger(100)
    ledger.copy(0, 1, 60)
    assert (ledger.length(1), ledger.used) == (60, 100)
    assert (ledger.private(0), ledger.private(1)) == (40, 0)
    assert ledger.shared(0) and ledger.shared(0, 59, 60) and not ledger.shared(0, 60, 100)
    assert ledger.shared(1) and ledger.sharers(0) == {1} and ledger.sharers(1) == {0}
    ledger.compute(1, 10)  # its own tokens after the shared prefix
    assert (ledger.private(1), ledger.used) == (10, 110)
    ledger.check()


def test_copy_continues_a_dst_that_already_holds_a_prefix() -> None:
    ledger = _ledger(100, 20)  # seq 1's 20 cells are its own, not seq 0's
    ledger.copy(0, 1, 70)
    assert (ledger.length(1), ledger.private(1), ledger.used) == (70, 20, 120)
    ledger.copy(0, 1, 70)  # nothing left to take
    ledger.copy(0, 1, 100)
    assert (ledger.private(0), ledger.private(1), ledger.used) == (20, 20, 120)
    ledger.check()


@pytest.mark.parametrize(
    ("lengths", "src", "dst", "end"),
    [
        ((100, 50), 0, 1, 40),  # dst is longer than end
        ((100, 0), 0, 1, 101),  # beyond src
        ((100,), 0, 0, 100),  # onto itself
        ((100,), 0, -1, 10),  # no such sequence id
    ],
)
def test_copy_rejects(lengths: tuple[int, ...], src: int, dst: int, end: int) -> None:
    ledger = _ledger(*lengths)
    with pytest.raises(ValueError):
        ledger.copy(src, dst, end)
    assert [ledger.length(seq) for seq in range(len(lengths))] == list(lengths)
    ledger.check()


def test_adopt_swaps_a_restored_copy_of_a_prefix_for_the_shared_cells() -> None:
    ledger = _ledger(1000, 1300)  # seq 1 restored its own copy of seq 0's 1000 tokens, and 300 more
    ledger.adopt(0, 1, 1000)
    assert (ledger.length(1), ledger.used, ledger.private(0), ledger.private(1)) == (1300, 1300, 0, 300)
    assert ledger.sharers(1) == {0} and not ledger.shared(1, 1000, 1300)
    ledger.clear(0)  # the donor ends: the cells stay, now seq 1's alone
    assert (ledger.used, ledger.private(1)) == (1300, 1300)
    ledger.check()


@pytest.mark.parametrize(("src", "dst", "end"), [(0, 0, 10), (0, 1, 31), (1, 0, 21), (0, -1, 0)])
def test_adopt_rejects(src: int, dst: int, end: int) -> None:
    ledger = _ledger(20, 30)
    with pytest.raises(ValueError):
        ledger.adopt(src, dst, end)


def test_trim_frees_only_cells_nobody_else_holds() -> None:
    ledger = _ledger(100)
    ledger.copy(0, 1, 80)
    ledger.trim(0, 50)
    assert (ledger.length(0), ledger.used, ledger.private(1)) == (50, 80, 30)
    ledger.trim(0, 500)  # holds fewer: nothing to drop, as seq_rm
    assert ledger.length(0) == 50
    with pytest.raises(ValueError):
        ledger.trim(0, -1)
    ledger.check()


def test_a_trimmed_sequence_computes_into_the_cells_it_freed() -> None:
    ledger = _ledger(100)
    ledger.trim(0, 30)
    ledger.compute(0, 10)
    assert (ledger.length(0), ledger.used, len(ledger._runs)) == (40, 40, 1)
    ledger.check()


def test_clear_frees_the_private_cells_and_forgets_the_sequence() -> None:
    ledger = _ledger(100)
    ledger.copy(0, 1, 100)
    ledger.compute(1, 5)
    ledger.clear(0)
    assert (ledger.length(0), ledger.used, ledger.private(1), ledger.sharers(1)) == (0, 105, 105, set())
    ledger.clear(1)
    assert (ledger.used, len(ledger._runs)) == (0, 0)
    ledger.check()


def test_shift_drops_a_range_and_frees_its_private_cells() -> None:
    ledger = _ledger(100)
    ledger.shift(0, 10, 30)
    assert (ledger.length(0), ledger.used, ledger.private(0)) == (70, 70, 70)
    ledger.compute(0, 1)  # the shifted sequence goes on decoding at its end
    assert (ledger.length(0), ledger.used) == (71, 71)
    ledger.check()


def test_shift_refuses_to_move_a_shared_cell() -> None:
    ledger = _ledger(100)
    ledger.copy(0, 1, 80)  # seq 0's positions 50..79, which would move, are seq 1's too
    with pytest.raises(ValueError, match="shared"):
        ledger.shift(0, 10, 40)
    assert (ledger.length(0), ledger.used) == (100, 100)
    ledger.check()


def test_shift_may_drop_shared_cells_and_keep_shared_cells() -> None:
    ledger = _ledger(100)
    ledger.copy(0, 1, 60)
    ledger.shift(0, 10, 50)  # keeps 0..9 (shared), drops 10..59 (shared), moves 60..99 (private)
    assert (ledger.length(0), ledger.used, ledger.private(0), ledger.private(1)) == (50, 100, 40, 50)
    assert ledger.shared(0, 0, 10) and not ledger.shared(0, 10, 50)
    ledger.check()


def test_sharers_hold_the_same_cells_not_merely_the_same_run() -> None:
    ledger = _ledger(10)
    ledger.copy(0, 1, 10)
    ledger.compute(1, 5)  # seq 1 grows the run it shares
    ledger.trim(0, 3)
    ledger.shift(1, 0, 3)  # seq 1 now holds cells 3..14 of the run, seq 0 cells 0..2
    assert ledger.sharers(0) == ledger.sharers(1) == set() and not ledger.shared(1)
    assert (ledger.used, ledger.private(0), ledger.private(1)) == (15, 3, 12)
    ledger.check()


@pytest.mark.parametrize(("keep", "discard"), [(-1, 5), (5, -1), (60, 41), (0, 101)])
def test_shift_rejects_a_range_outside_the_sequence(keep: int, discard: int) -> None:
    ledger = _ledger(100)
    with pytest.raises(ValueError):
        ledger.shift(0, keep, discard)
    ledger.shift(0, 100, 0)  # nothing dropped, nothing moved
    assert ledger.length(0) == 100


@pytest.mark.parametrize(("start", "end"), [(-1, 5), (6, 5), (0, 101)])
def test_shared_rejects_a_range_outside_the_sequence(start: int, end: int) -> None:
    with pytest.raises(ValueError):
        _ledger(100).shared(0, start, end)


def test_eight_slots_sharing_a_system_prompt_count_it_once() -> None:
    ledger = _ledger(1000)
    for seq in range(1, 8):
        ledger.copy(0, seq, 1000)
        ledger.compute(seq, 50)
    ledger.compute(0, 50)
    # sum(len(slot.cached)) would say 8 * 1050 = 8400.
    assert ledger.used == 1000 + 8 * 50
    assert all(ledger.private(seq) == 50 and ledger.length(seq) == 1050 for seq in range(8))
    assert ledger.sharers(0) == set(range(1, 8)) and ledger.sharers(3) == set(range(8)) - {3}
    assert not ledger.shared(0, 1000, 1050) and ledger.shared(5, 0, 1000)
    ledger.clear(0)  # frees seq 0's own 50; the prompt stays for the other seven
    assert ledger.used == 1000 + 7 * 50
    for seq in range(1, 7):
        ledger.clear(seq)
    assert ledger.private(7) == ledger.used == 1050 and not ledger.shared(7)
    ledger.check()
    ledger.clear(7)
    assert (ledger.used, len(ledger._runs)) == (0, 0)


def test_runs_do_not_outlive_their_cells_under_churn() -> None:
    ledger = CellLedger()
    for turn in range(200):
        seq, other = turn % 4, (turn + 1) % 4
        ledger.compute(seq, 7)
        if ledger.length(other):
            ledger.trim(other, 3)
        else:
            ledger.copy(seq, other, ledger.length(seq))
        ledger.compute(other, 2)
        if turn % 3 == 0:
            ledger.clear(seq)
    ledger.check()
    for seq in range(4):
        ledger.clear(seq)
    assert (ledger.used, len(ledger._runs)) == (0, 0)
    ledger.check()


SEQS = range(4)


class Reference:
    """The brute-force model: every cell an id, every sequence its ids by position."""

    def __init__(self) -> None:
        self.seqs: dict[int, list[int]] = {seq: [] for seq in SEQS}
        self.next_id = 0

    def others(self, seq: int) -> set[int]:
        return {cell for other, cells in self.seqs.items() if other != seq for cell in cells}

    def compute(self, seq: int, n: int) -> None:
        self.seqs[seq] += range(self.next_id, self.next_id + n)
        self.next_id += n

    def copy(self, src: int, dst: int, end: int) -> bool:
        if src == dst or not len(self.seqs[dst]) <= end <= len(self.seqs[src]):
            return False
        self.seqs[dst] += self.seqs[src][len(self.seqs[dst]) : end]
        return True

    def adopt(self, src: int, dst: int, end: int) -> bool:
        if src == dst or not end <= min(len(self.seqs[src]), len(self.seqs[dst])):
            return False
        self.seqs[dst][:end] = self.seqs[src][:end]
        return True

    def trim(self, seq: int, keep: int) -> None:
        del self.seqs[seq][keep:]

    def shift(self, seq: int, keep: int, discard: int) -> bool:
        if keep + discard > len(self.seqs[seq]) or self.shared(seq, keep + discard, len(self.seqs[seq])):
            return False
        del self.seqs[seq][keep : keep + discard]
        return True

    def shared(self, seq: int, start: int, end: int) -> bool:
        return bool(set(self.seqs[seq][start:end]) & self.others(seq))

    def used(self) -> int:
        return len({cell for cells in self.seqs.values() for cell in cells})

    def private(self, seq: int) -> int:
        return len(set(self.seqs[seq]) - self.others(seq))

    def sharers(self, seq: int) -> set[int]:
        return {other for other in SEQS if other != seq and set(self.seqs[other]) & set(self.seqs[seq])}


@settings(max_examples=200, deadline=None, database=None)
@given(st.data())
def test_random_operations_match_the_brute_force_model(data: st.DataObject) -> None:
    ledger, ref = CellLedger(), Reference()
    seqs = st.sampled_from(SEQS)
    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        ops = ["compute", "compute", "copy", "copy", "adopt", "trim", "clear", "shift"]
        op = data.draw(st.sampled_from(ops))
        seq = data.draw(seqs, label="seq")
        n = len(ref.seqs[seq])
        # Positions near the sequence's length, a little beyond it now and then.
        position = st.integers(0, n + 2)
        if op == "compute":
            count = data.draw(st.integers(0, 6), label="n")
            ledger.compute(seq, count)
            ref.compute(seq, count)
        elif op == "copy":
            src = data.draw(seqs, label="src")
            end = data.draw(st.integers(0, len(ref.seqs[src]) + 2), label="end")
            before = ref.used()
            if ref.copy(src, seq, end):
                ledger.copy(src, seq, end)
                assert ledger.used == before  # sharing never makes cells
            else:
                with pytest.raises(ValueError):
                    ledger.copy(src, seq, end)
        elif op == "adopt":
            src = data.draw(seqs, label="src")
            end = data.draw(st.integers(0, min(n, len(ref.seqs[src])) + 2), label="end")
            before = ref.used()
            if ref.adopt(src, seq, end):
                ledger.adopt(src, seq, end)
                assert ledger.used <= before  # adopting never makes cells
            else:
                with pytest.raises(ValueError):
                    ledger.adopt(src, seq, end)
        elif op == "trim":
            keep = data.draw(position, label="keep")
            ledger.trim(seq, keep)
            ref.trim(seq, keep)
        elif op == "clear":
            ledger.clear(seq)
            ref.trim(seq, 0)
        else:
            keep = data.draw(position, label="keep")
            discard = data.draw(st.integers(0, max(0, n - keep) + 1), label="discard")
            if ref.shift(seq, keep, discard):
                ledger.shift(seq, keep, discard)
            else:
                with pytest.raises(ValueError):
                    ledger.shift(seq, keep, discard)
        ledger.check()
        assert ledger.used == ref.used()
        for s in SEQS:
            length = len(ref.seqs[s])
            assert ledger.length(s) == length
            assert ledger.private(s) == ref.private(s)
            assert ledger.sharers(s) == ref.sharers(s)
            assert ledger.shared(s) == ref.shared(s, 0, length)
            for start, end in [(0, length // 2), (length // 3, length // 3 + 1), (length // 2, length)]:
                end = min(end, length)
                assert ledger.shared(s, start, end) == ref.shared(s, start, end), (s, start, end)
        length = len(ref.seqs[seq])
        start = data.draw(st.integers(0, length), label="start")
        end = data.draw(st.integers(start, length), label="end")
        assert ledger.shared(seq, start, end) == ref.shared(seq, start, end)
    for s in SEQS:
        ledger.clear(s)
    assert (ledger.used, len(ledger._runs)) == (0, 0)
