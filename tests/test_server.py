"""`aie serve` as a real process, exercised with real clients: httpx and the official `openai` package.

Two kinds of server: one on the tiny random checkpoint (starts in seconds; the API's shape, its
errors, keys and limits), and ones on the course model (its answers equal the offline engine's;
overload, disconnects, SIGTERM and the hot swap, which need requests that last a while).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from aie_lessons.harness.server_process import ServerProcess, sse_payloads, wait_until

API_KEY, ADMIN_KEY = "test-api-key", "test-admin-key"
KEYS = {"AIE_API_KEY": API_KEY, "AIE_ADMIN_KEY": ADMIN_KEY}
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_server(tiny_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve")
    config = folder / "serve.yaml"
    config.write_text("max_body_bytes: 4096\nmax_seqs: 4\nstep: eager\n")
    server = ServerProcess(["--model", str(tiny_dir), "--config", str(config)], folder / "server.log", env=KEYS)
    yield server
    server.stop()


def post(server, path: str, body, headers=AUTH, timeout: float = 60) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=timeout)


# --- the API's shape, on the tiny model -------------------------------------------------------


def test_health_models_and_a_completion(tiny_server):
    assert httpx.get(tiny_server.url + "/health").json() == {"status": "ready"}
    models = httpx.get(tiny_server.url + "/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == ["tiny-llama"]
    response = post(tiny_server, "/v1/completions", {"prompt": "the cat", "max_tokens": 5, "temperature": 0,
                                                     "ignore_eos": True})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny-llama"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 5


def test_a_stream_holds_the_same_text_as_the_whole_answer(tiny_server):
    request = {"prompt": "hello world", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = post(tiny_server, "/v1/completions", request).json()
    with httpx.stream("POST", tiny_server.url + "/v1/completions", json=request | {"stream": True}, headers=AUTH,
                      timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(response)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_the_openai_client_completions_and_chat(tiny_server):
    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=API_KEY, max_retries=0)
    whole = client.completions.create(model="tiny-llama", prompt="the dog", max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.usage.completion_tokens == 8 and whole.choices[0].finish_reason == "length"
    streamed = client.completions.create(model="tiny-llama", prompt="the dog", max_tokens=8, temperature=0,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True})
    pieces = list(streamed)
    assert "".join(p.choices[0].text for p in pieces if p.choices) == whole.choices[0].text
    assert pieces[-1].usage.completion_tokens == 8

    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6
    deltas = list(client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=6,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == chat.choices[0].message.content
    assert deltas[-1].choices[0].finish_reason == "length"


def test_stop_strings_cut_the_answer_as_the_engine_does(tiny_server):
    base = {"prompt": "the cat", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    full = post(tiny_server, "/v1/completions", base).json()["choices"][0]["text"]
    stop = full[len(full) // 2:len(full) // 2 + 2]  # a piece from the middle of the greedy answer
    assert stop and stop in full
    cut = post(tiny_server, "/v1/completions", base | {"stop": [stop]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == full[:full.index(stop)]
    with httpx.stream("POST", tiny_server.url + "/v1/completions", json=base | {"stop": stop, "stream": True},
                      headers=AUTH, timeout=60) as response:
        chunks = [json.loads(p) for p in sse_payloads(response)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == cut["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("body, param, message", [
    ({"prompt": "word " * 80, "max_tokens": 4}, "prompt", "the model's context is 64 tokens"),
    ({"prompt": "hi", "temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"prompt": "hi", "top_p": 0}, "top_p", "greater than 0"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens", "valid integer"),
    ({"prompt": "hi", "max_token": 5}, "max_token", "unknown field 'max_token'"),
    ({"prompt": "hi", "n": 2}, "n", "one choice per request"),
    ({"prompt": "hi", "logprobs": 3}, "logprobs", "not returned"),
    ({"prompt": ["a", "b"]}, "prompt", "one per request"),
    ({"prompt": ""}, "prompt", "the prompt is empty"),
    ({"prompt": [5, 100000]}, "prompt", "outside the vocabulary"),
    ({"max_tokens": 3}, "prompt", "Field required"),
    ({"prompt": "hi", "seed": 2**64}, "seed", "less than or equal to"),
    ({"prompt": "hi", "repetition_penalty": 1e-45}, "repetition_penalty", "greater than or equal to 0.01"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", "only for streamed requests"),
])
def test_bad_input_gets_400_naming_the_field(tiny_server, body, param, message):
    response = post(tiny_server, "/v1/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_other_bad_requests(tiny_server):
    not_json = httpx.post(tiny_server.url + "/v1/completions", content=b"{not json", headers=AUTH | {
        "content-type": "application/json"})
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]
    wrong_model = post(tiny_server, "/v1/completions", {"prompt": "hi", "model": "gpt-4"})
    assert wrong_model.status_code == 404 and "tiny-llama" in wrong_model.json()["error"]["message"]
    chat = post(tiny_server, "/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages.0.role"


def test_a_body_over_the_limit_gets_413(tiny_server):
    big = {"prompt": "x" * 5000}
    declared = post(tiny_server, "/v1/completions", big)
    assert declared.status_code == 413 and "max_body_bytes" in declared.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit is enforced as the body arrives
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i:i + 1000]

    streamed = httpx.post(tiny_server.url + "/v1/completions", content=chunks(), headers=AUTH | {
        "content-type": "application/json"})
    assert streamed.status_code == 413 and "max_body_bytes" in streamed.json()["error"]["message"]


def test_keys(tiny_server):
    body = {"prompt": "hi", "max_tokens": 1}
    assert post(tiny_server, "/v1/completions", body, headers={}).status_code == 401
    wrong = post(tiny_server, "/v1/completions", body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "Authorization: Bearer" in wrong.json()["error"]["message"]
    assert httpx.get(tiny_server.url + "/v1/models").status_code == 401
    # the key is checked before the body is read: no key, a broken body, still 401
    assert post(tiny_server, "/v1/completions", {"max_token": 5}, headers={}).status_code == 401
    assert httpx.get(tiny_server.url + "/health").status_code == 200  # probes need no key
    assert httpx.get(tiny_server.url + "/metrics").status_code == 200
    # the admin route takes the admin key only, never the API key
    assert post(tiny_server, "/admin/swap", {"model_dir": "x"}, headers=AUTH).status_code == 401


def test_each_request_has_an_id_in_its_response_and_a_json_log_line(tiny_server):
    response = post(tiny_server, "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                    headers=AUTH | {"X-Request-Id": "trace-42"})
    assert response.headers["x-request-id"] == "trace-42"
    generated = post(tiny_server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert len(generated.headers["x-request-id"]) == 32
    wait_until(lambda: any(line.get("request_id") == "trace-42" for line in tiny_server.logs()),
               what="a log line for trace-42")
    line = next(line for line in tiny_server.logs() if line.get("request_id") == "trace-42")
    assert line["status"] == 200 and line["path"] == "/v1/completions" and line["ms"] >= 0


def test_a_bad_config_is_refused_by_name(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("max_seq: 4\n")
    run = subprocess.run([sys.executable, "-m", "aie_lessons.cli", "serve", "--config", str(config)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "unknown field 'max_seq'" in run.stderr and "'max_seqs'" in run.stderr


# --- the compiled step (stage 09) on the tiny model ---------------------------------------------


@pytest.fixture(scope="module")
def compiles(tiny_dir):
    from aie_lessons.engine.engine_config import choose_step
    from aie_lessons.model import LlamaModel

    step, why = choose_step(LlamaModel.from_pretrained(tiny_dir), "auto")
    if step != "compiled":
        pytest.skip(f"the compiled step cannot run here: {why}")


def test_the_compiled_step_is_compiled_before_the_server_says_ready(tiny_dir, tmp_path, compiles):
    """Every bucket is compiled before /health says 200, and the answers are the eager engine's."""
    from aie_lessons.engine.paged_engine import paged_engine
    from aie_lessons.model import LlamaModel
    from aie_lessons.sampling import SamplingParams
    from aie_lessons.tokenizer import Tokenizer

    server = ServerProcess(["--model", str(tiny_dir), "--max-seqs", "2", "--step", "compiled"],
                           tmp_path / "server.log", env=KEYS)
    try:
        lines = server.logs()
        messages = [line["message"] for line in lines]
        assert messages.index("compiling the engine's step") < messages.index("compiled") < messages.index("ready")
        assert lines[messages.index("compiling the engine's step")]["buckets"] == [1, 2]
        assert lines[messages.index("ready")]["step"] == "compiled"
        prompts = ["the cat", "a dog and"]
        offline = paged_engine(LlamaModel.from_pretrained(tiny_dir), Tokenizer.from_pretrained(tiny_dir), max_seqs=2
                               ).generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
        for prompt, expected in zip(prompts, offline):
            answer = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                      "ignore_eos": True})
            assert answer.json()["choices"][0]["text"] == expected.text
        assert server.stop() == 0
    finally:
        server.kill()


