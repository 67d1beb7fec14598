"""The `aie` command line, run as a learner would run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aie_lessons.infra import compile_cache as cache
from side_by_side import two_at_a_time


# The console script `pip install` made, as a user runs it (not `python -m`, which would also put
# the working directory first on the import path).
AIE = [str(Path(sys.executable).parent / "aie")]


pytestmark = pytest.mark.slow  # almost every test here starts the console script (a new Python, torch imported)


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*AIE, *args], capture_output=True, text=True, timeout=600, env=env)


def run_json_side_by_side(monkeypatch, *commands: tuple[str, ...]) -> list[dict]:
    """``aie ... --json`` for each command, two at a time with one thread each, in order: runs on
    the tiny model are mostly a Python starting and importing torch, one core's work."""
    def output(args: tuple[str, ...]) -> dict:
        out = run(*args)
        assert out.returncode == 0, (args, out.stderr[-2000:])
        return json.loads(out.stdout)

    outputs = two_at_a_time(lambda i: output(commands[i]), list(range(len(commands))), monkeypatch)
    return [outputs[i] for i in range(len(commands))]  # by position: two commands may be the same


def test_generate_json_has_ids_text_and_timings(tiny_dir):
    out = run("generate", "hello", "--model", str(tiny_dir), "--max-new-tokens", "5", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result) == {"prompt_ids", "token_ids", "text", "finish_reason", "seed", "loop", "step", "timings"}
    assert result["loop"] == "engine"  # the default for one prompt too
    assert result["step"] == ("compiled" if cache.cpp_compiler() else "eager")
    assert result["seed"] is None  # greedy: nothing was drawn
    assert result["prompt_ids"] and len(result["token_ids"]) <= 5
    assert {"first_token_s", "total_s", "decode_tokens_per_s"} <= set(result["timings"])


def test_generate_streams_the_same_text_as_json(tiny_dir):
    args = ("generate", "The quick", "--model", str(tiny_dir), "--max-new-tokens", "8")
    streamed = run(*args)
    as_json = json.loads(run(*args, "--json").stdout)
    assert streamed.returncode == 0
    assert streamed.stdout == as_json["text"] + "\n"


def test_too_long_prompt_is_refused_with_the_numbers(tiny_dir):
    out = run("generate", "word " * 80, "--model", str(tiny_dir), "--max-new-tokens", "4")
    assert out.returncode == 2
    assert "context is 64 tokens" in out.stderr and "Traceback" not in out.stderr


def test_missing_model_is_a_clear_error(tmp_path):
    out = run("generate", "hi", "--model", str(tmp_path))
    assert out.returncode == 2
    assert "aie fetch-model" in out.stderr and "Traceback" not in out.stderr


def test_env_reports_torch_triton_and_the_cpus_low_precision_instructions():
    out = run("env")
    assert out.returncode == 0, out.stderr
    assert "torch" in out.stdout and "triton" in out.stdout
    # bf16 and int8 results and speeds depend on the CPU's instructions: say which it has
    for row in ("bf16 arithmetic", "int8 arithmetic", "torch cpu kernels"):
        assert row in out.stdout, row


def test_bf16_weights_with_either_activation_dtype(tiny_dir):
    args = ("generate", "The quick", "--model", str(tiny_dir), "--max-new-tokens", "4", "--json", "--dtype", "bfloat16",
            "--loop", "cached")
    for activations in ("float32", "bfloat16"):
        out = run(*args, "--activations", activations)
        assert out.returncode == 0, out.stderr
        assert len(json.loads(out.stdout)["token_ids"]) == 4


def ran_the_compiled_decoder(stderr: str) -> bool:
    """The CLI said it compiled stage 09's decoder, or loaded it compiled before."""
    return "compiling the decoder" in stderr or "loaded the compiled decoder" in stderr


def ran_the_compiled_step(stderr: str) -> bool:
    """The CLI said it compiled the engine's step, or loaded it compiled before, and ran it."""
    said = "compiling the engine's step" in stderr or "loaded the engine's compiled step" in stderr
    return said and "compiled step)" in stderr


@pytest.mark.oracle
def test_chat_answer_about_france(real_model_dir):
    """The default: the engine, its step compiled ahead of time (or loaded, compiled before)."""
    out = run("generate", "--chat", "What is the capital of France?", "--max-new-tokens", "32",
              "--model", str(real_model_dir))
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert ran_the_compiled_step(out.stderr), out.stderr


