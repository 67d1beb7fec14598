"""Checks for stage 10: a stream's server-sent events and its abort on disconnect (10.1), the
admission rule (10.2) and the drain on shutdown (10.3).

Each check runs the learner's code on an event loop of its own, on a worker thread (a notebook
already runs one loop, and a check must not disturb it), against fakes whose timing is known: an
event source that pauses between events, an engine whose requests finish at set times. A
heartbeat task on the same loop measures whether the code ever held the loop: the mistake that
stalls every other client of a real server.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor

from aie_lessons.checks.common import CheckFailed, fail, passed

STALL_S = 0.3  # the loop held this long without a heartbeat tick: blocking code


def _run(exercise: str, coroutine_factory, timeout: float):
    """Run ``coroutine_factory()`` on a fresh loop on a worker thread; a crash in the learner's code
    is reported as the exercise's failure, a hang as one that names the wait."""
    async def bounded():
        return await asyncio.wait_for(coroutine_factory(), timeout)

    with ThreadPoolExecutor(1) as pool:
        try:
            return pool.submit(asyncio.run, bounded()).result()
        except (CheckFailed, NotImplementedError):
            raise
        except asyncio.TimeoutError:
            raise
        except Exception as exc:
            raise CheckFailed(f"Exercise {exercise}: your code raised {type(exc).__name__}: {exc}") from exc


class Heartbeat:
    """Ticks every 10 ms on the loop; ``longest`` is the longest gap between two ticks (the last
    one up to the exit included: code that never awaits leaves no tick at all)."""

    def __init__(self):
        self.longest, self.last, self._task = 0.0, 0.0, None

    async def __aenter__(self):
        async def beat():
            while True:
                await asyncio.sleep(0.01)
                now = time.perf_counter()
                self.longest, self.last = max(self.longest, now - self.last), now

        self.last = time.perf_counter()
        self._task = asyncio.ensure_future(beat())
        return self

    async def __aexit__(self, *exc):
        self.longest = max(self.longest, time.perf_counter() - self.last - 0.01)
        self._task.cancel()


# --- 10.1 -------------------------------------------------------------------------------------


def _event(**fields):
    from aie_lessons.server.token_queue import Event

    return Event(**fields)


def _chunk(event) -> dict:
    return {"text": event.text, "finish_reason": event.finish_reason, "completion_tokens": event.completion_tokens}


async def _source(events, pause: float = 0.02, then_wait: bool = False):
    for event in events:
        await asyncio.sleep(pause)
        yield event
    if then_wait:  # a source that stays open: only the stream's own rule may end it
        await asyncio.Event().wait()


def _frames(exercise: str, items: list, what: str) -> list[str]:
    """The SSE frames of a response body, checked against the format: bytes, ``data: `` lines,
    each frame ended by a blank line."""
    for item in items:
        if not isinstance(item, (bytes, bytearray)):
            fail(exercise, f"{what}: yield bytes, got {type(item).__name__} {item!r:.50} — encode the frame "
                           "(str.encode()) or use sse_frame(...)")
    body = b"".join(items).decode().replace("\r\n", "\n")  # CRLF line ends are valid SSE too
    if not body.endswith("\n\n"):
        fail(exercise, f"{what}: the body ends with {body[-20:]!r}: every frame ends with a blank line "
                       "('\\n\\n') — without it the client waits for the rest of the event")
    frames = body[:-2].split("\n\n")
    for frame in frames:
        if not frame.startswith("data: "):
            fail(exercise, f"{what}: the frame {frame!r:.60} does not start with 'data: ' — each frame is "
                           "b'data: ' + payload + b'\\n\\n'")
        if "\ndata: " in frame:
            fail(exercise, f"{what}: two frames ran together ({frame!r:.80}): every frame ends with a blank "
                           "line ('\\n\\n') — with one '\\n' the client reads them as one event")
        if "\n" in frame:
            fail(exercise, f"{what}: the frame {frame!r:.80} spans several lines: a line break ends an SSE "
                           "field, so the JSON must be on one line — json.dumps(data) without indent")
    return [frame[len("data: "):] for frame in frames]


