# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stage 07 — Memory pool and paged KV cache
#
# Stage 06's engine gives every running request a **slot**: one row of the KV cache, as long as
# the longest request it may ever serve. A request that stops after 20 tokens still holds memory
# for `max_len`; the engine runs at most as many requests as it has slots, however short they are.
# On a GPU server the KV cache is most of the memory, so that reservation decides how many users
# one machine serves.
#
# This stage takes the reservation apart in three moves:
#
# 1. **Why not reserve exactly what each request needs?** A pool of variable-size reservations
#    fragments: memory is free, but not in one piece (section 1).
# 2. **Pages.** Cut the memory into fixed-size **blocks** of 16 tokens; a request holds a list of
#    blocks that grows as it generates — a **block table**, like an operating system's page table.
#    Attention reads keys and values through that table (sections 2–3).
# 3. **What pages make possible.** Requests with the same prompt prefix share its blocks
#    (**prefix caching**, section 4); when memory does run out, a request is **preempted** and
#    recomputed later instead of failing (section 5).
#
# ```
#   token ids ─► Scheduler ── admit: blocks for the prompt ─┐   ┌── grow: one block when the last is full
#                  (stage 06)     make room: preempt ◄──────┼───┤
#                                                           ▼   ▼
#                             PagedAllocator: free queue, ref counts, block tables, prefix cache
#                                                           │ block tables, slots
#                                                           ▼
#          model ─► PagedBatch.attend: write k, v at their slots; read them through the tables
# ```
#
# The engine that results is checked against stage 06's slot cache, stage 04's loop and — in the
# tests — HuggingFace `transformers`. From here on it is the course's default engine (`aie
# generate` with several prompts, the throughput benchmark).

# %%
# Stages you committed with `aie commit` are imported below; this checks them first.
from aie_lessons.course.progress import verify_committed_stages

verify_committed_stages(before="07")

# %%
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from types import SimpleNamespace

import matplotlib.pyplot as plt
import torch

from aie_lessons import checks
from aie_lessons.cached_generate import generate_cached
from aie_lessons.config import ModelConfig
from aie_lessons.engine.batch import chunk_inputs
from aie_lessons.engine.engine import Engine
from aie_lessons.engine.request import Request, RequestStatus
from aie_lessons.engine.batch import PackedStep
from aie_lessons.engine.runner import ModelRunner
from aie_lessons.engine.scheduler import Schedule, ScheduledChunk, Scheduler, SchedulerConfig, effective_priority
from aie_lessons.engine.simulator import Arrival, StepCost, simulate
from aie_lessons.engine.workload import mixed_workload
from aie_lessons.flash_attention import HAS_TRITON, interpreted, online_softmax_update
from aie_lessons.generate import PromptError
from aie_lessons.infra.paths import default_model_dir
from aie_lessons.kv_cache import kv_cache_bytes
from aie_lessons.masks import causal_mask
from aie_lessons.model import AttentionFn, LlamaModel, check_kernel, sdpa_attention
from aie_lessons.output import stop_token_ids
from aie_lessons.sampling import SamplingParams
from aie_lessons.tokenizer import Tokenizer

torch.manual_seed(0)
MODEL_DIR = default_model_dir()
model = LlamaModel.from_pretrained(MODEL_DIR)
tokenizer = Tokenizer.from_pretrained(MODEL_DIR)

# %% [markdown]
# ## 1. A memory pool, and why contiguous KV fragments
#
# Stage 06 gave every running request a **slot**: a row of the cache as long as the longest request
# could ever be. A request that stops after a short answer still holds the whole row, so most of
# the cache sits idle. The obvious fix is to reserve for each request only what it can need —
# its prompt plus `max_new_tokens` tokens of keys and values — as **one contiguous region** of a
# big arena, because attention wants each request's keys as one tensor.
#
# That turns the cache into a general-purpose memory allocator, with the allocator's oldest
# problem. Requests finish in any order, and each one leaves a **hole** where its KV was:
#
# ```
#  arena  │AAAA│····│BBBBBB│··│CCC│······│DD│···│
#                ▲ hole       ▲ hole   ▲ hole   ▲ hole
#  a new request needs more than the largest hole, though less than all the holes together
# ```
#
# The free memory is enough in total, but no single hole is: the request is refused. This is
# **external fragmentation**, and we measure it as
#
# **fragmentation = 1 − largest hole / free bytes**
#
# 0 when all free memory is one hole; close to 1 when it is dust.
#
# An allocator keeps a **free list**: the holes, as `[offset, length]` pairs sorted by offset.
# Allocating `n` units takes the *first* hole that is long enough (**first fit**) and **splits**
# it: the front `n` units are reserved, the rest stays a (smaller) hole. Freeing puts the units
# back and **coalesces** them with a hole that ends where they start and one that starts where
# they end — otherwise the free list fills with small neighbouring holes that are one big hole
# in fact, and every later large request is refused for nothing.
#
# A `Reservation` is the caller's handle on its units. It is a small *mutable* object: the pool
# may move the units (compaction, below) and then updates the handle's `offset`, so every holder
# of the handle sees the new place.

# %%
# export: engine.memory_pool
"""A variable-size memory pool: why contiguous KV reservations fragment, and what blocks fix.

A server that keeps each request's KV contiguous needs a general allocator: this one is a
first-fit free list that splits holes, coalesces them, and can compact. A seeded KV trace,
replayed over it and over fixed-size blocks, measures the external fragmentation that paging
removes.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

Holes = list[list[int]]  # [offset, length] pairs, sorted by offset; no empty and no touching holes
TakeFn = Callable[[Holes, int], "int | None"]
GiveBackFn = Callable[[Holes, int, int], None]


@dataclass(eq=False)
class Reservation:
    """``size`` units at ``offset`` of a pool. Mutable on purpose: compaction moves the units and
    rewrites ``offset``, so every holder of this handle follows them. Compared by identity."""

    offset: int
    size: int

    @property
    def end(self) -> int:
        return self.offset + self.size


# %% [markdown]
# ### Exercise 7.1 — first fit, split and coalesce
#
# Complete `first_fit_free_list()`: it defines and returns the free list's two edits, which the
# pool below calls on its list of holes. Both change the list they are given **in place** (the
# pool keeps that list), and both leave it sorted by offset, with no zero-length hole and no two
# holes that touch.
#
# * `take(holes, n)` — reserve `n` units from the **start** of the **first** hole that is at
#   least `n` long and return their offset; keep the rest of that hole as a hole. Return `None`,
#   holes unchanged, when no hole is long enough.
# * `give_back(holes, offset, n)` — make units `offset … offset + n − 1` free again, merged with
#   a hole that ends at `offset` and with one that starts at `offset + n`. If any of those units
#   is already free, it is a **double free**: raise `ValueError` and change nothing.

# %%
# export: engine.memory_pool
def first_fit_free_list() -> tuple[TakeFn, GiveBackFn]:
    """The free list's two edits: ``take`` (first fit, split) and ``give_back`` (coalesce).

    Kept apart from ``MemoryPool`` so that the policy is one small piece of code, checked on its
    own: the pool only adds handles, statistics and compaction around it.
    """
    # BEGIN EXERCISE 7.1: define take (first fit, splitting the hole) and give_back (merging with both neighbours, refusing a double free)
    # Hint 1: Allocation cuts n units off the front of the lowest-addressed hole that is long enough and keeps the rest as a hole; a freed range that touches a hole on either side must become part of it, or neighbouring holes pile up and large requests are refused although the memory is free.
    # Hint 2: take scans the holes in order and replaces the first long-enough one by its remainder (or deletes it when nothing remains); give_back finds its place with bisect on the offsets, refuses an overlap with the hole before or after, absorbs the next hole if it starts at offset + n, then extends the previous hole if it ends at offset or inserts a new one.
    def take(holes: Holes, n: int) -> int | None:
        for i, (start, length) in enumerate(holes):
            if length >= n:
                if length == n:
                    del holes[i]
                else:
                    holes[i] = [start + n, length - n]
                return start
        return None

    def give_back(holes: Holes, offset: int, n: int) -> None:
        i = bisect.bisect_left(holes, offset, key=lambda hole: hole[0])
        left = holes[i - 1] if i > 0 else None
        right = holes[i] if i < len(holes) else None
        if (left and left[0] + left[1] > offset) or (right and right[0] < offset + n):
            raise ValueError(f"units {offset}…{offset + n - 1} overlap a free hole: were they freed twice?")
        if right and right[0] == offset + n:
            n += right[1]
            del holes[i]
        if left and left[0] + left[1] == offset:
            left[1] += n
        else:
            holes.insert(i, [offset, n])
    # END EXERCISE 7.1
    return take, give_back


# %%
# Check exercise 7.1
checks.stage07.check_first_fit(first_fit_free_list)

# %% [markdown]
# ### The pool
#
# `MemoryPool` wraps your free list with what a caller needs: handles, a choice of policy, the
# statistics above, and **compaction**. **Best fit** picks the *smallest* hole that fits instead
# of the first, hoping to keep large holes whole; it reuses your `take` on that one hole. When
# no hole fits although enough memory is free, the last resort is to **compact**: slide every
# live reservation down to offset 0, in order, so that all free memory becomes one hole at the
# end. That copies every reservation that moves — for a KV cache, megabytes of keys and values
# while requests wait — and every pointer into the moved memory must be rewritten (here: the
# handles' `offset`). `allocate_or_compact` does exactly what a server with contiguous KV must:
# allocate, and if that fails while enough memory is free, compact and allocate again.

# %%
# export: engine.memory_pool
class MemoryPool:
    """One arena of ``size`` units, handed out as contiguous reservations from a free list."""

    FITS = ("first", "best")

    def __init__(self, size: int):
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"size={size!r}: a pool needs a positive whole number of units")
        self.size = size
        self._holes: Holes = [[0, size]]
        self._take, self._give_back = first_fit_free_list()
        self._live: set[Reservation] = set()
        self.compactions = 0  # how often compact() ran
        self.bytes_moved = 0  # units copied by all compactions together

    def allocate(self, n: int, fit: str = "first") -> Reservation | None:
        """``n`` contiguous units, or None when no hole is long enough (the pool is unchanged)."""
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"allocate(n={n!r}): n must be a positive whole number of units")
        if fit not in self.FITS:
            raise ValueError(f"allocate(fit={fit!r}): unknown policy; use one of {', '.join(self.FITS)}")
        offset = self._take(self._holes, n) if fit == "first" else self._take_best(n)
        if offset is None:
            return None
        reservation = Reservation(offset, n)
        self._live.add(reservation)
        return reservation

    def _take_best(self, n: int) -> int | None:
        """Best fit: the smallest hole that is long enough (the lowest such on ties), split by
        ``take`` run on a list that holds only that hole."""
        fitting = [i for i, (_, length) in enumerate(self._holes) if length >= n]
        if not fitting:
            return None
        i = min(fitting, key=lambda j: self._holes[j][1])
        only = [list(self._holes[i])]
        offset = self._take(only, n)
        self._holes[i:i + 1] = only
        return offset

    def free(self, reservation: Reservation) -> None:
        if reservation not in self._live:
            raise ValueError(f"{reservation} is not live in this pool: it was freed already, or "
                             "belongs to another pool. Free each reservation once, to its own pool")
        self._live.remove(reservation)
        self._give_back(self._holes, reservation.offset, reservation.size)

    def compact(self) -> int:
        """Slide the live reservations down to offset 0, in address order, updating their
        handles; all free memory becomes one hole at the end. Returns the units copied."""
        moved, cursor = 0, 0
        for reservation in sorted(self._live, key=lambda r: r.offset):
            if reservation.offset != cursor:
                moved += reservation.size
                reservation.offset = cursor
            cursor += reservation.size
        self._holes[:] = [[cursor, self.size - cursor]] if cursor < self.size else []
        self.compactions += 1
        self.bytes_moved += moved
        return moved

    def allocate_or_compact(self, n: int, fit: str = "first") -> Reservation | None:
        """What a contiguous-KV server must do: allocate; if no hole fits although enough memory
        is free, compact and allocate again. None only when the memory is really full."""
        reservation = self.allocate(n, fit)
        if reservation is None and self.free_bytes >= n:
            self.compact()
            reservation = self.allocate(n, fit)
        return reservation

    @property
    def holes(self) -> list[tuple[int, int]]:
        """The free list, as (offset, length) pairs sorted by offset (a copy)."""
        return [(offset, length) for offset, length in self._holes]

    @property
    def free_bytes(self) -> int:
        return sum(length for _, length in self._holes)

    @property
    def used_bytes(self) -> int:
        return self.size - self.free_bytes

    @property
    def largest_hole(self) -> int:
        """The largest request that can succeed now, without compaction."""
        return max((length for _, length in self._holes), default=0)

    @property
    def fragmentation(self) -> float:
        """1 − largest hole / free memory: 0 when the free memory is one hole (or there is none)."""
        free = self.free_bytes
        return 0.0 if free == 0 else 1.0 - self.largest_hole / free


# %% [markdown]
# A small arena shows the pool at work: reservations A–E fill most of it, B and D finish, and a
# request that needs more than any one hole is refused although the free memory would hold it. Freeing C
# coalesces the holes on both its sides into one; compaction instead moves the live reservations
# and fixes their handles.

# %%
def arena_map(pool: MemoryPool, names: dict[str, Reservation]) -> str:
    """One character per unit: a reservation's name, or · for free."""
    cells = ["·"] * pool.size
    for name, r in names.items():
        cells[r.offset:r.end] = name * r.size
    return "".join(cells)


