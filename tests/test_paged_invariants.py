"""Stage 07's paged KV cache under fuzzing: the block accounting holds after every step.

The issue's invariant: "after 10,000 simulated requests with random lengths, priorities, shared
prefixes and aborts: free + used + cached = total after every step, reference counts equal the
number of tables holding each block, zero leaked blocks at the end". The run uses the real
``Engine``, ``PagedScheduler`` and ``PagedAllocator`` on the simulator's scripted runner, with a
pool far smaller than the load, so that requests are preempted, resumed, share cached prefixes and
are aborted in every state. The scripted runner's tokens depend only on a request's arrival order,
so every request that was not aborted must end with exactly its scripted tokens: preemption and
prefix hits may change when a token is computed, never which.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field

from aie_lessons.engine.block_manager import PagedAllocator
from aie_lessons.engine.engine import Engine
from aie_lessons.engine.preemption import PagedScheduler
from aie_lessons.engine.request import Request, RequestStatus
from aie_lessons.engine.scheduler import SchedulerConfig
from aie_lessons.engine.simulator import Arrival, StepCost, simulate

COST = StepCost()  # the simulator's default: every step takes at least COST.fixed simulated seconds
VOCAB = 1000  # the scripted runner's vocabulary
BLOCK = 4  # small, so that prompts and outputs cross block boundaries all the time
CONFIG = SchedulerConfig(max_seqs=8, token_budget=32)


def scripted_tokens(request: Request, count: int) -> list[int]:
    """The tokens the scripted runner emits for ``request``: token i is 1 + (seq + i) % (vocab − 1)."""
    return [1 + (request.seq + i) % (VOCAB - 1) for i in range(count)]


def workload(rng: random.Random, count: int) -> list[Arrival]:
    """``count`` short requests in bursts, in the order of their arrival (so request ``ri`` has seq i).

    Most prompts start with one of a few shared system prefixes: lengths that are multiples of the
    block size and lengths that are not (one shorter than a block, never cached), some the start of
    others, and sometimes the prefix is the whole prompt, so that the prompt is cached but for the
    blocks that hold its last token (always computed: its logits give the first output token).
    Bursts overload the pool; the gaps between them let the queue drain, so that the waiting list
    stays short and the run stays fast.
    """
    root = tuple(rng.randrange(1, VOCAB) for _ in range(3 * BLOCK + 1))  # prefixes of prefixes: partial hits
    prefixes = [root[:n] for n in (BLOCK, 2 * BLOCK, 3 * BLOCK + 1)]
    prefixes += [tuple(rng.randrange(1, VOCAB) for _ in range(n)) for n in (BLOCK - 1, 2 * BLOCK - 1, 3 * BLOCK)]
    arrivals, now = [], 0.0
    while len(arrivals) < count:
        for _ in range(min(rng.randint(5, 40), count - len(arrivals))):
            now += rng.expovariate(1 / 0.004)
            prefix = rng.choice(prefixes) if rng.random() < 0.8 else ()
            whole = prefix and rng.random() < 0.2  # the prefix is the whole prompt
            prompt = prefix + (() if whole else tuple(rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 10))))
            priority = rng.choice([0.0, 0.0, 1.0, 5.0])
            arrivals.append(Arrival(now, len(prompt), rng.randint(1, 10), priority, prompt))
        now += rng.uniform(0.3, 1.2)
    return arrivals


def random_aborts(rng: random.Random, arrivals: list[Arrival], fraction: float) -> dict[int, list[str]]:
    """Aborts of random requests at random steps, each late enough that the request has arrived.

    Before step s the clock has passed s × COST.fixed at least, so every arrival up to that time has
    been added: aborting an id the engine has not seen yet would be the caller's mistake. Many of
    them hit requests that have already finished, which ``abort`` answers with False.
    """
    aborts: dict[int, list[str]] = {}
    for i in rng.sample(range(len(arrivals)), int(fraction * len(arrivals))):
        step = math.ceil(arrivals[i].time / COST.fixed) + 1 + rng.randint(0, 20)
        aborts.setdefault(step, []).append(f"r{i}")
    return aborts


@dataclass
class Checker:
    """``after_step``: every invariant of the blocks and the queues, checked after every step.

    It also aborts random live requests: it picks a running, a waiting or a preempted one and adds
    it to ``aborts`` for the next step (``simulate`` reads that dict step by step), so that each
    kind is aborted often, which random ids at random steps rarely manage for preempted ones.
    """

    allocator: PagedAllocator
    aborts: dict[int, list[str]]
    rng: random.Random
    abort_rate: float = 0.0
    live: set[str] = field(default_factory=set)  # waiting or running after the last step
    num_finished: int = 0
    num_seen: int = 0  # requests added so far: r0 … r(num_seen − 1), as arrivals are in time order
    aborted_when: Counter = field(default_factory=Counter)  # the status of each abort's request, before it
    live_aborted: set[str] = field(default_factory=set)  # requests an abort found not yet finished
    steps: int = 0

    def __call__(self, engine: Engine) -> None:
        self.steps += 1
        assert engine.stats[-1].kv_used == self.allocator.used
        assert len(engine.scheduler.running) <= CONFIG.max_seqs
        # A prefix hit never covers a prompt's last token: it must run, its logits give the next one.
        assert all(length > 0 for _, _, length in engine.stats[-1].chunks), engine.stats[-1].chunks
        check_blocks(self.allocator)
        check_tables(self.allocator, engine)
        self.check_partition(engine)
        self.abort_some(engine)

    def check_partition(self, engine: Engine) -> None:
        """Waiting, running and finished partition the requests. A full scan per step would make the
        run quadratic, so only the requests that could have moved are looked at: the live ones of the
        last step and the ones added since; every other request finished for good."""
        scheduler = engine.scheduler
        waiting = {r.id for r in scheduler.waiting}
        running = {r.id for r in scheduler.running}
        assert len(waiting) == len(scheduler.waiting), "a request waits twice"
        assert len(running) == len(scheduler.running), "a request runs twice"
        assert not waiting & running, f"{sorted(waiting & running)} both wait and run"
        live = waiting | running
        new = {f"r{i}" for i in range(self.num_seen, len(engine.requests))}
        assert all(rid in engine.requests for rid in new), "requests were added out of their arrival order"
        candidates = self.live | new
        assert live <= candidates, f"{sorted(live - candidates)} came back to life after finishing"
        for rid in candidates - live:
            request = engine.requests[rid]
            assert request.status is RequestStatus.FINISHED, f"{rid} left the queues as {request.status}"
            assert request.finish_reason in ("length", "abort"), f"{rid} finished for {request.finish_reason!r}"
        self.num_finished += len(candidates - live)
        self.num_seen = len(engine.requests)
        self.live = live
        assert len(live) + self.num_finished == len(engine.requests)
        for request in scheduler.running:
            assert request.status is RequestStatus.RUNNING, f"{request.id} is running as {request.status}"
        preempted = {r.id for r in scheduler.waiting if r.status is RequestStatus.PREEMPTED}
        assert preempted == {r.id for r in scheduler.preempted}, "scheduler.preempted and the waiting list disagree"
        assert len(scheduler.preempted) == len(preempted), "a request was preempted twice"
        for request in scheduler.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), request.status
            assert request.num_computed == 0, f"waiting {request.id} claims {request.num_computed} computed tokens"

    def abort_some(self, engine: Engine) -> None:
        """Note the status of the requests the next step aborts; add a random live one to them."""
        scheduler = engine.scheduler
        nxt = len(engine.stats)  # simulate applies aborts[step] before step number `step`
        if self.rng.random() < self.abort_rate:
            kind = self.rng.choice(["running", "waiting", "preempted", "preempted"])  # the rarest kind
            pool = {"running": scheduler.running, "preempted": scheduler.preempted,
                    "waiting": [r for r in scheduler.waiting if r.status is RequestStatus.WAITING]}[kind]
            if pool:
                self.aborts.setdefault(nxt, []).append(self.rng.choice(pool).id)
        for rid in self.aborts.get(nxt, []):
            request = engine.requests.get(rid)
            self.aborted_when[request.status.value if request else "arriving"] += 1
            if request is not None and request.status is not RequestStatus.FINISHED:
                self.live_aborted.add(rid)


def check_blocks(allocator: PagedAllocator) -> None:
    """Every block is exactly one of used, cached, free; reference counts match the tables."""
    holders = Counter(block for table in allocator.tables.values() for block in table)  # duplicates count
    refs = allocator.ref_counts
    for block in range(allocator.num_blocks):
        assert refs[block] == holders[block], (
            f"block {block} has reference count {refs[block]} but {holders[block]} tables hold it")
    queue = allocator.free_queue
    assert all(refs[block] == 0 for block in queue), "a block in the free queue is still referenced"
    unreferenced = {block for block in range(allocator.num_blocks) if refs[block] == 0}
    assert unreferenced == set(queue), f"blocks {sorted(unreferenced - set(queue))} leaked: no table, not free"
    # The three states, each from its own definition: disjoint, covering the pool, and what the
    # allocator's counters say (free + used + cached = total).
    used = {block for block in range(allocator.num_blocks) if refs[block] > 0}
    cached = {block for block in queue if block in allocator.hash_of_block}
    free = {block for block in queue if block not in allocator.hash_of_block}
    assert not (used & cached or used & free or cached & free), "a block is in two states at once"
    assert used | cached | free == set(range(allocator.num_blocks)), "a block is in no state"
    assert (allocator.used, allocator.cached, allocator.free_blocks) == (len(used), len(cached), len(free)), (
        f"counters used/cached/free {allocator.used}/{allocator.cached}/{allocator.free_blocks}, "
        f"counted {len(used)}/{len(cached)}/{len(free)}")
    # The prefix cache: both maps agree, and each key is the hash of the tokens it stands for.
    assert len(allocator.block_of_hash) == len(allocator.hash_of_block) == len(allocator.key_of_block)
    for key, block in allocator.block_of_hash.items():
        assert allocator.hash_of_block.get(block) == key, f"hash → block {block} does not map back"
        assert hash(allocator.key_of_block[block]) == key, f"block {block}'s key is not its tokens' hash"
    if not allocator.prefix_caching:
        assert not allocator.block_of_hash and allocator.hit_tokens == 0


def check_tables(allocator: PagedAllocator, engine: Engine) -> None:
    """Exactly the running requests hold tables, big enough for what they computed, and every
    cached block in a table holds that request's tokens."""
    running = {r.id: r for r in engine.scheduler.running}
    assert set(allocator.tables) == set(running), (
        f"tables {sorted(allocator.tables)} but running {sorted(running)}")
    assert set(allocator.hashed) == set(allocator.cached_tokens) == set(running), "per-request state leaked"
    size = allocator.block_size
    for rid, table in allocator.tables.items():
        request = running[rid]
        assert len(set(table)) == len(table), f"{rid}'s table {table} holds a block twice"
        assert allocator.blocks_for(request.num_computed) <= len(table) <= allocator.blocks_for(request.num_tokens), (
            f"{rid}: {len(table)} blocks for {request.num_computed} computed of {request.num_tokens} tokens")
        for i, block in enumerate(table):
            key = allocator.key_of_block.get(block)
            if key is not None:
                assert key[1] == tuple(request.token_ids(i * size, (i + 1) * size)), (
                    f"{rid}'s block {i} (#{block}) is cached under other tokens than the request's")