def _expect_stream(exercise: str, payloads: list[str], expected: list[dict], what: str) -> None:
    if payloads and payloads[-1] != "[DONE]" and [json.loads(p) for p in payloads if p.startswith("{")] == expected[:-1]:
        fail(exercise, f"{what}: the final event was skipped — it has no text, but it carries finish_reason and "
                       "the usage: skip only events that have no text and are not final, then send [DONE]")
    if not payloads or payloads[-1] != "[DONE]":
        last = payloads[-1] if payloads else "nothing"
        if payloads and payloads[-1] == '"[DONE]"':
            fail(exercise, f"{what}: the last frame is data: \"[DONE]\" — [DONE] is literal text, not JSON: "
                           "b'data: [DONE]\\n\\n'")
        fail(exercise, f"{what}: the stream must end with data: [DONE] (OpenAI's clients wait for it), "
                       f"the last frame was {last!r:.60}")
    if payloads.count("[DONE]") != 1:
        fail(exercise, f"{what}: [DONE] is sent {payloads.count('[DONE]')} times: once, after the final event")
    try:
        got = [json.loads(p) for p in payloads[:-1]]
    except json.JSONDecodeError as exc:
        fail(exercise, f"{what}: a frame's data is not JSON ({exc}): json.dumps(chunk(event))")
    if len(got) < len(expected) and got == expected[:len(got)]:
        missing = expected[len(got)]
        why = ("the final event's frame is missing: it carries finish_reason and the usage, so yield it before "
               "[DONE]" if len(got) == len(expected) - 1 else f"the frame for {missing} is missing")
        fail(exercise, f"{what}: {why}")
    if len(got) > len(expected) and any(g.get("text") == "" and g.get("finish_reason") is None for g in got):
        fail(exercise, f"{what}: an event with no text that is not final was sent: skip it (an empty chunk "
                       "tells the client nothing)")
    if got != expected and "error" in expected[-1] and got[:-1] == expected[:-1]:
        fail(exercise, f"{what}: the last frame should be the error frame {expected[-1]}, got {got[-1]} — a final "
                       "event whose finish_reason is \"error\" is sent as {\"error\": {\"message\": event.error, "
                       "\"type\": \"server_error\"}}, not as a chunk")
    if got != expected:
        fail(exercise, f"{what}: expected the frames' data {expected}, got {got} — one frame per event with text "
                       "(or final), in order, holding chunk(event)")


async def _opened(exercise: str, sse_stream, *args):
    """``sse_stream(*args)`` as an async generator. A stub has no ``yield``, so calling it makes a
    coroutine: awaiting it raises the stub's NotImplementedError."""
    stream = sse_stream(*args)
    if inspect.iscoroutine(stream):
        try:
            await asyncio.wait_for(stream, 0.5)
        except asyncio.TimeoutError:
            pass
        fail(exercise, "sse_stream must be an async generator: yield each frame (an async def with yield "
                       "in it), do not collect them and return them")
    if not inspect.isasyncgen(stream):
        fail(exercise, f"sse_stream must be an async generator (async def with yield), it returned "
                       f"{type(stream).__name__}")
    return stream


