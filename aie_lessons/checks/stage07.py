"""Checks for stage 07: first fit, a block table's resize, the slot mapping, the hash chain, make room.

The block manager and the scheduler are pure Python, so the checks drive them with small
stand-ins and compare with a reference computed here from the rules, never with the package's
copy (which may be the learner's own after ``aie commit``).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from types import SimpleNamespace

from aie_lessons.checks.common import CheckFailed, call, fail, passed
from aie_lessons.engine.request import RequestStatus  # stage 06's enum: given code, not an exercise


# --- 7.1: first fit (the reference is a byte map, one flag per unit) ----------------------------
Hole = tuple[int, int]


def _runs(free: list[bool]) -> list[Hole]:
    """The maximal runs of free units, as (offset, length), in address order."""
    runs: list[Hole] = []
    for unit, is_free in enumerate(free):
        if not is_free:
            continue
        if runs and runs[-1][0] + runs[-1][1] == unit:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((unit, 1))
    return runs


def _byte_map(holes: list[Hole], size: int) -> list[bool]:
    free = [False] * size
    for offset, length in holes:
        free[offset:offset + length] = [True] * length
    return free


def _reference_take(free: list[bool], n: int) -> int | None:
    """The lowest-addressed run of free units that is at least n long gives its first n units."""
    for offset, length in _runs(free):
        if length >= n:
            free[offset:offset + n] = [False] * n
            return offset
    return None


# --- reading the learner's holes ---------------------------------------------------------------
def _shape(ex: str, holes, after: str) -> list[Hole]:
    """The learner's hole list as (offset, length) tuples, or a failure that says what it holds."""
    if not isinstance(holes, list):
        fail(ex, f"after {after}, holes is a {type(holes).__name__}: keep it the list you were given")
    shaped = []
    for hole in holes:
        if (not isinstance(hole, (list, tuple)) or len(hole) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in hole)):
            fail(ex, f"after {after}, holes holds {hole!r}: every hole is an [offset, length] pair of ints")
        shaped.append((hole[0], hole[1]))
    return shaped


def _hole(hole: Hole) -> str:
    return f"[{hole[0]}, {hole[1]}]"


def _show(holes: list[Hole]) -> str:
    return "[" + ", ".join(_hole(h) for h in holes) + "]"


def _list_units(units: list[int]) -> str:
    if units == list(range(units[0], units[-1] + 1)):
        return f"units {units[0]}…{units[-1]}" if len(units) > 1 else f"unit {units[0]}"
    return f"units {', '.join(map(str, units))}"


def _units(holes: list[Hole]) -> set[int]:
    return {unit for offset, length in holes for unit in range(offset, offset + length)}


def _common_hole_faults(ex: str, got: list[Hole], want: list[Hole], after: str) -> None:
    """Faults either edit can leave: empty holes, holes out of order, holes that overlap."""
    empty = [h for h in got if h[1] <= 0]
    if empty:
        fail(ex, f"after {after}, holes holds a zero-length hole {_show(empty)}: when a hole is used up "
                 f"exactly, delete it (holes {_show(got)}, expected {_show(want)})")
    if got != sorted(got):
        fail(ex, f"after {after}, holes are not sorted by offset: {_show(got)}. Keep the list in address order "
                 "(insert where the range belongs; bisect finds the place), or first fit is no longer the "
                 "lowest hole and neighbours cannot be found")
    for (o1, n1), (o2, _) in zip(got, got[1:]):
        if o1 + n1 > o2:
            fail(ex, f"after {after}, holes [{o1}, {n1}] and one at {o2} overlap: {_show(got)}. A hole that "
                     f"was merged into another must be removed (expected {_show(want)})")


