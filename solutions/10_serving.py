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
# # Stage 10 — Serving the engine over HTTP
#
# Stages 06 and 07 built an engine that serves many requests at once, one `step()` at a time.
# So far a Python loop called `step()` and the requests were a list given up front. A real
# service gets its requests from the network, one at a time, from clients that come and go: a
# client asks for a stream and reads it token by token, another gives up halfway, a third arrives
# while the machine is already full, and an operator stops the server to deploy a new model.
# This stage puts the engine behind an HTTP API that the usual clients already speak — OpenAI's —
# and makes each of those moments safe:
#
# ```
#   client ──HTTP──► event loop (FastAPI, uvicorn) ──submit──► inbox ──► engine thread: Engine.step()
#      ▲              one handler per request                               │ RequestOutputs (ids)
#      └──── SSE ◄──── sse_stream (10.1) ◄──── TokenQueue (per request) ◄───┘
#                      admission (10.2): 503 + Retry-After when the waiting queue is full
#                      drain (10.3): on SIGTERM, finish what was accepted, then exit
# ```
#
# 1. **Streaming.** Each request gets a queue of events; its handler turns them into server-sent
#    events — your exercise 10.1 — and tells the engine when the client has gone (section 1).
# 2. **Overload.** A server that accepts everything answers nobody in time: a bounded waiting
#    queue, and a `503` that says when to come back — exercise 10.2 (section 2).
# 3. **The engine thread.** `Engine.step()` computes without pause, step after step; it runs on a
#    thread of its own so that the event loop stays free for the network (section 3).
# 4. **The HTTP API**, OpenAI-compatible, checked with the `openai` client itself, with bad input
#    refused by name, `/health` and `/metrics` (section 4).
# 5. **Stopping and swapping.** A graceful stop — exercise 10.3 — and a hot model swap that drops
#    no request (section 5).
# 6. **The application and the process**: the routes, a middleware for request ids, size limits
#    and JSON logs, and uvicorn with your drain on `SIGTERM` (section 6).
# 7. **The server, for real**: `aie serve` as a process, driven by real clients (section 7); a
#    load test with the latency knee and a capacity plan (section 8); a graceful stop (section 9).
#
# Everything here runs on the stage-07 engine you built: the server adds no model code.

# %%
# Stages you committed with `aie commit` are imported below; this checks them first.
from aie_lessons.course.progress import verify_committed_stages

verify_committed_stages(before="10")

# %%
import asyncio
import json
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from aie_lessons import checks
from aie_lessons.engine.engine import Engine, drive
from aie_lessons.engine.output_processor import read_output
from aie_lessons.engine.outputs import RequestOutput
from aie_lessons.engine.paged_engine import paged_engine
from aie_lessons.infra.paths import default_model_dir
from aie_lessons.model import LlamaModel
from aie_lessons.output import OutputStream
from aie_lessons.sampling import SamplingParams
from aie_lessons.tokenizer import Tokenizer

torch.manual_seed(0)
MODEL_DIR = default_model_dir()
model = LlamaModel.from_pretrained(MODEL_DIR)
tokenizer = Tokenizer.from_pretrained(MODEL_DIR)

# %% [markdown]
# ## 1. A stream per request
#
# A client that asks for `"stream": true` wants each piece of text as soon as it exists, not the
# whole answer at the end: a chat window shows words appearing. Over HTTP the usual way is
# **server-sent events** (SSE): one response that stays open, with `Content-Type:
# text/event-stream`, into which the server writes *events* as they happen. The format is
# plain text. An event is one or more `field: value` lines followed by a **blank line**; OpenAI's
# API (and every client library written for it) uses one field, `data`, holding a JSON object,
# and ends the stream with the literal `data: [DONE]`:
#
# ```
# data: {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": " Paris", "finish_reason": null}]}
#
# data: {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": ".", "finish_reason": "stop"}]}
#
# data: [DONE]
#
# ```
#
# The blank line is what ends an event: a client reading `data: …\n` without it keeps waiting
# for more lines of the same event. And since a line break ends a field, the JSON must be on one
# line (`json.dumps` without `indent` escapes the line breaks inside strings as `\n`).
#
# Where do the events come from? The engine runs on a thread of its own (section 3); the
# request's handler runs on the server's event loop. Each request has a `TokenQueue` between the
# two: the engine thread `put`s each `RequestOutput` of the request into it (token ids: stage 06's
# engine only computes), and the handler reads `Event`s out of it — the queue turns the ids into
# text on the event loop with the request's `OutputStream` (stage 06's `read_output`), so a
# stop string is found there, and ends the request at the engine through `on_stop`. The last
# event says why the request ended (`finish_reason`) and how many tokens it used.

# %%
# export: server.token_queue
"""One request's events, handed from the engine's thread to its HTTP handler on the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Event:
    """What a request's handler reads: a piece of text, or the end (``final``).

    The last event carries the usage (tokens in and out) and why the request ended —
    "eos", "stop", "length", "abort" (a client left, or the server stopped) or "error" (the
    engine failed; ``error`` says how).
    """

    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None


class TokenQueue:
    """A request's outputs, ``put`` by the engine thread; its ``events()``, read on the event loop.

    ``asyncio.Queue`` belongs to its event loop and is not thread-safe: a ``put_nowait`` from
    another thread would change it behind the loop's back and, worse, would not wake a loop that
    is waiting for the network, so the event would sit there until something else happened.
    ``call_soon_threadsafe`` hands the ``put_nowait`` to the loop itself and wakes it.

    Text is made on the loop's side, from the request's ``OutputStream``, as soon as an output
    arrives — not when the handler reads it, which a slow client delays: the engine thread only
    computes, and a stop string ends the request at once. ``on_stop`` is called once when the
    stream stops at a stop string the engine cannot see (it ends the request there).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, stream: OutputStream,
                 on_stop: Callable[[], object] = lambda: None):
        self.loop = loop
        self.stream = stream
        self.on_stop = on_stop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self._ended = False  # the final event is queued: later outputs (the engine's echo of a stop) are dropped

    def put(self, output: RequestOutput, error: str | None = None) -> bool:
        """Called on the engine thread: never blocks it (the queue has no bound). ``error`` says
        what went wrong when the engine thread ends the request with "error". False if the event
        loop has closed — the process is exiting, and nobody is left to read the output.

        Asking ``loop.is_closed()`` first and then putting would race: the loop can close in
        between, and the put would raise on the engine thread. So the put is tried, and the one
        error a closed loop gives is told apart from any other by asking after it."""
        try:
            self.loop.call_soon_threadsafe(self._receive, output, error)
        except RuntimeError:
            if not self.loop.is_closed():
                raise
            return False
        return True

    def _receive(self, output: RequestOutput, error: str | None) -> None:
        """On the event loop, the moment an output arrives: its text, as events."""
        if self._ended:
            return
        text = read_output(self.stream, output)
        if not self.stream.finished:
            if text:
                self.queue.put_nowait(Event(text=text))
            return
        self._ended = True
        if not output.finished:  # a stop string: the engine, which sees no text, goes on until told
            self.on_stop()
        result = self.stream.result
        self.queue.put_nowait(Event(text, result.finish_reason, len(result.prompt_ids), len(result.token_ids), error))

    async def events(self) -> AsyncIterator[Event]:
        """The request's events in order, up to and including the final one."""
        while True:
            event = await self.queue.get()
            yield event
            if event.final:
                return


# %% [markdown]
# ### Exercise 10.1 — frame the stream, and free on disconnect
#
# `sse_stream(events, chunk, abort)` is the body of a streaming response. For each event of
# `events` (an async iterator of `Event`s, ending with a final one) it yields one SSE frame as
# `bytes`: `data: ` + the JSON of `chunk(event)` on one line + a blank line — `sse_frame(data)`
# below builds one. Skip events with no text unless they are final (an empty chunk tells the
# client nothing); the final event usually has no text, but it always gets its frame, since it
# carries the `finish_reason` and the usage. A final event whose `finish_reason` is `"error"`
# becomes an error frame instead, `{"error": {"message": event.error, "type": "server_error"}}`.
# After the final event's frame, end with `data: [DONE]` (not JSON: the literal text) and stop.
#
# The other half: if the stream ends **before** its final event — the client disconnected, so
# the server closed or cancelled this generator while it waited — call `abort()` exactly once,
# so the engine ends the request and frees its KV blocks at once instead of generating tokens
# nobody reads. A stream that reached its final event must not call it. And never block: this
# runs on the event loop that serves every other client, so wait for events only with `await`.

# %%
# export: server.sse
"""A streaming response's body: server-sent events, OpenAI's way."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable


def sse_frame(data: dict) -> bytes:
    """One server-sent event holding ``data`` as JSON, on one line, ended by a blank line."""
    return f"data: {json.dumps(data)}\n\n".encode()


async def sse_stream(events: AsyncIterator[Event], chunk: Callable[[Event], dict],
                     abort: Callable[[], None]) -> AsyncIterator[bytes]:
    """A streaming response's body: one ``data:`` frame per event, then ``data: [DONE]``;
    ``abort()`` if it ends before the final event (the client went away)."""
    # BEGIN EXERCISE 10.1: yield one SSE frame (bytes) per event with text or a final one — an error frame for an "error" end — then b"data: [DONE]\n\n"; call abort() once if the stream stops before its final event
    # Hint 1: A frame is b"data: " + one line of JSON + b"\n\n": the blank line ends the event. Ending early happens while the generator waits at an await or a yield: the server cancels it or closes it, which raises inside it — so the "did we reach the end?" question belongs in a finally block.
    # Hint 2: Keep a flag that says whether the final event was reached, set as soon as it arrives. Loop over the events with async for; skip the empty non-final ones; build each frame with sse_frame from chunk(event), or from an error dict for an "error" end; after the final event's frame send the literal [DONE] frame and return. Put the loop inside try, and in its finally call abort() when the flag is still unset.
    finished = False
    try:
        async for event in events:
            if not event.text and not event.final:
                continue
            finished = event.final
            if event.finish_reason == "error":
                yield sse_frame({"error": {"message": event.error, "type": "server_error"}})
            else:
                yield sse_frame(chunk(event))
            if finished:
                yield b"data: [DONE]\n\n"
                return
    finally:
        if not finished:
            abort()
    # END EXERCISE 10.1


# %%
# Check exercise 10.1
checks.stage10.check_sse_stream(sse_stream)

# %% [markdown]
# Here is what a client receives for a short stream of events (section 4 builds the real
# `chunk`, with OpenAI's fields):

# %%
async def demo_events():
    for event in (Event(text="Paris"), Event(text=""), Event(text=" is."),
                  Event(finish_reason="stop", prompt_tokens=5, completion_tokens=3)):
        yield event


async def show_frames():
    frames = [frame async for frame in sse_stream(demo_events(), lambda e: {"text": e.text, "finish_reason": e.finish_reason},
                                                  abort=lambda: print("aborted"))]
    print(b"".join(frames).decode(), end="")


await show_frames()

# %% [markdown]
# ## 2. Admission: saying no, early
#
# A server gets requests faster than it finishes them now and then. The engine already queues
# them: its scheduler runs at most `max_seqs` at once and keeps the rest waiting. But a queue
# with no bound turns a burst into latency for everyone: every request that joins it waits for
# all those before it, and once the wait is longer than a client's patience the server is
# computing answers nobody will read. So a server bounds its waiting queue and refuses the
# request that would overflow it, **at once**, with `503 Service Unavailable` and a
# `Retry-After` header: a load balancer sends it elsewhere, a client backs off and tries again.
#
# How long should it wait? The server knows how fast requests have been finishing: with `w`
# requests waiting and `r` of them finishing per second, the queue has room again in about
# `(w − limit + 1) / r` seconds. `Retry-After` is a whole number of seconds; the rule clips it to
# between 1 and 60, and says 1 when the rate is not known yet (nothing has finished).
#
# A server that is shutting down (section 5) refuses every new request too, whatever its queue.

# %% [markdown]
# ### Exercise 10.2 — the admission rule
#
# `admission(waiting, max_waiting, draining, finish_rate)` returns `None` to accept a request
# and a `Refusal(status=503, retry_after=…, message=…)` to refuse it. `waiting` counts the
# requests accepted that cannot run yet, *before* this one; accept while `waiting + 1` is at most
# `max_waiting` (at least 1: a request that finds a free place counts itself as the one waiting
# for an instant, so with nothing waiting it is always accepted). While `draining`, refuse with
# `retry_after` 1 (another server may take it; this one is going away). Otherwise, when full,
# `retry_after = ceil((waiting − max_waiting + 1) / finish_rate)` clipped to [1, 60], or 1 when
# `finish_rate` is 0. The message says `max_waiting` and its value, and the fix, for the person
# who reads it in a log and has to decide which setting to change.

# %%
# export: server.admission
"""Whether a new request may join the waiting queue, and if not, when to come back."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_RETRY_AFTER_S = 60