def check_sse_stream(sse_stream) -> None:
    """10.1: a stream of text events, an error end, a client that leaves (closed, then cancelled),
    a source that stays open after its final event, and the loop never held."""
    ex = "10.1"
    events = [_event(text="Hel"), _event(text=""), _event(text="lo world"),  # the final event has no text,
              _event(finish_reason="stop", prompt_tokens=4, completion_tokens=3)]  # as the engine's has
    expected = [_chunk(events[0]), _chunk(events[2]), _chunk(events[3])]

    async def whole(source_events, then_wait=False):
        aborts = []
        async with Heartbeat() as heart:
            stream = await _opened(ex, sse_stream, _source(source_events, then_wait=then_wait), _chunk,
                                   lambda: aborts.append(1))
            items = [item async for item in stream]
        return items, len(aborts), heart.longest

    try:
        items, aborts, stall = _run(ex, lambda: whole(events, then_wait=True), 3.0)
    except asyncio.TimeoutError:
        fail(ex, "the stream did not end after its final event (the source stayed open): the final event has "
                 "no text but gets its frame all the same; after it, yield [DONE] and return — do not wait for "
                 "more events")
    what = "a stream of 4 events (one with no text, the last final)"
    payloads = _frames(ex, items, what)
    _expect_stream(ex, payloads, expected, what)
    if aborts:
        fail(ex, f"{what}: abort() was called {aborts} time(s) although the stream reached its final event — "
                 "abort only when the stream ends early (the client left)")
    if stall > STALL_S:
        fail(ex, f"{what}: the event loop was held for {stall:.2f} s at once — blocking code (time.sleep, a "
                 "blocking queue.get) stalls every other client: wait only with await")

    error = [_event(text="partial"), _event(finish_reason="error", error="CUDA out of memory")]
    items, aborts, _ = _run(ex, lambda: whole(error), 3.0)
    what = "a stream whose engine failed"
    payloads = _frames(ex, items, what)
    _expect_stream(ex, payloads, [_chunk(error[0]), {"error": {"message": "CUDA out of memory",
                                                               "type": "server_error"}}], what)

    async def leaves(how: str):
        aborts = []
        stream = await _opened(ex, sse_stream, _source([_event(text="a"), _event(text="b")], then_wait=True),
                               _chunk, lambda: aborts.append(1))
        got = [await stream.__anext__(), await stream.__anext__()]
        if how == "close":  # the server closes the body's generator
            await stream.aclose()
        else:  # the server cancels the task that waits for the next frame
            task = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.05)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except StopAsyncIteration:
                fail(ex, "the server cancelled the task waiting for the next event and the stream ended quietly: "
                         "the CancelledError was swallowed — let it propagate (abort in finally, no except that "
                         "keeps it), or the server cannot tell the task was cancelled")
        return got, len(aborts)

    for how, when in (("close", "the server closed the stream"),
                      ("cancel", "the server cancelled the task waiting for the next event")):
        _, aborts = _run(ex, lambda: leaves(how), 3.0)
        if aborts == 0:
            fail(ex, f"the client left after 2 frames ({when}) and abort() was not called: the request would go "
                     "on generating, holding its KV blocks, for nobody — call it in a finally block when the "
                     "final event was not reached")
        if aborts > 1:
            fail(ex, f"the client left ({when}) and abort() was called {aborts} times: once is enough")
    passed(ex, "one-line JSON frames ended by a blank line, empty events skipped, the final and error frames, "
               "[DONE]; abort() once when the client leaves (closed or cancelled), never after the end; the "
               "loop never held")


# --- 10.2 -------------------------------------------------------------------------------------


def _expected_retry(waiting: int, max_waiting: int, rate: float) -> int:
    over = waiting - max_waiting + 1
    return min(max(math.ceil(over / rate) if rate > 0 else 1, 1), 60)


