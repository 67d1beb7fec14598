"""Checks for stage 06: the aging key, the scheduler's step, a chunk's inputs, the postprocess.

The scheduler is pure Python, so its checks drive it with small stand-ins — requests that carry
only what the scheduler reads, an allocator with a fixed number of units that refuses to
over-allocate — and compare each step with a reference schedule computed here from the rules.
"""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass, field
from types import SimpleNamespace

from aie_lessons.checks.common import CheckFailed, call, fail, isolated, passed


# --- stand-ins --------------------------------------------------------------------------------
@dataclass(eq=False)
class _Request:
    """What the scheduler and the postprocess read of a request, and nothing they may not."""

    id: str
    seq: int
    prompt_ids: list[int]
    priority: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: object = None
    finish_reason: str | None = None
    metrics: SimpleNamespace = None
    stop_ids: frozenset[int] = frozenset({0})
    params: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(max_new_tokens=10))

    def __post_init__(self) -> None:
        # Like the engine's Request, the arrival is kept in the metrics (and read through `arrival`).
        self.metrics = SimpleNamespace(arrival=0.0, first_scheduled=None, first_token=None, finished=None)

    @property
    def arrival(self) -> float:
        return self.metrics.arrival

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.num_computed

    def token_ids(self, start: int, end: int) -> list[int]:
        return (self.prompt_ids + self.output_ids)[start:end]


class _Allocator:
    """``units`` slots; allocating past them, twice, or freeing what is not held is an error.

    With ``max_prompt``, it also refuses prompts longer than that, as stage 07's block allocator
    refuses a request whose blocks do not fit while a smaller one would.
    """

    def __init__(self, units: int, max_prompt: int | None = None):
        self.units = units
        self.max_prompt = max_prompt
        self.held: dict[str, int] = {}
        self.freed: list[str] = []

    def can_allocate(self, request) -> bool:
        fits = self.max_prompt is None or len(request.prompt_ids) <= self.max_prompt
        return fits and len(self.held) < self.units

    def allocate(self, request) -> int:
        if not self.can_allocate(request):
            raise RuntimeError("allocate() was called although can_allocate() said no")
        if request.id in self.held:
            raise RuntimeError(f"{request.id} was allocated twice")
        slot = min(set(range(self.units)) - set(self.held.values()))
        self.held[request.id] = slot
        return slot

    def handle(self, request_id: str) -> int:
        return self.held[request_id]

    def free(self, request_id: str) -> None:
        if request_id not in self.held:
            raise RuntimeError(f"{request_id} was freed but holds no KV")
        del self.held[request_id]
        self.freed.append(request_id)

    @property
    def used(self) -> int:
        return len(self.held)


def _reference_priority(request, now: float, aging_rate: float) -> float:
    return request.priority + aging_rate * (now - request.arrival)


# --- 6.1 the aging key ------------------------------------------------------------------------
def check_effective_priority(effective_priority) -> None:
    ex = "6.1"
    rng = random.Random(61)
    for _ in range(20):
        priority = rng.choice([0.0, 1.0, 5.0, -2.0])
        arrival = rng.uniform(0, 10)
        request = _request("r", 0, 1, priority=priority, arrival=arrival)
        now, rate = arrival + rng.uniform(0.5, 20), rng.choice([0.5, 2.0, 10.0])
        got = call(ex, effective_priority, request, now, rate)
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            fail(ex, f"return a number (the effective priority), got {type(got).__name__}")
        want = _reference_priority(request, now, rate)
        if abs(got - want) <= 1e-9 * max(1.0, abs(want)):
            continue
        waited = now - arrival
        if abs(got - rate * waited) < 1e-9 and priority:
            fail(ex, "you dropped the request's own priority: aging adds to it")
        if abs(got - priority) < 1e-9:
            fail(ex, "the priority does not grow while the request waits: add aging_rate × (now − arrival)")
        if abs(got - (priority - rate * waited)) < 1e-9:
            fail(ex, "the priority *falls* as the request waits (arrival − now): waiting must raise it, "
                     "use now − arrival")
        if abs(got - (priority + rate * now)) < 1e-9:
            fail(ex, "you added aging_rate × now: two requests that arrived at different times then age "
                     "alike. Age each by the time since *its* arrival: now − request.arrival")
        if abs(got - (priority + waited) * rate) < 1e-9 or abs(got - priority * rate * waited) < 1e-9:
            fail(ex, "aging_rate scales the waiting time only: priority + aging_rate × (now − arrival), "
                     "the request's own priority is not multiplied")
        if abs(got - (priority + waited / rate)) < 1e-9:
            fail(ex, "you divided by aging_rate: it is a rate (priority units per unit of time), multiply")
        fail(ex, f"priority {priority}, arrival {arrival:.3f}, now {now:.3f}, aging_rate {rate}: expected "
                 f"{want:.4f}, got {got!r}")
    passed(ex, "the priority grows by aging_rate per unit of waiting time, from each request's own arrival")