def test_without_warm_up_the_server_compiles_on_first_use(tiny_dir, tmp_path, compiles):
    """warm_up: false starts without compiling (an empty inductor cache: nothing to load either);
    the first request pays for its bucket, and is answered."""
    config = tmp_path / "serve.yaml"
    config.write_text("warm_up: false\nstep: compiled\nmax_seqs: 2\n")
    server = ServerProcess(["--model", str(tiny_dir), "--config", str(config)], tmp_path / "server.log",
                           env=KEYS | {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "empty-cache")})
    try:
        messages = [line["message"] for line in server.logs()]
        assert "compiling the engine's step" not in messages
        assert next(line for line in server.logs() if line["message"] == "ready")["step"] == "compiled"
        assert not list((tmp_path / "empty-cache").rglob("*.so")), "compiled before any request"
        answer = post(server, "/v1/completions", {"prompt": "the cat", "max_tokens": 4, "ignore_eos": True},
                      timeout=300)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        assert list((tmp_path / "empty-cache").rglob("*.so")), "the first request's bucket was compiled"
        assert server.stop() == 0
    finally:
        server.kill()


def test_auto_runs_eager_when_the_compiler_cannot_build(tiny_dir, tmp_path, compiles):
    """A compiler that exists but cannot build (here `true`, which writes nothing) is found only
    by compiling: step auto then serves with the eager step and says why."""
    server = ServerProcess(["--model", str(tiny_dir), "--max-seqs", "2"], tmp_path / "server.log",
                           env=KEYS | {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "empty-cache"), "CXX": "true"})
    try:
        lines = server.logs()
        assert next(line for line in lines if line["message"] == "ready")["step"] == "eager"
        warning = next(line for line in lines if "failed to compile" in line["message"])
        assert warning["level"] == "warning" and warning["error"]
        answer = post(server, "/v1/completions", {"prompt": "the cat", "max_tokens": 4, "ignore_eos": True})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        assert server.stop() == 0
    finally:
        server.kill()


