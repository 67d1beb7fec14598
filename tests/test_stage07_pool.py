"""Stage 07, section 1: the memory pool, its trace replay, and the check of exercise 7.1 proven by
wrong free lists that must fail with the right message."""

from __future__ import annotations

import bisect

import pytest

from aie_lessons.checks import stage07
from check_expect import mutants, names_the_mistake
from aie_lessons.engine.memory_pool import (BlockKV, ContiguousKV, MemoryPool, Reservation, first_fit_free_list, kv_trace,
                         simulate_trace)


# --- the pool ----------------------------------------------------------------------------------------
def test_allocate_splits_the_first_hole_that_fits():
    pool = MemoryPool(100)
    a = pool.allocate(30)
    assert (a.offset, a.size, a.end) == (0, 30, 30)
    assert pool.holes == [(30, 70)]
    assert (pool.used_bytes, pool.free_bytes, pool.largest_hole, pool.fragmentation) == (30, 70, 70, 0.0)


def test_free_coalesces_with_both_neighbours():
    pool = MemoryPool(100)
    a, b, c, d = (pool.allocate(n) for n in (10, 20, 30, 40))
    pool.free(a)
    pool.free(c)
    assert pool.holes == [(0, 10), (30, 30)]
    assert pool.fragmentation == pytest.approx(1 - 30 / 40)
    pool.free(b)
    assert pool.holes == [(0, 60)]
    pool.free(d)
    assert pool.holes == [(0, 100)] and pool.free_bytes == 100


def test_first_fit_and_best_fit_choose_different_holes():
    pool = MemoryPool(100)
    parts = [pool.allocate(n) for n in (20, 5, 10, 5, 60)]
    pool.free(parts[0])  # a hole of 20 at 0
    pool.free(parts[2])  # a hole of 10 at 25
    assert pool.allocate(8, fit="best").offset == 25
    assert pool.allocate(8, fit="first").offset == 0
    assert pool.holes == [(8, 12), (33, 2)]


def test_a_hole_used_up_exactly_disappears():
    pool = MemoryPool(10)
    pool.allocate(10)
    assert pool.holes == [] and pool.largest_hole == 0 and pool.fragmentation == 0.0
    assert pool.allocate(1) is None


def test_compaction_moves_live_reservations_fixes_handles_and_counts_bytes():
    pool = MemoryPool(100)
    a, b, c, d = (pool.allocate(n) for n in (10, 20, 30, 40))
    pool.free(a)
    pool.free(c)
    assert pool.allocate(50) is None and pool.free_bytes == 40
    moved = pool.compact()
    assert moved == 20 + 40  # b and d moved; nothing else did
    assert (b.offset, d.offset) == (0, 20)
    assert pool.holes == [(60, 40)] and pool.fragmentation == 0.0
    assert (pool.compactions, pool.bytes_moved) == (1, 60)
    assert pool.compact() == 0  # already compact: nothing moves
    pool.free(b)  # the moved handles still free the right units
    assert pool.holes == [(0, 20), (60, 40)]


def test_allocate_or_compact_compacts_only_when_enough_memory_is_free():
    pool = MemoryPool(100)
    parts = [pool.allocate(25) for _ in range(4)]
    pool.free(parts[0])
    pool.free(parts[2])
    r = pool.allocate_or_compact(40)
    assert r is not None and r.offset == 50 and pool.compactions == 1
    assert (parts[1].offset, parts[3].offset) == (0, 25)
    assert pool.allocate_or_compact(20) is None and pool.compactions == 1  # 10 free: no compaction helps


@pytest.mark.parametrize("call, message", [
    (lambda p: p.allocate(0), "positive whole number"),
    (lambda p: p.allocate(-3), "positive whole number"),
    (lambda p: p.allocate(2.5), "positive whole number"),
    (lambda p: p.allocate(True), "positive whole number"),
    (lambda p: p.allocate(4, fit="worst"), "unknown policy; use one of first, best"),
])
def test_bad_requests_are_refused_with_the_fix(call, message):
    with pytest.raises(ValueError, match=message):
        call(MemoryPool(16))