# --- 6.2 the scheduler's step -------------------------------------------------------------------
@dataclass
class _Case:
    """A scheduler state: running requests (with their progress), waiting ones, and the limits."""

    name: str
    running: list[_Request]
    waiting: list[_Request]
    max_seqs: int
    budget: int
    units: int  # the allocator's capacity (≥ max_seqs unless the allocator is the limit)
    now: float = 10.0
    aging_rate: float = 1.0
    static: bool = False
    max_prompt: int | None = None  # the allocator refuses longer prompts


def _request(rid: str, seq: int, prompt: int, computed: int = 0, outputs: int = 0, priority: float = 0.0,
             arrival: float = 0.0) -> _Request:
    r = _Request(rid, seq, list(range(1, prompt + 1)), priority=priority)
    r.metrics.arrival = arrival
    r.output_ids = [7] * outputs
    r.num_computed = computed
    return r


def _cases() -> list[_Case]:
    def decode(rid, seq, prompt=5, outputs=2):  # a running request whose next chunk is one token
        return _request(rid, seq, prompt, computed=prompt + outputs - 1, outputs=outputs)

    cases = [
        _Case("decodes only", [decode("a", 0), decode("b", 1), decode("c", 2)], [], 4, 16, 4),
        _Case("a prefill to continue, listed before the decodes",
              [_request("p", 0, 40, computed=16), decode("a", 1), decode("b", 2)], [], 4, 16, 4),
        _Case("admission fills the budget with a chunk",
              [decode("a", 0)], [_request("w", 5, 30, arrival=9.0)], 4, 12, 4),
        _Case("max_seqs stops admission", [decode("a", 0), decode("b", 1)],
              [_request("w1", 5, 3, arrival=8.0), _request("w2", 6, 3, arrival=9.0)], 3, 64, 8),
        _Case("the allocator stops admission", [decode("a", 0)],
              [_request("w1", 5, 3, arrival=8.0), _request("w2", 6, 3, arrival=9.0)], 8, 64, 2),
        _Case("priority decides the order",
              [], [_request("lo", 1, 4, arrival=9.0), _request("hi", 2, 4, priority=5.0, arrival=9.5),
                   _request("mid", 3, 4, priority=2.0, arrival=9.9)], 2, 64, 8, aging_rate=0.0),
        _Case("aging lifts an old request",
              [], [_request("new", 4, 4, priority=3.0, arrival=9.9), _request("old", 1, 4, priority=0.0, arrival=1.0)],
              1, 64, 8, aging_rate=1.0),
        _Case("equal priorities: first come first served",
              [], [_request("second", 2, 4, arrival=5.0), _request("first", 1, 4, arrival=5.0)], 1, 64, 8),
        _Case("the budget runs out during admission",
              [decode("a", 0)], [_request("w1", 5, 10, arrival=8.0), _request("w2", 6, 10, arrival=9.0)], 8, 8, 8),
        _Case("the budget runs out before every running request",
              [decode("a", 0), _request("p", 1, 50, computed=10), _request("q", 2, 50, computed=20)],
              [_request("w", 5, 4, arrival=9.0)], 8, 20, 8),
        _Case("static batching admits nothing while a batch runs",
              [decode("a", 0)], [_request("w", 5, 4, arrival=9.0)], 4, 64, 4, static=True),
        _Case("the allocator refuses the most urgent: no one overtakes it", [decode("a", 0)],
              [_request("big", 5, 40, priority=5.0, arrival=8.0), _request("small", 6, 3, arrival=9.0)],
              8, 64, 8, max_prompt=10),
        _Case("static batching fills an empty batch",
              [], [_request("w1", 5, 4, arrival=8.0), _request("w2", 6, 4, arrival=9.0)], 4, 64, 4, static=True),
    ]
    rng = random.Random(62)
    for n in range(12):  # random states: mixes of every kind, random limits
        running, waiting, seq = [], [], 0
        for i in range(rng.randint(0, 5)):
            prompt = rng.randint(1, 40)
            if rng.random() < 0.6:
                outputs = rng.randint(1, 5)
                running.append(_request(f"d{i}", seq, prompt, computed=prompt + outputs - 1, outputs=outputs))
            else:
                running.append(_request(f"p{i}", seq, prompt + 1, computed=rng.randint(0, prompt)))
            seq += 1
        for i in range(rng.randint(0, 6)):
            waiting.append(_request(f"w{i}", seq, rng.randint(1, 60), priority=rng.choice([0.0, 1.0, 3.0]),
                                    arrival=rng.uniform(0, 10)))
            seq += 1
        rng.shuffle(running)
        rng.shuffle(waiting)
        max_seqs = len(running) + rng.randint(0, 4)
        max_seqs = max(max_seqs, 1)
        cases.append(_Case(f"random state {n}", running, waiting, max_seqs, rng.randint(max_seqs, 64),
                           rng.randint(len(running), max_seqs + 2), aging_rate=rng.choice([0.0, 0.3, 2.0])))
    return cases


