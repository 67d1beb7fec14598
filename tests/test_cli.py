"""The `aie` command line, run as a learner would run it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

AIE = [sys.executable, "-m", "aie_lessons.cli"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*AIE, *args], capture_output=True, text=True, timeout=600)


def test_generate_json_has_ids_text_and_timings(tiny_dir):
    out = run("generate", "hello", "--model", str(tiny_dir), "--max-new-tokens", "5", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result) == {"prompt_ids", "token_ids", "text", "finish_reason", "timings"}
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


def test_env_reports_torch_and_triton():
    out = run("env")
    assert out.returncode == 0
    assert "torch" in out.stdout and "triton" in out.stdout
    assert "bf16 arithmetic" in out.stdout  # bf16 results depend on the CPU family: say which


def test_bf16_weights_with_either_activation_dtype(tiny_dir):
    args = ("generate", "The quick", "--model", str(tiny_dir), "--max-new-tokens", "4", "--json", "--dtype", "bfloat16")
    for activations in ("float32", "bfloat16"):
        out = run(*args, "--activations", activations)
        assert out.returncode == 0, out.stderr
        assert len(json.loads(out.stdout)["token_ids"]) == 4


@pytest.mark.oracle
def test_chat_answer_about_france(real_model_dir):
    out = run("generate", "--chat", "What is the capital of France?", "--max-new-tokens", "32")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_cached_uncached_and_compiled_generation_agree(tiny_dir):
    args = ("generate", "The quick", "--model", str(tiny_dir), "--max-new-tokens", "10", "--json")
    cached = json.loads(run(*args).stdout)
    for other in ("--no-cache", "--compile"):
        result = json.loads(run(*args, other).stdout)
        assert (result["token_ids"], result["text"]) == (cached["token_ids"], cached["text"]), other


def test_no_cache_and_compile_are_refused_together(tiny_dir):
    out = run("generate", "x", "--model", str(tiny_dir), "--no-cache", "--compile")
    assert out.returncode != 0 and "exclude each other" in out.stderr


def test_compile_with_bf16_activations_is_refused(tiny_dir):
    out = run("generate", "x", "--model", str(tiny_dir), "--compile", "--activations", "bfloat16")
    assert out.returncode != 0 and "--compile computes in float32" in out.stderr