def test_the_five_loops_agree(tiny_untied_dir, monkeypatch):
    """The same tokens and text from every loop, all run with one thread (the tests of each loop
    on the real model run with every core). The default for one prompt is the engine, its step
    compiled; the lessons' loops are its oracles. Sampled, it draws the cached loop's tokens from
    the same seed."""
    if cache.cpp_compiler() is None:
        pytest.skip("no C++ compiler: the compiled step and decoder cannot run here")
    args = ("generate", "The quick", "--model", str(tiny_untied_dir), "--max-new-tokens", "10", "--json")
    loops = ("skeleton", "cached", "compiled")
    engine, eager, *others = run_json_side_by_side(monkeypatch, args, (*args, "--step", "eager"),
                                                   *((*args, "--loop", loop) for loop in loops))
    assert [r["loop"] for r in (engine, eager, *others)] == ["engine", "engine", *loops]  # none fell back
    assert (engine["step"], eager["step"]) == ("compiled", "eager")
    assert len(set(engine["token_ids"])) > 3, "the model must produce varied tokens for this to mean anything"
    for loop, result in zip(("eager step", *loops), (eager, *others)):
        assert (result["token_ids"], result["text"]) == (engine["token_ids"], engine["text"]), loop
    sampled = (*args, "--temperature", "1.5", "--top-p", "0.95", "--seed", "5")
    engine, cached = run_json_side_by_side(monkeypatch, sampled, (*sampled, "--loop", "cached"))
    assert (engine["loop"], cached["loop"]) == ("engine", "cached")
    assert engine["token_ids"] == cached["token_ids"] and engine["token_ids"] != others[1]["token_ids"]


def test_sampling_flags_sample_reproducibly(tiny_untied_dir, monkeypatch):
    # The cached loop: the seed's rules are the CLI's, whatever the loop (the compiled decoder
    # samples from its logits with the same sample_next: tests/test_fast_decode.py).
    args = ("generate", "The quick", "--model", str(tiny_untied_dir), "--max-new-tokens", "10", "--json", "--loop",
            "cached", "--temperature", "1.5", "--top-k", "50", "--top-p", "0.95", "--repetition-penalty", "1.1")
    greedy, first, again, other, unseeded = run_json_side_by_side(
        monkeypatch, args[:9], (*args, "--seed", "5"), (*args, "--seed", "5"), (*args, "--seed", "6"), args)
    greedy, first, again, other = (r["token_ids"] for r in (greedy, first, again, other))
    assert first == again and first != greedy and other != first
    # An unseeded run chooses a seed and reports it, and that seed repeats the answer (with the
    # same one thread: OMP_NUM_THREADS is still set).
    repeated = json.loads(run(*args, "--seed", str(unseeded["seed"])).stdout)
    assert isinstance(unseeded["seed"], int) and repeated["token_ids"] == unseeded["token_ids"]


def test_sampling_flags_at_temperature_zero_get_a_note(tiny_dir):
    out = run("generate", "x", "--model", str(tiny_dir), "--max-new-tokens", "2", "--top-k", "5", "--seed", "1",
              "--loop", "cached")
    assert out.returncode == 0 and "--top-k, --seed only matter when sampling" in out.stderr


@pytest.mark.parametrize("old, new", [("--no-cache", "--loop skeleton"), ("--compile", "--loop compiled")])
def test_the_old_loop_flags_name_their_replacement(tiny_dir, old, new):
    out = run("generate", "x", "--model", str(tiny_dir), old)
    assert out.returncode != 0 and f"Fix: use {new}" in out.stderr


@pytest.mark.parametrize("flag, value, field", [
    ("--temperature", "-1", "temperature"),
    ("--top-p", "0", "top_p"),
    ("--top-k", "-3", "top_k"),
    ("--repetition-penalty", "0", "repetition_penalty"),
    ("--max-new-tokens", "-1", "max_new_tokens"),
])
def test_invalid_sampling_values_are_refused_with_the_field(tiny_dir, flag, value, field):
    out = run("generate", "x", "--model", str(tiny_dir), flag, value)
    assert out.returncode == 2 and f"{field}={value}" in out.stderr and "must be" in out.stderr
    assert "Traceback" not in out.stderr


def test_unknown_loop_is_refused(tiny_dir):
    out = run("generate", "x", "--model", str(tiny_dir), "--loop", "fast")
    assert out.returncode != 0 and "invalid choice: 'fast'" in out.stderr