demo = MemoryPool(40)
demo_live = {name: demo.allocate(size) for name, size in zip("ABCDE", (6, 8, 4, 8, 6))}
for name in "BD":
    demo.free(demo_live.pop(name))
print(arena_map(demo, demo_live), "holes", demo.holes)
print(f"free {demo.free_bytes}, largest hole {demo.largest_hole}, fragmentation {demo.fragmentation:.2f}; "
      f"allocate(12) → {demo.allocate(12)}")
demo.free(demo_live.pop("C"))
print(arena_map(demo, demo_live), "holes", demo.holes, "← C merged with both neighbours")
moved = demo.compact()
print(arena_map(demo, demo_live), "holes", demo.holes, f"← compacted: {moved} units moved, E now at {demo_live['E'].offset}")

# %% [markdown]
# ### A day of KV traffic
#
# `kv_trace` makes a seeded stream of requests: at each step a request arrives with some
# probability, with a random prompt and `max_new_tokens`, and holds its KV until it finishes after
# a random number of decode steps. `simulate_trace` replays the same stream over a KV space and
# records, after every event, the free memory, the largest hole and the two kinds of refusal:
# **failed** (enough memory free in total, but no hole fits — fragmentation's fault) and **out of
# memory** (not enough free at all — nobody's fault).
#
# The spaces are:
#
# * `ContiguousKV` — each request as one reservation of (prompt + max_new_tokens) × bytes per
#   token in a `MemoryPool`, by first fit or best fit, and optionally compacting when stuck;
# * `BlockKV` — the same arena cut into **fixed-size blocks** of a few tokens each; a request takes
#   ⌈tokens / block⌉ blocks from a free list, *any* blocks, in any place. No request ever waits for
#   a large enough hole, because there are no holes: every free block serves anyone. What is lost
#   is the unfilled tail of each request's last block — **internal** fragmentation, less than
#   one block per request.

# %%
# export: engine.memory_pool
class KVSpace(Protocol):
    """KV memory as the trace replay sees it: reserve a request's tokens, release them later."""

    bytes_per_token: int

    def reserve(self, tokens: int) -> object | None: ...  # a handle, or None when refused

    def release(self, handle: object) -> None: ...

    @property
    def free_bytes(self) -> int: ...

    @property
    def largest_hole(self) -> int: ...  # the largest reservation (bytes) that succeeds now

    @property
    def wasted_bytes(self) -> int: ...  # reserved but never to be used (internal fragmentation)


class ContiguousKV:
    """Each request's KV as one contiguous reservation of a ``MemoryPool`` (bytes)."""

    def __init__(self, size_bytes: int, bytes_per_token: int, fit: str = "first", compact: bool = False):
        self.pool = MemoryPool(size_bytes)
        self.bytes_per_token = bytes_per_token
        self.fit = fit
        self.compact = compact
        self.wasted_bytes = 0  # contiguous reservations are exact: only the holes are lost

    def reserve(self, tokens: int) -> Reservation | None:
        allocate = self.pool.allocate_or_compact if self.compact else self.pool.allocate
        return allocate(tokens * self.bytes_per_token, self.fit)

    def release(self, handle: Reservation) -> None:
        self.pool.free(handle)

    @property
    def free_bytes(self) -> int:
        return self.pool.free_bytes

    @property
    def largest_hole(self) -> int:
        return self.pool.largest_hole