# --- take ------------------------------------------------------------------------------------------
def _diagnose_take(ex: str, before: list[Hole], n: int, got: int | None, got_holes: list[Hole],
                   want: int | None, want_holes: list[Hole]) -> None:
    after = f"take(holes={_show(before)}, n={n})"
    fitting = [h for h in before if h[1] >= n]
    if got != want:
        if want is None:
            fail(ex, f"{after} returned {got!r}, but no hole is {n} long: return None and leave holes as they are")
        if got is None:
            fail(ex, f"{after} returned None, but the hole {_hole(fitting[0])} is long enough (length ≥ n fits, "
                     "= included)")
        exact = next((h for h in fitting if h[1] == n), None)
        if exact is not None and exact[0] == want and got != want:
            fail(ex, f"{after} returned {got!r}: it skipped the hole {_hole(exact)}, which is exactly n = {n} long. "
                     "A hole fits when length >= n (it is then used up and removed)")
        best = min(fitting, key=lambda h: h[1])
        if got == best[0] != want:
            fail(ex, f"{after} returned {got}: you chose the smallest hole that fits (best fit). First fit takes "
                     f"the first hole in address order that is long enough: {want}")
        if got == fitting[-1][0] != want:
            fail(ex, f"{after} returned {got}: you chose the last hole that fits. First fit takes the *first* "
                     f"one in address order: {want}")
        if got == max(fitting, key=lambda h: h[1])[0] != want:
            fail(ex, f"{after} returned {got}: you chose the largest hole (worst fit). First fit takes the first "
                     f"hole in address order that is long enough: {want}")
        if got == fitting[0][0] + fitting[0][1] - n:
            fail(ex, f"{after} returned {got}: you cut the n units from the end of the hole. Take them from its "
                     f"start ({want}) and keep the rest as a hole after them")
        fail(ex, f"{after} returned {got!r}, expected offset {want!r} (the start of the first hole that is at "
                 "least n long)")
    if got_holes == want_holes:
        return
    if got is not None:
        used = next(h for h in before if h[0] == got)
        if got_holes == [h for h in before if h != used] and used[1] > n:
            fail(ex, f"after {after}, the hole {_hole(used)} disappeared: the rest of the hole was lost. Split "
                     f"it: its last {used[1] - n} units stay free, as the hole [{got + n}, {used[1] - n}]")
    if got_holes == before:
        fail(ex, f"after {after}, holes did not change: take must edit the list it is given, in place (the pool "
                 f"keeps that very list; expected {_show(want_holes)})")
    _common_hole_faults(ex, got_holes, want_holes, after)
    fail(ex, f"after {after}, holes are {_show(got_holes)}, expected {_show(want_holes)}")


def _try_take(ex: str, take, holes: list, n: int, size: int) -> int | None:
    """Run the learner's take on ``holes`` (edited in place), compare with the byte map, and
    return the offset it gave."""
    before = _shape(ex, holes, "the previous edit")
    free = _byte_map(before, size)
    want = _reference_take(free, n)
    got = call(ex, take, holes, n, hint="when no hole is long enough, take returns None")
    got_holes = _shape(ex, holes, f"take(holes={_show(before)}, n={n})")
    _diagnose_take(ex, before, n, got, got_holes, want, _runs(free))
    return got


# --- give_back ---------------------------------------------------------------------------------
def _diagnose_give_back(ex: str, before: list[Hole], offset: int, n: int, got: list[Hole], want: list[Hole]) -> None:
    if got == want:
        return
    after = f"give_back(holes={_show(before)}, offset={offset}, n={n})"
    if got == before:
        fail(ex, f"after {after}, holes did not change: give_back must edit the list it is given, in place "
                 "(insert, del, or change a hole); assigning a new list to the name `holes` makes one the pool "
                 f"never sees (expected {_show(want)})")
    extra = sorted(_units(got) - _units(want))
    if extra:
        fail(ex, f"after {after}, {_list_units(extra)} lie inside a hole but are still in use: you "
                 f"merged holes that are not adjacent (holes {_show(got)}, expected {_show(want)}). Two ranges "
                 "touch only when offset + length == the next offset — mind the off-by-one")
    _common_hole_faults(ex, got, want, after)
    lost = sorted(_units(want) - _units(got))
    if lost:
        fail(ex, f"after {after}, {_list_units(lost)} are not free: holes {_show(got)}, expected "
                 f"{_show(want)}")
    left = next((h for h in before if h[0] + h[1] == offset), None)
    right = next((h for h in before if h[0] == offset + n), None)
    if left and right:
        if left in got and right in got:
            fail(ex, f"after {after}, the freed units were not merged with their neighbours {_hole(left)} (ends at "
                     f"offset) and {_hole(right)} (starts at offset + n): three touching holes are one hole "
                     f"(expected {_show(want)})")
        if (left[0], left[1] + n) in got and right in got:
            fail(ex, f"after {after}, the freed units merged only with the left neighbour {_hole(left)}, not "
                     f"with the right one {_hole(right)} that starts at offset + n: merge with both "
                     f"(expected {_show(want)})")
        if left in got and (offset, n + right[1]) in got:
            fail(ex, f"after {after}, the freed units merged only with the right neighbour {_hole(right)}, not "
                     f"with the left one {_hole(left)} that ends at offset: merge with both "
                     f"(expected {_show(want)})")
    if left and left in got:
        fail(ex, f"after {after}, the freed units were not merged with the hole {_hole(left)} that ends at "
                 f"offset (its left neighbour): holes {_show(got)}, expected {_show(want)}")
    if right and right in got:
        fail(ex, f"after {after}, the freed units were not merged with the hole {_hole(right)} that starts at "
                 f"offset + n (its right neighbour): holes {_show(got)}, expected {_show(want)}")
    fail(ex, f"after {after}, holes are {_show(got)}, expected {_show(want)}")