def test_quant_quantizes_once_and_reads_the_file_after(tiny_dir, tmp_path, monkeypatch):
    """`--quant`: the first run writes the checkpoint's quantized/ file, the next read it, and
    the tokens are those of the same quantized model in-process (engine and cached loop alike)."""
    import shutil

    from aie_lessons.cached_generate import generate_cached
    from aie_lessons.model import LlamaModel
    from aie_lessons.quantize import quantize_model
    from aie_lessons.sampling import SamplingParams
    from aie_lessons.tokenizer import Tokenizer

    model_dir = tmp_path / "tiny"
    shutil.copytree(tiny_dir, model_dir)
    args = ("generate", "hello", "--model", str(model_dir), "--max-new-tokens", "6", "--json", "--quant", "int4-g32",
            "--loop", "cached")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # every run compared here with one thread
    first = run(*args)
    assert first.returncode == 0 and "quantizing tiny to int4-g32, once" in first.stderr, first.stderr
    assert len(list((model_dir / "quantized").glob("*.safetensors"))) == 1
    engine_args = (*args, "--loop", "engine")
    runs = two_at_a_time(lambda command: run(*command), [args, engine_args], monkeypatch)
    second, engine = runs[args], runs[engine_args]
    for later in (second, engine):
        assert later.returncode == 0 and "quantizing" not in later.stderr, later.stderr
    assert len(list((model_dir / "quantized").glob("*.safetensors"))) == 1
    second, engine = json.loads(second.stdout), json.loads(engine.stdout)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    model = quantize_model(LlamaModel.from_pretrained(model_dir), "int4-g32")
    want = generate_cached(model, tokenizer, [tokenizer.encode("hello")], SamplingParams(max_new_tokens=6))[0]
    assert json.loads(first.stdout)["token_ids"] == second["token_ids"] == engine["token_ids"] == want.token_ids


def test_the_head_in_a_scheme_of_its_own(tiny_dir, tmp_path, capsys):
    """`--quant int4-g32 --quant-head-scheme int8`: int4 blocks and an int8 head (llama.cpp's
    4-bit files keep a 6-bit one), the tokens of that model in-process."""
    import shutil

    from aie_lessons.cached_generate import generate_cached
    from aie_lessons.model import LlamaModel
    from aie_lessons.quantize import quantize_model
    from aie_lessons.sampling import SamplingParams
    from aie_lessons.tokenizer import Tokenizer

    model_dir = tmp_path / "tiny"
    shutil.copytree(tiny_dir, model_dir)
    status, out, err = aie(capsys, "generate", "hello", "--model", str(model_dir), "--max-new-tokens", "6", "--json",
                           "--quant", "int4-g32", "--quant-head-scheme", "int8", "--loop", "cached")
    assert status == 0 and "to int4-g32 (the head in int8), once" in err, err
    tokenizer = Tokenizer.from_pretrained(model_dir)
    model = quantize_model(LlamaModel.from_pretrained(model_dir), "int4-g32", head="int8")
    want = generate_cached(model, tokenizer, [tokenizer.encode("hello")], SamplingParams(max_new_tokens=6))[0]
    assert json.loads(out)["token_ids"] == want.token_ids


def test_the_cli_names_every_quantization_scheme():
    from aie_lessons.cli import QUANT_SCHEMES
    from aie_lessons.quantize import SCHEMES

    assert QUANT_SCHEMES == tuple(SCHEMES)


def test_the_compiled_loop_compiles_once_into_data_cache_then_loads(tiny_dir, tmp_path, monkeypatch):
    """Stage 09's compiled decoder: the first run says it compiles, the next that it loads, both
    give stage 04's cached loop's tokens, and the packages land in the course's cache folder —
    the CLI points inductor there before anything imports it (its default is in /tmp). The
    folder is redirected here, as data/cache/inductor would be."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    folder = tmp_path / "inductor"
    script = ("import sys; from pathlib import Path; import aie_lessons.infra.compile_cache as cache; "
              f"cache.INDUCTOR_CACHE = Path({str(folder)!r}); from aie_lessons.cli import main; "
              "sys.exit(main(sys.argv[1:]))")
    args = ("generate", "The quick", "--model", str(tiny_dir), "--max-new-tokens", "6", "--json", "--loop", "compiled")
    first, second = (subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                                    timeout=600) for _ in range(2))
    assert first.returncode == 0 and "compiling the decoder" in first.stderr, first.stderr
    assert second.returncode == 0 and "loaded the compiled decoder" in second.stderr, second.stderr
    assert "compiling" not in second.stderr and "Warning" not in first.stderr + second.stderr, second.stderr
    packages = list((cache.cache_folder(folder) / "aot").glob("*.pt2"))  # a subfolder where ATEN_CPU_CAPABILITY is set
    assert len(packages) == 2, "one package for the layers, one for the head"
    cached = json.loads(run(*args[:-2], "--loop", "cached").stdout)
    assert json.loads(first.stdout)["token_ids"] == json.loads(second.stdout)["token_ids"] == cached["token_ids"]


def test_a_compiler_that_fails_leaves_the_eager_step(tiny_dir, tmp_path, monkeypatch):
    """A compiler that exists but cannot build (here `true`, which writes nothing): the default
    falls back to the engine's eager step with a one-line note; an explicit --step compiled or
    --loop compiled is refused, without a traceback."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "empty"))  # nothing to load: it must compile
    monkeypatch.setenv("CXX", "true")
    args = ("generate", "The quick", "--model", str(tiny_dir), "--max-new-tokens", "4", "--json")
    fallback = run(*args)
    assert fallback.returncode == 0 and "the compiled step cannot be built here, so the eager step runs" in \
        fallback.stderr, fallback.stderr
    assert "Traceback" not in fallback.stderr and "TORCHDYNAMO_VERBOSE" not in fallback.stderr, fallback.stderr
    result = json.loads(fallback.stdout)
    assert len(result["token_ids"]) > 0 and (result["loop"], result["step"]) == ("engine", "eager")
    for flag, value in (("--step", "compiled"), ("--loop", "compiled")):
        refused = run(*args, flag, value)
        assert refused.returncode == 2 and f"{flag} compiled:" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
    assert not list((tmp_path / "empty").glob("aot/*.pt2")), "a failed compile left a package behind"
    assert (tmp_path / "empty" / "aot" / "failure.log").exists(), "the whole error is kept for whoever digs"