def test_a_signal_during_the_first_compile_stops_the_server_at_once(tiny_dir, tmp_path, compiles):
    """A first compile of every bucket takes a minute; a SIGTERM then must not wait for it: the
    load runs on a daemon thread, which the process leaves behind. (An empty inductor cache, so
    that the compile is under way when the signal comes.)"""
    log_file = tmp_path / "server.log"
    env = {**os.environ, **KEYS, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "empty-cache")}
    with log_file.open("w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "aie_lessons.cli", "serve", "--port", "0", "--model",
                                    str(tiny_dir), "--max-seqs", "16", "--step", "compiled"],
                                   stdout=subprocess.DEVNULL, stderr=stderr, env=env)
    try:
        wait_until(lambda: "compiling the engine's step" in log_file.read_text(), timeout=120,
                   what="the compile under way")
        process.send_signal(signal.SIGTERM)
        start = time.monotonic()
        assert process.wait(30) == 0
        assert time.monotonic() - start < 10, log_file.read_text()
        messages = [json.loads(line)["message"] for line in log_file.read_text().splitlines() if line.startswith("{")]
        assert "compiled" not in messages, "the compile finished first: the test proved nothing"
        assert "exiting before the load ended" in messages
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


# --- the course model: answers, overload, disconnects, SIGTERM, hot swap ------------------------