@dataclass(frozen=True)
class Refusal:
    """A request refused before any work: the HTTP status, ``Retry-After`` (whole seconds), why."""

    status: int
    retry_after: int
    message: str


def admission(waiting: int, max_waiting: int, draining: bool, finish_rate: float) -> Refusal | None:
    """None to accept one more request; a 503 ``Refusal`` when the waiting queue is full or the
    server is draining. ``finish_rate``: requests finished per second lately (0: not known yet)."""
    # BEGIN EXERCISE 10.2: return None if the request may join the queue (waiting + 1 <= max_waiting, not draining), else Refusal(503, retry_after, message) with retry_after from the finish rate, clipped to [1, 60]
    # Hint 1: Two reasons to refuse: the server is draining, or the queue would be over its limit with this request in it. Retry-After estimates when there is room again: the requests over the limit, divided by the rate at which requests leave the queue.
    # Hint 2: Check draining first (a refusal with Retry-After 1). Then accept when one more waiting request stays within max_waiting. Otherwise the requests over the limit are waiting − max_waiting + 1; divide by finish_rate and round up (1 when the rate is 0), clip to 1…60 with min and max, and put the limit's name and value in the message.
    if draining:
        return Refusal(503, 1, "the server is shutting down and accepts no new requests. Fix: retry on another "
                               "server, or here once it has restarted")
    if waiting + 1 <= max_waiting:
        return None
    over = waiting - max_waiting + 1
    seconds = math.ceil(over / finish_rate) if finish_rate > 0 else 1
    retry_after = min(max(seconds, 1), MAX_RETRY_AFTER_S)
    return Refusal(503, retry_after, f"the server is full: {waiting} requests are waiting, the limit is max_waiting="
                                     f"{max_waiting}. Fix: retry after {retry_after} s, or raise max_waiting "
                                     "in the server's config (at the cost of longer waits)")
    # END EXERCISE 10.2


# %%
# Check exercise 10.2
checks.stage10.check_admission(admission)

# %% [markdown]
# ## 3. One engine thread
#
# A server's event loop (asyncio) runs thousands of clients on one thread because each handler
# spends its time *waiting* — for bytes from the network, for a database — and gives the loop
# back at every `await`. A step of the engine is the opposite: tens of milliseconds of
# arithmetic that never waits. Run it on the loop and every other client stalls for the whole
# step: no new request is read, no token of another stream is sent, and `/health` times out.
# So the engine gets a **thread of its own**, which does nothing but step:
#
# ```
#   event loop                               engine thread
#   ──────────                               ─────────────
#   submit(prompt) ─► inbox (deque) ───────► take the inbox: add_request / abort
#        │  admission (10.2)                 step(): schedule, run, sample, postprocess
#        ▼                                    │ each RequestOutput ─► TokenQueue.put(output)
#   await queue.events() ◄─────────────────── │ (token ids; the last one says why it ended)
#   (token ids ─► text, stop strings)        idle: sleep until the inbox has something
# ```
#
# Only the engine thread touches the engine: the loop talks to it through the inbox (a `deque`,
# whose `append` and `popleft` are atomic) and a `threading.Event` that wakes it. PyTorch
# releases Python's global lock inside its kernels, so while the thread multiplies matrices the
# loop goes on serving the network.
#
# The engine thread also feeds the server's **metrics** — a `/metrics` page in Prometheus'
# text format, which a monitoring system reads every few seconds: requests running and waiting,
# KV blocks in use, the batch size of each step, and histograms of time to first token (TTFT),
# inter-token latency and end-to-end latency, which give their percentiles. What describes an
# engine (requests running and waiting, KV blocks) carries an `engine` label: during a hot swap
# (section 5) two engines run side by side, and each keeps its own series until it stops.

# %%
# export: server.metrics
"""The server's measurements in Prometheus' text format: what ``/metrics`` shows."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class EngineGauges:
    """One engine's gauges, under its own ``engine`` label."""

    label: str
    running: Gauge
    waiting: Gauge
    kv_used: Gauge
    kv_total: Gauge
    tracked: Gauge


class ServerMetrics:
    """Gauges, counters and histograms of one server, in a registry of its own (not the process'
    global one), so that two servers in one process — or a test's — never share a number.

    What an engine *is* (requests running and waiting, KV blocks) is a gauge per engine, labelled
    ``engine``: during a hot swap two engines run side by side, and one series written by both
    would jump between their numbers. What the server *did* (tokens, latencies, refusals) is
    counted once for the server, whichever engine did it.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("aie_requests_running", "Requests holding KV and decoding", ["engine"], registry=r)
        self.waiting = Gauge("aie_requests_waiting", "Requests accepted but not yet running", ["engine"], registry=r)
        self.kv_used = Gauge("aie_kv_blocks_used", "KV blocks in use", ["engine"], registry=r)
        self.kv_total = Gauge("aie_kv_blocks_total", "KV blocks in the pool", ["engine"], registry=r)
        self.tracked = Gauge("aie_requests_tracked", "Requests the engine and the server still keep a record of: "
                             "0 when idle, or something leaks", ["engine"], registry=r)
        self._engines: dict[str, EngineGauges] = {}  # the live engines' gauges, by label
        self._labels_lock = threading.Lock()  # engines are built on worker threads and end on their own
        self.batch = Histogram("aie_batch_size", "Sequences in each engine step", buckets=BATCH_SIZE_BUCKETS, registry=r)
        self.ttft = Histogram("aie_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS_S,
                              registry=r)
        self.itl = Histogram("aie_inter_token_latency_seconds", "Time between two pieces of a stream",
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.e2e = Histogram("aie_e2e_request_latency_seconds", "Arrival to the last token",
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("aie_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("aie_generation_tokens", "Tokens generated (rate() gives tokens/s)",
                                        registry=r)
        self.finished = Counter("aie_requests_finished", "Requests ended, by finish reason", ["finish_reason"],
                                registry=r)
        self.rejected = Counter("aie_requests_rejected", "Requests refused before any work, by reason", ["reason"],
                                registry=r)

    def engine_gauges(self, name: str) -> EngineGauges:
        """The gauges of a new engine, labelled ``name`` — or ``name#2``, ``name#3``... while an
        engine of that name is still live (a swap may load the same model again)."""
        with self._labels_lock:
            label, n = name, 1
            while label in self._engines:
                n += 1
                label = f"{name}#{n}"
            gauges = EngineGauges(label, *(gauge.labels(label) for gauge in self._engine_series()))
            self._engines[label] = gauges
        return gauges

    def forget_engine(self, gauges: EngineGauges) -> None:
        """An engine has ended: its series leave ``/metrics`` (a stopped engine has no state)."""
        with self._labels_lock:
            if self._engines.get(gauges.label) is not gauges:  # forgotten already (the label may be another's now)
                return
            del self._engines[gauges.label]
            for gauge in self._engine_series():
                gauge.remove(gauges.label)

    def _engine_series(self) -> tuple[Gauge, ...]:
        return self.running, self.waiting, self.kv_used, self.kv_total, self.tracked

    def render(self) -> bytes:
        return generate_latest(self.registry)


def metric_value(text: str, name: str, labels: str = "") -> float | None:
    """A sample's value read back from ``/metrics`` text, None if absent: what the tests and the
    notebook read. With ``labels`` (as written there, e.g. ``'finish_reason="abort"'``) the one
    sample that has them; without, the sum of every sample of ``name`` (all engines, all reasons)."""
    values = [float(line.split()[-1]) for line in text.splitlines()
              if (line.startswith(f"{name}{{{labels}}} ") if labels
                  else line.startswith(name + " ") or line.startswith(name + "{"))]
    return sum(values) if values else None


# %% [markdown]
# The `AsyncEngine` below is the bridge. It is given code, but read `_run`: the whole life of the
# engine thread is one call of stage 06's `drive` — take the inbox before each step, deliver each
# step's outputs to their queues, sleep when idle.
# `submit` is the other side: it checks the request (a bad prompt is refused before it reaches
# the thread), applies your admission rule, and returns the request's `TokenQueue`.

# %%
# export: server.async_engine
"""The engine on a thread of its own, fed and read from an asyncio event loop."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Sequence

from aie_lessons.engine.engine import Engine, drive
from aie_lessons.engine.outputs import RequestOutput
from aie_lessons.engine.request import Request
from aie_lessons.output import OutputStream
from aie_lessons.sampling import SamplingParams

log = logging.getLogger("aie.server")

FINISH_RATE_WINDOW_S = 30.0  # Retry-After's estimate uses the requests finished in this window


class Overloaded(Exception):
    """``submit`` refused a request: its ``refusal`` has the status and Retry-After."""

    def __init__(self, refusal: Refusal):
        super().__init__(refusal.message)
        self.refusal = refusal


class EngineFailed(RuntimeError):
    """The engine raised during a step: every request it held has ended with an "error" event."""