def test_without_a_cpp_compiler_the_compiled_loop_is_refused_and_the_default_says_why(tiny_dir, monkeypatch):
    monkeypatch.setenv("CXX", "/nowhere/g++")
    args = ("generate", "The quick", "--model", str(tiny_dir), "--max-new-tokens", "4")
    refused = run(*args, "--loop", "compiled")
    assert refused.returncode == 2 and "needs a C++ compiler" in refused.stderr and "Traceback" not in refused.stderr
    default = run(*args)
    assert default.returncode == 0 and "the eager step runs, because compiling for the CPU needs a C++ compiler" \
        in default.stderr, default.stderr


def test_quantized_weights_run_through_the_compiled_decoder(tiny_dir, tmp_path):
    """int4-g32 through the integer kernels (the course's on x86, PyTorch's elsewhere) inside the
    compiled step."""
    import shutil

    model_dir = tmp_path / "tiny"
    shutil.copytree(tiny_dir, model_dir)  # its quantized/ folder is this test's own
    compiled = run("generate", "hello", "--model", str(model_dir), "--max-new-tokens", "6", "--json",
                   "--quant", "int4-g32", "--loop", "compiled")
    assert compiled.returncode == 0 and ran_the_compiled_decoder(compiled.stderr), compiled.stderr
    assert len(json.loads(compiled.stdout)["token_ids"]) == 6


@pytest.mark.parametrize("argv, loop, step", [
    (("a prompt",), "engine", "auto"),
    (("a prompt", "--quant", "int8"), "engine", "auto"),  # quantized weights are no reason to leave "auto"
    (("a prompt", "--max-new-tokens", "1"), "engine", "eager"),  # the prefill alone: nothing to compile
    (("x", "y"), "engine", "eager"),  # several prompts would not pay back a step compiled per batch size
    (("x", "y", "--step", "auto"), "engine", "auto"),
    (("a prompt", "--loop", "cached"), "cached", None),
    (("a prompt", "--device", "cuda"), "engine", "eager"),  # compiled there in every run: not by default
])
def test_the_default_is_the_engine_compiled_for_one_prompt(argv, loop, step):
    """One prompt or many, the engine runs; for one prompt its step is compiled where it can run
    ("auto": build_engine falls back to eager, saying why, where it cannot)."""
    from aie_lessons.cli import _engine_step, _loop, build_parser

    args = build_parser().parse_args(["generate", *argv])
    count = len(args.prompts)
    assert _loop(args, count) == loop
    if step:
        assert _engine_step(args, count) == step


def test_the_engine_compiles_its_step_once_then_loads_it(tiny_dir, tmp_path, monkeypatch):
    """One prompt, the default: the engine's step for one request is compiled ahead of time on the
    first run and loaded by the next, whose tokens are stage 04's."""
    if cache.cpp_compiler() is None:
        pytest.skip("no C++ compiler: the compiled step cannot run here")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    args = ("generate", "The quick", "--model", str(tiny_dir), "--max-new-tokens", "6", "--json")
    first, second = run(*args), run(*args)
    assert first.returncode == 0 and "compiling the engine's step for batches of (1,)" in first.stderr, first.stderr
    assert second.returncode == 0 and "loaded the engine's compiled step" in second.stderr, second.stderr
    assert "compiling" not in second.stderr and "Warning" not in first.stderr + second.stderr, second.stderr
    assert len(list((tmp_path / "inductor" / "aot").glob("*.pt2"))) == 2, "the layers' call and the head"
    tokens = [json.loads(out.stdout)["token_ids"] for out in (first, second)]
    assert tokens[0] == tokens[1] == stage04(tiny_dir, ["The quick"], 6)[0].token_ids


def test_compiled_loop_with_bf16_activations_is_refused(tiny_dir):
    out = run("generate", "x", "--model", str(tiny_dir), "--loop", "compiled", "--activations", "bfloat16")
    assert out.returncode != 0 and "--loop compiled computes in float32" in out.stderr


# --- several prompts: the engine (stage 07's paged KV cache by default, stage 06's slots) -----


