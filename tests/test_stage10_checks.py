"""Stage 10's checks: the reference passes each, and each usual mistake fails with its message."""

from __future__ import annotations

import asyncio
import json
import math
import time

from aie_lessons.checks import stage10 as checks
from aie_lessons.server.admission import MAX_RETRY_AFTER_S, Refusal, admission
from aie_lessons.server.lifecycle import DrainReport, drain
from aie_lessons.server.sse import sse_frame, sse_stream

from check_expect import mutants, names_the_mistake


def test_the_references_pass_their_checks():
    checks.check_sse_stream(sse_stream)
    checks.check_admission(admission)
    checks.check_drain(drain)


# --- 10.1 -------------------------------------------------------------------------------------


def _stream(frame=sse_frame, done=b"data: [DONE]\n\n", skip_empty=True, abort_on="finally", stop=True,
            error_frame=True, final_frame=True, block=0.0, skip_textless=False, swallow=False, returns=False):
    """The reference with one thing changed."""
    if returns:
        async def collected(events, chunk, abort):
            return [frame(chunk(event)) async for event in events]
        return collected

    async def stream(events, chunk, abort):
        finished = False
        try:
            async for event in events:
                if block:
                    time.sleep(block)
                if skip_empty and not event.text and not event.final:
                    continue
                if skip_textless and not event.text:
                    continue
                if event.finish_reason == "error" and error_frame:
                    yield frame({"error": {"message": event.error, "type": "server_error"}})
                elif final_frame or not event.final:
                    yield frame(chunk(event))
                if event.final:
                    finished = True
                    if done:
                        yield done
                    if stop:
                        return
        except asyncio.CancelledError:
            if abort_on == "cancel":
                abort()
            if not swallow:
                raise
        finally:
            if abort_on == "finally" and not finished:
                abort()
            if abort_on == "always":
                abort()
    return stream


@mutants("10.1", [
    (_stream(frame=lambda d: f"data: {json.dumps(d)}\n\n"), "yield bytes"),
    (_stream(frame=lambda d: f"data: {json.dumps(d)}\n".encode()), "frames ran together"),
    (_stream(frame=lambda d: f"data: {json.dumps(d, indent=1)}\n\n".encode()), "JSON must be on one line"),
    (_stream(frame=lambda d: f"{json.dumps(d)}\n\n".encode()), "does not start with 'data: '"),
    (_stream(done=None), "must end with data: \\[DONE\\]"),
    (_stream(done=b'data: "[DONE]"\n\n'), "literal text, not JSON"),
    (_stream(skip_empty=False), "no text that is not final was sent"),
    (_stream(final_frame=False), "final event's frame is missing"),
    (_stream(error_frame=False), "should be the error frame"),
    (_stream(abort_on="never"), "abort\\(\\) was not called"),
    (_stream(abort_on="cancel"), "server closed the stream\\) and abort\\(\\) was not called"),
    (_stream(abort_on="always"), "although the stream reached its final event"),
    (_stream(stop=False), "did not end after its final event"),
    (_stream(block=0.4), "event loop was held"),
    (_stream(skip_textless=True), "the final event has no text but gets its frame"),
    (_stream(swallow=True, abort_on="cancel"), "server closed the stream\\) and abort\\(\\) was not called"),
    (_stream(returns=True), "must be an async generator"),
    (_stream(frame=lambda d: f"data: {json.dumps(d)}\r\n\r\n".encode(), abort_on="never"), "abort\\(\\) was not called"),
])
def test_sse_stream_mistakes_are_named(wrong, message):
    with names_the_mistake("10.1", message):
        checks.check_sse_stream(wrong)


# --- 10.2 -------------------------------------------------------------------------------------


def _admit(fits=lambda w, m: w + 1 <= m, draining=True, rounding=math.ceil, over=lambda w, m: w - m + 1,
           clip=(1, MAX_RETRY_AFTER_S), rate_used=True, status=503, kind=int, message=None):
    def admit(waiting, max_waiting, is_draining, finish_rate):
        if draining and is_draining:
            return Refusal(status, 1, "draining")
        if fits(waiting, max_waiting):
            return None
        seconds = rounding(over(waiting, max_waiting) / finish_rate) if finish_rate > 0 and rate_used else 1
        retry = kind(min(max(seconds, clip[0]), clip[1]))
        return Refusal(status, retry, message or f"full: max_waiting={max_waiting}")
    return admit


@mutants("10.2", [
    (_admit(fits=lambda w, m: w < m + 1), "accepted a request over the limit"),
    (_admit(fits=lambda w, m: w + 2 <= m), "refused a request that fits"),
    (_admit(draining=False), "while the server drains"),
    (_admit(status=429), "answers 503"),
    (_admit(rounding=math.floor), "round up"),
    (_admit(over=lambda w, m: w - m), "the request itself is over the limit too"),
    (_admit(clip=(0, 10**6)), "clip it to \\[1, 60\\]"),
    (_admit(rate_used=False), "ignores the finish rate"),
    (_admit(kind=float), "must be a whole number of seconds"),
    (_admit(message="the server is full"), "should name the limit"),
    (lambda w, m, d, r: None if w + 1 <= m else Refusal(503, math.ceil((w - m + 1) / r), "max_waiting=" + str(m)),
     "ZeroDivisionError"),
])
def test_admission_mistakes_are_named(wrong, message):
    with names_the_mistake("10.2", message):
        checks.check_admission(wrong)


# --- 10.3 -------------------------------------------------------------------------------------


def _drain(stop_first=True, stop=True, sleep="async", deadline=True, abort=True, wait=True, count_at="start",
           milliseconds=False, deadline_wait=False):
    clock = time.monotonic

    async def wrong(engine, deadline_s, poll_s=0.05):
        start = clock()
        if stop and stop_first:
            engine.stop_admitting()
        at_start = engine.in_flight()
        if deadline_wait:
            await asyncio.sleep(deadline_s)
        while wait and engine.in_flight() and (not deadline or clock() - start < deadline_s):
            if sleep == "async":
                await asyncio.sleep(poll_s)
            elif sleep == "blocking":
                time.sleep(poll_s)
            else:
                await asyncio.sleep(0)
        if stop and not stop_first:
            engine.stop_admitting()
        aborted = engine.abort_all() if abort and engine.in_flight() else []
        counted = at_start if count_at == "start" else engine.in_flight()
        return DrainReport(counted, len(aborted), (clock() - start) * (1000 if milliseconds else 1))
    return wrong


@mutants("10.3", [
    (_drain(stop=False), "stop_admitting\\(\\) was never called"),
    (_drain(stop_first=False), "stop_admitting\\(\\) was called .* into the drain"),
    (_drain(sleep="blocking"), "event loop was held"),
    (_drain(sleep="busy"), "not in a busy loop"),
    (_drain(deadline=False), "did not return within"),
    (_drain(abort=False), "abort_all\\(\\) was not called"),
    (_drain(wait=False), "aborted although they would have finished"),
    (_drain(deadline_wait=True), "stop waiting as soon as in_flight\\(\\) is 0"),
    (_drain(count_at="end"), "DrainReport.in_flight should be the requests in flight when the drain began"),
    (_drain(milliseconds=True), "DrainReport.seconds"),
])
def test_drain_mistakes_are_named(wrong, message):
    with names_the_mistake("10.3", message):
        checks.check_drain(wrong)