def _reference_schedule(case: _Case) -> tuple[list[tuple[str, int, int]], list[str]]:
    """The rules of exercise 6.2, step by step: (id, start, length) per chunk, and the admitted ids."""
    budget, chunks, admitted = (10**9 if case.static else case.budget), [], []
    running = sorted(case.running, key=lambda r: r.remaining > 1)
    for r in running:
        length = min(r.remaining, budget)
        if length == 0:
            break
        chunks.append((r.id, r.num_computed, length))
        budget -= length
    waiting, held = list(case.waiting), len(case.running)
    admitting = not (case.static and case.running)
    while admitting and waiting and budget > 0 and held < case.max_seqs:
        r = min(waiting, key=lambda r: (-_reference_priority(r, case.now, case.aging_rate), r.seq))
        if held >= case.units or (case.max_prompt is not None and len(r.prompt_ids) > case.max_prompt):
            break
        waiting.remove(r)
        held += 1
        admitted.append(r.id)
        length = min(r.remaining, budget)
        chunks.append((r.id, r.num_computed, length))
        budget -= length
    return chunks, admitted


def _fresh(case: _Case) -> _Case:
    """A deep copy of the case's requests: a wrong scheduler may change them."""
    def copy(r: _Request) -> _Request:
        c = _request(r.id, r.seq, len(r.prompt_ids), r.num_computed, len(r.output_ids), r.priority, r.arrival)
        return c
    return _Case(case.name, [copy(r) for r in case.running], [copy(r) for r in case.waiting], case.max_seqs,
                 case.budget, case.units, case.now, case.aging_rate, case.static, case.max_prompt)


def _run_schedule(ex: str, Scheduler, SchedulerConfig, case: _Case):
    allocator = _Allocator(case.units, case.max_prompt)
    config = SchedulerConfig(max_seqs=case.max_seqs, token_budget=case.budget, aging_rate=case.aging_rate,
                             static=case.static)
    scheduler = Scheduler(config, allocator, lambda: case.now)
    for r in case.running:
        allocator.allocate(r)
        scheduler.running.append(r)
    scheduler.waiting.extend(case.waiting)
    schedule = call(ex, scheduler.schedule)
    return scheduler, allocator, schedule