def _try_give_back(ex: str, give_back, holes: list, offset: int, n: int, size: int) -> None:
    before = _shape(ex, holes, "the previous edit")
    free = _byte_map(before, size)
    after = f"give_back(holes={_show(before)}, offset={offset}, n={n})"
    double = any(free[offset:offset + n])
    try:
        give_back(holes, offset, n)
        refused = None
    except NotImplementedError:
        raise
    except ValueError as exc:
        refused = exc
    except Exception as exc:  # the learner's code may raise anything; we report it, not hide it
        fail(ex, f"{after} raised {type(exc).__name__}: {exc}")
    got = _shape(ex, holes, after)
    if double:
        if refused is None:
            fail(ex, f"{after} frees units that are already free (they overlap a hole): a double free. "
                     "Raise ValueError and change nothing — accepted, it lets two later reservations share "
                     "the same memory")
        if got != before:
            fail(ex, f"{after} refused the double free but changed holes to {_show(got)}: check for the overlap "
                     "before changing anything")
        return
    if refused is not None:
        fail(ex, f"{after} raised ValueError ({refused}), but units {offset}…{offset + n - 1} were in use. Only "
                 "a range that overlaps a hole is a double free: one that starts where a hole ends, or ends "
                 "where a hole starts, only touches it")
    free[offset:offset + n] = [True] * n
    _diagnose_give_back(ex, before, offset, n, got, _runs(free))


# --- the check ---------------------------------------------------------------------------------
TAKE_CASES = [  # (holes, n): each tells one mistake apart from the others
    ([[0, 5], [10, 3], [20, 9], [40, 4]], 3),  # first, best, worst and last fit all differ
    ([[0, 10]], 3),  # split: the rest of the hole stays
    ([[0, 4], [10, 5]], 4),  # a hole used up exactly disappears
    ([[0, 2], [10, 6], [20, 3], [30, 9]], 3),  # the first that fits is not the first hole
    ([[0, 2], [5, 3]], 4),  # nothing fits
    ([], 1),  # nothing is free
]
GIVE_BACK_CASES = [  # (holes, offset, n, size)
    ([[0, 2], [6, 3]], 3, 2, 12),  # a gap of one unit on both sides: no merge; inserted in the middle
    ([[0, 2], [5, 3]], 2, 3, 12),  # touches both neighbours: one hole
    ([[0, 2], [9, 3]], 2, 3, 12),  # touches the left neighbour only
    ([[0, 2], [6, 3]], 3, 3, 12),  # touches the right neighbour only
    ([], 4, 2, 12),  # into an empty list
    ([[5, 2]], 0, 3, 12),  # before the first hole
    ([[0, 2]], 6, 1, 12),  # after the last hole
    ([[0, 4], [10, 5]], 2, 3, 16),  # double free: overlaps the left hole's tail
    ([[0, 4], [10, 5]], 8, 3, 16),  # double free: overlaps the right hole's start
    ([[0, 4], [10, 5]], 11, 2, 16),  # double free: inside a hole
    ([[0, 4], [10, 5]], 10, 5, 16),  # double free: exactly a hole
]


