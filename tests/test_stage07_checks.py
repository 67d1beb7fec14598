"""Stage 07's checks of exercises 7.2–7.5, each proven by wrong implementations that must fail with
the right message (exercise 7.1's are in test_stage07_pool.py)."""

from __future__ import annotations

import pytest

from aie_lessons import checks
from aie_lessons.engine.block_manager import BlockManager, block_hashes
from aie_lessons.engine.paged_batch import chunk_slots
from aie_lessons.engine.preemption import make_room
from aie_lessons.engine.request import RequestStatus
from aie_lessons.engine.scheduler import effective_priority
from check_expect import mutants, names_the_mistake


# --- 7.2 ----------------------------------------------------------------------------------------
def manager_with(name: str, **mistake):
    """The reference resize with one mistake a learner could make."""

    def resize(self, table: list[int], num_tokens: int) -> None:
        need = self.blocks_for(num_tokens)
        if mistake.get("floor"):
            need = num_tokens // self.block_size
        elif mistake.get("one_too_many"):
            need = num_tokens // self.block_size + 1
        while len(table) < need:
            if mistake.get("takes_the_tail"):
                block, _ = self.free_queue.popitem(last=True)
            else:
                block = self.take_block()
            if mistake.get("counts_twice"):
                self.ref_counts[block] += 1
                self.ref_counts[block] += 1
            else:
                self.ref_counts[block] = 1
            table.append(block)
        if mistake.get("grows_only"):
            return
        if mistake.get("drops_in_order"):
            dropped = table[need:]
            del table[need:]
            for block in dropped:
                self.ref_counts[block] -= 1
                if self.ref_counts[block] == 0:
                    self.release_block(block)
            return
        if mistake.get("rebinds"):
            for block in table[need:]:
                self.ref_counts[block] -= 1
                if self.ref_counts[block] == 0:
                    self.release_block(block)
            table = table[:need]  # a new list: the caller's table keeps its blocks
            return
        while len(table) > need:
            block = table.pop(0) if mistake.get("shrinks_from_the_front") else table.pop()
            if mistake.get("keeps_the_count"):
                if self.ref_counts[block] == 0:
                    self.release_block(block)
                continue
            self.ref_counts[block] -= 1
            if mistake.get("no_count_check"):
                self.release_block(block)
            elif mistake.get("queues_while_held"):
                self.free_queue[block] = None
            elif self.ref_counts[block] == 0:
                self.release_block(block)
                if mistake.get("releases_twice"):
                    self.release_block(block)

    return type(name, (BlockManager,), {"resize": resize})


def test_resize_check_passes_the_reference(capsys):
    checks.stage07.check_resize(BlockManager)
    assert "✓ Exercise 7.2 passed" in capsys.readouterr().out


@mutants("7.2", [
    (manager_with("Floor", floor=True), "round the division up"),
    (manager_with("OneTooMany", one_too_many=True), "off-by-one in the number of blocks"),
    (manager_with("TakesTheTail", takes_the_tail=True), "the queue's head"),
    (manager_with("CountsTwice", counts_twice=True), "reference count 1"),
    (manager_with("GrowsOnly", grows_only=True), "did not shrink"),
    (manager_with("ShrinksFromTheFront", shrinks_from_the_front=True), "drops from the end"),
    (manager_with("DropsInOrder", drops_in_order=True), "last first"),
    (manager_with("KeepsTheCount", keeps_the_count=True), "subtract one from the count of each dropped block"),
    (manager_with("NoCountCheck", no_count_check=True), "still held by another table"),
    (manager_with("QueuesWhileHeld", queues_while_held=True), "also held by another table"),
    (manager_with("ReleasesTwice", releases_twice=True), "freed twice"),
    (manager_with("Rebinds", rebinds=True), "change the list in place"),
])
def test_resize_check_names_the_mistake(wrong, message):
    with names_the_mistake("7.2", message):
        checks.stage07.check_resize(wrong)


# --- 7.3 ----------------------------------------------------------------------------------------
def slot_is_position(chunk, block_size):
    return list(range(chunk.start, chunk.start + chunk.length))