@pytest.fixture(scope="module")
def real_server(real_model_dir, tmp_path_factory):
    """The course model with the default step: compiled where a C++ compiler exists (stage 09)."""
    folder = tmp_path_factory.mktemp("serve-real")
    # ready_s: on a slow CPU's first run, compiling the buckets takes minutes
    server = ServerProcess(["--model", str(real_model_dir), "--max-seqs", "2", "--max-waiting", "1"],
                           folder / "server.log", env=KEYS, ready_s=600)
    yield server
    server.stop()


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three primary colours are"]


def test_greedy_answers_equal_the_offline_engine(real_server, real_model, real_model_dir):
    """The server's default step, compiled before it said ready, answers as stage 07's eager engine."""
    from aie_lessons.engine.engine_config import choose_step
    from aie_lessons.engine.paged_engine import paged_engine
    from aie_lessons.sampling import SamplingParams
    from aie_lessons.tokenizer import Tokenizer

    ready = next(line for line in real_server.logs() if line["message"] == "ready")
    assert ready["step"] == choose_step(real_model, "auto")[0]
    tokenizer = Tokenizer.from_pretrained(real_model_dir)
    offline = paged_engine(real_model, tokenizer, max_seqs=2).generate(PROMPTS, SamplingParams(max_new_tokens=24))
    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key=API_KEY, max_retries=0)
    for prompt, reference in zip(PROMPTS, offline):
        answer = client.completions.create(model=real_model_dir.name, prompt=prompt, max_tokens=24, temperature=0)
        assert answer.choices[0].text == reference.text
        assert answer.usage.completion_tokens == len(reference.token_ids)
        streamed = client.completions.create(model=real_model_dir.name, prompt=prompt, max_tokens=24,
                                             temperature=0, stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed) == reference.text


def _stream(server, body: dict, result: dict, started: threading.Event | None = None) -> None:
    """One streaming request: ``result`` gets its status, payloads and finish reason."""
    with httpx.stream("POST", server.url + "/v1/completions", json=body | {"stream": True}, headers=AUTH,
                      timeout=120) as response:
        result["status"] = response.status_code
        if started is not None:
            started.set()
        if response.status_code != 200:
            response.read()
            result["body"] = response.json()
            return
        payloads = sse_payloads(response)
    result["payloads"] = payloads
    result["finish_reason"] = json.loads(payloads[-2])["choices"][0]["finish_reason"]


def _stream_in_background(server, body: dict, started: threading.Event | None = None) -> tuple[threading.Thread, dict]:
    """A streaming request on a thread."""
    result: dict = {}
    thread = threading.Thread(target=_stream, args=(server, body, result, started))
    thread.start()
    return thread, result


def _keep_streaming(server, body: dict, until: threading.Event) -> tuple[threading.Thread, list[dict]]:
    """A client that always has a stream in flight until ``until`` is set: it starts the next one
    when the last ends, and tries again after a ``503`` for a full queue (the answer it asks for).
    A stream that breaks is a result too (``error``), never a silently dead thread."""
    results: list[dict] = []

    def run():
        while not until.is_set():
            result: dict = {}
            try:
                _stream(server, body, result)
            except Exception as exc:  # a cut stream: the failure the caller asserts on
                result["error"] = repr(exc)
            if result.get("status") == 503 and "max_waiting" in result["body"]["error"]["message"]:
                time.sleep(0.05)
                continue
            results.append(result)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, results


LONG = {"prompt": "Once upon a time", "max_tokens": 120, "ignore_eos": True, "temperature": 0}