class AsyncEngine:
    """``Engine.step()`` on a thread of its own; requests in through ``submit``, events out
    through each request's ``TokenQueue``.

    ``max_waiting`` bounds the requests accepted but not yet running (exercise 10.2 refuses the
    rest). Call ``start()`` from the event loop that will read the queues.
    """

    def __init__(self, engine: Engine, max_waiting: int = 64, metrics: ServerMetrics | None = None,
                 name: str = "engine"):
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics or ServerMetrics()
        self.name = name
        self.gauges = self.metrics.engine_gauges(name)  # this engine's own series, until its thread ends
        self.admitting = True
        self.error: BaseException | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        # submit and the thread's last act (ending what is left) take turns under this lock, so
        # that no request is accepted after the thread has stopped reading the inbox
        self._lock = threading.Lock()
        self._closed = False
        self._inbox: deque[tuple] = deque()
        self._wake = threading.Event()
        self._stopping = False
        self._queues: dict[str, TokenQueue] = {}  # accepted and not yet ended
        self._requests: dict[str, Request] = {}  # in the engine and not yet ended: their metrics' source
        self._last_token: dict[str, float] = {}  # when each request last got a token: inter-token latency
        self._steps_seen = len(engine.stats)  # engine steps whose batch size is in the metrics (warm-up's not)
        self._finish_times: deque[float] = deque()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"aie-{name}", daemon=True)

    # --- the event loop's side -------------------------------------------------------------

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.gauges.kv_total.set(self.engine.runner.allocator.num_blocks)
        self._thread.start()

    def waiting(self) -> int:
        """Requests accepted that must wait for others: those beyond ``max_seqs``, or more if the
        scheduler holds more back (KV memory is short). A request that has just been accepted into
        a free place counts as running, though the engine thread may not have taken it yet: so
        the admission rule sees the same queue however quick the thread happens to be."""
        return max(self.in_flight() - self.engine.config.max_seqs, self.engine.load().waiting)

    def in_flight(self) -> int:
        """Requests accepted and not yet ended (waiting or running): what a drain waits for."""
        return len(self._queues)

    def finish_rate(self) -> float:
        """Requests ended per second over the last ``FINISH_RATE_WINDOW_S`` (or since the start, if
        that is shorter); 0 if none has ended yet."""
        now, times = time.monotonic(), list(self._finish_times)
        recent = [t for t in times if now - t <= FINISH_RATE_WINDOW_S]
        return len(recent) / max(min(FINISH_RATE_WINDOW_S, now - self._started), 1.0)

    async def submit(self, prompt: str | Sequence[int], params: SamplingParams) -> tuple[str, TokenQueue]:
        """Accept a request: its id in the engine, and the queue its events will arrive in. Raises
        ``PromptError`` or ``SamplingParamsError`` for bad input, ``Overloaded`` when refused,
        ``EngineFailed`` when the engine thread has stopped.

        The prompt is tokenized and checked on a worker thread: a long one takes a while, and the
        event loop has every other client to serve meanwhile. The id is the engine's own, never
        the client's ``X-Request-Id``: a client may reuse its id on a retry while the first try is
        still ending.
        """
        prompt_ids = await asyncio.to_thread(self.engine.check_request, prompt, params)
        with self._lock:
            if self._closed:
                raise EngineFailed(f"the engine has stopped{f' after an error ({self.error})' if self.error else ''}. "
                                   "Fix: retry on another server, or restart this one")
            refusal = admission(self.waiting(), self.max_waiting, not self.admitting, self.finish_rate())
            if refusal is not None:
                self.metrics.rejected.labels("draining" if not self.admitting else "queue_full").inc()
                raise Overloaded(refusal)
            request_id = uuid.uuid4().hex
            stream = OutputStream(self.engine.tokenizer, prompt_ids, params, self.engine.stop_ids)
            queue = TokenQueue(self.loop, stream, on_stop=lambda: self.abort(request_id, "stop"))
            self._queues[request_id] = queue
            self._send(("add", request_id, prompt_ids, params))
        return request_id, queue

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End a request — its client left ("abort"), or its text reached a stop string ("stop"):
        its KV is freed before the engine's next step."""
        self._send(("abort", request_id, reason))

    def abort_all(self) -> list[str]:
        """End every request in flight (a drain past its deadline): each one's client gets a final
        "abort" event, so none is dropped silently. Returns their ids."""
        ids = list(self._queues)
        for request_id in ids:
            self.abort(request_id)
        return ids

    def stop_admitting(self) -> None:
        self.admitting = False

    def stop(self, timeout: float | None = None) -> None:
        """Admit nothing more, let the thread finish the work it holds, then end it."""
        self.stop_admitting()
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif self._thread.ident is None:  # never started: no thread will forget its gauges
            self.metrics.forget_engine(self.gauges)

    def _send(self, message: tuple) -> None:
        self._inbox.append(message)
        self._wake.set()

    # --- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        """The engine thread's whole life: stage 06's ``drive``, fed from the inbox before each step,
        each step's outputs delivered, asleep while idle; on its way out, every request still held
        gets its final event."""
        try:
            drive(self.engine, self._deliver, self._take_inbox, self._idle)
        except Exception as exc:  # the engine is broken: the finally tells every request it held
            log.exception("the engine failed")
            self.error = exc
        finally:
            with self._lock:  # from here on submit refuses: nobody would read the inbox
                self._closed = True
            reason, error = ("error", f"{type(self.error).__name__}: {self.error}") if self.error else ("abort", None)
            try:
                for request_id in list(self._queues):
                    self._end(request_id, RequestOutput(request_id, (), reason), error)
            finally:
                self.metrics.forget_engine(self.gauges)

    def _idle(self) -> bool:
        """Nothing to step: end the thread if it is stopping, else sleep until a message comes."""
        if self._stopping:
            return False
        self._wake.wait()
        return True

    def _take_inbox(self) -> None:
        self._wake.clear()  # before reading the inbox: a message sent after this wakes the thread
        while self._inbox:
            kind, request_id, *rest = self._inbox.popleft()
            if kind == "add":
                prompt_ids, params = rest
                try:
                    self._requests[request_id] = self.engine.add_request(prompt_ids, params, request_id=request_id)
                except Exception as exc:  # this request cannot run (its sampler refused it): it alone ends
                    log.warning("request refused by the engine", extra={"fields": {"error": str(exc)}})
                    self._end(request_id, RequestOutput(request_id, (), "error"), f"{type(exc).__name__}: {exc}")
            elif request_id in self._requests:  # its end comes out of the next step
                self.engine.abort(request_id, *rest)
            # otherwise the request has ended already and its client has its final event
        self._gauges()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """After a step: each output to its request's queue, and the metrics of what the step did."""
        metrics, now = self.metrics, time.perf_counter()
        if len(self.engine.stats) > self._steps_seen:  # a step ran (not only ends reported)
            self._steps_seen = len(self.engine.stats)
            metrics.batch.observe(len(self.engine.stats[-1].chunks))
        for output in outputs:
            if output.token_ids:
                metrics.generated_tokens.inc(len(output.token_ids))
                last = self._last_token.get(output.request_id)
                if last is not None:
                    metrics.itl.observe(now - last)
                self._last_token[output.request_id] = now
            if output.finished:
                self._finished(output)
            elif output.request_id in self._queues:
                self._queues[output.request_id].put(output)

    def _gauges(self) -> None:
        """Running, waiting and KV in use, as of now: read before each step and before the thread
        sleeps, so that an abort with no step after it shows too."""
        load = self.engine.load()
        self.gauges.running.set(load.running)
        self.gauges.waiting.set(self.waiting())
        self.gauges.kv_used.set(load.kv_used)
        self.gauges.tracked.set(load.requests + len(self._requests) + len(self._queues) + len(self._last_token))

    def _finished(self, output: RequestOutput) -> None:
        """A request the engine ended: its final output, its metrics, and the engine forgets it."""
        metrics, request = self.metrics, self._requests.pop(output.request_id)
        self._end(request.id, output)
        if request.ttft is not None:
            metrics.ttft.observe(request.ttft)
        if request.latency is not None:
            metrics.e2e.observe(request.latency)
        metrics.prompt_tokens.inc(len(request.prompt_ids))
        metrics.finished.labels(output.finish_reason).inc()
        self.engine.forget(request.id)  # a server runs for weeks: forget what has ended

    def _end(self, request_id: str, output: RequestOutput, error: str | None = None) -> None:
        queue = self._queues.pop(request_id, None)
        self._last_token.pop(request_id, None)
        self._finish_times.append(time.monotonic())
        while len(self._finish_times) > 1000:
            self._finish_times.popleft()
        if queue is not None:
            queue.put(output, error)


# %% [markdown]
# Three clients at once, on the real model: each reads its own stream while the engine thread
# batches all three in its steps. The texts must be the ones the offline engine gives for the
# same prompts (greedy decoding, fp32: the same arithmetic whatever else is in the batch).

# %%
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three primary colours are"]
GREEDY = SamplingParams(max_new_tokens=24)


async def read_stream(queue):
    pieces, final = [], None
    async for event in queue.events():
        pieces.append(event.text)
        final = event
    return "".join(pieces), final


async def three_clients():
    async_engine = AsyncEngine(paged_engine(model, tokenizer, max_seqs=4))
    async_engine.start()
    try:
        queues = [(await async_engine.submit(prompt, GREEDY))[1] for prompt in PROMPTS]
        return await asyncio.gather(*(read_stream(q) for q in queues)), async_engine
    finally:
        async_engine.stop()


served, demo_engine = await three_clients()
offline = paged_engine(model, tokenizer, max_seqs=4).generate(PROMPTS, GREEDY)
for (text, final), reference in zip(served, offline):
    print(f"{final.finish_reason:6} {final.completion_tokens:2} tokens  same as offline: {text == reference.text}  {text!r:.60}")
assert all(text == reference.text for (text, _), reference in zip(served, offline))
print("KV blocks in use after the three:", demo_engine.engine.runner.allocator.used)

# %% [markdown]
# ## 4. The HTTP API
#
# The clients people already have — the `openai` Python and JavaScript packages, LangChain,
# `curl` scripts — speak OpenAI's API, so a server that speaks it too is usable without new
# code. Three routes matter: `POST /v1/completions` (a prompt in, text out), `POST
# /v1/chat/completions` (messages in: the server applies the model's chat template) and `GET
# /v1/models`. Each takes the sampling parameters you know from stage 01 under OpenAI's names
# (`max_tokens`, `temperature`, `top_p`, `stop`, `seed`; `top_k`, `repetition_penalty` and
# `ignore_eos` as extensions), and answers with the text, a `finish_reason` and the `usage`
# (tokens in and out), or — with `"stream": true` — with your `sse_stream`.
#
# Bad input is the client's mistake and gets a `400` whose message names the field and the fix,
# never a traceback: a prompt longer than the context, `temperature: -1`, a field that does
# not exist (a typo like `max_token` would otherwise be ignored in silence), a parameter we do
# not support (`n: 2`, `logprobs`). A body over the size limit gets `413` before it is read
# whole; a missing or wrong API key `401`.

