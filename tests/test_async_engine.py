"""The engine thread's edges, without HTTP: the bounded step log, a loop that closes under a put,
a shutdown racing new requests, and two engines' gauges side by side (a hot swap)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from aie_lessons.engine.engine import Engine, StepStats
from aie_lessons.engine.outputs import RequestOutput
from aie_lessons.engine.paged_engine import paged_engine
from aie_lessons.engine.simulator import ScriptTokenizer
from aie_lessons.engine.step_log import StepLog
from aie_lessons.model import LlamaModel
from aie_lessons.output import OutputStream
from aie_lessons.sampling import SamplingParams
from aie_lessons.server.async_engine import AsyncEngine, EngineFailed, Overloaded
from aie_lessons.server.metrics import ServerMetrics, metric_value
from aie_lessons.server.token_queue import Event, TokenQueue
from aie_lessons.tokenizer import Tokenizer


def step(number: int) -> StepStats:
    return StepStats(number, 0.0, 1.0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0)


def test_the_step_log_keeps_the_latest_steps_under_their_own_numbers():
    log = StepLog(capacity=3)
    assert len(log) == 0 and list(log) == [] and log[0:] == [] and log.capacity == 3
    for n in range(5):
        log.append(step(n))
    assert len(log) == 5 and log.first_kept == 2  # every step counted, the last three kept
    assert [s.step for s in log.kept()] == [2, 3, 4]
    with pytest.raises(IndexError, match="step 0 has left the log"):
        list(log)
    assert log[-1].step == 4 and log[3].step == 3 and [s.step for s in log[3:]] == [3, 4]
    assert log[5:] == []  # nothing since "now"
    with pytest.raises(IndexError, match=r"step 1 has left the log.*last 3 steps.*stats_capacity"):
        log[1:]  # never a silently shorter answer
    with pytest.raises(IndexError, match="step 0 has left"):
        log[0]
    with pytest.raises(IndexError):
        log[5]
    with pytest.raises(ValueError, match="capacity"):
        StepLog(0)


@pytest.fixture(scope="module")
def tiny(tiny_dir) -> tuple[LlamaModel, Tokenizer]:
    return LlamaModel.from_pretrained(tiny_dir), Tokenizer.from_pretrained(tiny_dir)


def engine_of(tiny, stats_capacity: int = 10_000) -> Engine:
    model, tokenizer = tiny
    return paged_engine(model, tokenizer, max_seqs=4, token_budget=32, stats_capacity=stats_capacity)


def test_the_engine_keeps_a_bounded_log(tiny):
    engine = engine_of(tiny, stats_capacity=4)
    engine.generate(["the cat"] * 3, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert len(engine.stats) >= 12 and [s.step for s in engine.stats.kept()] == list(range(len(engine.stats) - 4,
                                                                                               len(engine.stats)))
    with pytest.raises(IndexError, match="has left the log"):
        list(engine.stats)  # all of it is no longer there: never a silently shorter list


def test_a_put_after_the_loop_closed_is_refused_quietly():
    """The engine thread may end a request while the process exits: put says False, and never
    raises on the engine thread (asking is_closed first would leave a window for that)."""
    loop = asyncio.new_event_loop()
    queue = TokenQueue(loop, script_stream())
    assert queue.put(RequestOutput("r", (5,))) is True
    loop.close()
    assert queue.put(RequestOutput("r", (), "abort")) is False


def test_a_put_that_fails_for_another_reason_still_raises():
    class BrokenLoop:
        def call_soon_threadsafe(self, *args):
            raise RuntimeError("a bug, not a closed loop")

        def is_closed(self) -> bool:
            return False

    with pytest.raises(RuntimeError, match="a bug"):
        TokenQueue(BrokenLoop(), script_stream()).put(RequestOutput("r", (5,)))


def script_stream(**params) -> OutputStream:
    """A request's stream over the simulator's tokenizer: token i reads " i", 0 is the EOS."""
    return OutputStream(ScriptTokenizer(), [1, 2], SamplingParams(**params), {0})


def test_the_queue_makes_the_text_and_stops_the_engine_at_a_stop_string():
    """Token ids in, text out, on the event loop: a stop string found there calls on_stop once,
    ends the events with "stop", and an output the engine sent meanwhile is dropped."""
    async def main() -> list[Event]:
        stops = []
        queue = TokenQueue(asyncio.get_running_loop(), script_stream(max_new_tokens=10, stop=(" 7",)),
                           on_stop=lambda: stops.append(1))
        for output in [RequestOutput("r", (5,)), RequestOutput("r", (6,)), RequestOutput("r", (7,)),
                       RequestOutput("r", (8,)), RequestOutput("r", (), "stop")]:
            queue.put(output)
        events = [event async for event in queue.events()]
        assert stops == [1]
        return events

    events = asyncio.run(main())
    assert [e.text for e in events] == [" 5", " 6", ""] and events[-1].finish_reason == "stop"
    assert (events[-1].prompt_tokens, events[-1].completion_tokens) == (2, 3)


def test_an_end_from_the_engine_thread_carries_its_error():
    async def main() -> list[Event]:
        queue = TokenQueue(asyncio.get_running_loop(), script_stream(max_new_tokens=10))
        queue.put(RequestOutput("r", (5,)))
        queue.put(RequestOutput("r", (), "error"), "RuntimeError: a broken kernel")
        return [event async for event in queue.events()]

    events = asyncio.run(main())
    assert [e.text for e in events] == [" 5", ""]
    assert (events[-1].finish_reason, events[-1].error, events[-1].completion_tokens) == (
        "error", "RuntimeError: a broken kernel", 1)


@pytest.mark.parametrize("when", ["draining", "stopped", "failed"])
def test_requests_arriving_at_shutdown_are_refused_or_finished_never_lost(tiny, when):
    """Two clients are still tokenizing (held at a gate) when the server stops admitting, has
    stopped, or its engine has failed; one request was accepted before. When the two get through,
    each is refused with an error its client sees — 503 for a draining server, "the engine has
    stopped" after — and the accepted one ends with its final event. Nothing is accepted and
    then forgotten (the engine thread would never read it)."""
    async def main() -> None:
        engine = AsyncEngine(engine_of(tiny), max_waiting=100, metrics=ServerMetrics())
        check, gate, held = engine.engine.check_request, threading.Event(), []

        def gated_check(prompt, params):
            if prompt == "the dog":  # the late clients' text (the engine thread checks token ids again)
                held.append(prompt)
                assert gate.wait(60), "the test never opened the gate"
            return check(prompt, params)

        engine.engine.check_request = gated_check
        if when == "failed":
            def broken_step():
                raise RuntimeError("a broken kernel")
            engine.engine.step = broken_step
        engine.start()
        _, first = await engine.submit("the cat", SamplingParams(max_new_tokens=20, ignore_eos=True))
        late = [asyncio.create_task(engine.submit("the dog", SamplingParams(max_new_tokens=2))) for _ in range(2)]
        while len(held) < 2:  # both late clients are at the gate
            await asyncio.sleep(0.01)
        if when == "draining":
            engine.stop_admitting()
        events = [event async for event in first.events()]
        if when != "draining":
            await asyncio.to_thread(engine.stop, 60)
        gate.set()
        outcomes = await asyncio.gather(*late, return_exceptions=True)
        expected = {"draining": Overloaded, "stopped": EngineFailed, "failed": EngineFailed}[when]
        assert all(isinstance(o, expected) for o in outcomes), outcomes
        assert events[-1].final and events[-1].finish_reason == ("error" if when == "failed" else "length"), events
        await asyncio.to_thread(engine.stop, 60)
        assert engine.in_flight() == 0

    asyncio.run(asyncio.wait_for(main(), timeout=120))


def test_two_engines_keep_gauges_of_their_own(tiny):
    """A swap runs two engines at once, possibly of the same model: each writes its own series,
    and a stopped one's leave /metrics."""
    metrics = ServerMetrics()

    async def main() -> None:
        old = AsyncEngine(engine_of(tiny), metrics=metrics, name="tiny")
        new = AsyncEngine(engine_of(tiny), metrics=metrics, name="tiny")
        assert (old.gauges.label, new.gauges.label) == ("tiny", "tiny#2")
        old.start()
        new.start()
        _, queue = await old.submit("the cat", SamplingParams(max_new_tokens=4, ignore_eos=True))
        [event async for event in queue.events()]
        text = metrics.render().decode()
        total = old.engine.runner.allocator.num_blocks
        assert metric_value(text, "aie_kv_blocks_total", 'engine="tiny"') == total
        assert metric_value(text, "aie_kv_blocks_total", 'engine="tiny#2"') == total
        assert metric_value(text, "aie_kv_blocks_total") == 2 * total  # no labels: the sum
        await asyncio.to_thread(old.stop)
        text = metrics.render().decode()
        assert 'engine="tiny"' not in text and metric_value(text, "aie_kv_blocks_total") == total
        third = AsyncEngine(engine_of(tiny), metrics=metrics, name="tiny")  # the label is free again
        assert third.gauges.label == "tiny"
        metrics.forget_engine(old.gauges)  # a stale second forget leaves the label's new owner alone
        assert metric_value(metrics.render().decode(), "aie_kv_blocks_total", 'engine="tiny"') == 0
        third.stop()  # never started: its series go too
        await asyncio.to_thread(new.stop)
        assert metric_value(metrics.render().decode(), "aie_kv_blocks_total") is None

    asyncio.run(main())


def test_a_stop_string_stops_the_engine_before_the_handler_reads():
    """A slow client must not keep its request generating: the text is made as outputs arrive."""
    async def main() -> None:
        stops = []
        queue = TokenQueue(asyncio.get_running_loop(), script_stream(max_new_tokens=40, stop=(" 6",)),
                           on_stop=lambda: stops.append(1))
        queue.put(RequestOutput("r", (5,)))
        queue.put(RequestOutput("r", (6,)))
        await asyncio.sleep(0.05)  # nobody reads the events yet
        assert stops == [1]
        queue.put(RequestOutput("r", (7,)))  # sampled before the engine heard of the stop: dropped
        events = [event async for event in queue.events()]
        assert [e.text for e in events] == [" 5", ""] and events[-1].finish_reason == "stop"

    asyncio.run(asyncio.wait_for(main(), timeout=30))