class BlockKV:
    """The same arena as fixed blocks of ``block_tokens`` tokens: a request takes any free blocks."""

    def __init__(self, size_bytes: int, bytes_per_token: int, block_tokens: int = 16):
        self.bytes_per_token = bytes_per_token
        self.block_tokens = block_tokens
        self.block_bytes = block_tokens * bytes_per_token
        self.free_blocks = list(range(size_bytes // self.block_bytes))
        self.wasted_bytes = 0
        self._tokens: dict[int, int] = {}  # a reservation's first block → its tokens

    def reserve(self, tokens: int) -> list[int] | None:
        need = math.ceil(tokens / self.block_tokens)
        if need > len(self.free_blocks):
            return None
        blocks = [self.free_blocks.pop() for _ in range(need)]
        self._tokens[blocks[0]] = tokens
        self.wasted_bytes += need * self.block_bytes - tokens * self.bytes_per_token
        return blocks

    def release(self, handle: list[int]) -> None:
        tokens = self._tokens.pop(handle[0], None)
        if tokens is None:
            raise ValueError(f"blocks {handle} are not a live reservation: released twice?")
        self.wasted_bytes -= len(handle) * self.block_bytes - tokens * self.bytes_per_token
        self.free_blocks.extend(handle)

    @property
    def free_bytes(self) -> int:
        return len(self.free_blocks) * self.block_bytes

    @property
    def largest_hole(self) -> int:
        return self.free_bytes  # every free block serves any request: all free memory is usable


class TraceEvent(NamedTuple):
    step: int
    kind: str  # "arrive" or "finish"
    request: int
    tokens: int  # prompt + max_new_tokens: what a request reserves when it arrives


def kv_trace(seed: int, steps: int = 2000, arrival_prob: float = 0.3, prompt_tokens: tuple[int, int] = (16, 768),
             max_new_tokens: tuple[int, int] = (16, 256)) -> list[TraceEvent]:
    """Requests arriving at random steps, each finishing after 1 … max_new_tokens decode steps.
    Integer steps and ``random.Random(seed)``: the same trace on every machine."""
    rng = random.Random(seed)
    events = []
    for step in range(steps):
        if rng.random() < arrival_prob:
            request, max_new = len(events) // 2, rng.randint(*max_new_tokens)
            tokens = rng.randint(*prompt_tokens) + max_new
            events.append(TraceEvent(step, "arrive", request, tokens))
            events.append(TraceEvent(step + rng.randint(1, max_new), "finish", request, tokens))
    return sorted(events, key=lambda e: (e.step, e.kind == "arrive", e.request))  # finishes free first


@dataclass
class TraceStats:
    """One entry per event of the trace (cumulative counts for the refusals)."""

    steps: list[int] = field(default_factory=list)
    free_bytes: list[int] = field(default_factory=list)
    largest_hole: list[int] = field(default_factory=list)
    wasted_bytes: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)  # refused although enough memory was free
    out_of_memory: list[int] = field(default_factory=list)  # refused: not enough memory free

    @property
    def fragmentation(self) -> list[float]:
        return [0.0 if free == 0 else 1.0 - hole / free for free, hole in zip(self.free_bytes, self.largest_hole)]

    @property
    def worst_fragmentation(self) -> float:
        return max(self.fragmentation, default=0.0)


def simulate_trace(space: KVSpace, trace: list[TraceEvent]) -> TraceStats:
    """Replay ``trace`` over ``space``: reserve on arrival, release on finish (a refused request
    is dropped), and record the memory's state after every event."""
    stats, handles, failed, out_of_memory = TraceStats(), {}, 0, 0
    for event in trace:
        if event.kind == "arrive":
            handle = space.reserve(event.tokens)
            if handle is not None:
                handles[event.request] = handle
            elif space.free_bytes >= event.tokens * space.bytes_per_token:
                failed += 1
            else:
                out_of_memory += 1
        elif event.request in handles:
            space.release(handles.pop(event.request))
        stats.steps.append(event.step)
        stats.free_bytes.append(space.free_bytes)
        stats.largest_hole.append(space.largest_hole)
        stats.wasted_bytes.append(space.wasted_bytes)
        stats.failed.append(failed)
        stats.out_of_memory.append(out_of_memory)
    return stats


# %% [markdown]
# Each token a request holds costs 2 (keys and values) × layers × KV heads × head dimension × 4
# bytes in fp32 (stage 04's `kv_cache_bytes` of the model's config). The arena holds
# `ARENA_TOKENS` tokens' worth of it, and the blocks are 16 tokens. Every space replays the same
# trace.

# %%
BYTES_PER_TOKEN = kv_cache_bytes(model.config, 1, 1, torch.float32)  # 2 × layers × kv heads × head dim × 4
ARENA_TOKENS, BLOCK_TOKENS, MIB = 16384, 16, 2**20
arena = ARENA_TOKENS * BYTES_PER_TOKEN
trace = kv_trace(seed=7)
kv_spaces = {
    "first fit": ContiguousKV(arena, BYTES_PER_TOKEN, fit="first"),
    "best fit": ContiguousKV(arena, BYTES_PER_TOKEN, fit="best"),
    "first fit + compaction": ContiguousKV(arena, BYTES_PER_TOKEN, fit="first", compact=True),
    f"blocks of {BLOCK_TOKENS} tokens": BlockKV(arena, BYTES_PER_TOKEN, block_tokens=BLOCK_TOKENS),
}
kv_runs = {name: simulate_trace(space, trace) for name, space in kv_spaces.items()}
print(f"{BYTES_PER_TOKEN} bytes per token, arena {ARENA_TOKENS} tokens = {arena / MIB:.0f} MiB, "
      f"{len(trace) // 2} requests over {trace[-1].step} steps")
for name, stats in kv_runs.items():
    served = len(trace) // 2 - stats.failed[-1] - stats.out_of_memory[-1]
    print(f"{name:>22}: served {served}, failed {stats.failed[-1]:2d} (enough memory free), out of memory "
          f"{stats.out_of_memory[-1]:2d}, worst fragmentation {stats.worst_fragmentation:.2f}")
compacting = kv_spaces["first fit + compaction"].pool
block_run = kv_runs[f"blocks of {BLOCK_TOKENS} tokens"]
block_used = [arena - free for free in block_run.free_bytes]
print(f"compaction ran {compacting.compactions} times and copied {compacting.bytes_moved / 2**30:.1f} GiB of KV; "
      f"blocks wasted at most {max(w / u for w, u in zip(block_run.wasted_bytes, block_used) if u):.1%} of the used memory")

fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
styles = {"first fit": ("tab:blue", "-", 1), "best fit": ("tab:orange", "-", 1),
          f"blocks of {BLOCK_TOKENS} tokens": ("tab:red", "-", 3), "first fit + compaction": ("tab:green", "--", 1.5)}
for name, (color, line, width) in styles.items():  # the two that stay at 0: the wide line, then dashes on it
    stats = kv_runs[name]
    zero = " (0 throughout)" if stats.failed[-1] == 0 else ""
    bottom.plot(stats.steps, stats.failed, label=name + zero, color=color, linestyle=line, linewidth=width,
                alpha=0.6 if width > 1 else 1)
    if "compaction" not in name:  # its fragmentation is first fit's until it compacts; its point is zero failures
        blocks = " (no holes: 0 by construction)" if name.startswith("blocks") else ""
        top.plot(stats.steps, stats.fragmentation, label=name + blocks, color=color, linewidth=0.8)
top.set_ylabel("fragmentation\n1 − largest hole / free")
top.set_title("the same KV trace over a contiguous pool and over blocks")
top.legend(loc="upper left")
bottom.set_xlabel("step")
bottom.set_ylabel("requests refused although\nenough memory was free")
bottom.legend(loc="upper left")
fig.tight_layout()
plt.show()

# %% [markdown]
# Read the two panels together. The free memory is in pieces most of the time, but that costs a
# request only when memory is also tight: the refusals come in bursts, when the arena is nearly
# full and a long request arrives. In this run first fit refused 30 requests that the free memory
# could have held. Best fit, which fills the smallest holes to keep the large ones whole, refused
# 31: choosing the hole more cleverly does not help, because the holes are made by the order in
# which requests *finish*, and no placement policy controls that.
#
# Compaction removes those refusals, at a price: it ran 19 times and copied 10.5 GiB of keys and
# values — copies during which every request waits, after which every pointer into the cache
# must be rewritten. Blocks too refuse nobody while enough memory is free, without moving anything,
# and the block pool served 586 requests to first fit's 578 (compacting
# first fit, whose reservations waste nothing, 589). What
# blocks cost is the unfilled tail of each request's last block, at most 3.5% of the used memory
# here. The out-of-memory refusals that remain are real: the memory was full.
#
# The rest of this stage builds on that. The KV cache becomes a pool of fixed-size blocks; each
# request keeps a **block table** from its positions to its blocks, and attention reads keys and
# values through that table (**paged attention**). Blocks also remove the other waste that this
# section kept: here every request still reserved its whole `max_new_tokens` on arrival, while a
# paged request takes one more block only when its last one is full.


# %% [markdown]
# ## 2. Blocks: memory in pages of tokens
#
# Cut the KV memory into **blocks** of `block_size` tokens (16 here). A request holds a *list* of
# blocks — its **block table** — and asks for one more block only when its last one is full. Any
# free block will do, so there is no external fragmentation at all: the only waste is the unused
# tail of each request's last block, fewer than 16 tokens. The price is one indirection: to find
# a token, first find its block in the table, then its place inside that block.
#
# ```
#  request A: table [7, 2, 9]     pool: ┌──┬──┬──┬──┬──┬──┬──┬──┬──┬──┐
#  request B: table [4, 0]              │B │  │A │  │B │  │  │A │  │A │   (blocks 0 … 9)
#                                       └──┴──┴──┴──┴──┴──┴──┴──┴──┴──┘
# ```
#
# The `BlockManager` is the pure-Python bookkeeping behind it (under `PagedAllocator`, below: stage
# 06's `KVAllocator` for blocks). Every block is in exactly one state:
#
# * **used** — its **reference count** is ≥ 1: that many block tables hold it. Section 4 lets two
#   requests share one block, so a count, not a flag;
# * **cached** — count 0, but it still holds a full block of keys and values that a later request
#   with the same prefix may reuse (section 4);
# * **free** — count 0 and nothing worth keeping.
#
# Cached and free blocks wait together in one **free queue**, least recently released first. A
# request that needs a block takes the head; if that block was cached, its contents are forgotten
# (evicted) — the coldest cache entry goes first.
#
# ### Exercise 7.2 — grow and shrink a block table
#
# One method does all three moves of a table: `resize(table, num_tokens)` makes `table` hold
# exactly the blocks that `num_tokens` tokens need, changing the list **in place** (the caller
# keeps it). Allocating a request is a resize from an empty table, appending a token that starts a
# new block is a resize by one, and freeing a request is a resize to 0 tokens.
#
# New blocks come from the head of the free queue (`take_block`); blocks leave from the **end** of
# the table; the reference counts must say, at every moment, how many tables hold each block; and
# a block goes back to the queue (`release_block`) only when no table holds it any more.

# %%
# export: engine.block_manager
"""KV memory as fixed-size blocks: a free queue, reference counts, one block table per request."""

from __future__ import annotations

import math
from collections import OrderedDict


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that ``num_tokens`` tokens occupy: the last one may be partly filled."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Hands out blocks of ``block_size`` tokens' keys and values; the scheduler's ``KVAllocator``
    in stage 07.

    A block is *used* (reference count ≥ 1), *cached* (count 0, a full block a later prompt may
    reuse) or *free*. Cached and free blocks wait in one queue, least recently released first, so
    taking its head evicts the coldest cached block. While anything runs, admission keeps
    ``watermark`` of the blocks free, so that running requests can grow a while before anyone must
    be preempted.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, prefix_caching: bool = False,
                 watermark: float = 0.01):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks!r}: the pool needs at least one block. Fix: a larger "
                             "KV memory budget, or a smaller block_size")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} must be a positive number of tokens (16 is usual)")
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark={watermark!r} is a fraction of the blocks, in [0, 1)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.watermark_blocks = math.ceil(watermark * num_blocks)
        self.ref_counts = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.tables: dict[str, list[int]] = {}
        # The prefix cache (section 4): full blocks by the hash of their tokens and every token before.
        self.block_of_hash: dict[int, int] = {}
        self.key_of_block: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # (parent hash, tokens)
        self.hash_of_block: dict[int, int] = {}
        self.hashed: dict[str, tuple[int, int | None]] = {}  # request → (blocks registered, last hash)
        self.cached_tokens: dict[str, int] = {}  # request → prompt tokens found in the cache
        # Tokens that prefix-cache hits saved from prefill over the pool's life: shared prompts, and
        # also a resumed request finding its own blocks again.
        self.hit_tokens = 0

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def take_block(self) -> int:
        """The head of the free queue (the least recently released block), forgetting what it cached."""
        if not self.free_queue:
            raise RuntimeError(f"KV pool exhausted: all {self.num_blocks} blocks are in use. The scheduler "
                               "checks can_allocate / can_grow first; a caller that did not must. Fix: a "
                               "larger KV memory budget, or fewer requests at once (max_seqs)")
        block, _ = self.free_queue.popitem(last=False)
        self.forget(block)
        return block

    def release_block(self, block: int) -> None:
        """Back to the tail of the free queue; a full block stays findable in the prefix cache."""
        if self.ref_counts[block] != 0 or block in self.free_queue:
            raise RuntimeError(f"block {block} released with reference count {self.ref_counts[block]}"
                               f"{' while already free' if block in self.free_queue else ''}: freed twice")
        self.free_queue[block] = None

    def forget(self, block: int) -> None:
        key = self.hash_of_block.pop(block, None)
        if key is not None:
            del self.block_of_hash[key]
            del self.key_of_block[block]

    def resize(self, table: list[int], num_tokens: int) -> None:
        """Make ``table`` hold exactly the blocks for ``num_tokens`` tokens: allocate, append, free."""
        # BEGIN EXERCISE 7.2: grow the table with fresh blocks (count 1) or shrink it from its end, releasing each block whose count drops to 0
        # Hint 1: A block's reference count is the number of tables holding it. A table that grows takes blocks nobody holds; a table that shrinks lets go of its last blocks, and a block is free again only when no table holds it any more.
        # Hint 2: need = ceil(num_tokens / block_size) (self.blocks_for). While the table is shorter: take_block(), count 1, append. While it is longer: pop the last block, subtract one from its count, release_block() it if the count is now 0.
        need = self.blocks_for(num_tokens)
        while len(table) < need:
            block = self.take_block()
            self.ref_counts[block] = 1
            table.append(block)
        while len(table) > need:
            block = table.pop()
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.release_block(block)
        # END EXERCISE 7.2


# %%
# Check exercise 7.2
checks.stage07.check_resize(BlockManager)

# %% [markdown]
# `PagedAllocator` puts the scheduler's `KVAllocator` protocol around `resize`, plus `can_grow` /
# `grow`, which stage 06's slots never needed: a slot held its request's whole length from the
# start, a block table grows one block at a time. A request that could never fit, even alone in an
# empty pool, is refused when it is added, with the numbers. While anything runs, admission also
# keeps a small **watermark** of blocks free (section 5 says why), and it counts a prefix-cache hit
# that sits in the free queue as taken: the request will hold that block, so it cannot also be one
# of its fresh blocks. Skip `cache_hits` and `commit` for now: they are the prefix cache of section 4.