def check_first_fit(first_fit_free_list) -> None:
    """Exercise 7.1: ``first_fit_free_list()`` returns ``(take, give_back)`` that edit a sorted list
    of [offset, length] holes in place exactly as a byte map of free units says they must."""
    ex = "7.1"
    pair = call(ex, first_fit_free_list)
    if not (isinstance(pair, tuple) and len(pair) == 2 and all(callable(f) for f in pair)):
        fail(ex, f"first_fit_free_list() should return the pair (take, give_back), got {pair!r}")
    take, give_back = pair
    for holes, n in TAKE_CASES:
        size = max([o + length for o, length in holes] + [1]) + 4
        _try_take(ex, take, [list(h) for h in holes], n, size)
    for holes, offset, n, size in GIVE_BACK_CASES:
        _try_give_back(ex, give_back, [list(h) for h in holes], offset, n, size)
    rng = random.Random(71)
    for _ in range(40):  # random sequences of edits on one list, as a pool makes them
        size = rng.randint(8, 96)
        holes, live = [[0, size]], []
        for _ in range(60):
            if live and rng.random() < 0.45:
                offset, n = live.pop(rng.randrange(len(live)))
                _try_give_back(ex, give_back, holes, offset, n, size)
            elif holes and rng.random() < 0.08:  # a double free of some units of a hole
                offset, length = holes[rng.randrange(len(holes))]
                start = rng.randrange(offset, offset + length)
                _try_give_back(ex, give_back, holes, start, rng.randint(1, offset + length - start), size)
            else:
                n = rng.randint(1, max(1, size // 4))
                offset = _try_take(ex, take, holes, n, size)
                if offset is not None:
                    live.append((offset, n))
    passed(ex, "take cuts n units from the first hole that fits and keeps the rest; give_back merges with "
               "both neighbours, keeps the holes sorted, and refuses a double free")


# --- 7.2: resize ---------------------------------------------------------------------------------
def _blocks(num_tokens: int, size: int) -> int:
    return -(-num_tokens // size)


def check_resize(BlockManager) -> None:
    ex = "7.2"
    size = 4
    manager = BlockManager(8, size)
    table: list[int] = []
    call(ex, manager.resize, table, 5)
    if len(table) == 1:
        fail(ex, f"5 tokens in blocks of {size} need 2 blocks, your table has 1: round the division up "
                 "(ceil), the last block may be partly filled")
    if len(table) != 2:
        fail(ex, f"5 tokens in blocks of {size} need 2 blocks; your table has {len(table)}: {table}")
    if table != [0, 1]:
        fail(ex, f"a fresh pool hands out blocks 0 and 1 first (take_block, the queue's head); got {table}")
    if [manager.ref_counts[b] for b in table] != [1, 1]:
        fail(ex, f"new blocks must have reference count 1 (one table holds them); got "
                 f"{[manager.ref_counts[b] for b in table]}")
    call(ex, manager.resize, table, 8)
    if len(table) != 2:
        fail(ex, f"8 tokens fill exactly 2 blocks of {size}, but resizing to 8 gave {len(table)} blocks: "
                 "an off-by-one in the number of blocks (ceil(8 / 4) = 2)")
    call(ex, manager.resize, table, 9)
    if len(table) != 3:
        fail(ex, f"9 tokens need 3 blocks of {size}; got {len(table)} after growing from 8 tokens")
    # Another table shares the first block, as a prefix-cache hit would.
    shared = table[0]
    manager.ref_counts[shared] += 1
    before, grown = list(manager.free_queue), list(table)
    call(ex, manager.resize, table, 4)
    if table == grown:
        if manager.ref_counts[grown[-1]] == 0 or grown[-1] in manager.free_queue:
            fail(ex, f"resizing from 9 tokens to 4 released blocks but left the caller's table at {table}: "
                     "change the list in place (table.pop(), table.append()); `table = table[:n]` makes a new "
                     "list that the caller never sees")
        fail(ex, f"resizing from 9 tokens to 4 left the table at {table}: it did not shrink. When the table "
                 "holds more blocks than the tokens need, drop the extra ones from its end")
    if table != [shared]:
        fail(ex, f"shrinking to 4 tokens keeps the table's FIRST block and drops from the end; got {table}")
    released = list(manager.free_queue)[len(before):]
    if not released and [manager.ref_counts[b] for b in grown[1:]] == [1, 1]:
        fail(ex, f"shrinking dropped blocks {grown[1:]} from the table, but their reference counts are still 1, "
                 "so they were never released: subtract one from the count of each dropped block, and release "
                 "it when the count reaches 0")
    if sorted(released) != sorted([1, 2]):
        fail(ex, f"shrinking from 3 blocks to 1 must give back exactly the 2 dropped blocks; the free queue "
                 f"gained {released}")
    if released != [2, 1]:
        fail(ex, f"drop blocks from the end of the table, last first: the free queue should gain [2, 1], "
                 f"got {released}")
    if any(manager.ref_counts[b] for b in released):
        fail(ex, "a released block must have reference count 0: drop each dropped block's count by one")
    call(ex, manager.resize, table, 0,
         hint=f"block {shared} is still held by another table (its count was 2): subtract one from its count, "
              "and release a block only when its count reaches 0")
    if table:
        fail(ex, f"resizing to 0 tokens empties the table; it still holds {table}")
    if shared in manager.free_queue:
        fail(ex, f"block {shared} was also held by another table (reference count 2): freeing one table "
                 "must only lower its count to 1, not release it")
    if manager.ref_counts[shared] != 1:
        fail(ex, f"block {shared} was held by two tables; after one lets go its count must be 1, got "
                 f"{manager.ref_counts[shared]} — drop the count of every block you remove")
    _random_resizes(ex, BlockManager)
    passed(ex, "tables grow from the free queue's head with count 1, shrink from their end, and a block is "
               "released only when no table holds it")


def _random_resizes(ex: str, BlockManager) -> None:
    """Random grows and shrinks of several tables, against a model of the counts and the queue."""
    rng = random.Random(7)
    size, total = 3, 24
    manager = BlockManager(total, size)
    tables = [[] for _ in range(4)]
    counts = [0] * total
    queue = OrderedDict.fromkeys(range(total))
    for step in range(200):
        i = rng.randrange(len(tables))
        table = tables[i]
        target = rng.randint(0, 12)
        need = _blocks(target, size)
        if need - len(table) > len(queue):
            continue
        expected = list(table)
        while len(expected) < need:
            block, _ = queue.popitem(last=False)
            counts[block] = 1
            expected.append(block)
        while len(expected) > need:
            block = expected.pop()
            counts[block] -= 1
            if counts[block] == 0:
                queue[block] = None
        call(ex, manager.resize, table, target)
        if table != expected:
            fail(ex, f"after a random sequence of resizes (step {step}: {target} tokens), the table is {table}, "
                     f"expected {expected}")
        if list(manager.ref_counts) != counts or list(manager.free_queue) != list(queue):
            fail(ex, f"after a random sequence of resizes (step {step}) the reference counts or the free "
                     "queue differ from the rule: each taken block gets count 1, each dropped block loses 1 "
                     "and is released at 0")


# --- 7.3: slot mapping ------------------------------------------------------------------------
def check_chunk_slots(chunk_slots) -> None:
    ex = "7.3"
    rng = random.Random(3)
    for size in (4, 16, 1):  # block_size 1 last: there a shift and a wrong block look alike
        for _ in range(20):
            # One spare block in the table, and a request that may go on past the chunk (a prefill
            # chunk need not end at the request's last token): reads past the chunk then show.
            table = rng.sample(range(64), 7)
            start = rng.randrange(0, 5 * size)
            length = rng.randint(1, 6 * size - start)
            request = SimpleNamespace(num_tokens=start + length + rng.randint(0, size), id="r0")
            chunk = SimpleNamespace(request=request, start=start, length=length, kv=table)  # what it reads

            def slots(positions: range) -> list[int]:
                return [table[p // size] * size + p % size for p in positions]

            positions = range(start, start + length)
            expected = slots(positions)
            got = call(ex, chunk_slots, chunk, size)
            got = list(got) if got is not None else None
            if got == expected:
                continue
            where = f"(table {table}, block_size {size}, tokens {start}…{start + length - 1})"
            if got is not None and len(got) == request.num_tokens - start != length:
                fail(ex, f"one slot per token of the chunk: its {length} tokens run from chunk.start to "
                         f"chunk.start + chunk.length − 1, not to the request's last token; got {len(got)} slots "
                         f"{where}")
            if got is None or len(got) != length:
                fail(ex, f"one slot per token of the chunk: expected {length}, got "
                         f"{None if got is None else len(got)} {where}")
            if got == list(positions):
                fail(ex, f"the slots are the positions themselves: look each position's block up in the table "
                         f"{where}")
            if got == [table[p // size] + p % size for p in positions]:
                fail(ex, f"a block number is a count of blocks, not of slots: multiply it by block_size {where}")
            if got == [table[p // size] * size for p in positions]:
                fail(ex, f"every token of a block got the block's first slot: add the offset p % block_size "
                         f"inside the block {where}")
            if got == slots(range(length)):
                fail(ex, f"positions start at chunk.start, not 0: the chunk's first token is position {start} "
                         f"{where}")
            if got in (slots(range(start + 1, start + length + 1)), slots(range(start - 1, start + length - 1))):
                fail(ex, f"the slots are shifted by one position: the chunk's tokens are positions chunk.start … "
                         f"chunk.start + chunk.length − 1 {where}")
            first_wrong = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
            p = start + first_wrong
            new_block = " — the first token of a new block: check the division" if p % size == 0 else ""
            fail(ex, f"position {p} (offset {p % size} in table entry {p // size}) should be slot "
                     f"{expected[first_wrong]}, got {got[first_wrong]}{new_block} {where}")
    passed(ex, "every token's slot is table[p // block_size] · block_size + p % block_size")


# --- 7.4: hash chain --------------------------------------------------------------------------
def _reference_hashes(tokens: list[int], size: int, parent=None) -> list[int]:
    keys = []
    for start in range(0, len(tokens) // size * size, size):
        parent = hash((parent, tuple(tokens[start:start + size])))
        keys.append(parent)
    return keys


def _keys(ex: str, block_hashes, *args) -> list:
    """The learner's keys as a list; a list block (unhashable) is named, other crashes reported."""
    try:
        got = call(ex, block_hashes, *args)
    except CheckFailed as failure:
        cause = failure.__cause__
        if isinstance(cause, TypeError) and "unhashable" in str(cause):
            fail(ex, f"your code raised TypeError: {cause} — a list cannot be hashed: make each block a tuple, "
                     "tuple(tokens[start:start + block_size])")
        raise
    if got is None:
        fail(ex, "block_hashes returned None: return the list of keys, one per full block")
    return list(got)


def _first_key_mistake(tokens: list[int], size: int, got: int) -> str | None:
    """Name the usual way the first key comes out wrong, if ``got`` is one of them."""
    block = tuple(tokens[:size])
    if got == hash((block, None)):
        return ("the key is hash((parent, tuple(block))), in that order: you hashed (block, parent) — a "
                "different tuple, so a different key")
    for begin in (0, 1):
        for stop in (size - 1, size, size + 1):
            if (begin, stop) != (0, size) and got == hash((None, tuple(tokens[begin:stop]))):
                return (f"the first key hashes tokens[{begin}:{stop}], not tokens[0:{size}]: your slices are off "
                        f"by one. Block i is tokens[i * block_size:(i + 1) * block_size]")
    return None


def check_block_hashes(block_hashes) -> None:
    ex = "7.4"
    rng = random.Random(4)
    size = 4
    tokens = [rng.randrange(1000) for _ in range(14)]  # 3 full blocks and a partial one
    got = _keys(ex, block_hashes, tokens, size)
    expected = _reference_hashes(tokens, size)
    if len(got) == 4:
        fail(ex, "14 tokens in blocks of 4 are 3 full blocks and 2 tokens: the partial last block gets no key "
                 "(its contents will still change)")
    if len(got) == len(tokens) - size + 1:
        fail(ex, f"14 tokens in blocks of 4 gave {len(got)} keys, one key per token position: the blocks do "
                 "not overlap, so step by block_size from one block's start to the next")
    if len(got) != 3:
        fail(ex, f"14 tokens in blocks of 4 have 3 full blocks, so 3 keys; got {len(got)}")
    blocks = [tuple(tokens[i:i + size]) for i in range(0, 12, size)]
    if got == [hash(block) for block in blocks]:
        fail(ex, "each key must chain the previous block's key: hash((previous key, block)), so that equal "
                 "blocks after different prefixes get different keys")
    if got == [hash((None, block)) for block in blocks]:
        fail(ex, "every key was hashed with the same parent: the running key is never updated. After each "
                 "block, the key you just made is the parent of the next block")
    if got[0] != expected[0]:
        fail(ex, _first_key_mistake(tokens, size, got[0])
             or "the first key is hash((parent, tuple(first block's tokens))) with parent None at the start "
                "of a prompt")
    if got != expected:
        fail(ex, "the keys differ from the chain hash((previous key, tuple(block))): update the running key "
                 "after each block and slice blocks at multiples of block_size")
    keys = _keys(ex, block_hashes, tokens[:size] * 3, size)
    if len(set(keys)) != 3:
        fail(ex, "three equal blocks at different places got equal keys: the chain must make them differ")
    if _keys(ex, block_hashes, tokens[size:], size, expected[0]) != expected[1:]:
        fail(ex, f"continuing a chain: block_hashes(tokens[{size}:], {size}, parent=first key) must give the "
                 "same keys as the whole prompt's blocks 2, 3, …: start from `parent`")
    for _ in range(20):
        n = rng.randint(0, 40)
        sample = [rng.randrange(50) for _ in range(n)]
        if _keys(ex, block_hashes, sample, 5) != _reference_hashes(sample, 5):
            fail(ex, f"wrong keys for {n} tokens in blocks of 5")
    passed(ex, "one chained key per full block; equal keys mean equal prefixes")


# --- 7.5: make room -------------------------------------------------------------------------
class _Allocator:
    """``free`` blocks; request ``i`` holds ``held[i]`` blocks of ``size`` tokens."""

    def __init__(self, free: int, size: int = 4):
        self.free_count, self.size, self.held = free, size, {}
        self.last_asked: str | None = None  # tells "asked again after being its own victim" apart

    def can_grow(self, rid: str, num_tokens: int) -> bool:
        if rid not in self.held:
            if rid == self.last_asked:
                raise RuntimeError(f"{rid} was its own victim, and you asked again whether it can grow: once "
                                   "preempted it has no blocks, so stop when the victim is the request itself")
            raise RuntimeError(f"{rid} was preempted earlier in this loop to make room for another request, so "
                               "it has no blocks to grow: skip requests that are no longer RUNNING")
        self.last_asked = rid
        return _blocks(num_tokens, self.size) - self.held[rid] <= self.free_count

    def grow(self, rid: str, num_tokens: int) -> None:
        if rid not in self.held:
            raise RuntimeError(f"{rid} was preempted, yet you grew it: grow only a request that is still running "
                               "(stop when the victim is the request itself)")
        need = _blocks(num_tokens, self.size) - self.held[rid]
        if need > self.free_count:
            raise RuntimeError(f"KV pool exhausted: {rid} was grown while can_grow was false — keep "
                               "preempting while it is false (one victim may not be enough)")
        if need > 0:
            self.free_count -= need
            self.held[rid] += need

    def free(self, rid: str) -> None:
        self.free_count += self.held.pop(rid)


class _Scheduler:
    def __init__(self, requests, free: int, aging_rate: float = 1.0):
        self.config = SimpleNamespace(aging_rate=aging_rate)
        self.allocator = _Allocator(free)
        self.running = list(requests)
        self.preempted_log: list[str] = []
        for r in requests:
            held = r.held if r.held is not None else _blocks(r.num_tokens - 1, self.allocator.size)
            self.allocator.held[r.id] = held

    def preempt(self, request) -> None:
        if request not in self.running:
            raise RuntimeError(f"{request.id} preempted twice")
        self.allocator.free(request.id)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        self.preempted_log.append(request.id)


def _request(rid: str, seq: int, tokens: int, priority: float = 0.0, arrival: float = 0.0,
             held: int | None = None):
    return SimpleNamespace(id=rid, seq=seq, num_tokens=tokens, priority=priority, status=RequestStatus.RUNNING,
                           metrics=SimpleNamespace(arrival=arrival), arrival=arrival, held=held)


Case = tuple[list[tuple], int, float, float]  # (spec, free blocks, now, aging rate)


def _case(spec, free, now=10.0, rate=1.0) -> Case:
    """spec: (tokens, priority, arrival[, blocks held]) per request. By default a request holds the
    blocks of all its tokens but the last, so it needs a new block when tokens − 1 is a multiple of 4."""
    return spec, free, now, rate


def _scheduler(case: Case) -> _Scheduler:
    """Fresh stand-ins for one case: every run (the learner's, the reference's) starts from the same state."""
    spec, free, _, rate = case
    return _Scheduler([_request(f"r{i}", i, *s) for i, s in enumerate(spec)], free, rate)


CASES = {
    "enough free blocks": _case([(5, 0, 0), (9, 0, 1), (3, 0, 2)], free=2),
    "priorities": _case([(5, 2, 5), (9, 0, 5), (13, 1, 5)], free=0),
    "one block short, equal priorities (latest arrival gives way)": _case([(5, 0, 0), (9, 0, 1), (13, 0, 2)], free=2,
                                                                           rate=0.0),
    "aging: an old low priority outranks a new higher one": _case([(5, 0, 0), (9, 5, 9.5), (13, 3, 9)], free=1),
    "the victim is the request itself": _case([(5, 0, 1), (3, 1, 0)], free=0),
    "two victims for one request": _case([(9, 3, 0, 1), (3, 0, 1), (2, 0, 2)], free=0, rate=0.0),
    "no block free, nobody can grow": _case([(5, 0, 0), (9, 0, 1)], free=0),
}


def _lowest(running, request, eff):
    """The rule: the lowest effective priority, and among equals the latest arrival."""
    return min(running, key=lambda r: (eff(r), -r.seq))


def _earliest_on_ties(running, request, eff):
    return min(running, key=lambda r: (eff(r), r.seq))


def _fixed_priority(running, request, eff):
    return min(running, key=lambda r: (r.priority, -r.seq))


def _others_only(running, request, eff):
    return min((r for r in running if r is not request), key=lambda r: (eff(r), -r.seq))


def _highest(running, request, eff):
    return max(running, key=lambda r: (eff(r), -r.seq))


def _highest_earliest(running, request, eff):
    return max(running, key=lambda r: (eff(r), r.seq))


LOWEST_NOT_HIGHEST = "the victim is the LOWEST effective priority, not the highest"
WRONG_VICTIMS = [  # (a usual wrong victim rule, what to tell the learner who wrote it)
    (_earliest_on_ties, "among equal effective priorities the LATEST arrival (largest seq) gives way, not the "
                        "earliest: it has the least invested"),
    (_fixed_priority, "use the effective priority (exercise 6.1), which grows while a request waits, not the "
                      "fixed priority"),
    (_others_only, "the request that needs the block may have the lowest effective priority itself: choose the "
                   "victim among all running requests, itself included, and stop when it is the victim"),
    (_highest, LOWEST_NOT_HIGHEST),
    (_highest_earliest, LOWEST_NOT_HIGHEST),
]


def _room_by(victim_of):
    """make_room over the stand-ins with the victim chosen by ``victim_of(running, request, eff)``:
    the rule (the reference), or one of the usual wrong ones (to recognise a learner's mistake)."""

    def room(sched: _Scheduler, now: float) -> list:
        rate = sched.config.aging_rate

        def eff(r) -> float:
            return r.priority + rate * (now - r.arrival)

        out = []
        for request in sorted(sched.running, key=lambda r: (-eff(r), r.seq)):
            if request.status is not RequestStatus.RUNNING:
                continue
            while not sched.allocator.can_grow(request.id, request.num_tokens):
                victim = victim_of(sched.running, request, eff)
                sched.preempt(victim)
                out.append(victim)
                if victim is request:
                    break
            else:
                sched.allocator.grow(request.id, request.num_tokens)
        return out

    return room


def _outcomes(make_room) -> list:
    """What ``make_room`` does in every case (whom it preempts and what each holds, or the error it
    raises): two rules with the same outcomes cannot be told apart by these cases."""
    outcomes = []
    for case in CASES.values():
        sched = _scheduler(case)
        try:
            make_room(sched, case[2])
        except Exception as exc:  # the learner's code may raise anything; it is part of the outcome
            outcomes.append(type(exc).__name__)
            continue
        outcomes.append((sched.preempted_log, sched.allocator.held))
    return outcomes


def check_make_room(make_room) -> None:
    ex = "7.5"
    for name, case in CASES.items():
        reference = _scheduler(case)
        _room_by(_lowest)(reference, case[2])
        expected, held = reference.preempted_log, reference.allocator.held
        sched = _scheduler(case)
        got = call(ex, make_room, sched, case[2])
        if got is None:
            fail(ex, f"make_room returned None: return the list of preempted requests, in the order you "
                     f"preempted them (case '{name}')")
        got_ids = [r.id for r in got]
        if not sched.preempted_log and got_ids:
            fail(ex, f"case '{name}': you returned {got_ids} but never called scheduler.preempt: it is what "
                     "frees the victim's blocks, takes it out of `running`, marks it PREEMPTED and queues it")
        if sched.preempted_log != expected:
            wrong = _diagnose_victims(make_room, sched.preempted_log, expected)
            fail(ex, f"case '{name}': preempted {sched.preempted_log}, expected {expected}. {wrong}")
        if got_ids != sched.preempted_log:
            fail(ex, f"case '{name}': return the preempted requests in the order you preempted them: "
                     f"returned {got_ids}, preempted {sched.preempted_log}")
        if sched.allocator.held != held:
            fail(ex, f"case '{name}': blocks held after make_room {sched.allocator.held}, expected {held}: "
                     "every request still running must be grown to hold all its tokens")
    passed(ex, "the most urgent grow first; the victim is the lowest effective priority, then the latest "
               "arrival; a request that is its own victim stops")


def _diagnose_victims(make_room, got: list[str], expected: list[str]) -> str:
    if not expected and got:
        return "Nobody needed to be preempted here: check can_grow before choosing a victim."
    if expected and not got:
        return "A request that cannot grow needs a victim: preempt one while can_grow is false."
    learner = _outcomes(make_room)
    for victim_of, mistake in WRONG_VICTIMS:
        if _outcomes(_room_by(victim_of)) == learner:
            return f"Victim rule: {mistake}."
    if len(got) < len(expected) and got == expected[:len(got)]:
        return ("One victim may not free enough blocks: keep preempting while can_grow is false (a loop, not "
                "a single if), and stop once the request itself is preempted.")
    if len(got) > len(expected) and got[:len(expected)] == expected:
        return ("A preempted request has nothing left to grow: stop when the victim is the request itself, and "
                "skip requests already preempted in this loop.")
    return "Check the victim rule: the lowest effective priority, and among equals the latest arrival."