# %%
# export: server.protocol
"""OpenAI's completion and chat requests: checked, and turned into the engine's SamplingParams;
and the responses and stream chunks that OpenAI's clients expect."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from aie_lessons.sampling import SamplingParams

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort", "error": "error"}


class APIError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": None}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The fields both routes share. Unknown fields are refused: a misspelt ``max_token`` would
    otherwise be ignored without a word, and the answer would be 16 tokens long."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, ge=0.01, le=100)  # 1e-45 would turn the logits into inf
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)  # what a torch.Generator takes
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    n: int = 1
    logprobs: int | bool | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    def refuse_unsupported(self) -> None:
        """Parameters OpenAI has and this server does not: refused by name, never ignored."""
        unsupported = {
            "n": (self.n != 1, "this server returns one choice per request. Fix: send n requests"),
            "logprobs": (self.logprobs not in (None, False, 0), "log-probabilities are not returned. Fix: leave it out"),
            "presence_penalty": (self.presence_penalty != 0, "not supported. Fix: repetition_penalty (> 1)"),
            "frequency_penalty": (self.frequency_penalty != 0, "not supported. Fix: repetition_penalty (> 1)"),
            "logit_bias": (bool(self.logit_bias), "not supported. Fix: leave it out"),
        }
        for name, (given, why) in unsupported.items():
            if given:
                raise APIError(400, f"{name}={getattr(self, name)!r}: {why}", param=name)
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise APIError(400, f"stop has {len(self.stop)} strings; at most 4 (as OpenAI). Fix: fewer", param="stop")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only for streamed requests. Fix: set stream, or leave it out",
                           param="stream_options")

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's parameters; ``max_tokens`` is the route's default when the field is absent."""
        self.refuse_unsupported()
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(max_new_tokens=max_tokens if self.max_tokens is None else self.max_tokens,
                              stop=stop, ignore_eos=self.ignore_eos, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, repetition_penalty=self.repetition_penalty, seed=self.seed)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def the_prompt(self) -> str | list[int]:
        """One prompt: a string or token ids. A list of prompts (OpenAI allows it) is refused."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"prompt holds {len(prompt)} prompts; this server takes one per request. "
                                    "Fix: send one request per prompt", param="prompt")
            prompt = prompt[0]
        for name, given in (("echo", self.echo), ("suffix", self.suffix), ("best_of", self.best_of not in (None, 1))):
            if given:
                raise APIError(400, f"{name} is not supported. Fix: leave it out", param=name)
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str | list[dict]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"message content part {part!r:.60}: only text parts are supported",
                               param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            max_tokens = self.max_completion_tokens
        return super().sampling_params(max_tokens)


def usage(event: Event) -> dict:
    return {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
            "total_tokens": event.prompt_tokens + event.completion_tokens}


class CompletionFormat:
    """The bodies of one ``/v1/completions`` answer: whole, or as stream chunks."""

    object = "text_completion"

    def __init__(self, request_id: str, model: str, include_usage: bool = False):
        self.id, self.model, self.include_usage = f"cmpl-{request_id}", model, include_usage
        self.created = int(time.time())

    def _head(self, object: str) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model}

    def choice(self, text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def chunk(self, event: Event) -> dict:
        """A stream chunk for ``sse_stream``; the final one has the finish reason (and usage)."""
        reason = FINISH_REASONS[event.finish_reason] if event.final else None
        body = self._head(self.object) | {"choices": [self.choice(event.text, reason)]}
        if event.final and self.include_usage:
            body["usage"] = usage(event)
        return body

    def response(self, text: str, final: Event) -> dict:
        return self._head(self.object) | {"choices": [self.choice(text, FINISH_REASONS[final.finish_reason])],
                                          "usage": usage(final)}


class ChatFormat(CompletionFormat):
    """The same for ``/v1/chat/completions``: a message, or deltas whose first names the role."""

    object = "chat.completion"

    def __init__(self, request_id: str, model: str, include_usage: bool = False):
        super().__init__(request_id, model, include_usage)
        self.id = f"chatcmpl-{request_id}"
        self._first = True

    def chunk(self, event: Event) -> dict:
        delta = {"content": event.text} if event.text or not event.final else {}
        if self._first:
            delta, self._first = {"role": "assistant"} | delta, False
        reason = FINISH_REASONS[event.finish_reason] if event.final else None
        body = self._head("chat.completion.chunk") | {"choices": [{"index": 0, "delta": delta,
                                                                  "finish_reason": reason}]}
        if event.final and self.include_usage:
            body["usage"] = usage(event)
        return body

    def response(self, text: str, final: Event) -> dict:
        message = {"role": "assistant", "content": text}
        return self._head(self.object) | {
            "choices": [{"index": 0, "message": message, "finish_reason": FINISH_REASONS[final.finish_reason]}],
            "usage": usage(final)}


# %% [markdown]
# A server is configured once, from a file, and a typo there should stop it at the start with
# the field named — not surface as a strange behaviour a week later. `ServeConfig` lists every
# setting with its default; `load_config` reads a YAML file and refuses unknown fields (with
# the closest known name), values of the wrong type and values out of range. One rule is about
# safety: the server listens on `127.0.0.1` (this machine only) unless told otherwise, and it
# refuses to listen on another address without an API key.

# %%
# export: server.config
"""The server's settings: defaults, a YAML file (``aie serve --config``), checked field by field."""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import os
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from aie_lessons.engine.engine_config import STEPS, EngineConfig


class ServeConfigError(ValueError):
    """A setting the server cannot start with; the message names the field and the fix."""


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"  # loopback: this machine only
    port: int = 8000
    model_dir: str | None = None  # default: the course model (aie fetch-model)
    model_name: str | None = None  # the id clients send as "model"; default: the folder's name
    dtype: str = "float32"  # the weights: float32 or bfloat16
    max_seqs: int = EngineConfig.max_seqs  # requests running at once
    token_budget: int = EngineConfig.token_budget  # tokens per engine step (chunked prefill)
    step: str = "auto"  # the engine's step (stage 09): compiled where it can run, eager where not
    kv_memory_mb: float | None = None  # the paged KV pool; default: stage 07's (16 × 1024 tokens)
    max_waiting: int = 64  # accepted requests not yet running; one more gets 503
    max_body_bytes: int = 1_000_000  # a larger request body gets 413
    default_max_tokens: int = 256  # chat requests without max_tokens (completions: 16, as OpenAI)
    # on SIGTERM, how long in-flight requests may take to finish: 20 s, plus uvicorn's 5 s to close
    # connections, fits the 30 s that process managers (Kubernetes among them) wait before they kill
    drain_timeout_s: float = 20.0
    api_key: str | None = None  # if set, /v1/* needs "Authorization: Bearer <api_key>"
    admin_key: str | None = None  # /admin/* needs it; without one the admin API is off
    warm_up: bool = True  # compile every bucket of a compiled step, then one short request, before /health says ok

    def __post_init__(self) -> None:
        checks = {
            "port": (0 <= self.port <= 65535, "a port number, 0 to 65535 (0: any free port)"),
            "dtype": (self.dtype in ("float32", "bfloat16"), "float32 or bfloat16"),
            "max_seqs": (self.max_seqs >= 1, "at least 1"),
            "token_budget": (self.token_budget >= 1, "at least 1"),
            "step": (self.step in STEPS, " or ".join(STEPS)),
            "kv_memory_mb": (self.kv_memory_mb is None or self.kv_memory_mb > 0, "a positive number of MB"),
            "max_waiting": (self.max_waiting >= 1, "at least 1 (a request waits an instant even for a free place)"),
            "max_body_bytes": (self.max_body_bytes >= 1024, "at least 1024"),
            "default_max_tokens": (self.default_max_tokens >= 1, "at least 1"),
            "drain_timeout_s": (self.drain_timeout_s >= 0, "0 or more seconds"),
        }
        for name, (ok, allowed) in checks.items():
            if not ok:
                raise ServeConfigError(f"{name}={getattr(self, name)!r} is invalid: it must be {allowed}.")
        if self.token_budget < self.max_seqs:
            raise ServeConfigError(f"token_budget={self.token_budget} is below max_seqs={self.max_seqs}: a step must "
                                   "have room for one token of every running request. Fix: raise token_budget")
        for name in ("api_key", "admin_key"):
            if getattr(self, name) is not None and not getattr(self, name).strip():
                raise ServeConfigError(f"{name} is empty, which would let an empty key in. Fix: a real key, or "
                                       "leave it out")
        if not is_loopback(self.host) and not self.api_key:
            raise ServeConfigError(f"host={self.host!r} can be reached from other machines, and api_key is not set: "
                              "anyone on the network could use the server. Fix: set api_key (or AIE_API_KEY), "
                              "or keep host 127.0.0.1")

    def with_overrides(self, **values) -> ServeConfig:
        """This config with the given fields replaced (None means: keep), checked again."""
        return dataclasses.replace(self, **{k: v for k, v in values.items() if v is not None})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _field_type(field: dataclasses.Field) -> tuple[type, ...]:
    text = str(field.type)
    kinds = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}
    return tuple(t for name, types in kinds.items() if name in text.split(" | ") for t in types)


def load_config(path: Path | None = None, environ: dict[str, str] | None = None) -> ServeConfig:
    """Defaults, then the YAML file at ``path``, then the keys from the environment
    (``AIE_API_KEY``, ``AIE_ADMIN_KEY``: secrets are better kept out of files)."""
    environ = os.environ if environ is None else environ
    values: dict = {}
    if path is not None:
        try:
            values = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ServeConfigError(f"config file {path} does not exist. Fix: the path of a YAML file, or no --config")
        except yaml.YAMLError as exc:
            raise ServeConfigError(f"{path} is not valid YAML: {exc}")
        if not isinstance(values, dict):
            raise ServeConfigError(f"{path}: expected a mapping of settings (name: value), got {type(values).__name__}")
    known = {f.name: f for f in fields(ServeConfig)}
    for name, value in values.items():
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else f" Known fields: {', '.join(known)}."
            raise ServeConfigError(f"{path}: unknown field {name!r}.{hint}")
        types = _field_type(known[name])
        optional = "None" in str(known[name].type)
        if value is None and optional:
            continue
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            kind = " or ".join(t.__name__ for t in types)
            raise ServeConfigError(f"{path}: field {name!r} must be {kind}, got {value!r} ({type(value).__name__})")
    for name, variable in (("api_key", "AIE_API_KEY"), ("admin_key", "AIE_ADMIN_KEY")):
        if environ.get(variable):
            values[name] = environ[variable]
    try:
        return ServeConfig(**values)
    except ServeConfigError as exc:
        raise ServeConfigError(f"{path}: {exc}" if path else str(exc)) from None


# %% [markdown]
# ## 5. Stopping, and swapping the model
#
# Servers are stopped all the time: a new version is deployed, a machine is drained for
# maintenance, an autoscaler removes one. The operating system says so with `SIGTERM` (and a
# person at a terminal with Ctrl-C, `SIGINT`). Exiting at once would cut every stream in the
# middle and lose every queued request — each of them a user who gets an error for nothing.
# A **graceful stop** (a *drain*) does it in order:
#
# 1. stop admitting: new requests get `503` (and `/health` says 503, so a load balancer stops
#    sending any);
# 2. let the requests already accepted — running **and waiting** — finish, up to a deadline;
# 3. past the deadline, end the rest explicitly, so that each client gets a final event with
#    `finish_reason: "abort"` rather than a connection cut without a word;
# 4. then exit.
#
# ### Exercise 10.3 — the drain
#
# `drain(engine, deadline_s, poll_s)` does steps 1–3 on an engine with three methods:
# `stop_admitting()`, `in_flight()` (requests accepted and not ended: waiting or running) and
# `abort_all()` (ends them all, returns their ids). Wait by polling `in_flight()` every `poll_s`
# seconds — with `await asyncio.sleep`, never `time.sleep`: the drain runs on the event loop,
# which must go on sending the streams it is waiting for. Return a `DrainReport`: how many
# requests were in flight when the drain began, how many were aborted at the deadline, and the
# seconds it took (`time.monotonic()`).