def test_double_free_and_foreign_reservations_are_refused():
    pool, other = MemoryPool(16), MemoryPool(16)
    r = pool.allocate(4)
    pool.free(r)
    with pytest.raises(ValueError, match="freed already, or belongs to another pool"):
        pool.free(r)
    with pytest.raises(ValueError, match="not live in this pool"):
        pool.free(other.allocate(4))
    with pytest.raises(ValueError, match="not live in this pool"):
        pool.free(Reservation(0, 4))
    for size in (0, -1, 1.5):
        with pytest.raises(ValueError, match="positive whole number of units"):
            MemoryPool(size)


def test_give_back_refuses_overlap_and_changes_nothing():
    _, give_back = first_fit_free_list()
    holes = [[0, 4], [10, 5]]
    for offset, n in ((2, 3), (8, 3), (11, 2), (10, 5)):
        with pytest.raises(ValueError, match="freed twice"):
            give_back(holes, offset, n)
    assert holes == [[0, 4], [10, 5]]


# --- the trace -----------------------------------------------------------------------------------------
def test_the_trace_is_deterministic_and_well_formed():
    trace = kv_trace(3, steps=300)
    assert trace == kv_trace(3, steps=300)
    assert trace != kv_trace(4, steps=300)
    arrive = {e.request: e.step for e in trace if e.kind == "arrive"}
    finish = {e.request: e.step for e in trace if e.kind == "finish"}
    assert arrive.keys() == finish.keys() and all(finish[r] > arrive[r] for r in arrive)
    assert [e.step for e in trace] == sorted(e.step for e in trace)


def test_blocks_never_fail_while_contiguous_pools_do():
    bpt, arena = 1000, 4096 * 1000
    trace = kv_trace(5, steps=800, arrival_prob=0.35, prompt_tokens=(16, 512), max_new_tokens=(16, 128))
    first = simulate_trace(ContiguousKV(arena, bpt), trace)
    blocks = simulate_trace(BlockKV(arena, bpt, block_tokens=16), trace)
    compacting = ContiguousKV(arena, bpt, compact=True)
    compacted = simulate_trace(compacting, trace)
    assert first.failed[-1] > 0 and first.worst_fragmentation > 0.5
    assert blocks.failed[-1] == 0 and blocks.worst_fragmentation == 0.0
    assert compacted.failed[-1] == 0 and compacting.pool.bytes_moved > 0
    assert len(first.steps) == len(trace)
    assert all(0 <= w < 16 * bpt * 100 for w in blocks.wasted_bytes)  # under one block per request
    assert blocks.wasted_bytes[-1] == 0  # everything released at the end


def test_block_space_refuses_a_double_release():
    space = BlockKV(64 * 10, 10, block_tokens=16)
    blocks = space.reserve(20)
    assert len(blocks) == 2 and space.wasted_bytes == (32 - 20) * 10
    space.release(blocks)
    with pytest.raises(ValueError, match="released twice"):
        space.release(blocks)


