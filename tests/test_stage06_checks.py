"""Stage 06's checks, each proven by wrong implementations that must fail with the right message."""

from __future__ import annotations

import sys
import time

import pytest

from aie_lessons import checks
from aie_lessons.checks import CheckFailed
from aie_lessons.engine.batch import chunk_inputs
from aie_lessons.engine.engine import postprocess
from aie_lessons.engine.outputs import RequestOutput
from aie_lessons.engine.scheduler import (Schedule, ScheduledChunk, Scheduler, SchedulerConfig,
                                          effective_priority)
from check_expect import mutants, names_the_mistake


# --- 6.1 ----------------------------------------------------------------------------------------
def no_aging(request, now, aging_rate):
    return request.priority


def ages_backwards(request, now, aging_rate):
    return request.priority + aging_rate * (request.arrival - now)


def ages_by_the_clock(request, now, aging_rate):
    return request.priority + aging_rate * now


def scales_the_priority(request, now, aging_rate):
    return (request.priority + now - request.arrival) * aging_rate


def divides_by_the_rate(request, now, aging_rate):
    return request.priority + (now - request.arrival) / aging_rate


def drops_the_priority(request, now, aging_rate):
    return aging_rate * (now - request.arrival)


def reads_a_field_requests_lack(request, now, aging_rate):
    return request.priority + aging_rate * (now - request.arrival_time)


def test_effective_priority_check_passes_the_reference():
    checks.stage06.check_effective_priority(effective_priority)


@mutants("6.1", [
    (no_aging, "does not grow while the request waits"),
    (ages_backwards, "falls.*now − arrival"),
    (ages_by_the_clock, "since \\*its\\* arrival"),
    (scales_the_priority, "is not multiplied"),
    (divides_by_the_rate, "you divided by aging_rate"),
    (reads_a_field_requests_lack, "raised AttributeError"),
    (drops_the_priority, "dropped the request's own priority"),
])
def test_effective_priority_check_names_the_mistake(wrong, message):
    with names_the_mistake("6.1", message):
        checks.stage06.check_effective_priority(wrong)


# --- 6.2 ----------------------------------------------------------------------------------------
def scheduler_with(name: str, **mistake):
    """The reference step with one mistake a learner could make."""

    def schedule(self) -> Schedule:
        now = time.time() if mistake.get("wall_clock") else self.clock()
        budget = sys.maxsize if self.config.static else self.config.token_budget
        chunks, admitted = [], []
        admitting = not (self.config.static and self.running) or mistake.get("ignores_static")
        ordered = self.running if mistake.get("no_decode_first") else sorted(self.running, key=lambda r: r.remaining > 1)
        if mistake.get("shortest_first"):
            ordered = sorted(self.running, key=lambda r: r.remaining)
        for request in ordered:
            length = request.remaining if mistake.get("no_budget") else min(request.remaining, budget)
            if length == 0:
                break
            start = 0 if mistake.get("start_at_zero") else request.num_computed
            chunks.append(ScheduledChunk(request, start, length, self.allocator.handle(request.id)))
            budget -= length
            if mistake.get("advances_progress"):
                request.num_computed += length
        limit = 10**9 if mistake.get("ignores_max_seqs") else self.config.max_seqs
        skipped = []
        while admitting and self.waiting and budget > 0 and len(self.running) < limit:
            candidates = [r for r in self.waiting if r not in skipped]
            if not candidates:
                break
            if mistake.get("skips_refused"):
                request = min(candidates, key=lambda r: (-effective_priority(r, now, self.config.aging_rate), r.seq))
            elif mistake.get("fifo"):
                request = min(self.waiting, key=lambda r: r.seq)
            elif mistake.get("least_urgent_first"):
                request = max(self.waiting, key=lambda r: (-effective_priority(r, now, self.config.aging_rate), r.seq))
            elif mistake.get("no_aging"):
                request = min(self.waiting, key=lambda r: (-r.priority, r.seq))
            else:
                request = min(self.waiting, key=lambda r: (-effective_priority(r, now, self.config.aging_rate), r.seq))
            if not self.allocator.can_allocate(request):
                if mistake.get("skips_refused"):
                    skipped.append(request)
                    continue
                break
            if mistake.get("whole_prompts_only") and request.remaining > budget:
                break
            kv = self.admit(request, now)
            admitted.append(request)
            chunks.append(ScheduledChunk(request, request.num_computed, min(request.remaining, budget), kv))
            budget -= min(request.remaining, budget)
        return Schedule(chunks, admitted)

    return type(name, (Scheduler,), {"schedule": schedule})