def run(count: int, num_blocks: int, prefix_caching: bool, seed: int, abort_rate: float, **pool):
    """The workload through the paged engine, checked after every step; the engine, checker, allocator."""
    rng = random.Random(seed)
    arrivals = workload(rng, count)
    aborts = random_aborts(rng, arrivals, fraction=0.03)
    assert aborts, "simulate replaces an empty aborts dict by its own: the checker adds to this one"
    allocator = PagedAllocator(num_blocks, BLOCK, prefix_caching=prefix_caching, **pool)
    checker = Checker(allocator, aborts, rng, abort_rate)
    engine = simulate(arrivals, CONFIG, COST, aborts=aborts, allocator=allocator,
                      scheduler_class=PagedScheduler, after_step=checker)
    assert checker.steps == len(engine.stats) > 0
    ended_by_abort = {rid for rid, request in engine.requests.items() if request.finish_reason == "abort"}
    assert ended_by_abort == checker.live_aborted, "an abort asked for did not happen, or one happened unasked"
    check_end(engine, allocator, arrivals)
    return engine, checker, allocator


def check_end(engine: Engine, allocator: PagedAllocator, arrivals: list[Arrival]) -> None:
    """Nothing left: no request, no table, no referenced block; every output is the script's."""
    assert len(engine.requests) == len(arrivals)
    assert not engine.scheduler.waiting and not engine.scheduler.running and not engine.scheduler.preempted
    assert allocator.used == 0 and not allocator.tables and not allocator.hashed and not allocator.cached_tokens
    assert sorted(allocator.free_queue) == list(range(allocator.num_blocks)), "blocks leaked at the end"
    assert not any(allocator.ref_counts)
    for i, arrival in enumerate(arrivals):
        request = engine.requests[f"r{i}"]
        assert request.seq == i and request.status is RequestStatus.FINISHED
        expected = scripted_tokens(request, arrival.output_len)
        if request.finish_reason == "abort":
            assert len(request.output_ids) < arrival.output_len
            assert request.output_ids == expected[:len(request.output_ids)], f"r{i}'s tokens before its abort"
        else:
            assert request.finish_reason == "length", f"r{i} finished for {request.finish_reason!r}"
            assert request.output_ids == expected, f"r{i}'s output changed under preemption or prefix hits"