def test_a_full_queue_gets_503_with_retry_after_and_loses_nothing(real_server):
    running = [_stream_in_background(real_server, LONG) for _ in range(2)]
    wait_until(lambda: real_server.metric("aie_requests_running") == 2, what="2 requests running")
    accepted = threading.Event()
    waiting = _stream_in_background(real_server, LONG, accepted)
    assert accepted.wait(30)
    refused = post(real_server, "/v1/completions", LONG)
    assert refused.status_code == 503, refused.text
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert "max_waiting=1" in refused.json()["error"]["message"]
    for thread, result in [*running, waiting]:
        thread.join(120)
        assert result["status"] == 200 and result["payloads"][-1] == "[DONE]" and result["finish_reason"] == "length"
    assert real_server.metric("aie_requests_rejected_total", 'reason="queue_full"') >= 1


def test_a_client_that_disconnects_is_aborted_and_its_blocks_freed(real_server):
    aborted_before = real_server.metric("aie_requests_finished_total", 'finish_reason="abort"') or 0
    long = LONG | {"max_tokens": 400}
    with httpx.stream("POST", real_server.url + "/v1/completions", json=long | {"stream": True}, headers=AUTH,
                      timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        wait_until(lambda: real_server.metric("aie_kv_blocks_used") > 0, what="KV blocks in use")
    # the stream was closed after its first event: the request ends and frees its blocks at once
    wait_until(lambda: real_server.metric("aie_kv_blocks_used") == 0, timeout=5, what="KV blocks back to 0")
    assert real_server.metric("aie_requests_finished_total", 'finish_reason="abort"') == aborted_before + 1
    assert real_server.metric("aie_requests_running") == 0

    with pytest.raises(httpx.ReadTimeout):  # a client that gives up on a non-streaming request
        post(real_server, "/v1/completions", long, timeout=1.0)
    wait_until(lambda: real_server.metric("aie_requests_finished_total", 'finish_reason="abort"')
               == aborted_before + 2, timeout=5, what="the second abort")
    wait_until(lambda: real_server.metric("aie_kv_blocks_used") == 0, timeout=5, what="KV blocks back to 0")


def test_a_hot_swap_loses_no_request(real_server, real_model_dir):
    """Last of the tests on ``real_server``: it leaves the bf16 model in place. The new model is
    compiled before it takes requests, which takes longer than any one stream on some CPUs and
    less on others: two clients keep a stream in flight until the swap answers, so that whatever
    the swap's length, requests are running on the old engine when it drains."""
    swapped = threading.Event()
    # two lengths, so that the clients' streams end (and the next ones start) at different steps
    clients = [_keep_streaming(real_server, LONG | {"max_tokens": n}, swapped) for n in (60, 97)]
    try:
        _swap_under_load(real_server, real_model_dir, swapped, clients)
    finally:
        swapped.set()  # the clients stop, whatever failed


def _swap_under_load(real_server, real_model_dir, swapped: threading.Event, clients) -> None:
    wait_until(lambda: real_server.metric("aie_requests_running") == 2, what="2 requests running")
    swap: dict = {}
    target = {"model_dir": str(real_model_dir), "dtype": "bfloat16", "model_name": "smollm2-bf16"}

    def swap_and_tell():
        try:
            swap["response"] = httpx.post(real_server.url + "/admin/swap", json=target, headers=ADMIN, timeout=300)
        finally:
            swapped.set()

    swapper = threading.Thread(target=swap_and_tell)
    swapper.start()
    wait_until(lambda: any(line["message"] == "swapping" for line in real_server.logs()), timeout=30,
               what="the swap under way")
    second = post(real_server, "/admin/swap", target, headers=ADMIN)
    assert second.status_code == 409 and "already under way" in second.json()["error"]["message"]
    during = []
    while swapper.is_alive() and len(during) < 20:  # requests keep coming while the swap goes on
        during.append(post(real_server, "/v1/completions", {"prompt": "Hello", "max_tokens": 4}))
    swapper.join(300)
    assert swap["response"].status_code == 200, swap["response"].text
    report = swap["response"].json()
    assert report["new"] == "smollm2-bf16" and report["aborted"] == 0
    assert report["step"] == next(line for line in real_server.logs() if line["message"] == "ready")["step"]
    assert report["drained"] >= 1  # the streams in flight at the switch finished on the old engine
    for thread, results in clients:
        thread.join(120)
        assert not thread.is_alive() and results
        assert all(r.get("status") == 200 and r["payloads"][-1] == "[DONE]" and r["finish_reason"] == "length"
                   for r in results), [r for r in results if r.get("status") != 200 or "error" in r]
    assert all(r.status_code in (200, 503) for r in during) and any(r.status_code == 200 for r in during)
    refused = [r for r in during if r.status_code == 503]
    assert all("max_waiting" in r.json()["error"]["message"] for r in refused)  # the queue, never the swap
    models = httpx.get(real_server.url + "/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == ["smollm2-bf16"]
    after = post(real_server, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "model": "smollm2-bf16"})
    assert after.status_code == 200 and after.json()["model"] == "smollm2-bf16"


@pytest.mark.parametrize("deadline, finish_reason", [(60, "length"), (0.5, "abort")])
def test_sigterm_drains_in_flight_requests(real_model_dir, tmp_path, deadline, finish_reason):
    server = ServerProcess(["--model", str(real_model_dir), "--max-seqs", "2", "--drain-timeout", str(deadline),
                            "--step", "eager"],
                           tmp_path / "server.log", env=KEYS)
    try:
        body = LONG | {"max_tokens": 40 if finish_reason == "length" else 2000}  # 40: done within the deadline
        streams = [_stream_in_background(server, body) for _ in range(2)]
        wait_until(lambda: server.metric("aie_requests_running") == 2, what="2 requests running")
        server.process.send_signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(server.url + "/health").status_code == 503, what="/health 503")
        refused = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        for thread, result in streams:
            thread.join(120)
            assert result["payloads"][-1] == "[DONE]" and result["finish_reason"] == finish_reason
        assert server.process.wait(60) == 0
        drained = next(line for line in server.logs() if line["message"] == "drained")
        assert drained["in_flight"] == 2 and drained["aborted"] == (2 if finish_reason == "abort" else 0)
    finally:
        server.kill()