def test_schedule_check_passes_the_reference():
    checks.stage06.check_schedule(Scheduler, ScheduledChunk, SchedulerConfig)


@mutants("6.2", [
    (scheduler_with("NoDecodeFirst", no_decode_first=True), "before a running decode"),
    (scheduler_with("NoBudget", no_budget=True), "over the token budget"),
    (scheduler_with("StartAtZero", start_at_zero=True), "starts at the request's num_computed"),
    (scheduler_with("Fifo", fifo=True), "highest effective_priority"),
    (scheduler_with("LeastUrgentFirst", least_urgent_first=True), "highest effective_priority"),
    (scheduler_with("NoAging", no_aging=True), "you ordered by the fixed priority"),
    (scheduler_with("IgnoresMaxSeqs", ignores_max_seqs=True), "over max_seqs"),
    (scheduler_with("WholePromptsOnly", whole_prompts_only=True), "chunked prefill"),
    (scheduler_with("IgnoresStatic", ignores_static=True), "static batch"),
    (scheduler_with("AdvancesProgress", advances_progress=True), "it only plans"),
    (scheduler_with("WallClock", wall_clock=True), "the scheduler's clock"),
    (scheduler_with("SkipsRefused", skips_refused=True), "must not overtake it"),
    (scheduler_with("ShortestFirst", shortest_first=True), "keeping its order in self.running"),
])
def test_schedule_check_names_the_mistake(wrong, message):
    with names_the_mistake("6.2", message):
        checks.stage06.check_schedule(wrong, ScheduledChunk, SchedulerConfig)


# --- 6.3 ----------------------------------------------------------------------------------------
def positions_from_zero(chunk):
    return chunk.request.token_ids(chunk.start, chunk.start + chunk.length), list(range(chunk.length))


def prompt_only(chunk):
    end = chunk.start + chunk.length
    return chunk.request.prompt_ids[chunk.start:end], list(range(chunk.start, end))


def shifted_ids(chunk):
    end = chunk.start + chunk.length
    return chunk.request.token_ids(chunk.start + 1, end + 1), list(range(chunk.start, end))


def positions_plus_one(chunk):
    end = chunk.start + chunk.length
    return chunk.request.token_ids(chunk.start, end), list(range(chunk.start + 1, end + 1))


def test_chunk_inputs_check_passes_the_reference():
    checks.stage06.check_chunk_inputs(chunk_inputs, ScheduledChunk)


@mutants("6.3", [
    (positions_from_zero, "off by the chunk's offset"),
    (prompt_only, "from the prompt only"),
    (shifted_ids, "shifted by one"),
    (positions_plus_one, "off by one"),
])
def test_chunk_inputs_check_names_the_mistake(wrong, message):
    with names_the_mistake("6.3", message):
        checks.stage06.check_chunk_inputs(wrong, ScheduledChunk)