# %%
# export: engine.block_manager
class PagedAllocator(BlockManager):
    """The ``KVAllocator`` protocol over a ``BlockManager``: a request's handle is its block table."""

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """Refuse, with the numbers, a request that even the whole pool could not hold."""
        total = prompt_len + max_new_tokens
        if self.blocks_for(total) > self.num_blocks:
            raise PromptError(
                f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} = {total} tokens need "
                f"{self.blocks_for(total)} KV blocks of {self.block_size}, but the whole pool has "
                f"{self.num_blocks}. Fix: a larger KV memory budget (kv_bytes), a shorter prompt, or a "
                "lower max_new_tokens")

    def cache_hits(self, tokens: list[int]) -> list[int]:
        """The cached blocks that hold ``tokens``' leading full blocks, each verified token by token.
        The block holding the last token is always left to compute: that token's output is the next
        token's logits, and writing it into a shared block would change the block for its other
        holders (reusing all but that one token would need copy-on-write)."""
        hits: list[int] = []
        if not self.prefix_caching:
            return hits
        parent, size = None, self.block_size
        for i, key in enumerate(block_hashes(tokens[:-1], size)):
            block = self.block_of_hash.get(key)
            if block is None or self.key_of_block[block] != (parent, tuple(tokens[i * size:(i + 1) * size])):
                break  # a miss, or a hash collision caught by the tokens
            hits.append(block)
            parent = key
        return hits

    def commit(self, request: Request) -> None:
        """Enter the request's newly computed full blocks into the prefix cache (after a step, and
        before its blocks are freed): from then on, a prompt that starts the same way reuses them."""
        if not self.prefix_caching:
            return
        done, parent = self.hashed[request.id]
        full, size = request.num_computed // self.block_size, self.block_size
        if full <= done:
            return
        tokens, table = request.token_ids(done * size, full * size), self.tables[request.id]
        for i, key in enumerate(block_hashes(tokens, size, parent)):
            block = table[done + i]
            if key not in self.block_of_hash and block not in self.hash_of_block:  # first come, kept
                self.block_of_hash[key] = block
                self.hash_of_block[block] = key
                self.key_of_block[block] = (parent, tuple(tokens[i * size:(i + 1) * size]))
            parent = key
        self.hashed[request.id] = (full, parent)

    def can_allocate(self, request: Request) -> bool:
        hits = self.cache_hits(request.token_ids(0, request.num_tokens))
        idle_hits = sum(1 for b in hits if self.ref_counts[b] == 0)  # in the free queue: not for others
        need = self.blocks_for(request.num_tokens) - len(hits)
        reserve = self.watermark_blocks if self.tables else 0  # an idle pool takes anything that fits
        return need + reserve <= len(self.free_queue) - idle_hits

    def allocate(self, request: Request) -> list[int]:
        if request.id in self.tables:
            raise ValueError(f"request {request.id!r} already holds blocks {self.tables[request.id]}")
        hits = self.cache_hits(request.token_ids(0, request.num_tokens))
        for block in hits:  # shared: one more table holds it
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1
        table = list(hits)
        self.resize(table, request.num_tokens)
        self.tables[request.id] = table
        self.cached_tokens[request.id] = len(hits) * self.block_size
        self.hit_tokens += len(hits) * self.block_size
        self.hashed[request.id] = (len(hits), self.hash_of_block[hits[-1]] if hits else None)
        return table

    def handle(self, request_id: str) -> list[int]:
        return self.tables[request_id]

    def num_cached(self, request_id: str) -> int:
        """Tokens of the request found in the prefix cache at admission: already computed."""
        return self.cached_tokens[request_id]

    def can_grow(self, request_id: str, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(self.tables[request_id]) <= len(self.free_queue)

    def grow(self, request_id: str, num_tokens: int) -> None:
        table = self.tables[request_id]
        if self.blocks_for(num_tokens) > len(table):
            self.resize(table, num_tokens)

    def free(self, request_id: str) -> None:
        self.resize(self.tables.pop(request_id), 0)
        del self.cached_tokens[request_id], self.hashed[request_id]

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def cached(self) -> int:
        """Blocks in the free queue that still hold a prefix worth reusing."""
        return sum(1 for block in self.hash_of_block if self.ref_counts[block] == 0)

    @property
    def free_blocks(self) -> int:
        return len(self.free_queue) - self.cached

# %% [markdown]
# A small pool at work: 6 blocks of 4 tokens, two requests. Watch the tables grow one block at a
# time, and the free queue take freed blocks at its tail, the table's last block first.

# %%
def toy_request(request_id: str, num_tokens: int) -> SimpleNamespace:
    """Just what the allocator reads of a request."""
    return SimpleNamespace(id=request_id, num_tokens=num_tokens, token_ids=lambda start, end: list(range(start, end)))


toy = PagedAllocator(6, block_size=4)


def show(event: str) -> None:
    tables = ", ".join(f"{rid}: {table}" for rid, table in toy.tables.items())
    print(f"{event:<28} tables {{{tables}}}  free queue {list(toy.free_queue)}  used {toy.used}")


toy.allocate(toy_request("A", 6))
show("A admitted with 6 tokens")
toy.allocate(toy_request("B", 3))
show("B admitted with 3 tokens")
toy.grow("A", 9)
show("A grows to 9 tokens")
toy.free("A")
show("A finishes")
toy.grow("B", 5)
show("B grows to 5 tokens")

# %% [markdown]
# ## 3. The paged cache, the slot mapping and attention over pages
#
# The pool's tensors are sized from a **memory budget in bytes**, not from a batch and a length:
# one block holds `block_size` tokens × layers × 2 (keys and values) × kv heads × head dim numbers.
# Each layer's keys are one tensor `(num_blocks, block_size, kv_heads, head_dim)`, so that block
# `b`, offset `o` is row `b · block_size + o` of the same memory seen as `(num_blocks ·
# block_size, kv_heads, head_dim)`: one flat **slot** number per token. (Not stage 06's slot, which
# was one request's whole row: from here on a slot is one token's place in the pool, and the list
# of a step's slots is its **slot mapping**.)

# %%
# export: engine.paged_cache
"""KV memory of stage 07: one pool of blocks per layer, sized from a budget in bytes."""

from __future__ import annotations

import torch


def block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block: keys and values of ``block_size`` tokens in every layer."""
    return kv_cache_bytes(config, block_size, 1, dtype)


def slot_pool_bytes(config: ModelConfig, slots: int, max_len: int, block_size: int, dtype: torch.dtype) -> int:
    """The memory of ``slots`` stage-06 slots of ``max_len`` tokens, rounded up to whole blocks: a
    paged pool as large as a slot cache, in which any request that fitted a slot fits."""
    return slots * blocks_for(max_len, block_size) * block_bytes(config, block_size, dtype)


def blocks_for_budget(config: ModelConfig, kv_bytes: int, block_size: int, dtype: torch.dtype) -> int:
    """How many whole blocks ``kv_bytes`` of memory hold."""
    blocks = kv_bytes // block_bytes(config, block_size, dtype)
    if blocks < 1:
        raise ValueError(f"kv_bytes={kv_bytes} holds no block: one block of {block_size} tokens takes "
                         f"{block_bytes(config, block_size, dtype)} bytes in {dtype}. Fix: a larger budget")
    return blocks


class PagedKVCache:
    """Keys and values of every layer: (layers, num_blocks, block_size, kv_heads, head_dim) each."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


# %% [markdown]
# ### Exercise 7.3 — the slot mapping of a chunk
#
# A step runs chunks (stage 06): tokens `start … start + length − 1` of a request whose block table
# is the chunk's `kv` handle. Return the flat slot of each of those tokens, where the model will
# write its keys and values.

# %%
# export: engine.paged_batch
"""One step's chunks packed into one sequence, for a paged cache: slots, block tables, lengths."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def chunk_slots(chunk: ScheduledChunk, block_size: int) -> list[int]:
    """The flat cache slot (block · block_size + offset) of each token a chunk runs."""
    # BEGIN EXERCISE 7.3: the slot of each position start … start + length − 1, through the chunk's block table (chunk.kv)
    # Hint 1: A position falls in one block_size-token stretch of the request: the table entry for that stretch names the pool block, and what is left over is the place inside it. In the flat view, consecutive blocks are block_size rows apart.
    # Hint 2: For each position from chunk.start on (chunk.length of them): table entry = integer division by block_size, offset = the remainder; slot = that block's first row (block times block_size) plus the offset.
    return [chunk.kv[p // block_size] * block_size + p % block_size
            for p in range(chunk.start, chunk.start + chunk.length)]
    # END EXERCISE 7.3


# %%
# Check exercise 7.3
checks.stage07.check_chunk_slots(chunk_slots)

# %% [markdown]
# Packing a step is stage 06's packing with slots in place of cache rows. One-token chunks (the
# decodes) are attended together: each brings its block table and its length, and attention
# reads their keys through the tables. Longer chunks (prefills) gather their own blocks and use
# stage 06's causal mask.

# %%
# export: engine.paged_batch
@dataclass(kw_only=True, eq=False)
class PagedBatch(PackedStep):
    """A packed step over a paged cache (N tokens, K of them sampled): blocks, not rows."""

    slots: torch.Tensor  # (N,) where each token's keys and values are written
    decode_rows: torch.Tensor  # (n,) packed indices of one-token chunks
    decode_tables: torch.Tensor  # (n, max_blocks) their block tables, padded with block 0
    decode_lens: torch.Tensor  # (n,) their lengths, the new token included
    # For gathering (once per step, not per layer): the slot of each column of each decode row
    # (n, T), T the longest row, and the (n, 1, 1, T) mask of the columns each row may see.
    decode_slots: torch.Tensor | None
    decode_mask: torch.Tensor | None
    chunks: list[tuple[int, int, int]]  # (offset, length, end) of each chunk of more than one token
    # All those chunks in one attention call, padded to a batch (None without chunks): the packed
    # index of each chunk's tokens (C, L), L the longest chunk; the slot of each column (C, T), T
    # the furthest end; the (C, 1, L, T) mask of what each sees; and, to put the R real rows of the
    # flattened (C·L) result back, their positions in it and their packed indices (R,) each.
    chunk_rows: torch.Tensor | None
    chunk_slots: torch.Tensor | None
    chunk_mask: torch.Tensor | None
    chunk_picked: torch.Tensor | None
    chunk_targets: torch.Tensor | None
    decode: str  # "paged" (read blocks through the tables) or "gather" (copy them out first)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
               kernel: AttentionFn) -> torch.Tensor:
        return block_attention(q, k, v, self.cache, layer, self, self.kernel)


def column_slots(tables: list[list[int]], width: int, block_size: int, device: torch.device | str) -> torch.Tensor:
    """The flat cache slot of each of ``width`` columns of each sequence (n, width), from block
    tables padded with block 0: columns past a sequence's own land in block 0, to be masked."""
    blocks = blocks_for(width, block_size)
    padded = torch.tensor([table[:blocks] + [0] * (blocks - len(table[:blocks])) for table in tables],
                          dtype=torch.long, device=device).view(len(tables), blocks)
    columns = torch.arange(width, device=device)
    return padded[:, columns // block_size] * block_size + columns % block_size


def chunk_batch(chunks: list[tuple[int, int, int]], tables: list[list[int]], block_size: int,
                device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """``PagedBatch``'s padded view of the prompt chunks, (offset, length, end) each, for one
    attention call: rows, slots, mask, picked and targets. A chunk's query j is position
    end - length + j and sees the columns up to itself (causal); a padding query sees column 0
    alone, so that its softmax has something to normalise (its output is thrown away).

    The price of one call: every chunk is padded to the longest chunk and the furthest end, so
    the work is C·L·T instead of the sum of each chunk's own — small when the chunks are alike
    (a step of new prompts), up to C times the work when one chunk continues a long prompt
    beside short new ones. The engine's token budget bounds L; nothing bounds T."""
    longest, furthest = max(c[1] for c in chunks), max(c[2] for c in chunks)
    offsets, lengths, ends = (torch.tensor(values, device=device) for values in zip(*chunks))
    j = torch.arange(longest, device=device)
    real = j[None, :] < lengths[:, None]  # (C, L)
    rows = torch.where(real, offsets[:, None] + j[None, :], 0)
    position = ends[:, None] - lengths[:, None] + j[None, :]  # (C, L)
    columns = torch.arange(furthest, device=device)
    mask = columns[None, None, :] <= position[:, :, None]  # (C, L, T)
    mask = torch.where(real[:, :, None], mask, columns[None, None, :] == 0)
    picked = real.flatten().nonzero().flatten()
    return rows, column_slots(tables, furthest, block_size, device), mask[:, None], picked, rows.flatten()[picked]


def prepare_paged_batch(schedule: Schedule, cache: PagedKVCache, decode: str, device: torch.device | str,
                        kernel: AttentionFn) -> PagedBatch:
    """Pack a schedule's chunks (paged handles: ``chunk.kv`` is a block table)."""
    ids, positions, slots, offsets, chunks, chunk_tables = [], [], [], {}, [], []
    decode_rows, decode_tables, decode_lens = [], [], []
    block_size = cache.block_size
    for chunk in schedule.chunks:
        offset = offsets[id(chunk)] = len(ids)
        chunk_ids, chunk_positions = chunk_inputs(chunk)
        ids += chunk_ids
        positions += chunk_positions
        slots += chunk_slots(chunk, block_size)
        end = chunk.start + chunk.length
        blocks = blocks_for(end, block_size)
        if len(chunk.kv) < blocks:
            raise RuntimeError(f"request {chunk.request.id!r} runs tokens up to {end} but its block table "
                               f"holds {len(chunk.kv)} blocks of {block_size}: every running request must be "
                               "grown before its chunk is scheduled (make_room, exercise 7.5)")
        table = chunk.kv[:blocks]  # the blocks up to the chunk's last token
        if chunk.length == 1:
            decode_rows.append(offset)
            decode_tables.append(table)
            decode_lens.append(end)
        else:
            chunks.append((offset, chunk.length, end))
            chunk_tables.append(table)
    sample_rows = [offsets[id(c)] + c.length - 1 for c in schedule.chunks if c.samples]
    width = max(map(len, decode_tables), default=0)
    padded = [table + [0] * (width - len(table)) for table in decode_tables]

    def tensor(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    tables, lens = tensor(padded).view(len(padded), width), tensor(decode_lens)
    decode_slots = decode_mask = None
    if decode == "gather" and decode_lens:
        columns = torch.arange(max(decode_lens), device=device)
        decode_slots = column_slots(decode_tables, len(columns), block_size, device)
        decode_mask = (columns[None, :] < lens[:, None])[:, None, None, :]
    chunk_rows, chunk_slots_, chunk_mask, chunk_picked, chunk_targets = (
        chunk_batch(chunks, chunk_tables, block_size, device) if chunks else (None,) * 5)
    return PagedBatch(cache=cache, logits_at=tensor(sample_rows), input_ids=tensor(ids)[None],
                      positions=tensor(positions)[None], kernel=kernel, slots=tensor(slots),
                      decode_rows=tensor(decode_rows), decode_tables=tables, decode_lens=lens,
                      decode_slots=decode_slots, decode_mask=decode_mask, chunks=chunks, chunk_rows=chunk_rows,
                      chunk_slots=chunk_slots_, chunk_mask=chunk_mask, chunk_picked=chunk_picked,
                      chunk_targets=chunk_targets, decode=decode)


# %% [markdown]
# The attention of a paged step (`PagedBatch.attend`) stores every new token's keys and values at its slot,
# then attends. For the decodes there are two ways to read a sequence's blocks:
#
# * **gather** (the reference, `gather_decode_attention`): copy each sequence's blocks out into one
#   dense `(kv_heads, T, D)` tensor, then attend as ever — in the engine, with the same attention
#   kernel as before (PyTorch's, or yours from stage 02);
# * **paged**: read the blocks in place, one block column of the whole batch at a time, with
#   stage 05's online softmax — no sequence is ever copied whole (`paged_decode_attention_torch`).
#   On a GPU this is the Triton kernel `paged_decode_attention_triton`: one program per sequence
#   and kv head walks its block table, stage 05's inner loop running over blocks instead of over
#   one contiguous tensor.
#
# All three are checked against the gather reference right below; the engine reads in place on a
# GPU and gathers on a CPU (section 7 measures why).

# %%
# export: engine.paged_attention
"""Decode attention over a paged KV cache: a gather reference, a block-by-block PyTorch version
and a Triton kernel, all reading one layer's pool through each sequence's block table.

The pool of one layer is ``keys, values: (num_blocks, block_size, Hkv, D)``: block ``b``, offset
``o`` holds the token at flat slot ``b * block_size + o``. Sequence ``i`` owns the blocks
``block_tables[i, :ceil(seq_lens[i] / block_size)]`` in token order (the rest of the row is
padding, usually 0), and its decode query is the token at position ``seq_lens[i] - 1``, already
written into the cache. Everything past ``seq_lens[i]`` (the tail of the last block, the padded
table entries) is someone else's memory or garbage, so every version masks it.
"""

from __future__ import annotations

import torch

# Stage 05's module, imported above, picked the Triton interpreter when there is no GPU (it must
# be chosen before triton is imported); HAS_TRITON, interpreted and online_softmax_update are its.
if HAS_TRITON:
    import triton
    import triton.language as tl


def gather_kv(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's keys (or values) as a dense (Hkv, length, D) tensor, copied out of the pool.

    This is the reference every paged version is checked against: simple, but it copies the
    whole context for every layer and every step, which is the cost paging attention avoids.
    """
    blocks = cache[table]  # (max_blocks, block_size, Hkv, D): the sequence's blocks, in order
    return blocks.flatten(0, 1)[:length].transpose(0, 1)


def _check_inputs(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Raise on shapes that do not describe one decode step over one layer's pool."""
    if q.dim() != 3 or keys.dim() != 4 or keys.shape != values.shape:
        raise ValueError(f"q must be (B, Hq, D) and keys, values (num_blocks, block_size, Hkv, D) "
                         f"of one shape; got q {tuple(q.shape)}, keys {tuple(keys.shape)}, "
                         f"values {tuple(values.shape)}")
    batch, heads, head_dim = q.shape
    kv_heads = keys.shape[2]
    if keys.shape[3] != head_dim or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit the pool {tuple(keys.shape)}: head_dim "
                         "must match and Hq be a multiple of Hkv")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(f"block_tables must be (B, max_blocks) and seq_lens (B,) for B={batch}; "
                         f"got {tuple(block_tables.shape)} and {tuple(seq_lens.shape)}")
    if block_tables.dtype != torch.long or seq_lens.dtype != torch.long:
        raise TypeError(f"block_tables and seq_lens must be torch.long (they index the pool), got "
                        f"{block_tables.dtype} and {seq_lens.dtype}")


def _longest(seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> int:
    """The longest sequence, after checking every length fits its table (one host sync)."""
    shortest, longest = int(seq_lens.min()), int(seq_lens.max())
    capacity = block_tables.shape[1] * block_size
    if shortest < 1 or longest > capacity:
        raise ValueError(f"seq_lens must be in [1, {capacity}] (max_blocks · block_size): a decode "
                         f"query is itself in the cache; got lengths from {shortest} to {longest}")
    return longest


def gather_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """The reference: gather each sequence's K and V, then plain softmax attention in fp32.

    q (B, Hq, D) -> (B, Hq, D) in q's dtype. Query head h reads K/V head h // G (G = Hq / Hkv).
    """
    _check_inputs(q, keys, values, block_tables, seq_lens)
    _longest(seq_lens, block_tables, keys.shape[1])
    groups = q.shape[1] // keys.shape[2]
    out = torch.empty_like(q)
    for i, length in enumerate(seq_lens.tolist()):
        k = gather_kv(keys, block_tables[i], length).float().repeat_interleave(groups, dim=0)
        v = gather_kv(values, block_tables[i], length).float().repeat_interleave(groups, dim=0)
        scores = (k @ q[i].float()[:, :, None])[..., 0] * scale  # (Hq, length)
        out[i] = (scores.softmax(dim=-1)[:, None, :] @ v)[:, 0].to(q.dtype)
    return out


def paged_decode_attention_torch(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                 block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                 scale: float) -> torch.Tensor:
    """Decode attention read block by block through the tables, the whole batch at once.

    Block column j of every table is read together (one gather of B blocks), masked past each
    sequence's length, and folded into a running softmax (stage 05's ``online_softmax_update``),
    so no sequence is ever copied out whole. Math in fp32; the result has q's dtype.
    """
    _check_inputs(q, keys, values, block_tables, seq_lens)
    batch, heads, head_dim = q.shape
    block_size, kv_heads = keys.shape[1], keys.shape[2]
    longest = _longest(seq_lens, block_tables, block_size)
    # (B, Hkv, G, D): a query group shares its K/V head, so each block is read once per group.
    q_groups = q.float().view(batch, kv_heads, heads // kv_heads, head_dim) * scale
    m = torch.full(q_groups.shape[:-1], float("-inf"), device=q.device)
    l = torch.zeros_like(m)
    acc = torch.zeros_like(q_groups)
    offsets = torch.arange(block_size, device=q.device)
    for j in range(blocks_for(longest, block_size)):
        blocks = block_tables[:, j]  # (B,): padded entries point at some block; the mask hides it
        valid = (j * block_size + offsets)[None, :] < seq_lens[:, None]  # (B, block_size)
        k = keys[blocks].float().permute(0, 2, 3, 1)  # (B, Hkv, D, block_size)
        # Zero the values we may not read: a masked score gives p = 0, but 0 · NaN is still NaN.
        v = values[blocks].float().masked_fill(~valid[:, :, None, None], 0.0).transpose(1, 2)
        scores = (q_groups @ k).masked_fill(~valid[:, None, None, :], float("-inf"))
        m, l, acc = online_softmax_update(m, l, acc, scores, v)
    return (acc / l[..., None]).view(batch, heads, head_dim).to(q.dtype)


if HAS_TRITON:

    @triton.jit
    def _paged_decode_kernel(
        Q, K, V, O, TABLES, LENS,
        stride_qb, stride_qh, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
        stride_ob, stride_oh, stride_tb, groups, scale,
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_PAD: tl.constexpr,
    ):
        """One sequence's query group (the G query heads of one K/V head) over its blocks.

        One program per (sequence, K/V head) rather than per query head: decode is memory-bound,
        and this way each K/V block is loaded once for the whole group instead of G times.

        The products are elementwise broadcasts reduced with tl.sum, not tl.dot: tl.dot needs
        every dimension ≥ 16 when compiled, and a group has G (3 in the model) rows. Padding the
        group to 16 rows would run but waste 13/16 of the work; at decode the cost is reading
        the cache, and a (GROUP_PAD, BLOCK_SIZE, HEAD_DIM) product is small enough for registers.
        The same code runs in the interpreter.
        """
        b, kv_head = tl.program_id(0), tl.program_id(1)
        offs_g = tl.arange(0, GROUP_PAD)  # a power of two ≥ groups; the extra rows are not stored
        offs_o = tl.arange(0, BLOCK_SIZE)
        offs_d = tl.arange(0, HEAD_DIM)
        q_rows = offs_g < groups
        q_heads = kv_head * groups + offs_g  # query head h reads K/V head h // G
        q = tl.load(Q + b * stride_qb + q_heads[:, None] * stride_qh + offs_d[None, :],
                    mask=q_rows[:, None], other=0.0).to(tl.float32) * scale
        seq_len = tl.load(LENS + b)
        m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
        for j in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
            block = tl.load(TABLES + b * stride_tb + j)  # int64: large pools overflow int32 offsets
            inside = j * BLOCK_SIZE + offs_o < seq_len  # the last block's tail is not ours
            k = tl.load(K + block * stride_kb + offs_o[:, None] * stride_ko + kv_head * stride_kh
                        + offs_d[None, :], mask=inside[:, None], other=0.0).to(tl.float32)
            v = tl.load(V + block * stride_vb + offs_o[:, None] * stride_vo + kv_head * stride_vh
                        + offs_d[None, :], mask=inside[:, None], other=0.0).to(tl.float32)
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # (GROUP_PAD, BLOCK_SIZE)
            scores = tl.where(inside[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(O + b * stride_ob + q_heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=q_rows[:, None])


def paged_decode_attention_triton(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                                  block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                  scale: float) -> torch.Tensor:
    """The Triton kernel: q (B, Hq, D) over the paged pool -> (B, Hq, D) in q's dtype.

    Lengths are not checked against the tables here (that would cost a host sync every layer):
    a length past ``max_blocks · block_size`` reads beyond the table row.
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed (it has no macOS build): use "
                           "paged_decode_attention_torch, or paged_decode_attention to choose")
    if interpreted() and q.dtype == torch.bfloat16:
        raise TypeError("bfloat16 is computed wrongly by the Triton interpreter (NumPy has no "
                        "bfloat16): use float16 or float32 on a CPU")
    tensors = (q, keys, values, block_tables, seq_lens)
    if not interpreted() and not all(t.is_cuda for t in tensors):
        raise ValueError(f"compiled Triton reads GPU memory only, and the inputs are on "
                         f"{sorted({str(t.device) for t in tensors})}: move them all to CUDA "
                         "(or use paged_decode_attention_torch)")
    _check_inputs(q, keys, values, block_tables, seq_lens)
    batch, heads, head_dim = q.shape
    block_size, kv_heads = keys.shape[1], keys.shape[2]
    for name, size in (("block_size", block_size), ("head_dim", head_dim)):
        if size & (size - 1):
            raise ValueError(f"{name} must be a power of two (tl.arange needs one), got {size}")
    q, keys, values = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, keys, values))
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    out = torch.empty_like(q)
    groups = heads // kv_heads
    _paged_decode_kernel[(batch, kv_heads)](
        q, keys, values, out, block_tables, seq_lens,
        q.stride(0), q.stride(1), *keys.stride()[:3], *values.stride()[:3],
        out.stride(0), out.stride(1), block_tables.stride(0), groups, scale,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, GROUP_PAD=triton.next_power_of_2(groups),
    )
    return out


def paged_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Decode attention over the paged pool: the compiled Triton kernel for CUDA tensors, else
    the PyTorch version (no Triton, CPU tensors; the interpreter is for tests, far too slow)."""
    kernel_runs = HAS_TRITON and q.is_cuda and not interpreted()
    fn = paged_decode_attention_triton if kernel_runs else paged_decode_attention_torch
    return fn(q, keys, values, block_tables, seq_lens, scale)


# %% [markdown]
# All three readers against the gather reference on a small random pool: shuffled block tables,
# sequences that end inside a block, exactly at a block's end, and after one token; every slot
# that no sequence owns holds NaN, so a reader that looks past a sequence's end shows. Without a
# GPU the Triton kernel runs in its interpreter (small shapes only: it is slow).

# %%
torch.manual_seed(0)
pool_k = torch.full((12, 4, 2, 16), float("nan"))  # 12 blocks of 4 tokens, 2 kv heads, head dim 16
pool_v = torch.full_like(pool_k, float("nan"))
lens = torch.tensor([5, 8, 1])
tables = torch.tensor([[7, 2, 0], [4, 9, 0], [11, 0, 0]])  # padded with block 0, which nobody owns
for row, length in enumerate(lens.tolist()):
    for p in range(length):
        pool_k[tables[row, p // 4], p % 4] = torch.randn(2, 16)
        pool_v[tables[row, p // 4], p % 4] = torch.randn(2, 16)
q_small = torch.randn(3, 4, 16)  # 4 query heads share the 2 kv heads
reference = gather_decode_attention(q_small, pool_k, pool_v, tables, lens, 16 ** -0.5)
readers = {"paged, PyTorch": paged_decode_attention_torch}
if HAS_TRITON:
    readers["paged, Triton" + (" (interpreter)" if interpreted() else "")] = paged_decode_attention_triton
for name, reader in readers.items():
    out = reader(q_small, pool_k, pool_v, tables, lens, 16 ** -0.5)
    print(f"{name}: equal to gather: {torch.allclose(out, reference, atol=1e-5)}")
    assert torch.allclose(out, reference, atol=1e-5)


# %%
# export: engine.block_attention
"""Attention for a packed step over a paged cache: store each token's k, v at its slot, attend."""

from __future__ import annotations

import math

import torch

def gather_rows(pool: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The pool's rows at ``slots`` (n, T), as (n, Hkv, T, D): the decodes' keys or values copied out
    of their blocks (``index_select`` of the flat rows: a few times faster on a CPU than indexing)."""
    n, width = slots.shape
    rows = pool.flatten(0, 1).index_select(0, slots.view(-1))
    return rows.view(n, width, *pool.shape[2:]).transpose(1, 2).to(dtype)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache, layer: int,
                    batch: PagedBatch, attend: AttentionFn) -> torch.Tensor:
    """q (1, Hq, N, D), k and v (1, Hkv, N, D) of the packed tokens -> (1, Hq, N, D): the new keys
    and values stored at their slots, then the decodes over their blocks, and every prompt chunk
    in one call of ``attend``, padded to a batch (``PagedBatch.chunk_mask``): one kernel launch
    however many prompts are being prefilled, instead of one per chunk."""
    keys, values = cache.keys[layer], cache.values[layer]  # (num_blocks, block_size, Hkv, D), views
    keys.flatten(0, 1).index_copy_(0, batch.slots, k[0].transpose(0, 1).to(keys.dtype))  # (N, Hkv, D)
    values.flatten(0, 1).index_copy_(0, batch.slots, v[0].transpose(0, 1).to(values.dtype))
    out = torch.empty_like(q)
    if len(batch.decode_rows):
        q_rows = q[0, :, batch.decode_rows].transpose(0, 1)  # (n, Hq, D)
        if batch.decode == "paged":
            rows = paged_decode_attention(q_rows, keys, values, batch.decode_tables, batch.decode_lens,
                                          1 / math.sqrt(q.shape[-1]))
        else:
            k_rows, v_rows = (gather_rows(pool, batch.decode_slots, q.dtype) for pool in (keys, values))
            rows = attend(q_rows[:, :, None], k_rows, v_rows, mask=batch.decode_mask)[:, :, 0]
        out[0, :, batch.decode_rows] = rows.transpose(0, 1)
    if batch.chunk_rows is not None:
        q_chunks = q[0, :, batch.chunk_rows].transpose(0, 1)  # (C, Hq, L, D)
        k_chunks, v_chunks = (gather_rows(pool, batch.chunk_slots, q.dtype) for pool in (keys, values))
        rows = attend(q_chunks, k_chunks, v_chunks, mask=batch.chunk_mask).transpose(0, 1)  # (Hq, C, L, D)
        out[0, :, batch.chunk_targets] = rows.flatten(1, 2)[:, batch.chunk_picked]
    return out


# %% [markdown]
# The runner is stage 06's `ModelRunner` with this cache, a `PagedAllocator` and `PagedBatch`
# metadata; its `run` is unchanged.

# %%
# export: engine.paged_runner
"""Runs a schedule through the model over a paged cache."""

from __future__ import annotations

import torch


class PagedModelRunner(ModelRunner):
    """The model, its paged cache and block allocator; ``prepare`` then ``run`` make a step's logits.

    ``decode``: how the decodes read their blocks — "paged" (in place), "gather" (copied out, then
    ``attention``), or "auto": paged where the Triton kernel compiles (a GPU), gather on a CPU,
    where the block loop is no faster and gather goes through your attention kernel.
    """

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int = 16,
                 attention: AttentionFn = sdpa_attention, kv_dtype: torch.dtype | None = None,
                 prefix_caching: bool = True, decode: str = "auto"):
        check_kernel(attention)
        if decode not in ("auto", "paged", "gather"):
            raise ValueError(f"decode={decode!r}: pick 'paged', 'gather' or 'auto'")
        self.model = model
        self.config = model.config
        self.attention = attention
        self.device = model.embed_tokens.weight.device
        self.decode = decode if decode != "auto" else ("paged" if torch.device(self.device).type == "cuda" else "gather")
        dtype = kv_dtype or model.embed_tokens.weight.dtype
        self.cache = PagedKVCache(model.config, num_blocks, block_size, dtype=dtype, device=self.device)
        self.allocator = PagedAllocator(num_blocks, block_size, prefix_caching)

    def prepare(self, schedule: Schedule) -> PagedBatch:
        return prepare_paged_batch(schedule, self.cache, self.decode, self.device, self.attention)

# %% [markdown]
# ## 4. Prefix caching: compute a shared prompt once
#
# Chat requests often start with the same long system prompt. Its keys and values are the same
# for every request — they depend only on the tokens *up to* each position. With blocks, a
# request whose prompt starts like an earlier one can simply **point its table at the earlier
# blocks** (their reference counts go up) and start computing where the shared part ends.
#
# To find them, every **full** block gets a key: a hash of its tokens *and of everything before
# it*, chained through its parent's key, `h_i = hash((h_{i−1}, tokens of block i))`. Two blocks
# with equal tokens at different places, or after different prefixes, get different keys. A block
# is entered in the cache once the model has computed it; a partial last block is never entered
# (its contents change as the request grows). A hit is verified token by token before it is used,
# and the block holding a prompt's last token is always computed, even when the cache has it: that
# token's output is the first new token's logits.
# When its last table lets it go, a cached block joins the free queue's tail *still cached*: it
# is evicted only when the queue's head reaches it — least recently used first.
#
# ### Exercise 7.4 — the block hash chain
#
# Return the chained key of each full block of `tokens`, continuing a chain whose last key is
# `parent` (`None` at the start of a prompt). Keys are Python's `hash` of a tuple
# `(parent key, tuple of the block's tokens)`.

# %%
# export: engine.block_manager
def block_hashes(tokens: list[int], block_size: int, parent: int | None = None) -> list[int]:
    """The chained key of each full block of ``tokens``: equal keys mean equal prefixes."""
    # BEGIN EXERCISE 7.4: one key per full block, hash((previous key, the block's tokens as a tuple)), starting from parent
    # Hint 1: A block's keys and values depend on every token before it, so its key must too: chain it through the previous block's key. A block that is not full yet will still change, so it gets no key.
    # Hint 2: Walk the full blocks only (len(tokens) // block_size of them); key = hash((key_so_far, tuple(block))), starting from parent; collect each key.
    keys = []
    for start in range(0, len(tokens) // block_size * block_size, block_size):
        parent = hash((parent, tuple(tokens[start:start + block_size])))
        keys.append(parent)
    return keys
    # END EXERCISE 7.4


# %%
# Check exercise 7.4
checks.stage07.check_block_hashes(block_hashes)

# %% [markdown]
# ## 5. When blocks run out: preemption by recompute
#
# Paging lets the engine admit requests by what they hold *now*, not by the most they might ever
# hold. The flip side: running requests keep growing, and one step the pool may have no block
# left for a request whose last block is full. Something has to give. The engine **preempts** a
# victim: takes all of its blocks back and puts it back in the waiting queue with its progress
# dropped (`num_computed = 0`, the tokens it generated kept). When it is admitted again, its
# prompt and its output so far are recomputed as one long prefill — that is *preemption by
# recompute*; the alternative, swapping its blocks out to host memory, costs bandwidth instead.
# The recompute is often short: `preempt` first enters the victim's full blocks into the prefix
# cache (section 4), so a request resumed soon after finds most of them again.
# Its random stream stays with the sampler, so even a seeded sampled request gives the same tokens
# as if nothing had happened.
#
# The rules, in the order the scheduler applies them each step:
#
# * every running request that needs a block for its next token gets one, **the most urgent
#   first** (effective priority, exercise 6.1);
# * when none is free, the **victim** is the running request with the *lowest* effective
#   priority, and among equals the *latest* arrival (it has waited the least); if the victim is
#   the very request that needed the block, it just stops there;
# * while any preempted request waits, **no new request is admitted**: preempted requests resume
#   first, most urgent first, as soon as their blocks fit.
#
# To make preemption rarer, admission keeps a **watermark** — 1% of the blocks, at least one — free
# while anything runs: running requests can then grow for a while before the pool is empty.
#
# ### Exercise 7.5 — make room
#
# Complete `make_room(scheduler, now)`. For each running request, most urgent first (the loop is
# given):
#
# * skip it if it was preempted earlier in this loop (its `status` is no longer
#   `RequestStatus.RUNNING`);
# * while `scheduler.allocator.can_grow(request.id, request.num_tokens)` is false, choose the
#   victim by the rules above among all of `scheduler.running` (the request itself included),
#   preempt it with `scheduler.preempt(...)` — defined below: it frees the victim's blocks, takes it
#   out of `running`, marks it `PREEMPTED` and queues it — and record it; if the victim was the
#   request itself, stop trying to grow it;
# * once it can grow, grow it: the allocator's `grow`, with the same arguments as `can_grow`.
#
# Return every request you preempted (a request that was its own victim included), in order.

# %%
# export: engine.preemption
"""Stage 06's scheduler over blocks: grow running requests, preempt when memory runs out."""

from __future__ import annotations

from collections.abc import Callable


def most_urgent_first(now: float, aging_rate: float) -> Callable[[Request], tuple[float, int]]:
    """A sort key: the highest effective priority first, then the earliest arrival."""
    return lambda r: (-effective_priority(r, now, aging_rate), r.seq)


def make_room(scheduler: PagedScheduler, now: float) -> list[Request]:
    """Give each running request the blocks for all its tokens; preempt victims when none are left."""
    rate = scheduler.config.aging_rate
    preempted: list[Request] = []
    for request in sorted(scheduler.running, key=most_urgent_first(now, rate)):
        # BEGIN EXERCISE 7.5: grow the request; while it cannot, preempt the running request with the lowest effective priority (then the latest arrival)
        # Hint 1: A request preempted earlier in this loop has nothing to grow. The victim is the running request with the least claim to the memory: lowest effective priority, and among equals the one that arrived last; if that is the request itself, it gives way and stops.
        # Hint 2: Skip the request unless its status is RUNNING. Loop while it cannot grow: the victim is a min over all running requests with a key that puts low effective priority first and breaks ties by reversed arrival order (seq); preempt and record it; leave the loop if it was the request itself. If the request is still running after the loop, grow it.
        if request.status is not RequestStatus.RUNNING:
            continue
        while not scheduler.allocator.can_grow(request.id, request.num_tokens):
            victim = min(scheduler.running, key=lambda r: (effective_priority(r, now, rate), -r.seq))
            scheduler.preempt(victim)
            preempted.append(victim)
            if victim is request:
                break
        else:
            scheduler.allocator.grow(request.id, request.num_tokens)
        # END EXERCISE 7.5
    return preempted


# %%
# Check exercise 7.5
checks.stage07.check_make_room(make_room)

# %% [markdown]
# The scheduler's step wraps stage 06's: first the bookkeeping of the last step (its full blocks
# enter the prefix cache), then `make_room`, then the preempted requests resume while their
# blocks fit, and only then stage 06's `schedule` — which admits nobody new while a preempted
# request still waits (`may_admit`).

# %%
# export: engine.preemption
class PagedScheduler(Scheduler):
    """A ``Scheduler`` whose allocator grows tables block by block (a ``PagedAllocator``): each step
    it enters computed blocks into the prefix cache, makes room for every running request's next
    token (preempting if it must), resumes preempted requests, then schedules as stage 06 does."""

    def __init__(self, config: SchedulerConfig, allocator: PagedAllocator, clock: Callable[[], float]):
        super().__init__(config, allocator, clock)
        # Preempted requests wait in `waiting` like new ones; this list of them (kept in step by
        # preempt, resume and finish) makes may_admit O(1) instead of a scan of `waiting` per step.
        self.preempted: list[Request] = []
        self.num_preemptions = 0

    def may_admit(self) -> bool:
        return not self.preempted and super().may_admit()

    def admit(self, request: Request, now: float) -> object:
        kv = super().admit(request, now)
        request.num_computed = self.allocator.num_cached(request.id)  # prefix hits are computed already
        return kv

    def finish(self, request: Request, reason: str, now: float) -> None:
        if request.status is RequestStatus.RUNNING:
            self.allocator.commit(request)  # its full blocks stay findable after it ends
        elif request.status is RequestStatus.PREEMPTED:
            self.preempted.remove(request)
        super().finish(request, reason, now)

    def preempt(self, request: Request) -> None:
        """Take a running request's blocks back; it waits, and recomputes its tokens when resumed."""
        self.allocator.commit(request)
        self.allocator.free(request.id)
        self.running.remove(request)
        request.num_computed = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.append(request)
        self.preempted.append(request)
        self.num_preemptions += 1

    def resume(self, now: float) -> list[Request]:
        """Preempted requests back to running, most urgent first, while their blocks fit."""
        resumed = []
        for request in sorted(self.preempted, key=most_urgent_first(now, self.config.aging_rate)):
            if len(self.running) >= self.config.max_seqs or not self.allocator.can_allocate(request):
                break  # no overtaking: the next one waits for the same memory
            self.preempted.remove(request)
            self.admit(request, now)
            resumed.append(request)
        return resumed

    def schedule(self) -> Schedule:
        now = self.clock()
        for request in self.running:
            self.allocator.commit(request)
        preempted = make_room(self, now)
        resumed = self.resume(now)
        schedule = super().schedule()
        schedule.admitted[:0] = resumed
        schedule.preempted = preempted
        return schedule


# %% [markdown]
# `paged_engine` builds the whole thing from a model: stage 06's `Engine` over this runner and
# scheduler. By default its pool gets the bytes of stage 06's default engine (16 slots of 1024
# tokens), and it may run more requests than that at once: `max_seqs` here is only an upper bound,
# memory decides.

# %%
# export: engine.paged_engine
"""The engine over a paged KV cache, built from a model: the course's default engine from stage 07."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def paged_engine(model: LlamaModel, tokenizer: Tokenizer, max_seqs: int = 64, token_budget: int = 256,
                 kv_bytes: int | None = None, block_size: int = 16, prefix_caching: bool = True,
                 aging_rate: float = 1.0, attention: AttentionFn = sdpa_attention, kv_dtype: torch.dtype | None = None,
                 decode: str = "auto", clock: Callable[[], float] = time.perf_counter,
                 stats_capacity: int = 10_000) -> Engine:
    """Continuous batching over blocks. ``kv_bytes``: the pool's memory (default: what 16 slots of
    1024 tokens take, stage 06's default engine); ``max_seqs``: the most requests running at once;
    ``stats_capacity``: how many of the latest steps' ``StepStats`` the engine keeps."""
    dtype = kv_dtype or model.embed_tokens.weight.dtype
    kv_bytes = slot_pool_bytes(model.config, 16, 1024, block_size, dtype) if kv_bytes is None else kv_bytes
    num_blocks = blocks_for_budget(model.config, kv_bytes, block_size, dtype)
    runner = PagedModelRunner(model, num_blocks, block_size, attention, dtype, prefix_caching, decode)
    config = SchedulerConfig(max_seqs, token_budget, aging_rate)
    return Engine(runner, tokenizer, stop_token_ids(model.config, tokenizer), config, clock, PagedScheduler,
                  stats_capacity)

# %% [markdown]
# ## 6. The paged engine against the slot cache and stage 04
#
# Paging changes where keys and values live, not what they are: every request's greedy tokens
# must equal stage 06's slot engine's and stage 04's loop's. The pool below is small on purpose
# (a budget of 10 blocks) so that the four requests do not all fit and the engine must preempt.

# %%
prompts = ["The capital of France is", "def fibonacci(n):",
           "A haiku about the sea:\n", "List three uses of a paperclip. First,"]
prompt_ids = [tokenizer.encode(p) for p in prompts]
greedy = SamplingParams(max_new_tokens=40)
slot_results = Engine.from_model(model, tokenizer, max_seqs=4, token_budget=64, max_len=128).generate(prompt_ids, greedy)
BLOCK = 16
small_pool = 10 * block_bytes(model.config, BLOCK, torch.float32)
paged = paged_engine(model, tokenizer, max_seqs=4, token_budget=64, kv_bytes=small_pool, block_size=BLOCK)
paged_results = paged.generate(prompt_ids, greedy)
oracle = [generate_cached(model, tokenizer, [ids], greedy)[0] for ids in prompt_ids]
for ids, got, slot, want in zip(prompt_ids, paged_results, slot_results, oracle):
    print(f"{len(ids):>2} prompt tokens -> {len(got.token_ids)} tokens, same as the slot engine: "
          f"{got.token_ids == slot.token_ids}, as stage 04: {got.token_ids == want.token_ids}")
print(f"pool: {paged.runner.allocator.num_blocks} blocks of {BLOCK} tokens; preemptions: "
      f"{paged.scheduler.num_preemptions}; blocks in use at the end: {paged.runner.allocator.used}")
assert all(g.token_ids == s.token_ids == w.token_ids for g, s, w in zip(paged_results, slot_results, oracle))
assert paged.scheduler.num_preemptions > 0 and paged.runner.allocator.used == 0

# %% [markdown]
# The steps where something happened: admissions (`+`), preemptions (`!`) and retirements (`-`).
# A preempted request comes back (`+` again) with a prefill chunk over its prompt *and* the tokens
# it had generated; the chunk starts after whatever of its full blocks the prefix cache still held.
# (Nobody new waits in this small run: section 7's simulation shows admission pausing.)

# %%
for stats in paged.stats:
    if stats.admitted or stats.preempted or stats.finished:
        events = " ".join([f"+{','.join(stats.admitted)}" if stats.admitted else "",
                           f"!{','.join(stats.preempted)}" if stats.preempted else "",
                           f"-{','.join(stats.finished)}" if stats.finished else ""]).strip()
        chunks = " ".join(f"{rid}[{start}:{start + length}]" for rid, start, length in stats.chunks if length > 1)
        print(f"step {stats.step:>3}: {events:<14} prefill chunks {chunks or '-'}  blocks used {stats.kv_used}")

# %% [markdown]
# Sampling with a seed (and `ignore_eos`, so that every request runs its 40 tokens and the tight
# pool must preempt): the preempted request keeps its random stream (the sampler holds it), so its
# text is the same as in a pool large enough that nobody is ever preempted.

# %%
seeded = [SamplingParams(max_new_tokens=40, temperature=0.8, top_p=0.9, seed=s, ignore_eos=True) for s in range(4)]
roomy = paged_engine(model, tokenizer, max_seqs=4, token_budget=64, kv_bytes=4 * small_pool)
tight = paged_engine(model, tokenizer, max_seqs=4, token_budget=64, kv_bytes=small_pool)
same = [a.token_ids == b.token_ids for a, b in zip(roomy.generate(prompt_ids, seeded), tight.generate(prompt_ids, seeded))]
print(f"preemptions: roomy pool {roomy.scheduler.num_preemptions}, tight pool {tight.scheduler.num_preemptions}; "
      f"same sampled tokens: {same}")
assert all(same) and tight.scheduler.num_preemptions > 0 and roomy.scheduler.num_preemptions == 0

# %% [markdown]
# ## 7. What pages buy
#
# ### More requests in the same memory
#
# Stage 06's workload (prompts of 16–256 tokens, outputs of 16–128) through the simulator of
# stage 06, twice with the **same KV bytes**: 16 slots of 384 tokens (the longest request), and
# the same 6,144 tokens as 384 blocks of 16. The simulator keeps the real scheduler and allocator
# and scripts only the model, so the counts below are exact.

# %%
def workload_arrivals(n: int, seed: int, gap: float = 0.0) -> list[Arrival]:
    """Stage 06's mixed workload as scripted arrivals, ``gap`` simulated seconds apart."""
    work = mixed_workload(n, seed, (16, 256), (16, 128), vocab_size=1000)
    return [Arrival(i * gap, len(p), params.max_new_tokens, prompt=tuple(p)) for i, (p, params) in enumerate(work)]


def running_over_time(engine: Engine) -> tuple[list[float], list[int]]:
    return [s.end for s in engine.stats], [s.running for s in engine.stats]


SLOTS, SLOT_LEN = 16, 384
print(f"KV memory: {SLOTS} slots × {SLOT_LEN} tokens = {SLOTS * SLOT_LEN} tokens = "
      f"{SLOTS * SLOT_LEN // BLOCK} blocks of {BLOCK}")
arrivals = workload_arrivals(64, seed=0)
slot_engine = simulate(arrivals, SchedulerConfig(max_seqs=SLOTS, token_budget=256), max_len=SLOT_LEN)
pool = PagedAllocator(SLOTS * SLOT_LEN // BLOCK, BLOCK)
paged_sim = simulate(arrivals, SchedulerConfig(max_seqs=128, token_budget=256), max_len=SLOT_LEN,
                     allocator=pool, scheduler_class=PagedScheduler)
for name, eng in [("slots", slot_engine), ("blocks", paged_sim)]:
    times, running = running_over_time(eng)
    tokens = sum(len(r.output_ids) for r in eng.requests.values())
    print(f"{name:>6}: at most {max(running):>2} running, {sum(running) / len(running):5.1f} on average; "
          f"{tokens} tokens in {times[-1]:.2f} simulated s = {tokens / times[-1]:.0f} tok/s; "
          f"preemptions {getattr(eng.scheduler, 'num_preemptions', 0)}")
ratio = max(running_over_time(paged_sim)[1]) / max(running_over_time(slot_engine)[1])
print(f"concurrent requests, blocks / slots: {ratio:.1f}x")

fig, ax = plt.subplots(figsize=(8, 3.2))
for name, eng in [("16 slots of 384 tokens", slot_engine), ("384 blocks of 16 tokens", paged_sim)]:
    ax.step(*running_over_time(eng), where="post", label=name)
ax.set_xlabel("simulated time (s)")
ax.set_ylabel("requests running")
ax.set_title("Same KV memory, 64 requests arriving at once")
ax.legend()
plt.show()

# %% [markdown]
# The blocks finish sooner even with their preemptions, whose recompute the simulated time
# includes. The simulator's cost model charges a little per decode row, so more requests per step
# is more tokens per second here; on the real model the same is measured by the throughput benchmark,
# which runs the slot engine and the paged engine side by side:
# `make bench-throughput` (`.venv/bin/python benchmarks/throughput.py`).
#
# ### Prefix caching
#
# 32 requests that share a 200-token system prompt, each with its own question of 8–24 tokens,
# arriving at once, through the simulator with and without prefix caching. Only whole blocks are
# shared (192 of the 200 tokens in blocks of 16: the 13th block also holds each request's own
# question), and only the first two requests compute the shared part: the second is admitted in the
# same step as the first, before the first one's blocks are computed.

# %%
def shared_prefix_arrivals(n: int = 32, shared: int = 200, seed: int = 1) -> list[Arrival]:
    rng = random.Random(seed)
    system = [rng.randrange(1, 1000) for _ in range(shared)]
    arrivals = []
    for _ in range(n):
        prompt = system + [rng.randrange(1, 1000) for _ in range(rng.randint(8, 24))]
        arrivals.append(Arrival(0.0, len(prompt), 16, prompt=tuple(prompt)))
    return arrivals


def prefill_run(arrivals: list[Arrival], prefix_caching: bool) -> Engine:
    allocator = PagedAllocator(1024, BLOCK, prefix_caching=prefix_caching)
    return simulate(arrivals, SchedulerConfig(max_seqs=64, token_budget=256), allocator=allocator,
                    scheduler_class=PagedScheduler)


shared_work = shared_prefix_arrivals()
runs = {caching: prefill_run(shared_work, caching) for caching in (False, True)}
prefill = {caching: sum(s.prefill_tokens for s in eng.stats) for caching, eng in runs.items()}
ttft = {caching: sorted(r.ttft for r in eng.requests.values()) for caching, eng in runs.items()}
same_tokens = all(runs[False].requests[i].output_ids == runs[True].requests[i].output_ids for i in runs[True].requests)
saved = runs[True].runner.allocator.hit_tokens
print(f"prefill tokens computed: {prefill[False]} without, {prefill[True]} with prefix caching "
      f"(-{1 - prefill[True] / prefill[False]:.0%}); tokens saved by hits: {saved} = "
      f"{saved // (200 // BLOCK * BLOCK)} requests × {200 // BLOCK * BLOCK} shared tokens")
print(f"median TTFT (simulated): {ttft[False][16] * 1000:.0f} ms without, {ttft[True][16] * 1000:.0f} ms with; "
      f"same outputs: {same_tokens}")

# %% [markdown]
# The same on the real model, smaller: six questions after one system prompt. The outputs must
# not change — a hit reuses keys and values that were computed from exactly the same tokens.

# %%
system = ("You are a concise assistant for a hardware store. Answer in one sentence, name the aisle "
          "when you can, and never recommend a product the store does not sell. The store sells tools, "
          "paint, garden supplies, plumbing and electrical parts, and it is open every day from 8 to 20.")
questions = ["Where is the paint?", "Do you sell hammers?", "When do you open?", "Can I buy a lawn mower?",
             "Where are the pipes?", "Do you have light bulbs?"]
chat_ids = [tokenizer.encode(f"{system}\nQuestion: {q}\nAnswer:") for q in questions]
short = SamplingParams(max_new_tokens=12)
real = {}
for caching in (False, True):
    engine = paged_engine(model, tokenizer, token_budget=128, prefix_caching=caching)
    results = engine.generate(chat_ids, short)
    real[caching] = ([r.token_ids for r in results], sum(s.prefill_tokens for s in engine.stats))
shared_len = len(tokenizer.encode(system))
print(f"system prompt: {shared_len} tokens; prefill tokens computed: {real[False][1]} without, {real[True][1]} with "
      f"caching; same tokens: {real[False][0] == real[True][0]}")
assert real[False][0] == real[True][0] and real[True][1] < real[False][1]

# %% [markdown]
# ### Reading blocks in place, or gathering them
#
# The two ways of reading a decode's keys, timed on this machine for 8 sequences at several
# context lengths (fp32): the gather reference, and the block-by-block PyTorch loop. On a CPU the
# loop does not win — each of its steps is a small gather of its own, and a CPU copies memory
# about as fast as it reads it. The paged design pays off on a GPU, where one kernel reads the
# blocks in place instead of writing and re-reading a copy of the whole context per layer per
# step; that is why the engine reads blocks in place on a GPU and gathers on a CPU. (The Triton
# kernel is not timed here: without a GPU it only runs in its interpreter.)

# %%
# NBVAL_IGNORE_OUTPUT
def time_ms(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[len(times) // 2]


cfg = model.config
heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
lengths, timings = [128, 512, 2048], {"gather": [], "paged": []}
for length in lengths:
    blocks = 8 * length // BLOCK
    keys = torch.randn(blocks, BLOCK, kv_heads, dim)
    values = torch.randn_like(keys)
    tables = torch.randperm(blocks).view(8, -1)
    lens = torch.full((8,), length)
    q = torch.randn(8, heads, dim)
    for name, fn in [("gather", gather_decode_attention), ("paged", paged_decode_attention_torch)]:
        timings[name].append(time_ms(lambda: fn(q, keys, values, tables, lens, dim ** -0.5)))
    print(f"context {length:>5}: gather {timings['gather'][-1]:6.2f} ms, paged {timings['paged'][-1]:6.2f} ms")
fig, ax = plt.subplots(figsize=(6, 3))
labels = {"gather": "gather (the reference)", "paged": "paged (the PyTorch block loop)"}
for name, ms in timings.items():
    ax.plot(lengths, ms, marker="o", label=labels[name])
ax.set_xscale("log", base=2)
ax.set_xlabel("context length (tokens)")
ax.set_ylabel("ms per decode step, one layer")
ax.set_title("8 sequences, fp32, this CPU")
ax.legend()
plt.show()

# %% [markdown]
# ## Summary
#
# * A variable-size pool fragments: free memory that no request can use. Fixed-size blocks and
#   a block table per request remove that (the waste is under one block per request).
# * The `PagedAllocator` keeps a reference count per block and one free queue; a table grows by
#   one block when its last block is full.
# * Attention writes each token at its slot and reads keys through the tables — gathered, or in
#   place (the Triton kernel on a GPU).
# * Full blocks are keyed by a chained hash and shared between requests with the same prefix.
# * When memory runs out, the least urgent request is preempted and recomputed later; its output
#   does not change.
#
# Commit the stage with `aie commit 07`: from now on `aie generate` with several prompts runs
# your paged engine.