# --- the check of exercise 7.1 ---------------------------------------------------------------------
def free_list_with(name: str, **mistake):
    """The reference free list with one mistake a learner could make."""

    def factory():
        def take(holes, n):
            strictly = mistake.get("strictly_longer")
            fitting = [i for i, (_, length) in enumerate(holes) if (length > n if strictly else length >= n)]
            if not fitting:
                return None
            i = fitting[0]
            if mistake.get("best_fit"):
                i = min(fitting, key=lambda j: holes[j][1])
            elif mistake.get("last_fit"):
                i = fitting[-1]
            elif mistake.get("worst_fit"):
                i = max(fitting, key=lambda j: holes[j][1])
            start, length = holes[i]
            if mistake.get("not_in_place"):
                holes = holes[:i] + holes[i + 1:]  # a new list: the caller's is untouched
                return start
            if mistake.get("cut_from_end"):
                holes[i] = [start, length - n]
                return start + length - n
            if mistake.get("not_split") or (length == n and not mistake.get("zero_length_hole")):
                del holes[i]
            else:
                holes[i] = [start + n, length - n]
            return start

        def give_back(holes, offset, n):
            if mistake.get("rebinds"):
                holes = sorted(holes + [[offset, n]])  # a new list: the caller's is untouched
                return
            if mistake.get("appends"):
                holes.append([offset, n])
                return
            i = bisect.bisect_left(holes, offset, key=lambda hole: hole[0])
            left = holes[i - 1] if i > 0 else None
            right = holes[i] if i < len(holes) else None
            slack = 1 if mistake.get("refuses_touching") else 0
            if not mistake.get("no_double_free_check") and (
                    (left and left[0] + left[1] + slack > offset) or (right and right[0] < offset + n + slack)):
                raise ValueError("freed twice")
            gap = 1 if mistake.get("off_by_one") else 0
            if right and right[0] <= offset + n + gap and not mistake.get("left_only") and not mistake.get("none"):
                n = right[0] + right[1] - offset
                if not mistake.get("keeps_merged_right"):
                    del holes[i]
            if left and left[0] + left[1] + gap >= offset and not mistake.get("right_only") and not mistake.get("none"):
                left[1] = offset + n - left[0]
            else:
                holes.insert(i, [offset, n])

        return take, give_back

    factory.__name__ = name
    return factory


def test_first_fit_check_passes_the_reference(capsys):
    stage07.check_first_fit(first_fit_free_list)
    assert "✓ Exercise 7.1 passed" in capsys.readouterr().out


@mutants("7.1", [
    (free_list_with("not_split", not_split=True), "the rest of the hole was lost"),
    (free_list_with("best_fit", best_fit=True), "smallest hole that fits \\(best fit\\)"),
    (free_list_with("last_fit", last_fit=True), "the last hole that fits"),
    (free_list_with("worst_fit", worst_fit=True), "largest hole \\(worst fit\\)"),
    (free_list_with("cut_from_end", cut_from_end=True), "from the end of the hole"),
    (free_list_with("zero_length_hole", zero_length_hole=True), "zero-length hole"),
    (free_list_with("not_in_place", not_in_place=True), "in place"),
    (free_list_with("left_only", left_only=True), "merged only with the left neighbour"),
    (free_list_with("right_only", right_only=True), "merged only with the right neighbour"),
    (free_list_with("no_coalescing", none=True), "not merged with their neighbours"),
    (free_list_with("appends", appends=True), "not sorted by offset"),
    (free_list_with("off_by_one", off_by_one=True), "not adjacent.*off-by-one"),
    (free_list_with("keeps_merged_right", keeps_merged_right=True), "overlap.*must be removed"),
    (free_list_with("no_double_free_check", no_double_free_check=True), "double free"),
    (free_list_with("refuses_touching", refuses_touching=True), "only touches it"),
    (free_list_with("strictly_longer", strictly_longer=True), "exactly n = \\d+ long.*length >= n"),
    (free_list_with("give_back_rebinds", rebinds=True), "give_back must edit the list it is given, in place"),
])
def test_first_fit_check_names_the_mistake(wrong, message):
    with names_the_mistake("7.1", message):
        stage07.check_first_fit(wrong)


def test_first_fit_check_refuses_a_wrong_return_and_passes_a_stub_through():
    with names_the_mistake("7.1", "should return the pair \\(take, give_back\\)"):
        stage07.check_first_fit(lambda: None)

    def stub():
        raise NotImplementedError("Exercise 7.1 is not implemented yet: replace this line with your code.")

    with pytest.raises(NotImplementedError):
        stage07.check_first_fit(stub)