# --- 6.4 ----------------------------------------------------------------------------------------
def postprocess_with(name: str, **mistake):
    def wrong(schedule, tokens, scheduler, now):
        outputs = []
        sampled = iter(tokens)
        # zip(chunks, tokens) pairs chunk i with token i, and stops at the shorter list
        chunks = schedule.chunks[:len(tokens)] if mistake.get("zips_chunks_with_tokens") else schedule.chunks
        for i, chunk in enumerate(chunks):
            request = chunk.request
            if not (mistake.get("sampling_only_advance") and not chunk.samples):
                request.num_computed += 1 if mistake.get("advance_by_one") else chunk.length
            if mistake.get("token_per_chunk"):
                token = next(sampled, 0)
            if not chunk.samples:
                continue
            if mistake.get("zips_chunks_with_tokens") or mistake.get("indexes_tokens_by_chunk"):
                token = tokens[i]
            elif not mistake.get("token_per_chunk"):
                token = next(sampled)
            request.output_ids.append(token)
            limit = request.params.max_new_tokens - (1 if mistake.get("one_early") else 0)
            at_limit = len(request.output_ids) > limit if mistake.get("past_the_limit") else len(request.output_ids) >= limit
            if mistake.get("always_stamp") or request.metrics.first_token is None:
                request.metrics.first_token = now
            is_eos = token == 0 if mistake.get("fixed_eos_id") else token in request.stop_ids
            if mistake.get("length_first"):
                reason = "length" if at_limit else "eos" if is_eos else None
            else:
                reason = "eos" if is_eos else "length" if at_limit else None
            if reason is not None:
                if mistake.get("frees_only_the_kv"):
                    scheduler.allocator.free(request.id)
                    request.finish_reason = reason
                elif not mistake.get("never_free"):
                    scheduler.finish(request, reason, now)
            if mistake.get("only_finished") and reason is None:
                continue
            outputs.append(RequestOutput(request.id, token if mistake.get("bare_token") else (token,),
                                         None if mistake.get("no_reason") else reason))
        return outputs

    wrong.__name__ = name
    return wrong


def postprocess_variant(name: str, **change):
    """Learners' mistakes found by working the exercise: each changes one detail of a correct postprocess."""
    def wrong(schedule, tokens, scheduler, now):
        outputs, sampled = [], iter(tokens)
        chunks = list(schedule.chunks)
        if change.get("pops_the_schedule"):  # consumed while walking it
            schedule.chunks.clear()
        for chunk in chunks:
            request = chunk.request
            request.num_computed += chunk.length
            if change.get("stamps_every_chunk") and request.metrics.first_token is None:
                request.metrics.first_token = now
            if not chunk.samples:
                continue
            token = next(sampled)
            if not (change.get("drops_eos") and token in request.stop_ids):
                request.output_ids.append(token)
            if request.metrics.first_token is None and not (change.get("stamps_long_chunks_only") and chunk.length == 1):
                request.metrics.first_token = now
            reason = ("eos" if token in request.stop_ids
                      else "length" if len(request.output_ids) >= request.params.max_new_tokens else None)
            if reason and change.get("ends_by_hand"):
                scheduler.running.remove(request)
                scheduler.allocator.free(request.id)
                request.finish_reason = reason
            elif reason:
                scheduler.finish(request, reason, now)
            outputs.append(RequestOutput(request.id, [token] if change.get("list_of_token") else (token,), reason))
        if change.get("yields"):
            return (o for o in outputs)
        return outputs

    if change.get("generator_function"):
        def wrong(schedule, tokens, scheduler, now):  # noqa: F811 — the body never runs
            yield from ()
    wrong.__name__ = name
    return wrong


def test_postprocess_check_passes_the_reference():
    assert postprocess_variant("unchanged").__name__ == "unchanged"
    checks.stage06.check_postprocess(postprocess_variant("unchanged"), Scheduler, SchedulerConfig, ScheduledChunk,
                                     Schedule, RequestOutput)  # the variants differ from a correct one by their change only
    checks.stage06.check_postprocess(postprocess, Scheduler, SchedulerConfig, ScheduledChunk, Schedule, RequestOutput)