# %%
# export: server.lifecycle
"""A server's life: loading and warming up an engine, draining it, swapping it for another."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ParamSpec, Protocol, TypeVar

import torch

from aie_lessons.engine.engine_config import EngineConfig, build_engine, compile_buckets, step_of
from aie_lessons.infra.paths import default_model_dir
from aie_lessons.model import LlamaModel
from aie_lessons.sampling import SamplingParams
from aie_lessons.tokenizer import Tokenizer


class Drainable(Protocol):
    """What ``drain`` needs of an engine (``AsyncEngine`` has it; the check's fake too)."""

    def stop_admitting(self) -> None: ...

    def in_flight(self) -> int: ...

    def abort_all(self) -> list[str]: ...


@dataclass(frozen=True)
class DrainReport:
    in_flight: int  # requests accepted and not ended when the drain began
    aborted: int  # of those, ended at the deadline
    seconds: float


async def drain(engine: Drainable, deadline_s: float, poll_s: float = 0.05) -> DrainReport:
    """Stop admitting, wait up to ``deadline_s`` for every accepted request, abort the rest."""
    # BEGIN EXERCISE 10.3: stop admitting; poll in_flight() every poll_s seconds (await asyncio.sleep) until it is 0 or deadline_s have passed; then abort_all() what is left; return DrainReport(in_flight at the start, aborted, seconds)
    # Hint 1: Order matters: refuse new requests first, or the queue refills while you wait. "In flight" means waiting or running: a request still in the queue was accepted too, and its client is waiting for it. Waiting must give the loop back, or the streams you wait for are never sent.
    # Hint 2: Note the start time with time.monotonic() and stop admitting at once; count the requests in flight. Loop while some are in flight and the deadline has not passed, awaiting asyncio.sleep(poll_s) each time round. After the loop, abort_all() only if some are still in flight, and build the report from the count at the start, the number of ids aborted and the elapsed time.
    start = time.monotonic()
    engine.stop_admitting()
    at_start = engine.in_flight()
    while engine.in_flight() and time.monotonic() - start < deadline_s:
        await asyncio.sleep(poll_s)
    aborted = engine.abort_all() if engine.in_flight() else []
    return DrainReport(at_start, len(aborted), time.monotonic() - start)
    # END EXERCISE 10.3


# %%
# Check exercise 10.3
checks.stage10.check_drain(drain)

# %% [markdown]
# A **hot swap** replaces the model without stopping the server: load the new weights *beside*
# the old ones (memory for both, for a while), warm the new engine up, point new requests at
# it, and drain the old one — with no deadline, since nobody is waiting to exit — before
# freeing it. A request accepted by the old engine finishes there; none is dropped.

# %%
# export: server.lifecycle


@dataclass
class LoadedModel:
    """An engine thread with what the API needs to know about its model."""

    engine: AsyncEngine
    tokenizer: Tokenizer
    name: str
    model_dir: Path
    step: str  # the engine's step: "compiled" or "eager"


def load_model(config: ServeConfig, metrics: ServerMetrics, model_dir: str | Path | None = None,
               dtype: str | None = None, name: str | None = None) -> LoadedModel:
    """Read a checkpoint and build its engine (stage 09's ``build_engine``) — slow: call it with
    ``off_the_loop``. A compiled step is compiled for every bucket here, unless ``config.warm_up``
    is off, so that no request waits for it. The engine thread is not started yet."""
    folder = Path(model_dir or config.model_dir or default_model_dir())
    tokenizer = Tokenizer.from_pretrained(folder)
    model = LlamaModel.from_pretrained(folder, dtype=getattr(torch, dtype or config.dtype))
    kv_bytes = None if config.kv_memory_mb is None else int(config.kv_memory_mb * 2**20)
    # stats_capacity: the server reads each step's stats once, right after it; a long record of
    # steps (and of the ids of requests long ended) would only take memory
    engine_config = EngineConfig(max_seqs=config.max_seqs, token_budget=config.token_budget, kv_bytes=kv_bytes,
                                 step=config.step, stats_capacity=16)
    engine = build_engine(model, tokenizer, engine_config, on_note=log.warning)
    if config.warm_up:
        try:
            seconds = compile_buckets(engine, lambda buckets: log.info("compiling the engine's step",
                                                                     extra={"fields": {"buckets": list(buckets)}}))
        except Exception as exc:
            # A compiler that exists but cannot build (missing headers, a broken toolchain) is
            # found only by compiling: "auto" promised eager then, "compiled" asked for this one.
            if config.step != "auto":
                raise
            log.warning("the eager step runs, because the compiled step failed to compile",
                        extra={"fields": {"error": f"{type(exc).__name__}: {str(exc)[:1000]}"}})
            engine = build_engine(model, tokenizer, dataclasses.replace(engine_config, step="eager"))
        else:
            if seconds is not None:
                log.info("compiled", extra={"fields": {"seconds": round(seconds, 1)}})
    label = name or (config.model_name if model_dir is None else None) or folder.name
    return LoadedModel(AsyncEngine(engine, config.max_waiting, metrics, label), tokenizer, label, folder,
                       step_of(engine))


P = ParamSpec("P")
T = TypeVar("T")


OFF_THE_LOOP = "aie-off-the-loop"  # the name of off_the_loop's threads


async def off_the_loop(function: Callable[P, T], *args: P.args) -> T:
    """``function(*args)`` on a thread of its own, awaited: for loading a model, which takes
    seconds to minutes (compiling, the first time) and cannot be interrupted. Not on
    ``asyncio.to_thread``'s workers: a process waits for those before it exits, so a Ctrl-C
    during a compile would wait for the compiler. This thread is a daemon that a stopping
    server leaves behind (``work_left_behind``); asyncio drops a result that comes too late."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if not done.set_running_or_notify_cancel():
            return
        try:
            done.set_result(function(*args))
        except BaseException as exc:  # handed to the awaiting task, which raises it
            done.set_exception(exc)

    threading.Thread(target=run, name=f"{OFF_THE_LOOP}: {getattr(function, '__name__', 'work')}", daemon=True).start()
    return await asyncio.wrap_future(done)


def work_left_behind() -> list[str]:
    """What ``off_the_loop`` threads are still running, by function name."""
    return [t.name.split(": ", 1)[1] for t in threading.enumerate() if t.name.startswith(OFF_THE_LOOP + ": ")]


async def warm_up(engine: AsyncEngine) -> None:
    """One short request through the engine, so that the first user does not pay for the first
    step's one-off costs (allocations, kernel choices)."""
    _, queue = await engine.submit([0], SamplingParams(max_new_tokens=2, ignore_eos=True))
    async for event in queue.events():
        if event.finish_reason == "error":
            raise EngineFailed(f"the warm-up request failed: {event.error}")


@dataclass(frozen=True)
class SwapReport:
    old: str
    new: str
    drained: DrainReport


class EngineSlot:
    """The model that takes new requests, and every engine still running: during a swap, the old
    one finishes its requests beside the new — a shutdown must drain both. ``swapping`` is set by
    whoever starts a swap, before loading anything, so that a second one is refused."""

    def __init__(self, current: LoadedModel):
        self.current = current
        self.live: list[AsyncEngine] = [current.engine]
        self.swapping = False

    async def swap(self, new: LoadedModel, warm: bool = True) -> SwapReport:
        """Start and warm ``new`` up, send new requests to it, then drain the old engine to its end."""
        new.engine.start()
        self.live.append(new.engine)
        try:
            if warm:
                await warm_up(new.engine)
        except BaseException:
            self.live.remove(new.engine)
            await asyncio.to_thread(new.engine.stop)  # the old engine keeps serving
            raise
        old, self.current = self.current, new  # from here on, new requests go to the new engine
        report = await drain(old.engine, deadline_s=math.inf)
        await asyncio.to_thread(old.engine.stop)
        self.live.remove(old.engine)
        return SwapReport(old.name, new.name, report)

    async def drain_all(self, deadline_s: float) -> DrainReport:
        """Drain every live engine at once (a shutdown): the totals of their reports."""
        reports = await asyncio.gather(*(drain(engine, deadline_s) for engine in list(self.live)))
        return DrainReport(sum(r.in_flight for r in reports), sum(r.aborted for r in reports),
                           max((r.seconds for r in reports), default=0.0))


# %% [markdown]
# ## 6. The application
#
# The routes are thin: parse and check the body (pydantic, with a `400` naming the field),
# `submit` to the current engine, and answer — whole, or as your `sse_stream`. A small
# middleware in front of everything, before any body is read, gives each request an id (the
# client's `X-Request-Id`, or a new one) and returns it in the response, checks the key (`401`),
# refuses a body over the limit with `413` as it arrives, and writes one JSON log line per
# request. A non-streaming request whose
# client disconnects is aborted too: its handler watches the connection while it waits.

# %%
# export: server.app
"""The HTTP API: OpenAI's routes, /health, /metrics and the admin swap, over the engine slot."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from aie_lessons.generate import PromptError
from aie_lessons.sampling import SamplingParamsError

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class JSONLines(logging.Formatter):
    """One JSON object per log line: what log collectors parse without a custom pattern."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": round(record.created, 3), "level": record.levelname.lower(), "message": record.getMessage()}
        line |= getattr(record, "fields", {})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


def json_logging(stream=None) -> None:
    """Send the server's log records to ``stream`` (stderr) as JSON lines."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JSONLines())
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


@dataclass
class ServerState:
    """What the routes share: the settings, the metrics, the engine slot (None while loading), and
    ``on_failure``, which the process sets to stop itself when the model cannot be loaded."""

    config: ServeConfig
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    slot: EngineSlot | None = None
    status: str = "loading"  # loading | ready | draining | failed
    failure: str | None = None
    on_failure: Callable[[], None] | None = None

    def health(self) -> str:
        """The status, "failed" too once the current engine's thread has died."""
        if self.slot is not None and self.slot.current.engine.error is not None and self.status != "failed":
            self.status, self.failure = "failed", f"the engine failed: {self.slot.current.engine.error}"
        return self.status

    def ready_model(self) -> LoadedModel:
        """The model for a new request, or a 503 that says why there is none. While draining the
        model is still returned: its engine's admission rule (10.2) refuses the request."""
        status = self.health()
        if status in ("ready", "draining") and self.slot is not None:
            return self.slot.current
        why = {"loading": "the model is still loading", "failed": f"the server failed: {self.failure}"}[status]
        self.metrics.rejected.labels(status).inc()
        raise APIError(503, f"{why}. Fix: retry shortly, or on another server", type="server_unavailable",
                       headers={"Retry-After": "1"})