def _diagnose(ex: str, case: _Case, got: list[tuple[str, int, int]], admitted: list[str], scheduler,
              want: list[tuple[str, int, int]], want_admitted: list[str]) -> None:
    by_id = {r.id: r for r in case.running + case.waiting}
    running_ids = {r.id for r in case.running}
    total = sum(length for _, _, length in got)
    where = f"(case: {case.name}; budget {case.budget}, max_seqs {case.max_seqs})"
    if any(length <= 0 for _, _, length in got):
        fail(ex, f"a chunk of zero tokens was scheduled {where}: stop when the budget is spent")
    if total > case.budget:
        fail(ex, f"the chunks hold {total} tokens, over the token budget of {case.budget} {where}: cut each "
                 "chunk to the budget that is left, and subtract what each chunk takes")
    for rid, start, _ in got:
        if start != by_id[rid].num_computed:
            fail(ex, f"{rid}'s chunk starts at {start}, but its cache holds {by_id[rid].num_computed} tokens "
                     f"{where}: a chunk starts at the request's num_computed")
    for rid, _, length in got:
        if length > by_id[rid].remaining:
            fail(ex, f"{rid}'s chunk is {length} tokens, but only {by_id[rid].remaining} remain {where}")
    kinds = ["decode" if rid in running_ids and by_id[rid].remaining == 1 else "other" for rid, _, _ in got]
    if "decode" in kinds and "other" in kinds and kinds.index("other") < len(kinds) - kinds[::-1].index("decode") - 1:
        fail(ex, f"a prefill chunk was scheduled before a running decode {where}: decodes first, so a "
                 "long prompt never stalls the requests that are streaming")
    decodes = [r.id for r in case.running if r.remaining == 1]
    missing = [rid for rid in decodes if rid not in {g[0] for g in got}]
    if missing and "other" in kinds:
        fail(ex, f"prefill chunks took the budget before a running decode ({missing} got nothing) {where}: "
                 "decodes first, so a long prompt never stalls the requests that are streaming")
    if missing and case.budget >= len(decodes):
        fail(ex, f"running decodes {missing} got no chunk {where}: every running request continues every step "
                 "while the budget lasts")
    if len(case.running) + len(admitted) > case.max_seqs:
        fail(ex, f"{len(case.running) + len(admitted)} requests running after the step, over max_seqs="
                 f"{case.max_seqs} {where}: admit only while fewer than max_seqs run")
    if case.static and case.running and admitted:
        fail(ex, f"admitted {admitted} while a static batch was running {where}: admit only while `admitting`")
    if [g[0] for g in got if g[0] in running_ids] != [g[0] for g in want if g[0] in running_ids]:
        fail(ex, f"running requests were scheduled as {[g[0] for g in got if g[0] in running_ids]}, expected "
                 f"{[g[0] for g in want if g[0] in running_ids]} {where}: decodes first, then prefills, each "
                 "group keeping its order in self.running")
    new_chunks = [g for g in got if g[0] not in running_ids]
    if [g[0] for g in new_chunks] != admitted:
        fail(ex, f"the admitted requests {admitted} and the new requests' chunks {[g[0] for g in new_chunks]} "
                 f"differ {where}: return every admitted request, each with a chunk")
    if set(admitted) - {r.id for r in scheduler.running}:
        fail(ex, f"admitted {admitted} but they are not in scheduler.running {where}: admit through self.admit")
    if len(admitted) < len(want_admitted) and admitted == want_admitted[:len(admitted)]:
        fail(ex, f"admitted {admitted} but {want_admitted[len(admitted)]} should have been admitted too {where}: "
                 "keep admitting while budget, max_seqs and the allocator allow — a prompt longer than "
                 "the budget left goes in as a shorter chunk (chunked prefill)")
    if admitted != want_admitted[:len(admitted)]:
        raw = [r.id for r in sorted(case.waiting, key=lambda r: (-r.priority, r.seq))][:len(admitted)]
        if case.aging_rate and admitted == raw:
            fail(ex, f"admitted {admitted}, expected {want_admitted} {where}: you ordered by the fixed priority; "
                     "order by effective_priority(request, now, aging_rate), which lets waiting requests age")
        if any(r.id in admitted and r.id not in want_admitted and case.max_prompt is not None for r in case.waiting):
            fail(ex, f"admitted {admitted}, expected {want_admitted} {where}: when the allocator refuses the most "
                     "urgent waiting request, stop admitting — a smaller request must not overtake it")
        fail(ex, f"admitted {admitted}, expected {want_admitted} {where}: take the waiting request with the "
                 "highest effective_priority(request, now, aging_rate) first, the earlier seq on ties")
    fail(ex, f"{where}: expected chunks (id, start, length) {want}, got {got}")