def stage04(model_dir: Path, prompts: list[str], max_new_tokens: int, model=None) -> list:
    """Stage 04's greedy answer to each prompt, run alone: what the engine must reproduce."""
    from aie_lessons.cached_generate import generate_cached
    from aie_lessons.model import LlamaModel
    from aie_lessons.sampling import SamplingParams
    from aie_lessons.tokenizer import Tokenizer

    tokenizer, model = Tokenizer.from_pretrained(model_dir), model or LlamaModel.from_pretrained(model_dir)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    return [generate_cached(model, tokenizer, [tokenizer.encode(p)], params)[0] for p in prompts]


def json_lines(out: subprocess.CompletedProcess) -> list[dict]:
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.mark.parametrize("kv", ["paged", "slots", None])
def test_several_prompts_run_through_the_engine_in_prompt_order(tiny_untied_dir, kv):
    """Positional prompts then --prompt ones, two at a time in 4-token steps (so prompts wait and
    are prefilled in chunks): each answer is stage 04's, and the text output labels them in order.
    Without --kv, the engine runs on blocks."""
    prompts = ["The quick brown fox", "Once upon", "Hello there, how are you"]
    args = ("generate", *prompts[:2], "--prompt", prompts[2], "--model", str(tiny_untied_dir),
            "--max-new-tokens", "6", "--max-seqs", "2", "--token-budget", "4", *(("--kv", kv) if kv else ()))
    results = json_lines(run(*args, "--json"))
    expected = stage04(tiny_untied_dir, prompts, 6)
    assert len({tuple(r.token_ids) for r in expected}) == 3, "distinct answers, or order is not tested"
    assert all(e.finish_reason == "length" for e in expected)  # 6 tokens each, none of them EOS
    assert [(r["prompt_ids"], r["token_ids"], r["text"]) for r in results] == \
        [(e.prompt_ids, e.token_ids, e.text) for e in expected]
    out = run(*args)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "\n".join(f"=== {i}/3: {p} ===\n{e.text}\n" for i, (p, e) in
                                   enumerate(zip(prompts, expected), 1))
    summary = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(summary) == 1 and "3 requests, 18 output tokens" in summary[0] and "tok/s" in summary[0]
    assert "up to 2 at once, 4 tokens per step" in summary[0]
    assert ("KV slots of" if kv == "slots" else "KV blocks of 16 tokens") in summary[0], summary[0]


def aie(capsys, *args: str) -> tuple[int, str, str]:
    """``aie ARGS`` run in this process: the console script's code without a new Python importing
    torch (seconds a run), for the cases where nothing but main() is under test."""
    from aie_lessons.cli import main

    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_one_prompt_through_the_engine_streams_like_the_other_loops(tiny_untied_dir, capsys):
    code, out, err = aie(capsys, "generate", "The quick", "--model", str(tiny_untied_dir), "--max-new-tokens", "8",
                         "--loop", "engine")
    assert code == 0, err
    assert out == stage04(tiny_untied_dir, ["The quick"], 8)[0].text + "\n"
    assert "1 request, 8 output tokens" in err


def test_the_engines_step_compiled_keeps_the_tokens_and_says_so(tiny_untied_dir, capsys):
    """--step compiled: stage 09's step for batches of 1 and 2, compiled before the clock starts."""
    prompts = ["The quick brown fox", "Once upon"]
    code, out, err = aie(capsys, "generate", *prompts, "--model", str(tiny_untied_dir), "--max-new-tokens", "6",
                         "--max-seqs", "2", "--token-budget", "8", "--step", "compiled", "--json")
    assert code == 0, err
    assert [json.loads(line)["token_ids"] for line in out.splitlines()] == \
        [e.token_ids for e in stage04(tiny_untied_dir, prompts, 6)]
    assert ran_the_compiled_step(err) and ("for batches of (1, 2)" in err or "loaded the" in err), err


def test_the_engines_step_compiled_without_a_compiler_is_refused_before_the_model_loads(monkeypatch, capsys):
    from aie_lessons.infra import compile_cache

    monkeypatch.setattr(compile_cache, "cpp_compiler", lambda: None)
    code, out, err = aie(capsys, "generate", "x", "y", "--model", "/nowhere", "--step", "compiled")
    assert code == 2 and not out and len(err.strip().splitlines()) == 1, err
    assert "--step compiled: compiling for the CPU needs a C++ compiler" in err and "or drop --step" in err


def test_serve_keeps_compiled_code_in_the_courses_cache(tiny_dir, tmp_path, monkeypatch, capsys):
    """aie serve compiles its step: into data/cache/inductor (its subfolder for ATEN_CPU_CAPABILITY),
    as aie generate does, set before the server imports inductor — not in inductor's /tmp default."""
    import aie_lessons.infra.compile_cache as cache
    import aie_lessons.server.serve as serve_module

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(cache, "INDUCTOR_CACHE", tmp_path / "inductor")
    seen = {}

    def serve(config) -> int:  # where the server would start: what it would compile into
        seen.update(folder=os.environ.get("TORCHINDUCTOR_CACHE_DIR"), step=config.step)
        return 0

    monkeypatch.setattr(serve_module, "serve", serve)
    code, _, err = aie(capsys, "serve", "--model", str(tiny_dir), "--step", "eager")
    assert code == 0, err
    assert seen == {"folder": str(cache.cache_folder(tmp_path / "inductor")), "step": "eager"}