class BodyTooLarge(HTTPException):
    """Raised while the body arrives, as soon as it passes the limit (FastAPI passes an
    ``HTTPException`` through its body parsing; any other error there would become a 400)."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is over {limit} bytes (max_body_bytes). Fix: a shorter "
                              "prompt, or raise max_body_bytes in the server's config")


def key_refusal(headers: dict[bytes, bytes], path: str, config: ServeConfig) -> APIError | None:
    """401 when a route's key is missing or wrong (compared in constant time); the admin routes
    take only the admin key, and are off (403) without one. /health and /metrics are open."""
    if path.startswith("/admin/"):
        if config.admin_key is None:
            return APIError(403, "the admin API is off. Fix: set admin_key (or AIE_ADMIN_KEY) and restart",
                            type="permission_error")
        key, what = config.admin_key, "admin"
    elif path.startswith("/v1/") and config.api_key is not None:
        key, what = config.api_key, "API"
    else:
        return None
    scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        return APIError(401, f"missing or wrong {what} key. Fix: send the header 'Authorization: Bearer <key>'",
                        type="authentication_error")
    return None


class RequestGuard:
    """ASGI middleware in front of every route, before any body is read: the request id (the
    client's ``X-Request-Id``, or a new one), the keys (401), the body size limit (413 from the
    ``Content-Length``, or as the body arrives), and one JSON log line per request."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        request_id = given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        limit, received, start, status = self.state.config.max_body_bytes, 0, time.perf_counter(), 0

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        try:
            declared = headers.get(b"content-length", b"0").decode("latin-1")
            refusal = key_refusal(headers, scope["path"], self.state.config)
            if refusal is None and declared.isdigit() and int(declared) > limit:
                refusal = APIError(413, BodyTooLarge(limit).detail)
            if refusal is not None:
                await JSONResponse(refusal.body(), refusal.status)(scope, receive, send_with_id)
            else:
                await self.app(scope, counted_receive, send_with_id)
        finally:
            log.info("request", extra={"fields": {
                "request_id": request_id, "method": scope["method"], "path": scope["path"], "status": status,
                "ms": round(1000 * (time.perf_counter() - start), 1)}})


async def until_disconnected(request: Request) -> None:
    """Returns when the client has closed the connection."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect_answer(queue: TokenQueue, request: Request, abort: Callable[[], None]) -> tuple[str, Event] | None:
    """A non-streaming answer: all the text and the final event — or None, after ``abort()``, if
    the client leaves first (or the handler itself is cancelled)."""
    async def read() -> tuple[str, Event]:
        pieces = []
        async for event in queue.events():
            pieces.append(event.text)
        return "".join(pieces), event

    reader, watcher = asyncio.ensure_future(read()), asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({reader, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        reader.cancel()
        abort()
        raise
    finally:
        watcher.cancel()
    if reader.done():
        return reader.result()
    reader.cancel()
    abort()
    return None


class SwapRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_dir: str
    dtype: Literal["float32", "bfloat16"] | None = None
    model_name: str | None = None


def create_app(state: ServerState) -> FastAPI:
    """The application over ``state``; its lifespan loads and warms the model up in the
    background (``/health`` says 503 until then) and stops the engine threads at the end."""

    async def start() -> None:
        try:
            loaded = await off_the_loop(load_model, state.config, state.metrics)
            loaded.engine.start()
            state.slot = EngineSlot(loaded)
            if state.config.warm_up:
                await warm_up(loaded.engine)
            if state.status == "loading":  # a SIGTERM during the load has made it "draining"
                state.status = "ready"
            log.info("ready", extra={"fields": {"model": loaded.name, "step": loaded.step, "kv_blocks":
                                                loaded.engine.engine.runner.allocator.num_blocks}})
        except Exception as exc:
            state.status, state.failure = "failed", f"{type(exc).__name__}: {exc}"
            log.exception("the model failed to load")
            if state.on_failure is not None:
                state.on_failure()

    async def lifespan(app: FastAPI):
        loading = asyncio.ensure_future(start())
        yield
        loading.cancel()
        if state.slot is not None:
            for engine in list(state.slot.live):
                await asyncio.to_thread(engine.stop, 10.0)

    app = FastAPI(title="aie", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    @app.exception_handler(BodyTooLarge)
    async def body_too_large(request: Request, exc: BodyTooLarge):
        return JSONResponse(APIError(413, exc.detail).body(), 413)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"] if part != "body")
        if error["type"] == "extra_forbidden":
            message = f"unknown field {where!r}: this server does not know it. Fix: check its spelling, or leave it out"
        elif error["type"] == "json_invalid":
            message = f"the body is not valid JSON: {error['msg']}. Fix: send a JSON object"
        else:
            message = (f"field {where!r}: {error['msg']}. Fix: change that field (OpenAI's API reference gives "
                       "its type and range)" if where else f"the body: {error['msg']}. Fix: send a JSON object")
        return JSONResponse(APIError(400, message, param=where or None).body(), 400)

    @app.get("/health")
    async def health():
        status = state.health()
        body = {"status": status} | ({"error": state.failure} if state.failure else {})
        return JSONResponse(body, 200 if status == "ready" else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        loaded = state.ready_model()
        return {"object": "list", "data": [{"id": loaded.name, "object": "model", "created": 0, "owned_by": "aie"}]}

    async def answer(request: Request, body: SamplingFields, loaded: LoadedModel, prompt: str | list[int],
                     max_tokens: int, format_class: type[CompletionFormat]):
        if body.model not in (None, loaded.name):
            raise APIError(404, f"model {body.model!r} is not served here; this server serves {loaded.name!r}. "
                                "Fix: send that name (GET /v1/models lists it)", param="model")
        engine = loaded.engine
        try:
            request_id, queue = await engine.submit(prompt, body.sampling_params(max_tokens))
        except Overloaded as exc:
            raise APIError(503, exc.refusal.message, type="server_overloaded",
                           headers={"Retry-After": str(exc.refusal.retry_after)})
        except (PromptError, SamplingParamsError) as exc:
            raise APIError(400, str(exc), param="prompt" if isinstance(exc, PromptError) else None)
        except EngineFailed as exc:
            raise APIError(503, str(exc), type="server_unavailable", headers={"Retry-After": "1"})
        fmt = format_class(request.state.request_id, loaded.name, body.include_usage)
        if body.stream:
            frames = sse_stream(queue.events(), fmt.chunk, lambda: engine.abort(request_id))
            return StreamingResponse(frames, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        answered = await collect_answer(queue, request, lambda: engine.abort(request_id))
        if answered is None:  # the client has gone: nobody reads this
            return Response(status_code=499)
        text, final = answered
        if final.finish_reason == "error":
            raise APIError(500, f"the engine failed: {final.error}", type="server_error")
        return fmt.response(text, final)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt = body.the_prompt()
        return await answer(request, body, state.ready_model(), prompt, 16, CompletionFormat)  # 16: OpenAI's

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        loaded = state.ready_model()
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = await asyncio.to_thread(loaded.tokenizer.apply_chat_template, messages)
        except ValueError as exc:  # a checkpoint without a chat template
            raise APIError(400, str(exc), param="messages")
        return await answer(request, body, loaded, prompt, state.config.default_max_tokens, ChatFormat)

    @app.post("/admin/swap")
    async def swap(body: SwapRequest):
        state.ready_model()
        slot = state.slot
        if slot.swapping:
            raise APIError(409, "a swap is already under way. Fix: wait for it to finish", type="conflict")
        slot.swapping = True  # before loading: a second swap must not load a model too
        log.info("swapping", extra={"fields": {"model_dir": body.model_dir, "dtype": body.dtype}})
        try:
            try:
                new = await off_the_loop(load_model, state.config, state.metrics, body.model_dir, body.dtype,
                                         body.model_name)
            except Exception as exc:  # a missing folder, a broken checkpoint: the old model keeps serving
                raise APIError(400, f"cannot load {body.model_dir!r}: {type(exc).__name__}: {exc}. The current "
                                    "model keeps serving. Fix: the folder of a checkpoint (aie fetch-model writes "
                                    "one)", param="model_dir")
            if state.status != "ready":  # a SIGTERM arrived during the load
                await asyncio.to_thread(new.engine.stop)  # never started: this forgets its metrics
                raise APIError(503, "the server is shutting down; the swap was cancelled", type="server_unavailable")
            report = await slot.swap(new, state.config.warm_up)
        finally:
            slot.swapping = False
        log.info("swapped", extra={"fields": {"old": report.old, "new": report.new, "step": new.step,
                                              "drained": report.drained.in_flight}})
        return {"old": report.old, "new": report.new, "step": new.step, "drained": report.drained.in_flight,
                "aborted": report.drained.aborted, "seconds": round(report.drained.seconds, 3)}

    app.add_middleware(RequestGuard, state=state)
    return app


# %% [markdown]
# Last, the process: uvicorn runs the application, and its first `SIGTERM` or `SIGINT` no longer
# exits at once — it starts your drain, and the server exits when the drain is done. A second
# signal still exits at once, for the operator who really means it. A signal while the model is
# still loading (a first compile can take minutes) exits at once too: the load runs on a thread
# of its own (`off_the_loop`), which nothing can interrupt, so the process leaves without it.

# %%
# export: server.serve
"""``aie serve``: the application under uvicorn, with a graceful stop on SIGTERM and SIGINT."""

from __future__ import annotations

import asyncio
import os
import sys

import uvicorn


class DrainingServer(uvicorn.Server):
    """uvicorn's server, except that the first SIGTERM/SIGINT drains the engine (exercise 10.3)
    before the server exits; a second one exits at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.servers and self.servers[0].sockets:
            self.port = self.servers[0].sockets[0].getsockname()[1]
            host = self.config.host
            print(f"aie serve: listening on http://{host}:{self.port} (GET /health says 200 once the model is "
                  "loaded; Ctrl-C drains and stops)", file=sys.stderr, flush=True)
            log.info("listening", extra={"fields": {"host": host, "port": self.port}})

    def handle_exit(self, sig, frame) -> None:
        if self._loop is None:  # before start-up: uvicorn's own way
            super().handle_exit(sig, frame)
        elif self._draining:  # a second signal: exit now, without waiting for anything
            self.should_exit = self.force_exit = True
        else:
            self._draining = True
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        state = self.state
        state.status = "draining"
        log.info("draining", extra={"fields": {"deadline_s": state.config.drain_timeout_s}})
        if state.slot is not None:  # every live engine: the old one of a swap under way too
            report = await state.slot.drain_all(state.config.drain_timeout_s)
            log.info("drained", extra={"fields": {"in_flight": report.in_flight, "aborted": report.aborted,
                                                  "seconds": round(report.seconds, 3)}})
        self.should_exit = True