def check_schedule(Scheduler, ScheduledChunk, SchedulerConfig) -> None:
    ex = "6.2"
    with isolated(Scheduler.schedule, effective_priority=_reference_priority):
        for case in _cases():
            case = _fresh(case)
            want, want_admitted = _reference_schedule(case)
            progress = {r.id: (r.num_computed, len(r.output_ids)) for r in case.running + case.waiting}
            scheduler, allocator, schedule = _run_schedule(ex, Scheduler, SchedulerConfig, case)
            moved = [r.id for r in case.running + case.waiting
                     if (r.num_computed, len(r.output_ids)) != progress[r.id]]
            if moved:
                fail(ex, f"schedule() changed the progress of {moved}: it only plans — the postprocess "
                         "advances num_computed once the model has really run the chunk")
            chunks = getattr(schedule, "chunks", None)
            if not isinstance(chunks, list) or not all(isinstance(c, ScheduledChunk) for c in chunks):
                fail(ex, "return Schedule(chunks, admitted) with a list of ScheduledChunk")
            got = [(c.request.id, c.start, c.length) for c in chunks]
            admitted = [r.id for r in schedule.admitted]
            for c in chunks:
                if c.kv != allocator.held.get(c.request.id):
                    fail(ex, f"{c.request.id}'s chunk carries kv={c.kv!r}, but its KV handle is "
                             f"{allocator.held.get(c.request.id)!r}: use allocator.handle(id) for a running "
                             "request, and the handle admit() returns for a new one")
            if got != want or admitted != want_admitted:
                _diagnose(ex, case, got, admitted, scheduler, want, want_admitted)
            for r in schedule.admitted:
                if r.metrics.first_scheduled is None:
                    fail(ex, f"{r.id} was admitted without self.admit(request, now): it moves the request, "
                             "allocates its KV and stamps metrics.first_scheduled")
                if r.metrics.first_scheduled != case.now:
                    fail(ex, f"{r.id} was admitted at {r.metrics.first_scheduled!r}, but the scheduler's clock "
                             f"said {case.now}: read the time once from self.clock() and admit with it")
    passed(ex, "decodes first, chunks from num_computed within the budget, admission by effective priority "
               "within max_seqs and the allocator, in every case")