def test_serve_step_compiled_without_a_compiler_is_refused_before_the_model_loads(monkeypatch, capsys):
    import aie_lessons.server.serve as serve_module
    from aie_lessons.infra import compile_cache

    monkeypatch.setattr(compile_cache, "cpp_compiler", lambda: None)
    monkeypatch.setattr(serve_module, "serve", lambda config: pytest.fail("the server started"))
    code, out, err = aie(capsys, "serve", "--model", "/nowhere", "--step", "compiled")
    assert code == 2 and "step compiled: compiling for the CPU needs a C++ compiler" in err and "--step eager" in err


def test_engine_flags_outside_the_engine_get_a_note(tiny_dir, capsys):
    code, _, err = aie(capsys, "generate", "Hi", "--model", str(tiny_dir), "--max-new-tokens", "2", "--loop", "cached",
                       "--step", "compiled")
    assert code == 0 and "--max-seqs, --token-budget and --step only matter for the engine" in err


@pytest.mark.parametrize("name, text", [
    ("prompts.txt", "The quick\n\n  \nOnce upon a time\n"),
    ("prompts.jsonl", '{"prompt": "The quick"}\n\n{"prompt": "Once upon\\na time"}\n'),
])
def test_prompts_file_runs_each_prompt_after_the_flags(tiny_dir, tmp_path, capsys, name, text):
    """Blank lines are skipped, a JSON line's prompt may hold a newline, and the file's prompts
    come after the positional one."""
    from aie_lessons.tokenizer import Tokenizer

    path = tmp_path / name
    path.write_text(text)
    code, out, err = aie(capsys, "generate", "Hi", "--prompts-file", str(path), "--model", str(tiny_dir),
                         "--max-new-tokens", "3", "--json")
    assert code == 0, err
    results = [json.loads(line) for line in out.splitlines()]
    prompts = ["Hi", "The quick", "Once upon\na time" if name.endswith(".jsonl") else "Once upon a time"]
    tokenizer = Tokenizer.from_pretrained(tiny_dir)
    assert [r["prompt_ids"] for r in results] == [tokenizer.encode(p) for p in prompts]
    assert all(len(r["token_ids"]) == 3 and r["finish_reason"] == "length" for r in results)


PROMPT_ERRORS = [
    (("generate", "--model", "{tiny}"), "no prompt given. Fix:"),
    (("generate", "x", "y", "--model", "{tiny}", "--loop", "skeleton"), "Fix: drop --loop, or use --loop engine"),
    (("generate", "x", "y", "--model", "{tiny}", "--max-seqs", "8", "--token-budget", "4"),
     "token_budget=4 < max_seqs=8"),
    (("generate", "x", "y", "--model", "{tiny}", "--kv", "slots", "--step", "compiled"),
     "over the paged KV cache, and --kv slots asks for stage 06's slots. Fix: drop --kv slots"),
    (("generate", "x", "y", "--model", "{tiny}", "--step", "compiled", "--activations", "bfloat16"),
     "--step compiled computes in float32. Fix: drop --activations bfloat16"),
    (("generate", "x", "y", "--model", "{tiny}", "--step", "compiled", "--quant", "int4-g192"),
     "--step compiled reads quantized weights through PyTorch's int4 kernel, which takes no int4-g192. Fix:"),
    (("generate", "x", "y", "--model", "{tiny}", "--max-new-tokens", "64"), "prompt 1 of 2 ('x'): prompt of 1 tokens"),
    (("generate", "--prompts-file", "{tmp}/nowhere.txt"), "nowhere.txt: No such file or directory. Fix:"),
    (("generate", "--prompts-file", "{tmp}/blank.txt"), "has no prompts (blank lines are skipped). Fix:"),
    (("generate", "--prompts-file", "{tmp}/bad.jsonl"), 'line 2: not an object with a "prompt" string. Fix:'),
    (("generate", "--prompts-file", "{tmp}/broken.jsonl"), "line 1: not JSON"),
]


@pytest.mark.parametrize("args, message", PROMPT_ERRORS, ids=lambda v: " ".join(v) if isinstance(v, tuple) else None)
def test_bad_prompts_get_one_line_naming_the_fix(args, message, tiny_dir, tmp_path, capsys):
    (tmp_path / "blank.txt").write_text("\n  \n")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    (tmp_path / "broken.jsonl").write_text('{"prompt": "unclosed\n')
    code, out, err = aie(capsys, *(a.format(tiny=tiny_dir, tmp=tmp_path) for a in args))
    assert code == 2 and message in err and not out, err
    assert len(err.strip().splitlines()) == 1, err