# --- the soak test: 1,000 requests with random disconnects, on the tiny model ------------------


def test_a_thousand_requests_with_disconnects_lose_none_and_leak_nothing(tiny_dir, tmp_path):
    """Every request the server accepted finishes unless its client left; afterwards no KV block is
    held and the resident memory is within 5% of its level after a warm-up of the same load."""
    import asyncio

    import psutil

    from aie_lessons.engine.workload import mixed_workload
    from aie_lessons.harness.load_test import run_load

    server = ServerProcess(["--model", str(tiny_dir), "--max-seqs", "16", "--max-waiting", "2000", "--step", "eager"],
                           tmp_path / "server.log")
    try:
        def load(n: int, seed: int):
            workload = mixed_workload(n, seed, prompt_lens=(4, 24), output_lens=(2, 12), vocab_size=300)
            return asyncio.run(run_load(server.url, workload, rate=200.0, seed=seed, leave_share=0.3))

        process = psutil.Process(server.process.pid)
        load(300, seed=1)  # the warm-up, at the same rate: allocator arenas and buffers reach their working size
        baseline = process.memory_info().rss
        result = load(1000, seed=2)
        summary = result.summary()
        assert summary["failed"] == 0 and summary["rejected"] == 0
        assert not result.lost(), f"{len(result.lost())} accepted requests never finished"
        left = sum(r.left_early for r in result.records)
        assert 200 < left < 400  # the disconnects happened
        assert sum(r.done is not None for r in result.records) == 1000 - left
        wait_until(lambda: server.metric("aie_kv_blocks_used") == 0 and server.metric("aie_requests_running") == 0,
                   timeout=10, what="KV blocks and running requests back to 0")
        assert server.metric("aie_requests_tracked") == 0  # no record of an ended request is kept
        grown = process.memory_info().rss / baseline - 1
        assert grown < 0.05, f"resident memory grew {100 * grown:.1f}% over 1,000 requests"
    finally:
        server.kill()