def block_index_not_table(chunk, block_size):
    return [(p // block_size) * block_size + p % block_size for p in range(chunk.start, chunk.start + chunk.length)]


def no_multiply(chunk, block_size):
    return [chunk.kv[p // block_size] + p % block_size for p in range(chunk.start, chunk.start + chunk.length)]


def positions_from_zero(chunk, block_size):
    return [chunk.kv[p // block_size] * block_size + p % block_size for p in range(chunk.length)]


def no_offset(chunk, block_size):
    return [chunk.kv[p // block_size] * block_size for p in range(chunk.start, chunk.start + chunk.length)]


def previous_block_at_its_first_token(chunk, block_size):
    return [chunk.kv[(p - 1) // block_size] * block_size + p % block_size
            for p in range(chunk.start, chunk.start + chunk.length)]


def runs_to_the_request_end(chunk, block_size):
    return [chunk.kv[p // block_size] * block_size + p % block_size
            for p in range(chunk.start, chunk.request.num_tokens)]


def shifted_by_one(chunk, block_size):
    return [chunk.kv[p // block_size] * block_size + p % block_size
            for p in range(chunk.start + 1, chunk.start + chunk.length + 1)]


def test_chunk_slots_check_passes_the_reference(capsys):
    checks.stage07.check_chunk_slots(chunk_slots)
    assert "✓ Exercise 7.3 passed" in capsys.readouterr().out


@mutants("7.3", [
    (slot_is_position, "the slots are the positions themselves"),
    (block_index_not_table, "the slots are the positions themselves"),
    (no_multiply, "multiply it by block_size"),
    (positions_from_zero, "positions start at chunk.start, not 0"),
    (no_offset, "add the offset p % block_size"),
    (previous_block_at_its_first_token, "the first token of a new block"),
    (runs_to_the_request_end, "one slot per token of the chunk.*not to the request's last token"),
    (shifted_by_one, "shifted by one position"),
])
def test_chunk_slots_check_names_the_mistake(wrong, message):
    with names_the_mistake("7.3", message):
        checks.stage07.check_chunk_slots(wrong)


# --- 7.4 ----------------------------------------------------------------------------------------
def hashes_with(name: str, **mistake):
    """The reference hash chain with one mistake a learner could make."""

    def wrong(tokens, block_size, parent=None):
        if mistake.get("ignores_parent"):
            parent = None
        first = parent
        keys = []
        stop = -(-len(tokens) // block_size) * block_size if mistake.get("hashes_the_partial_block") \
            else len(tokens) // block_size * block_size
        starts = range(0, len(tokens) - block_size + 1) if mistake.get("slides") else range(0, stop, block_size)
        for start in starts:
            end = start + block_size + (1 if mistake.get("slice_one_too_long") else 0)
            block = tokens[start:end] if mistake.get("list_not_tuple") else tuple(tokens[start:end])
            if mistake.get("no_chain"):
                key = hash(block)
            elif mistake.get("parent_never_updated"):
                key = hash((first, block))
            elif mistake.get("swapped"):
                key = hash((block, parent))
            else:
                key = hash((parent, block))
            parent = key
            keys.append(key)
        return keys

    wrong.__name__ = name
    return wrong


def test_block_hashes_check_passes_the_reference(capsys):
    checks.stage07.check_block_hashes(block_hashes)
    assert "✓ Exercise 7.4 passed" in capsys.readouterr().out


@mutants("7.4", [
    (hashes_with("hashes_the_partial_block", hashes_the_partial_block=True), "partial last block gets no key"),
    (hashes_with("no_chain", no_chain=True), "must chain the previous block's key"),
    (hashes_with("parent_never_updated", parent_never_updated=True), "the running key is never updated"),
    (hashes_with("list_not_tuple", list_not_tuple=True), "a list cannot be hashed.*tuple"),
    (hashes_with("slice_one_too_long", slice_one_too_long=True), "slices are off by one"),
    (hashes_with("slides", slides=True), "one key per token position.*step by block_size"),
    (hashes_with("ignores_parent", ignores_parent=True), "start from `parent`"),
    (hashes_with("swapped", swapped=True), "hash\\(\\(parent, tuple\\(block\\)\\)\\), in that order"),
])
def test_block_hashes_check_names_the_mistake(wrong, message):
    with names_the_mistake("7.4", message):
        checks.stage07.check_block_hashes(wrong)


# --- 7.5 ----------------------------------------------------------------------------------------
def make_room_with(name: str, **mistake):
    """The reference make_room with one mistake a learner could make."""

    def wrong(scheduler, now):
        rate = scheduler.config.aging_rate
        preempted = []

        def victim_key(r):
            if mistake.get("raw_priority"):
                return r.priority, -r.seq
            if mistake.get("earliest_on_ties"):
                return effective_priority(r, now, rate), r.seq
            return effective_priority(r, now, rate), -r.seq

        choose = max if mistake.get("highest") else min
        for request in sorted(scheduler.running, key=lambda r: (-effective_priority(r, now, rate), r.seq)):
            if request.status is not RequestStatus.RUNNING and not mistake.get("no_skip"):
                continue
            if mistake.get("preempts_first"):
                victim = choose(scheduler.running, key=victim_key)
                scheduler.preempt(victim)
                preempted.append(victim)
                if victim is request:
                    continue
            if mistake.get("if_not_while"):
                if not scheduler.allocator.can_grow(request.id, request.num_tokens):
                    victim = choose(scheduler.running, key=victim_key)
                    scheduler.preempt(victim)
                    preempted.append(victim)
                    if victim is request:
                        continue
                scheduler.allocator.grow(request.id, request.num_tokens)
                continue
            if mistake.get("removes_by_hand"):  # picks and returns the victims, but never preempts them
                held = dict(scheduler.allocator.held)
                while not scheduler.allocator.can_grow(request.id, request.num_tokens):
                    victim = choose(scheduler.running, key=victim_key)
                    scheduler.running.remove(victim)
                    scheduler.allocator.free_count += held.get(victim.id, 0)
                    preempted.append(victim)
                    if victim is request:
                        break
                else:
                    scheduler.allocator.grow(request.id, request.num_tokens)
                continue
            while not scheduler.allocator.can_grow(request.id, request.num_tokens):
                candidates = [r for r in scheduler.running if r is not request or not mistake.get("spares_itself")]
                victim = choose(candidates, key=victim_key)
                scheduler.preempt(victim)
                preempted.append(victim)
                if victim is request and not mistake.get("no_break"):
                    break
            else:
                if not mistake.get("never_grows"):
                    scheduler.allocator.grow(request.id, request.num_tokens)
        return None if mistake.get("returns_nothing") else preempted

    wrong.__name__ = name
    return wrong


def test_make_room_check_passes_the_reference(capsys):
    checks.stage07.check_make_room(make_room)
    assert "✓ Exercise 7.5 passed" in capsys.readouterr().out


@mutants("7.5", [
    (make_room_with("highest", highest=True), "LOWEST effective priority, not the highest"),
    (make_room_with("raw_priority", raw_priority=True), "use the effective priority"),
    (make_room_with("earliest_on_ties", earliest_on_ties=True), "the LATEST arrival"),
    (make_room_with("spares_itself", spares_itself=True), "itself included"),
    (make_room_with("if_not_while", if_not_while=True), "one victim may not be enough"),
    (make_room_with("no_break", no_break=True), "stop when the victim is the request itself"),
    (make_room_with("no_skip", no_skip=True), "skip requests that are no longer RUNNING"),
    (make_room_with("preempts_first", preempts_first=True), "check can_grow before choosing a victim"),
    (make_room_with("never_grows", never_grows=True), "must be grown"),
    (make_room_with("returns_nothing", returns_nothing=True), "return the list of preempted requests"),
    (make_room_with("removes_by_hand", removes_by_hand=True), "never called scheduler.preempt"),
])
def test_make_room_check_names_the_mistake(wrong, message):
    with names_the_mistake("7.5", message):
        checks.stage07.check_make_room(wrong)


# --- stubs --------------------------------------------------------------------------------------
def stub(*args):
    raise NotImplementedError("Exercise 7.N is not implemented yet: replace this line with your code.")


@pytest.mark.parametrize("run", [
    lambda: checks.stage07.check_resize(type("Stub", (BlockManager,), {"resize": stub})),
    lambda: checks.stage07.check_chunk_slots(stub),
    lambda: checks.stage07.check_block_hashes(stub),
    lambda: checks.stage07.check_make_room(stub),
], ids=["7.2", "7.3", "7.4", "7.5"])
def test_a_stub_passes_through_as_not_implemented(run):
    with pytest.raises(NotImplementedError, match="is not implemented yet"):
        run()