def test_ten_thousand_requests_keep_the_block_accounting_after_every_step():
    engine, checker, allocator = run(10_000, num_blocks=24, prefix_caching=True, seed=7, abort_rate=0.04)
    scheduler = engine.scheduler
    assert scheduler.num_preemptions > 0, "the pool was never short: the test must put it under pressure"
    assert allocator.hit_tokens > 0, "no prefix was ever found in the cache"
    for status in ("running", "waiting", "preempted", "finished"):
        assert checker.aborted_when[status] > 0, f"no abort hit a {status} request: {dict(checker.aborted_when)}"
    stats = (scheduler.num_preemptions, allocator.hit_tokens, dict(checker.aborted_when), checker.steps)
    print("preemptions, hit tokens, aborts by status, steps:", stats)


def test_without_prefix_caching_blocks_are_only_used_or_free():
    """Also with a watermark: admission leaves blocks free for the running requests to grow into."""
    engine, checker, allocator = run(2_000, num_blocks=20, prefix_caching=False, seed=11, abort_rate=0.1,
                                     watermark=0.1)
    assert allocator.watermark_blocks == 2
    assert engine.scheduler.num_preemptions > 0
    assert allocator.hit_tokens == 0 and allocator.cached == 0
    assert checker.aborted_when["preempted"] > 0