def test_engine_gives_stage04s_tokens_on_the_real_model(real_model, real_model_dir):
    """Greedy, two prompts sharing the engine (budget 7: the longer prompt is prefilled in chunks)
    give exactly what stage 04 gives each alone. Both prompts are far from fp32 ties for their
    first tokens (tests/test_engine_oracle.py measures the margins)."""
    prompts = ["The history of the lighthouse begins with fires on hills.", "The capital of France is"]
    results = json_lines(run("generate", *prompts, "--model", str(real_model_dir), "--max-new-tokens", "8",
                             "--max-seqs", "2", "--token-budget", "7", "--json"))
    expected = stage04(real_model_dir, prompts, 8, real_model)
    assert [(r["prompt_ids"], r["token_ids"], r["text"]) for r in results] == \
        [(e.prompt_ids, e.token_ids, e.text) for e in expected]


# --- every command, and every bad input a user can type: one line, exit status 2 ---------------


@pytest.fixture(scope="module")
def broken_checkpoints(tiny_dir, tmp_path_factory):
    """Copies of the tiny checkpoint with a config.json that is not JSON, lacks a field, or asks
    for an architecture we do not implement."""
    import shutil

    root = tmp_path_factory.mktemp("broken")
    configs = {"not-json": "{ this is not json",
               "no-field": json.dumps({k: v for k, v in json.loads((tiny_dir / "config.json").read_text()).items()
                                       if k != "hidden_size"}),
               "qwen2": json.dumps({**json.loads((tiny_dir / "config.json").read_text()), "model_type": "qwen2"})}
    for name, text in configs.items():
        shutil.copytree(tiny_dir, root / name)
        (root / name / "config.json").write_text(text)
    return root