def check_admission(admission) -> None:
    """10.2: accept below the limit, refuse at it (the request itself counts), refuse while
    draining, Retry-After from the finish rate (rounded up, clipped to [1, 60], 1 when unknown)."""
    ex = "10.2"
    cases = [  # waiting, max_waiting, draining, finish_rate
        (0, 4, False, 0.0), (3, 4, False, 1.0), (4, 4, False, 0.0), (0, 0, False, 5.0), (9, 4, False, 2.0),
        (9, 4, False, 0.5), (8, 4, False, 2.0), (400, 4, False, 0.1), (5, 4, False, 100.0), (0, 4, True, 3.0),
        (2, 4, True, 0.0), (9, 4, True, 0.5),
    ]
    for waiting, max_waiting, draining, rate in cases:
        what = (f"admission(waiting={waiting}, max_waiting={max_waiting}, draining={draining}, "
                f"finish_rate={rate})")
        try:
            got = admission(waiting, max_waiting, draining, rate)
        except NotImplementedError:
            raise
        except ZeroDivisionError as exc:
            raise CheckFailed(f"Exercise {ex}: {what} raised ZeroDivisionError: a finish rate of 0 means not "
                              "known yet — say 1 second then") from exc
        except Exception as exc:
            raise CheckFailed(f"Exercise {ex}: {what}: your code raised {type(exc).__name__}: {exc}") from exc
        fits = waiting + 1 <= max_waiting
        if draining:
            if got is None:
                fail(ex, f"{what} accepted the request: while the server drains, every new request is refused "
                         "(it is about to stop; another server can take it)")
        elif fits and got is not None:
            fail(ex, f"{what} refused a request that fits: {waiting} waiting + this one = {waiting + 1} ≤ "
                     f"{max_waiting} — refuse only when waiting + 1 > max_waiting")
        elif not fits and got is None:
            fail(ex, f"{what} accepted a request over the limit: with it, {waiting + 1} would wait, more than "
                     f"max_waiting={max_waiting} (the request itself counts)")
        if got is None:
            continue
        for name in ("status", "retry_after", "message"):
            if not hasattr(got, name):
                fail(ex, f"{what}: return a Refusal(status, retry_after, message), got {type(got).__name__}")
        if got.status != 503:
            fail(ex, f"{what}: status {got.status!r}: an overloaded or stopping server answers 503 Service "
                     "Unavailable (429 is for a client over its own quota)")
        if not isinstance(got.retry_after, int) or isinstance(got.retry_after, bool):
            fail(ex, f"{what}: retry_after={got.retry_after!r} must be a whole number of seconds (int): "
                     "Retry-After takes an integer — round up with math.ceil")
        if not isinstance(got.message, str) or not got.message.strip():
            fail(ex, f"{what}: the message is empty: say why (and the fix) for whoever reads the log")
        if draining:
            if got.retry_after != 1:
                fail(ex, f"{what}: retry_after={got.retry_after} while draining: say 1 (another server may "
                         "take the request; this one is going away)")
            continue
        want = _expected_retry(waiting, max_waiting, rate)
        if got.retry_after != want:
            over = waiting - max_waiting + 1
            raw = over / rate if rate > 0 else None
            if not 1 <= got.retry_after <= 60:
                why = "clip it to [1, 60]: 0 makes clients retry at once, and a wait of minutes is a guess"
            elif rate > 0 and got.retry_after == min(max(math.floor(raw), 1), 60):
                why = "round up (math.ceil): a client that retries too early only gets another 503"
            elif rate > 0 and got.retry_after == min(max(math.ceil((over - 1) / rate), 1), 60):
                why = ("the request itself is over the limit too: the requests to wait for are waiting − "
                       "max_waiting + 1")
            elif got.retry_after == 1:
                why = ("it ignores the finish rate: the requests over the limit divided by the rate at which "
                       "requests finish")
            else:
                why = "ceil((waiting − max_waiting + 1) / finish_rate), clipped to [1, 60], or 1 with no rate"
            fail(ex, f"{what}: retry_after should be {want}, got {got.retry_after} — {why}")
        if str(max_waiting) not in got.message or "max_waiting" not in got.message:
            fail(ex, f"{what}: the message {got.message!r:.80} should name the limit (max_waiting={max_waiting}) so "
                     "that an operator knows which setting to raise")
    passed(ex, "accepts while waiting + 1 ≤ max_waiting, refuses with 503 at the limit and while draining; "
               "Retry-After rounded up from the finish rate, clipped to [1, 60], 1 when unknown")


# --- 10.3 -------------------------------------------------------------------------------------


class FakeEngine:
    """Requests that finish at set seconds after the drain starts (``math.inf``: never), and a
    record of what the drain did and when."""

    def __init__(self, finish_at: list[float]):
        self.finish_at = list(finish_at)
        self.start = time.monotonic()
        self.admitting_stopped: float | None = None
        self.polls = 0
        self.aborted_at: float | None = None
        self.abort_calls = 0
        self.aborted: list[str] = []

    def _now(self) -> float:
        return time.monotonic() - self.start

    def _left(self) -> list[int]:
        if self.aborted_at is not None:
            return []
        now = self._now()
        return [i for i, t in enumerate(self.finish_at) if t > now]

    def stop_admitting(self) -> None:
        if self.admitting_stopped is None:
            self.admitting_stopped = self._now()

    def in_flight(self) -> int:
        self.polls += 1
        return len(self._left())

    def abort_all(self) -> list[str]:
        self.abort_calls += 1
        left = [f"r{i}" for i in self._left()]
        if self.aborted_at is None:
            self.aborted_at, self.aborted = self._now(), left
        return left