# --- 6.3 a chunk's inputs -----------------------------------------------------------------------
def check_chunk_inputs(chunk_inputs, ScheduledChunk) -> None:
    ex = "6.3"
    prompt, output = list(range(100, 112)), [500, 501, 502]
    cases = [("the first prefill chunk", 0, 5, []), ("a later prefill chunk", 5, 4, []),
             ("the prompt's last chunk", 8, 4, []), ("a decode", 14, 1, output),
             ("a chunk across the prompt's end (a recomputed request)", 10, 4, output),
             ("a whole prompt", 0, 12, [])]
    for name, start, length, outputs in cases:
        request = _Request("r", 0, list(prompt))
        request.output_ids = list(outputs)
        request.num_computed = start
        chunk = ScheduledChunk(request, start, length, 0)
        got = call(ex, chunk_inputs, chunk)
        if not (isinstance(got, tuple) and len(got) == 2):
            fail(ex, "return a pair: (token ids, positions)")
        ids, positions = (list(map(int, x)) if hasattr(x, "__iter__") else x for x in got)
        everything = prompt + outputs
        want_ids, want_pos = everything[start:start + length], list(range(start, start + length))
        if positions == list(range(length)) and start > 0:
            fail(ex, f"{name}: positions {positions} start at 0 — off by the chunk's offset: a chunk's "
                     f"positions continue where its request stopped ({start} here)")
        if positions == [p + 1 for p in want_pos] or positions == [p - 1 for p in want_pos]:
            fail(ex, f"{name}: positions {positions} are off by one: token i of the sequence is at position i")
        if positions != want_pos:
            fail(ex, f"{name}: expected positions {want_pos}, got {positions}")
        if outputs and ids == prompt[start:start + length]:
            fail(ex, f"{name}: the ids come from the prompt only — after the prompt, a request's tokens are "
                     "its output tokens (a decode runs the token sampled last)")
        if ids == everything[start + 1:start + length + 1] or ids == everything[start - 1:start + length - 1]:
            fail(ex, f"{name}: the ids are shifted by one: the chunk runs tokens start … start + length − 1")
        if ids != want_ids:
            fail(ex, f"{name}: expected ids {want_ids}, got {ids}")
    passed(ex, "each chunk runs its own window of prompt + output, at its own positions")