BAD_INPUTS = [
    (("generate", "", "--model", "{tiny}"), "the prompt is empty"),
    (("generate", "x", "--model", "{tiny}", "--max-new-tokens", "-1"), "max_new_tokens=-1 is invalid"),
    (("generate", "x", "--model", "{tiny}", "--max-new-tokens", "many"), "invalid int value: 'many'"),
    (("generate", "x", "--model", "{tiny}", "--max-new-tokens", "100"), "context is 64 tokens"),
    pytest.param(("generate", "x", "--model", "{tiny}", "--device", "cuda"), "PyTorch sees no CUDA GPU",
                 marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")),
    (("generate", "x", "--model", "{tiny}", "--device", "cuda:99"), "cuda:99"),
    (("generate", "x", "--model", "{tiny}", "--device", "tpu"), "--device tpu"),
    (("grade", "{tmp}", "--stages", "02", "--junit", "{tmp}"), "Is a directory"),
    (("generate", "x", "--model", "{tmp}/nowhere"), "nowhere/tokenizer.json. Fix: run `aie fetch-model`"),
    (("generate", "x", "--model", "{broken}/not-json"), "is not valid JSON"),
    (("generate", "x", "--model", "{broken}/no-field"), "has no 'hidden_size'"),
    (("generate", "x", "--model", "{broken}/qwen2"), "model_type='qwen2'"),
    (("generate", "x", "--dtype", "float8"), "invalid choice: 'float8'"),
    (("fetch-model", "--from", "{tmp}/nowhere"), "is not a directory"),
    (("grade", "{tmp}/nowhere"), "is not a folder"),
    (("grade", "{tmp}", "--stages", "42"), "no stage 42"),
    (("grade", "{tmp}", "--cell-timeout", "0"), "0 is not a positive number"),
    (("lab", "--port", "80"), "80 is not a port from 1024 to 65535"),
    (("commit", "42"), "there is no stage 42"),
    (("commit", "02", "--notebook", "{tmp}/missing.ipynb"), "missing.ipynb does not exist"),
    (("reset", "42"), "there is no stage 42"),
    (("status", "42"), "there is no stage 42"),
    (("status", "00"), "stage 00 has no exercises"),
    (("generate", "x", "--model", "{tiny}", "--loop", "compiled", "--quant", "int4-g192"), "takes no int4-g192"),
    (("generate", "x", "--model", "{tiny}", "--quant-head"), "Fix: add --quant SCHEME"),
    (("generate", "x", "--model", "{tiny}", "--quant-head-scheme", "int8"), "Fix: add --quant SCHEME"),
    (("generate", "x", "--quant", "int4-g32", "--quant-head-scheme", "int3"), "invalid choice: 'int3'"),
    (("generate", "x", "--quant", "int8", "--quant-head", "--quant-head-scheme", "int8"),
     "argument --quant-head-scheme: not allowed with argument --quant-head"),
    (("generate", "x", "--model", "{tiny}", "--loop", "compiled", "--quant", "int4-g32", "--quant-head-scheme",
      "int4-g192"), "takes no int4-g192. Fix: --quant-head-scheme int4-g64 or int4-g32"),
    (("generate", "x", "--model", "{tiny}", "--step", "compiled", "--quant", "int4-g32", "--quant-head-scheme",
      "int4-g192"), "takes no int4-g192. Fix: --quant-head-scheme int4-g64 or int4-g32"),
    (("generate", "x", "--quant", "int3"), "invalid choice: 'int3'"),
    (("frobnicate",), "invalid choice: 'frobnicate'"),
]


def run_in_process(args: list[str], capsys) -> tuple[int, str]:
    """``aie ARGS`` through ``cli.main`` — the function the console script calls — in this Python:
    (exit status, stderr). A bad input fails before any work, so a new Python per case would be
    mostly torch's import (27 cases took 200 s of the suite that way); the environment is put
    back afterwards, as a process of its own would leave it."""
    from aie_lessons import cli

    environ = dict(os.environ)
    try:
        status = cli.main(args)
    except SystemExit as exit:  # argparse's errors leave through sys.exit(2)
        status = exit.code
    finally:
        os.environ.clear()
        os.environ.update(environ)
    return status, capsys.readouterr().err


def assert_one_line(status: int, stderr: str, message: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip() and "note:" not in line]
    assert status == 2, stderr
    assert message in stderr and "Traceback" not in stderr, stderr
    assert len(lines) == 1, stderr


@pytest.mark.parametrize("args, message", BAD_INPUTS, ids=lambda v: " ".join(v) if isinstance(v, tuple) else None)
def test_bad_input_gets_one_line_and_exit_status_2(args, message, tiny_dir, broken_checkpoints, tmp_path, capsys):
    places = {"tiny": str(tiny_dir), "tmp": str(tmp_path), "broken": str(broken_checkpoints)}
    assert_one_line(*run_in_process([a.format(**places) for a in args], capsys), message)


@pytest.mark.parametrize("args, message", [
    (("generate", "", "--model", "{tiny}"), "the prompt is empty"),  # the course's own error
    (("frobnicate",), "invalid choice: 'frobnicate'"),  # argparse's
])
def test_the_console_script_reports_bad_input_in_one_line(args, message, tiny_dir):
    """The same through the installed console script: nothing between it and ``cli.main`` adds
    a traceback or another line."""
    out = run(*(a.format(tiny=str(tiny_dir)) for a in args))
    assert_one_line(out.returncode, out.stderr, message)


def test_status_runs_the_named_stages_checks_and_lists_their_modules():
    """The console script end to end, on two stages: their checks run (the reference passes all of
    them) and their modules are listed, and no other stage is. Every stage's listing is
    test_progress's (checks stubbed); every stage's checks passing, test_grade's sealed run."""
    out = run("status", "01", "03")
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines() if line[:2].isdigit()}
    assert sorted(rows) == ["01_skeleton_loop", "03_masks"], out.stdout
    from aie_lessons.course.progress import find_stage

    for number in ("01", "03"):
        stage, exercises = find_stage(number)[0], len(find_stage(number)[0].exercises)
        assert rows[stage.name].rstrip().endswith(f"{exercises} / {exercises}"), rows[stage.name]
    assert "aie_lessons/sampling.py" in out.stdout and "aie_lessons/masks.py" in out.stdout


def test_commit_and_reset_through_the_console_script(tmp_path, real_model_dir):
    """In a copy of the course: an unsolved notebook is refused and changes nothing; a solved one
    is committed; reset puts the reference back."""
    import shutil

    from course_copy import copy_course, course_env

    from aie_lessons.course.build import SOLUTIONS_DIR

    course = copy_course(tmp_path / "course")
    env, attention = course_env(course), course / "aie_lessons" / "attention.py"
    reference = attention.read_text()
    out = run("commit", "02", env=env)  # the copy's own, untouched notebooks/02_attention.ipynb
    assert out.returncode == 1 and "not committed" in out.stdout and "is not implemented yet" in out.stdout
    assert attention.read_text() == reference
    shutil.copy(SOLUTIONS_DIR / "02_attention.ipynb", tmp_path / "solved.ipynb")
    out = run("commit", "02", "--notebook", str(tmp_path / "solved.ipynb"), env=env)
    assert out.returncode == 0 and "committed" in out.stdout, out.stdout + out.stderr
    status = run("status", "02", env=env).stdout  # that stage's checks only: the others are unchanged
    rows = [line for line in status.splitlines() if line[:2].isdigit()]
    assert attention.read_text() != reference and len(rows) == 1 and "your code" in rows[0], status
    out = run("reset", "02", env=env)
    assert out.returncode == 0 and attention.read_text() == reference


def test_grade_through_the_console_script(tmp_path):
    out = run("grade", str(tmp_path), "--stages", "02", "--junit", str(tmp_path / "report.xml"))
    assert out.returncode == 1 and "02_attention" in out.stdout and "not in the submission" in out.stdout
    assert (tmp_path / "report.xml").exists()