def serve(config: ServeConfig) -> int:
    """Run the server until it is stopped; 0 after a graceful stop, 1 when the model failed to
    load. Stopped while a model still loads, it ends the process itself (``os._exit``), so
    nothing after it runs: no ``finally`` of the caller's, no ``atexit`` handler."""
    json_logging()
    state = ServerState(config)
    server = DrainingServer(uvicorn.Config(create_app(state), host=config.host, port=config.port, log_config=None,
                                           access_log=False, timeout_graceful_shutdown=5), state)
    state.on_failure = lambda: setattr(server, "should_exit", True)  # a model that cannot load: exit, status 1
    status = 1
    try:
        server.run()
        status = 0 if state.status != "failed" else 1
    except SystemExit as exc:  # uvicorn's own exit, e.g. 3 for a port already in use
        status = exc.code if isinstance(exc.code, int) else 1
        raise
    finally:
        left = work_left_behind()
        if left:
            # A model still loading (compiling) on a thread nothing can stop: the interpreter's
            # own shutdown would abort under it (C++ threads still running), so leave without it.
            log.info("exiting before the load ended", extra={"fields": {"unfinished": left, "status": status}})
            sys.stderr.flush()
            os._exit(status)
    return status


# %% [markdown]
# ## 7. The server, for real
#
# Everything above is in `aie_lessons.server`, and `aie serve` runs it. **Run `aie commit 10`
# now** (in a terminal, or `!aie commit 10` here) to put your 10.1–10.3 in it; until then, the
# server below runs the reference code. The cells below start it as a separate process — as you
# would from a terminal with `aie serve` — on a free port of `127.0.0.1`, and talk to it with
# real clients. `ServerProcess` is a small helper for that: it starts the process, waits for
# `/health` to say 200, and reads the JSON log. It and the load test below are tools for
# *trying* a server, not part of it: they go to `aie_lessons.harness`, apart from the server.
#
# By default `aie serve` runs stage 09's compiled step where it can (`build_engine` with
# `step="auto"`), and compiles it for every batch size before `/health` says 200: tens of
# seconds, once per start. The servers below run `--step eager`, so that they start in seconds
# and are the very engine the offline answers above came from.

# %%
# export: harness.server_process
"""``aie serve`` as a child process on a free loopback port: the notebook's and the tests' server."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")


class ServerProcess:
    """Starts ``aie serve --port 0 ARGS`` and waits until ``/health`` says 200. Its stderr — the
    JSON log — goes to ``log_file``, which ``logs()`` reads; ``stop()`` sends SIGTERM and waits."""

    def __init__(self, args: list[str], log_file: Path, env: dict[str, str] | None = None,
                 ready_s: float = 120.0):
        self.log_file = Path(log_file)
        with self.log_file.open("w") as stderr:  # the child has its own copy of the file
            self.process = subprocess.Popen(
                [sys.executable, "-m", "aie_lessons.cli", "serve", "--port", "0", *args],
                stdout=subprocess.DEVNULL, stderr=stderr, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + ready_s
        self.url = self._wait(deadline, self._url, "listen")
        self._wait(deadline, lambda: httpx.get(self.url + "/health").status_code == 200 or None, "say 200 on /health")

    def _url(self) -> str | None:
        found = LISTENING.search(self.log_file.read_text())
        return found.group(1) if found else None

    def _wait(self, deadline: float, probe, what: str):
        while time.monotonic() < deadline:
            found = probe()
            if found is not None:
                return found
            if self.process.poll() is not None:
                raise RuntimeError(f"aie serve exited with {self.process.returncode}:\n{self.log_file.read_text()}")
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"aie serve did not {what} in time:\n{self.log_file.read_text()}")

    def logs(self) -> list[dict]:
        """The JSON log lines so far (the one line for people, 'listening on', is left out)."""
        return [json.loads(line) for line in self.log_file.read_text().splitlines() if line.startswith("{")]

    def metric(self, name: str, labels: str = "") -> float | None:
        return metric_value(httpx.get(self.url + "/metrics").text, name, labels)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def sse_payloads(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of a streamed response, read as they arrive, up to ``[DONE]``."""
    payloads = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payloads.append(line[len("data: "):])
            if payloads[-1] == "[DONE]":
                break
    return payloads


def wait_until(condition, timeout: float = 10.0, what: str = "the condition") -> None:
    """Poll ``condition()`` until it is true; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} did not hold within {timeout} s")


# %%
import tempfile
import threading
from pathlib import Path

import httpx
import openai

WORK = Path(tempfile.mkdtemp(prefix="aie-serve-"))
server = ServerProcess(["--max-seqs", "4", "--max-waiting", "2", "--step", "eager"], WORK / "server.log")
print("healthy:", httpx.get(server.url + "/health").json())
print("models:", [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]])

# %% [markdown]
# The official `openai` package, pointed at our server: `base_url` is all it needs (the key is
# not checked unless the server has one). Greedy answers must be the offline engine's, word for
# word — the same engine, reached through HTTP and a thread.

# %%
client = openai.OpenAI(base_url=server.url + "/v1", api_key="not-needed", max_retries=0)
for prompt, reference in zip(PROMPTS, offline):
    answer = client.completions.create(model=MODEL_DIR.name, prompt=prompt, max_tokens=24, temperature=0)
    print(f"{answer.usage.completion_tokens:2} tokens  same as offline: {answer.choices[0].text == reference.text}"
          f"  {answer.choices[0].text!r:.50}")
    assert answer.choices[0].text == reference.text

stream = client.chat.completions.create(model=MODEL_DIR.name, messages=[{"role": "user", "content": "Name a fruit."}],
                                        max_tokens=20, temperature=0, stream=True)
pieces = [chunk.choices[0].delta.content or "" for chunk in stream]
print(f"chat, streamed in {len(pieces)} chunks: {''.join(pieces)!r}")

# %% [markdown]
# Bad input, as a client sees it: the status, and a message that names the field and the fix.

# %%
for body in ({"prompt": "word " * 9000, "max_tokens": 4}, {"prompt": "hi", "temperature": -1},
             {"prompt": "hi", "max_token": 5}, {"prompt": "hi", "n": 3}):
    response = httpx.post(server.url + "/v1/completions", json=body)
    print(response.status_code, response.json()["error"]["message"][:110])

# %% [markdown]
# **Overload.** Ten clients at once, on a server that runs 4 requests and lets 2 wait: the
# first six are accepted, the other four get `503` at once, with a `Retry-After`. (How many
# arrive before the first one finishes depends on this machine's speed, so the counts may
# differ here and there.)

# %%
# NBVAL_IGNORE_OUTPUT
def one_stream(results: list, i: int) -> None:
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"prompt": f"Story {i}:", "max_tokens": 48, "ignore_eos": True, "stream": True}) as response:
        if response.status_code == 200:
            results[i] = ("accepted", json.loads(sse_payloads(response)[-2])["choices"][0]["finish_reason"])
        else:
            results[i] = (response.status_code, response.headers.get("retry-after"))


results = [None] * 10
threads = [threading.Thread(target=one_stream, args=(results, i)) for i in range(10)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
for outcome in sorted(set(results), key=str):
    print(f"{results.count(outcome)} × {outcome}")

# %% [markdown]
# The server's own account of it, from `/metrics` — what a Prometheus would scrape every few
# seconds: requests by how they ended (the warm-up request at start-up included), refusals, KV
# blocks in use (0: every request has given its blocks back), and the latency histograms drawn
# as their cumulative counts. The `Retry-After` above came from the rate at which requests
# finished over the last 30 seconds.

# %%
# NBVAL_IGNORE_OUTPUT
import matplotlib.pyplot as plt

text = httpx.get(server.url + "/metrics").text
for name, labels in (("aie_requests_finished_total", 'finish_reason="length"'),
                     ("aie_requests_finished_total", 'finish_reason="eos"'),
                     ("aie_requests_rejected_total", 'reason="queue_full"'), ("aie_kv_blocks_used", "")):
    print(f"{name}{{{labels}}} = {metric_value(text, name, labels)}" if labels else
          f"{name} = {metric_value(text, name)}")

fig, ax = plt.subplots(figsize=(7, 3.5))
for name, label in (("aie_time_to_first_token_seconds", "time to first token"),
                    ("aie_inter_token_latency_seconds", "inter-token latency"),
                    ("aie_e2e_request_latency_seconds", "end-to-end latency")):
    total = metric_value(text, name + "_count")
    shares = [metric_value(text, name + "_bucket", f'le="{b}"') / total for b in LATENCY_BUCKETS_S]
    ax.step(LATENCY_BUCKETS_S, shares, where="post", label=label)
ax.set_xscale("log")
ax.set_xlabel("seconds (bucket upper bound)")
ax.set_ylabel("share of observations ≤ bound")
ax.set_title("Latency distributions from /metrics")
ax.legend()
plt.show()

# %% [markdown]
# **A client that leaves.** A stream is read for two chunks, then the client closes the
# connection. The server notices (Starlette watches for the disconnect), your `sse_stream` calls
# `abort()`, and the engine thread ends the request and frees its KV blocks before its next
# step — long before the 400 tokens it asked for.

# %%
aborted_before = server.metric("aie_requests_finished_total", 'finish_reason="abort"') or 0
with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                  json={"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}) as response:
    lines = response.iter_lines()
    for _ in range(2):  # read two chunks of the stream, then leave the block: the connection closes
        next(line for line in lines if line.startswith("data: "))
    wait_until(lambda: server.metric("aie_kv_blocks_used") > 0, what="KV blocks in use")
    print("while streaming, KV blocks in use:", server.metric("aie_kv_blocks_used") > 0)
wait_until(lambda: server.metric("aie_kv_blocks_used") == 0, timeout=5, what="the blocks freed")
print("after the client left: KV blocks in use", server.metric("aie_kv_blocks_used"), "| aborted requests",
      server.metric("aie_requests_finished_total", 'finish_reason="abort"') - aborted_before)

# %% [markdown]
# ## 8. Load, latency and capacity
#
# One request at a time tells little about a server: what matters is how it behaves when many
# users arrive at once, at random. A **load test** sends a seeded workload (stage 06's mix of
# prompt and output lengths) at a given **offered load** — requests per second, each arriving
# after an exponentially distributed gap, as independent users do (a Poisson process) — and
# records what each *client* saw: time to first token (TTFT), time per output token after it
# (TPOT), the gaps between chunks (inter-token latency) and the whole request (end to end).
#
# As the offered load grows, throughput grows with it — until the engine is saturated. Past that
# point requests only queue: throughput stays flat and latency climbs steeply. That bend is the
# **knee**; a service runs below it. A latency **objective** (here: TTFT ≤ 2 s and TPOT ≤ 200 ms)
# turns the curve into one number, **goodput**: the requests per second that met it.

# %%
# export: harness.load_test
"""A load test over HTTP: Poisson arrivals of a seeded workload, and what each client saw."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import httpx

from aie_lessons.engine.workload import percentile
from aie_lessons.sampling import SamplingParams


@dataclass
class ClientRecord:
    """One request as its client saw it; times in seconds since the test began."""

    sent: float
    status: int = 0  # the HTTP status; 0 if no response came (the connection failed)
    chunk_times: list[float] = field(default_factory=list)  # each chunk that carried text
    done: float | None = None  # when [DONE] arrived
    tokens: int = 0  # the final chunk's usage.completion_tokens
    finish_reason: str | None = None
    left_early: bool = False  # the client hung up on purpose (the soak test's disconnects)
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return None if self.done is None else self.done - self.sent

    @property
    def tpot(self) -> float | None:
        if self.done is None or not self.chunk_times or self.tokens < 2:
            return None
        return (self.done - self.chunk_times[0]) / (self.tokens - 1)

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