# --- 6.4 the postprocess ------------------------------------------------------------------------
def check_postprocess(postprocess, Scheduler, SchedulerConfig, ScheduledChunk, Schedule, RequestOutput) -> None:
    ex = "6.4"
    allocator = _Allocator(16)
    scheduler = Scheduler(SchedulerConfig(max_seqs=16, token_budget=128), allocator, lambda: 0.0)
    # (id, prompt, outputs so far, computed, chunk length, max_new_tokens, token sampled or None,
    #  ignore_eos); the stop id is 0
    plan = [("decoding", 6, 2, 7, 1, 10, 41, False), ("last_token", 6, 3, 8, 1, 4, 42, False),
            ("partial_prefill", 30, 0, 8, 8, 10, None, False), ("final_chunk", 20, 0, 12, 8, 10, 43, False),
            ("eos", 5, 1, 5, 1, 10, 0, False), ("whole_prompt", 9, 0, 0, 9, 10, 44, False),
            ("ignores_eos", 5, 1, 5, 1, 10, 0, True), ("eos_at_the_limit", 5, 3, 7, 1, 4, 0, False),
            ("one_token_wanted", 4, 0, 0, 4, 1, 45, False), ("one_token_prompt", 1, 0, 0, 1, 10, 47, False),
            ("one_short", 5, 2, 6, 1, 4, 46, False)]
    want_reason = {"last_token": "length", "eos": "eos", "eos_at_the_limit": "eos", "one_token_wanted": "length"}
    requests, chunks, tokens = {}, [], []
    for rid, prompt, outputs, computed, length, limit, token, ignore_eos in plan:
        r = _request(rid, len(requests), prompt, computed=computed, outputs=outputs)
        # the fields of SamplingParams a postprocess may read (the checks import no learner module)
        r.params = SimpleNamespace(max_new_tokens=limit, ignore_eos=ignore_eos, stop=(), temperature=0.0)
        r.stop_ids = frozenset() if ignore_eos else frozenset({0})
        if outputs:
            r.metrics.first_token = 1.0
        scheduler.waiting.append(r)
        kv = scheduler.admit(r, 0.0)  # given code: running, with its KV
        requests[rid] = r
        chunks.append(ScheduledChunk(r, computed, length, kv))
        if token is not None:
            tokens.append(token)
    schedule = Schedule(chunks, [])
    scheduled = list(schedule.chunks)
    before = {rid: (r.num_computed, len(r.output_ids)) for rid, r in requests.items()}
    try:
        outputs = call(ex, postprocess, schedule, tokens, scheduler, 5.0)
    except CheckFailed as exc:
        if "StopIteration" in str(exc) or "IndexError" in str(exc):
            fail(ex, f"{str(exc).split(': ', 1)[1]} — tokens holds one entry per *sampling* chunk, not one per "
                     "chunk: take them in order with an iterator")
        raise
    if inspect.isgeneratorfunction(postprocess):
        fail(ex, "your postprocess is a generator (it uses `yield`): its body runs only when someone iterates "
                 "over it, so nothing happened. Do the work, and return a list")
    if list(schedule.chunks) != scheduled:
        fail(ex, "the schedule's chunks changed: the postprocess only reads the schedule (the engine records "
                 "its chunks after it)")
    if requests["one_short"].num_computed == 6 and requests["decoding"].num_computed != 7:
        fail(ex, "the last chunks were never reached: zip(chunks, tokens) stops at the shorter list, and "
                 "tokens holds one entry per *sampling* chunk — walk every chunk, and take a token only "
                 "for those that sample")
    for rid, prompt, outputs_before, computed, length, limit, token, _ in plan:
        r = requests[rid]
        if r.num_computed == computed + 1 and length > 1:
            fail(ex, f"{rid}: num_computed advanced by 1 after a chunk of {length} tokens: advance it by the "
                     "chunk's length (the model stored the keys and values of all of them)")
        if r.num_computed == computed and token is None:
            fail(ex, f"{rid}: a chunk that does not sample still advances num_computed — otherwise the next "
                     "step runs the same prompt tokens again")
        if r.num_computed != computed + length:
            fail(ex, f"{rid}: num_computed is {r.num_computed} after a chunk of {length} from {computed}; "
                     f"expected {computed + length}")
    appended = {rid: requests[rid].output_ids[before[rid][1]:] for rid in requests}
    if appended["partial_prefill"]:
        fail(ex, "a chunk that stops inside its prompt got a token: only chunks that sample "
                 "(chunk.samples) take one of the tokens")
    expected = {rid: ([token] if token is not None else []) for rid, *_, token, _ in plan}
    eos_rows = [rid for rid, *_, token, ignore_eos in plan if token == 0 and not ignore_eos]
    if all(appended[rid] == [] for rid in eos_rows) and all(
            appended[rid] == expected[rid] for rid in expected if rid not in eos_rows):
        fail(ex, f"{eos_rows} sampled their stop id 0 and got nothing appended: output_ids holds every sampled "
                 "token, EOS included (the consumer's text leaves it out, not the engine)")
    grown = {rid: len(requests[rid].output_ids) - before[rid][1] for rid in requests}
    if any(grown[rid] != len(expected[rid]) for rid in requests):
        fail(ex, f"output_ids grew by {grown}: a sampling chunk appends exactly one token to its request's "
                 "output_ids, and other chunks none")
    if appended != expected:
        fail(ex, f"tokens appended {appended}, expected {expected}: the tokens line up with the sampling "
                 "chunks, in order (one iterator over them)")
    if requests["final_chunk"].metrics.first_token != 5.0 or requests["whole_prompt"].metrics.first_token != 5.0:
        fail(ex, "a request's first sampled token must stamp metrics.first_token with `now` (TTFT)")
    if requests["one_token_prompt"].metrics.first_token != 5.0:
        fail(ex, "one_token_prompt (a prompt of one token, sampled in its first chunk) has no first_token: "
                 "stamp it for every request whose first token was sampled now")
    if requests["partial_prefill"].metrics.first_token is not None:
        fail(ex, "partial_prefill has a first_token although nothing was sampled for it yet (its chunk "
                 "stops inside the prompt): TTFT is the time of the first *sampled* token")
    if requests["decoding"].metrics.first_token != 1.0:
        fail(ex, "metrics.first_token was overwritten for a request that already had its first token: "
                 "stamp it only while it is None")
    reported = {getattr(o, "request_id", None): getattr(o, "finish_reason", None)
                for o in (outputs if isinstance(outputs, list) else [])}

    def ended(rid: str) -> str | None:  # the reason, on the request or in its output
        return requests[rid].finish_reason or reported.get(rid)

    if ended("ignores_eos") is not None:
        fail(ex, "a request with ignore_eos ended on token 0: its stop_ids are empty — test the token "
                 "against request.stop_ids, not against a fixed EOS id")
    if ended("eos") is None:
        fail(ex, "a request whose token is one of its stop_ids did not end: that is reason \"eos\"")
    if ended("one_token_wanted") is None or ended("last_token") is None:
        fail(ex, "a request that now holds max_new_tokens output tokens did not end: compare the length of "
                 "its output_ids after the append (≥ max_new_tokens ends it with \"length\")")
    early = [(rid, len(requests[rid].output_ids), requests[rid].params.max_new_tokens)
             for rid in ("decoding", "final_chunk", "one_short", "one_token_prompt") if ended(rid) is not None]
    if early:
        fail(ex, "requests ended early (request, output tokens, max_new_tokens): "
                 f"{early}: a request samples until its output_ids hold max_new_tokens tokens")
    got_reasons = {rid: ended(rid) for rid in want_reason}
    if got_reasons != want_reason:
        fail(ex, f"finish reasons {got_reasons}, expected {want_reason}: \"eos\" when the token is a stop "
                 "id (first: a stop id at the limit is still an EOS), else \"length\" at max_new_tokens")
    ends = set(want_reason)
    still_held = sorted(ends & set(allocator.held))
    if still_held:
        fail(ex, f"{still_held} ended but still hold their KV slot: a slot never freed — end a request "
                 "through scheduler.finish(request, reason, now)")
    lingering = sorted(rid for rid in ends if requests[rid] in scheduler.running)
    if lingering:
        fail(ex, f"{lingering} ended but are still in scheduler.running: end a request through "
                 "scheduler.finish, which takes it out of the queue and frees its KV")
    not_marked = sorted(rid for rid in want_reason if requests[rid].finish_reason != want_reason[rid]
                        or getattr(requests[rid].status, "value", None) != "finished"
                        or requests[rid].metrics.finished != 5.0)
    if not_marked:
        fail(ex, f"{not_marked} were ended by hand: end a request through scheduler.finish(request, reason, now), "
                 "which also marks it FINISHED with its finish_reason and stamps metrics.finished — abort and "
                 "forget rely on that")
    if set(allocator.freed) != ends:
        fail(ex, f"freed {allocator.freed}: only ended requests free their KV")
    want = [RequestOutput(rid, (token,), want_reason.get(rid)) for rid, *_, token, _ in plan if token is not None]
    if not isinstance(outputs, list) or not all(isinstance(o, RequestOutput) for o in outputs):
        fail(ex, f"return a list of RequestOutput, one per sampling chunk; got {type(outputs).__name__}"
                 f"{'' if not isinstance(outputs, list) else ' of ' + ', '.join(sorted({type(o).__name__ for o in outputs}))}")
    if [o.request_id for o in outputs] != [o.request_id for o in want]:
        fail(ex, f"outputs for {[o.request_id for o in outputs]}, expected {[o.request_id for o in want]}: one "
                 "RequestOutput per sampling chunk — finished or not — in the schedule's order")
    wrong = [(o.request_id, o.token_ids, w.token_ids) for o, w in zip(outputs, want) if o.token_ids != w.token_ids]
    if wrong:
        fail(ex, f"token_ids (request, got, expected): {wrong}: each output carries the token just sampled "
                 "for its request, as a 1-tuple")
    wrong = [(o.request_id, o.finish_reason, w.finish_reason) for o, w in zip(outputs, want) if o.finish_reason != w.finish_reason]
    if wrong:
        fail(ex, f"finish_reason (request, got, expected): {wrong}: an output names the reason its request "
                 "ended in this step, and None while it goes on")
    passed(ex, "every chunk advances its request, sampled tokens land on the right requests, requests end "
               "at EOS or max_new_tokens with their KV freed, and the step's outputs say so as data")