def test_postprocess_check_passes_an_equivalent_design():
    """Outputs built after the loop, and the reason decided by two separate ifs: the same contract."""
    def two_passes(schedule, tokens, scheduler, now):
        sampled, news = iter(tokens), []
        for chunk in schedule.chunks:
            chunk.request.num_computed += chunk.length
            if chunk.samples:
                news.append((chunk.request, next(sampled)))
        outputs = []
        for request, token in news:
            request.output_ids += [token]
            request.metrics.first_token = request.metrics.first_token or now
            reason = None
            if len(request.output_ids) == request.params.max_new_tokens:
                reason = "length"
            if token in request.stop_ids:
                reason = "eos"
            if reason:
                scheduler.finish(request, reason, now)
            outputs.append(RequestOutput(request.id, tuple([token]), reason))
        return outputs

    checks.stage06.check_postprocess(two_passes, Scheduler, SchedulerConfig, ScheduledChunk, Schedule, RequestOutput)


@mutants("6.4", [
    (postprocess_with("advance_by_one", advance_by_one=True), "advanced by 1"),
    (postprocess_with("sampling_only_advance", sampling_only_advance=True), "does not sample still advances"),
    (postprocess_with("token_per_chunk", token_per_chunk=True), "line up with the sampling chunks"),
    (postprocess_with("always_stamp", always_stamp=True), "first_token was overwritten"),
    (postprocess_with("never_free", never_free=True), "a slot never freed"),
    (postprocess_with("frees_only_the_kv", frees_only_the_kv=True), "still in scheduler.running"),
    (postprocess_with("zips_chunks_with_tokens", zips_chunks_with_tokens=True), "zip\\(chunks, tokens\\) stops at the shorter list"),
    (postprocess_with("indexes_tokens_by_chunk", indexes_tokens_by_chunk=True), "one entry per \\*sampling\\* chunk"),
    (postprocess_with("fixed_eos_id", fixed_eos_id=True), "ignore_eos ended on token 0"),
    (postprocess_with("past_the_limit", past_the_limit=True), "now holds max_new_tokens output tokens did not end"),
    (postprocess_with("one_early", one_early=True), "requests ended early"),
    (postprocess_with("length_first", length_first=True), "a stop id at the limit is still an EOS"),
    (postprocess_with("only_finished", only_finished=True), "one RequestOutput per sampling chunk — finished or not"),
    (postprocess_with("bare_token", bare_token=True), "as a 1-tuple"),
    (postprocess_with("no_reason", no_reason=True), "an output names the reason its request ended"),
    (postprocess_variant("stamps_every_chunk", stamps_every_chunk=True), "partial_prefill has a first_token"),
    (postprocess_variant("stamps_long_chunks_only", stamps_long_chunks_only=True), "one_token_prompt .* has no first_token"),
    (postprocess_variant("drops_eos", drops_eos=True), "EOS included"),
    (postprocess_variant("ends_by_hand", ends_by_hand=True), "were ended by hand"),
    (postprocess_variant("pops_the_schedule", pops_the_schedule=True), "the schedule's chunks changed"),
    (postprocess_variant("list_of_token", list_of_token=True), "as a 1-tuple"),
    (postprocess_variant("generator_function", generator_function=True), "is a generator"),
    (postprocess_variant("yields", yields=True), "return a list of RequestOutput"),
])
def test_postprocess_check_names_the_mistake(wrong, message):
    with names_the_mistake("6.4", message):
        checks.stage06.check_postprocess(wrong, Scheduler, SchedulerConfig, ScheduledChunk, Schedule, RequestOutput)


def test_a_stub_passes_through_as_not_implemented():
    def stub(*args):
        raise NotImplementedError("Exercise 6.3 is not implemented yet")

    with pytest.raises(NotImplementedError):
        checks.stage06.check_chunk_inputs(stub, ScheduledChunk)
    assert issubclass(CheckFailed, AssertionError)