def check_drain(drain) -> None:
    """10.3: requests that finish before the deadline (none aborted), requests that never finish
    (aborted at the deadline), nothing in flight; admission stopped first, polling that gives the
    loop back at the pace asked, and the report's numbers."""
    ex = "10.3"
    cases = [  # finish_at (s after the start), deadline_s, expected aborted
        ([0.08, 0.16, 0.24], 2.0, 0),
        ([0.2, 0.5, 0.8], 3.0, 0),  # long enough that polling with time.sleep holds the loop past STALL_S
        ([0.08, math.inf, math.inf], 0.3, 2),
        ([], 1.0, 0),
    ]
    for finish_at, deadline, want_aborted in cases:
        finite = [t for t in finish_at if t < math.inf]
        what = (f"{len(finish_at)} requests in flight, {len(finite)} finishing within {max(finite, default=0):.2f} s, "
                f"deadline {deadline} s")

        async def run_one():
            engine = FakeEngine(finish_at)
            async with Heartbeat() as heart:
                report = await drain(engine, deadline, 0.02)
            return engine, report, heart.longest, time.monotonic() - engine.start

        try:
            engine, report, stall, took = _run(ex, run_one, deadline + 3.0)
        except asyncio.TimeoutError:
            fail(ex, f"{what}: drain did not return within {deadline + 3:.1f} s — stop waiting at the deadline "
                     "(compare time.monotonic() - start with deadline_s) and abort what is left")
        if engine.admitting_stopped is None:
            fail(ex, f"{what}: stop_admitting() was never called — new requests would keep arriving while you "
                     "wait, and the drain might never end")
        if engine.admitting_stopped > 0.05:
            fail(ex, f"{what}: stop_admitting() was called {engine.admitting_stopped:.2f} s into the drain: call it "
                     "first, or requests accepted meanwhile would be cut at exit")
        if stall > STALL_S:
            fail(ex, f"{what}: the event loop was held for {stall:.2f} s at once — time.sleep blocks the loop, "
                     "so the streams you are waiting for are never sent: await asyncio.sleep(poll_s)")
        if engine.polls > 20 * (took / 0.02 + 5):
            fail(ex, f"{what}: in_flight() was called {engine.polls} times in {took:.2f} s: poll every poll_s "
                     "seconds (await asyncio.sleep(poll_s)), not in a busy loop")
        if want_aborted == 0 and engine.aborted:
            fail(ex, f"{what}: {len(engine.aborted)} requests were aborted although they would have finished "
                     "before the deadline — accepted requests (waiting ones too) are finished, not dropped")
        if want_aborted == 0 and finish_at and took > max(finite) + 0.3:
            fail(ex, f"{what}: drain returned after {took:.2f} s, though every request had finished by "
                     f"{max(finite):.2f} s — stop waiting as soon as in_flight() is 0 (a server that waits out the "
                     "whole deadline makes every deploy slow)")
        if want_aborted == 0 and finish_at and took < max(finite) - 0.01:
            fail(ex, f"{what}: drain returned after {took:.2f} s, while requests were still in flight — wait until "
                     "in_flight() is 0 (or the deadline)")
        if want_aborted:
            if engine.aborted_at is None:
                fail(ex, f"{what}: past the deadline {want_aborted} requests were still in flight and abort_all() "
                         "was not called: their clients would be cut without a word — abort them so each one hears")
            if engine.aborted_at < deadline - 0.01:
                fail(ex, f"{what}: abort_all() was called {engine.aborted_at:.2f} s in, before the deadline of "
                         f"{deadline} s — wait for the deadline first")
            if engine.aborted_at > deadline + 0.3:
                fail(ex, f"{what}: abort_all() was called {engine.aborted_at:.2f} s in, long after the deadline "
                         f"of {deadline} s")
        for name in ("in_flight", "aborted", "seconds"):
            if not hasattr(report, name):
                fail(ex, f"{what}: return a DrainReport(in_flight, aborted, seconds), got {type(report).__name__}")
        if report.in_flight != len(finish_at):
            fail(ex, f"{what}: DrainReport.in_flight should be the requests in flight when the drain began "
                     f"({len(finish_at)}), got {report.in_flight}")
        if report.aborted != want_aborted:
            fail(ex, f"{what}: DrainReport.aborted should be {want_aborted} (the ids abort_all() returned), "
                     f"got {report.aborted}")
        if not abs(report.seconds - took) < 0.1:
            fail(ex, f"{what}: DrainReport.seconds is {report.seconds!r}, but the drain took {took:.2f} s — "
                     "time.monotonic() at the end minus at the start")
    passed(ex, "stops admitting first, waits (with await) for running and waiting requests, aborts only what is "
               "left at the deadline, and reports in flight, aborted and seconds")