@dataclass(frozen=True)
class Objective:
    """A latency objective: a request meets it if its TTFT and its TPOT are both within bounds."""

    ttft_s: float = 2.0
    tpot_s: float = 0.2

    def met(self, record: ClientRecord) -> bool:
        return (record.done is not None and record.ttft is not None and record.ttft <= self.ttft_s
                and (record.tpot is None or record.tpot <= self.tpot_s))


@dataclass
class LoadResult:
    rate: float  # offered requests per second (inf: all at once)
    seconds: float  # from the first request sent to the last answer
    records: list[ClientRecord]

    def summary(self, objective: Objective = Objective()) -> dict[str, float]:
        """What a load-test table shows for one offered load (p50/p99 are nearest-rank)."""
        def pct(values: list[float], q: float, scale: float = 1.0) -> float:
            return scale * percentile(values, q) if values else math.nan

        finished = [r for r in self.records if r.done is not None]
        ttft = [r.ttft for r in finished if r.ttft is not None]
        tpot = [r.tpot for r in finished if r.tpot is not None]
        gaps = [gap for r in finished for gap in r.gaps]
        e2e = [r.e2e for r in finished]
        return {
            "offered req/s": self.rate, "req/s": len(finished) / self.seconds,
            "tok/s": sum(r.tokens for r in finished) / self.seconds,
            "TTFT p50 s": pct(ttft, 50), "TTFT p99 s": pct(ttft, 99),
            "TPOT p50 ms": pct(tpot, 50, 1000), "TPOT p99 ms": pct(tpot, 99, 1000),
            "ITL p50 ms": pct(gaps, 50, 1000), "ITL p99 ms": pct(gaps, 99, 1000),
            "e2e p50 s": pct(e2e, 50), "e2e p99 s": pct(e2e, 99),
            "goodput req/s": sum(objective.met(r) for r in finished) / self.seconds,
            "rejected": sum(r.status == 503 for r in self.records),
            "lost": len(self.lost()), "failed": sum(r.status not in (200, 503) for r in self.records),
        }

    def lost(self) -> list[ClientRecord]:
        """Requests the server accepted (200) that never finished, though their client stayed."""
        return [r for r in self.records if r.status == 200 and r.done is None and not r.left_early]


async def _one(client: httpx.AsyncClient, url: str, prompt: list[int], params: SamplingParams,
               record: ClientRecord, start: float, leave_after: int | None) -> None:
    body = {"prompt": prompt, "max_tokens": params.max_new_tokens, "ignore_eos": params.ignore_eos,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            record.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now, payload = time.perf_counter() - start, line[len("data: "):]
                if payload == "[DONE]":
                    record.done = now
                    return
                chunk = json.loads(payload)
                if "error" in chunk:  # the engine failed: the stream ends with [DONE] after this
                    record.error = chunk["error"]["message"]
                    continue
                if chunk["choices"][0]["text"]:
                    record.chunk_times.append(now)
                if chunk.get("usage"):
                    record.tokens = chunk["usage"]["completion_tokens"]
                    record.finish_reason = chunk["choices"][0]["finish_reason"]
                if leave_after is not None and len(record.chunk_times) >= leave_after:
                    record.left_early = True  # leaving the block closes the connection mid-stream
                    return
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"


async def run_load(url: str, workload: list[tuple[list[int], SamplingParams]], rate: float, seed: int = 0,
                   leave_share: float = 0.0, timeout_s: float = 600.0) -> LoadResult:
    """Send ``workload`` to the server at ``url`` at ``rate`` requests per second (Poisson; ``inf``:
    all at once), every request streamed. With ``leave_share``, that share of the clients hangs up
    after 1–3 chunks, at random (seeded)."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start, arrival, tasks, records = time.perf_counter(), 0.0, [], []
        for prompt, params in workload:
            if math.isfinite(rate):
                arrival += rng.expovariate(rate)
                await asyncio.sleep(max(arrival - (time.perf_counter() - start), 0.0))
            leave = rng.randint(1, 3) if rng.random() < leave_share else None
            record = ClientRecord(sent=time.perf_counter() - start)
            records.append(record)
            tasks.append(asyncio.ensure_future(_one(client, url, prompt, params, record, start, leave)))
        await asyncio.gather(*tasks)
    return LoadResult(rate, time.perf_counter() - start, records)


def knee(results: list[LoadResult], objective: Objective = Objective()) -> LoadResult | None:
    """The highest offered load at which 99% of the requests sent finished within the objective
    (a refused or lost request does not): where to run the server. None if no load did."""
    good = [r for r in results if math.isfinite(r.rate) and r.records and not r.lost()
            and sum(objective.met(record) for record in r.records) >= 0.99 * len(r.records)]
    return max(good, key=lambda r: r.rate, default=None)


# %% [markdown]
# A short sweep on this machine: three offered loads, each a few seconds of seeded requests with
# prompts of 16–64 tokens and answers of 8–24, against a second server set up for throughput
# (16 requests at once, 64 waiting) rather than for the overload demonstration above. (`benchmarks/serve_load.py` runs a longer sweep,
# compares the saturated server with the offline engine on the same workload, and runs the soak
# test: 1,000 requests with random disconnects, then checks that no request was lost and no
# memory leaked.)

# %%
from aie_lessons.engine.workload import mixed_workload

OBJECTIVE = Objective(ttft_s=2.0, tpot_s=0.2)
RATES = (1.0, 4.0, 16.0)
load_server = ServerProcess(["--max-seqs", "16", "--max-waiting", "64", "--step", "eager"], WORK / "load-server.log")
sweep = []
for i, rate in enumerate(RATES):
    workload = mixed_workload(max(8, int(3 * rate)), seed=10 + i, prompt_lens=(16, 64), output_lens=(8, 24),
                              vocab_size=model.config.vocab_size)
    sweep.append(await run_load(load_server.url, workload, rate, seed=i))
print("every request answered:", all(not r.lost() and r.summary()["failed"] == 0 for r in sweep))
print("stopped cleanly:", load_server.stop() == 0)

# %%
# NBVAL_IGNORE_OUTPUT
columns = ("offered req/s", "req/s", "tok/s", "TTFT p50 s", "TTFT p99 s", "TPOT p50 ms", "e2e p99 s", "goodput req/s",
           "rejected")
print(" | ".join(f"{c:>13}" for c in columns))
for result in sweep:
    row = result.summary(OBJECTIVE)
    print(" | ".join(f"{row[c]:13.2f}" for c in columns))

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
rows = [r.summary(OBJECTIVE) for r in sweep]
for key, style in (("TTFT p50 s", "o-"), ("TTFT p99 s", "o--"), ("e2e p50 s", "s-"), ("e2e p99 s", "s--")):
    ax1.plot(RATES, [row[key] for row in rows], style, label=key)
ax1.axhline(OBJECTIVE.ttft_s, color="grey", lw=0.8, ls=":", label="TTFT objective")
best = knee(sweep, OBJECTIVE)
if best is not None:
    ax1.axvline(best.rate, color="red", lw=0.8, label=f"knee: {best.rate:g} req/s")
ax1.set(xscale="log", yscale="log", xlabel="offered load (requests/s)", ylabel="seconds", title="Latency vs offered load")
ax1.legend(fontsize=8)
ax2.plot(RATES, [row["req/s"] for row in rows], "o-", label="served")
ax2.plot(RATES, [row["goodput req/s"] for row in rows], "s-", label="goodput (met the objective)")
ax2.plot(RATES, RATES, ":", color="grey", label="offered")
ax2.set(xscale="log", yscale="log", xlabel="offered load (requests/s)", ylabel="requests/s", title="Throughput")
ax2.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# **Capacity planning** turns the knee into machines. Say each user sends one request a minute
# on average, with this workload's lengths: one machine serves `knee rate × 60` users within the
# objective, and `N` users need `ceil(N / that)` machines — plus one spare, so that one can be
# drained or fail (section 5) without the rest going past the knee.

# %%
# NBVAL_IGNORE_OUTPUT
if best is None:
    print("no offered load met the objective on this machine: relax the objective or lower the lengths")
else:
    users_per_machine = best.rate * 60
    for users in (100, 1_000, 10_000):
        machines = math.ceil(users / users_per_machine) + 1
        print(f"{users:>6} users, one request a minute each: {machines} machines "
              f"({users_per_machine:.0f} users per machine at {best.rate:g} req/s, plus one spare)")


# %% [markdown]
# ## 9. Stopping it
#
# **A graceful stop.** Two streams are running when the server gets `SIGTERM` (what `kill`,
# `docker stop` and Kubernetes send). It refuses new requests with 503 at once, finishes both
# streams to their last token, and exits with status 0; the log's `drained` line says how many
# requests it waited for and how many it had to abort.

# %%
streams = [dict() for _ in range(2)]


def read_stream_into(result: dict) -> None:
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True,
                            "stream": True}) as response:
        payloads = sse_payloads(response)
    result["finish_reason"] = json.loads(payloads[-2])["choices"][0]["finish_reason"]
    result["done"] = payloads[-1] == "[DONE]"


threads = [threading.Thread(target=read_stream_into, args=(result,)) for result in streams]
for thread in threads:
    thread.start()
wait_until(lambda: server.metric("aie_requests_running") == 2, what="two running requests")
server.process.send_signal(signal.SIGTERM)
wait_until(lambda: httpx.get(server.url + "/health").status_code == 503, what="/health saying 503")
late = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
print("a request after SIGTERM:", late.status_code, late.json()["error"]["message"][:60])
for thread in threads:
    thread.join()
print("the two streams:", streams)
print("exit status:", server.process.wait(60))
drained = next(line for line in server.logs() if line["message"] == "drained")
print("drained: in flight", drained["in_flight"], "aborted", drained["aborted"])

# %% [markdown]
# **A hot swap** is one call to the admin API, which needs its own key (`admin_key`, or the
# `AIE_ADMIN_KEY` variable): the new weights load beside the old, new requests go to them, and
# the old engine finishes what it holds before it is freed. The tests swap the model under load
# and check that no request is lost (`tests/test_server.py`); by hand:
#
# ```
# AIE_ADMIN_KEY=secret aie serve &
# curl -X POST http://127.0.0.1:8000/admin/swap -H 'Authorization: Bearer secret' \
#      -H 'Content-Type: application/json' -d '{"model_dir": "data/models/smollm2-135m-instruct", "dtype": "bfloat16"}'
# ```
#
# ## What you built
#
# A server that speaks OpenAI's API over the engine you wrote, streams with server-sent events
# (10.1), frees a request's memory the moment its client leaves, refuses what it cannot serve in
# time with a 503 that says when to come back (10.2), and stops without losing anything it
# accepted (10.3) — and you measured where its knee is, and what that means in machines.
