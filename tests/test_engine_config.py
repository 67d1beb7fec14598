"""Stage 09's EngineConfig and build_engine: one set of defaults for everything that runs the engine,
and the step it runs — compiled where it can, eager with the reason where not, refused when asked
for where it cannot run."""

from __future__ import annotations

import warnings

import pytest
import torch

from aie_lessons.engine import engine_config
from aie_lessons.engine.compiled_runner import CompiledPagedRunner
from aie_lessons.engine.engine_config import (STEPS, EngineConfig, StepUnavailable, build_engine, choose_step,
                                              compile_buckets, step_of)
from aie_lessons.engine.paged_engine import paged_engine
from aie_lessons.engine.scheduler import SchedulerConfig
from aie_lessons.model import LlamaModel
from aie_lessons.sampling import SamplingParams
from aie_lessons.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return LlamaModel.from_pretrained(tiny_dir), Tokenizer.from_pretrained(tiny_dir)


@pytest.fixture()
def no_compiler(monkeypatch):
    """A machine without a C++ compiler, as inductor's own lookup would report it."""
    import aie_lessons.infra.compile_cache as compile_cache

    monkeypatch.setattr(compile_cache, "cpp_compiler", lambda: None)


@pytest.mark.parametrize("settings, named", [
    ({"step": "fast"}, "step='fast'"),
    ({"buckets": ()}, "buckets"),
    ({"buckets": (1, 0)}, "buckets"),
    ({"buckets": (1, True)}, "buckets"),
    ({"kv_bytes": 0}, "kv_bytes"),
    ({"block_size": 0}, "block_size"),
    ({"max_seqs": 0}, "max_seqs"),
    ({"max_seqs": 32, "token_budget": 16}, "raise token_budget"),
    ({"aging_rate": -1.0}, "aging_rate"),
    ({"arithmetic": "fp16"}, "arithmetic='fp16' is not one of 'auto', 'bf16', 'float32'"),
])
def test_a_bad_setting_is_refused_by_name(settings, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(**settings)


def test_one_set_of_defaults_for_the_cli_the_server_and_the_scheduler():
    from aie_lessons import cli
    from aie_lessons.server.config import ServeConfig

    config, scheduler, serve = EngineConfig(), SchedulerConfig(), ServeConfig()
    assert (config.max_seqs, config.token_budget, config.aging_rate) == (
        scheduler.max_seqs, scheduler.token_budget, scheduler.aging_rate)
    assert (cli.DEFAULT_MAX_SEQS, cli.DEFAULT_TOKEN_BUDGET) == (config.max_seqs, config.token_budget)
    assert cli.ENGINE_STEPS == STEPS
    assert (serve.max_seqs, serve.token_budget, serve.step) == (config.max_seqs, config.token_budget, config.step)


def test_the_default_pool_is_stage_07s(tiny):
    model, tokenizer = tiny
    built = build_engine(model, tokenizer, EngineConfig(step="eager"))
    assert built.runner.allocator.num_blocks == paged_engine(model, tokenizer).runner.allocator.num_blocks
    assert built.config == EngineConfig().scheduler()


def test_auto_compiles_where_it_can(tiny, monkeypatch):
    import aie_lessons.infra.compile_cache as compile_cache

    monkeypatch.setattr(compile_cache, "cpp_compiler", lambda: "g++")  # a machine with a compiler, this one or not
    model, tokenizer = tiny
    assert choose_step(model, "auto") == ("compiled", None)
    engine = build_engine(model, tokenizer, EngineConfig(max_seqs=6, token_budget=32, buckets=(1, 2, 4, 8)))
    assert isinstance(engine.runner, CompiledPagedRunner) and step_of(engine) == "compiled"
    assert engine.runner.buckets == (1, 2, 4, 6)  # the buckets below max_seqs, and max_seqs itself


def test_compile_buckets_compiles_every_bucket_and_says_which_first(tiny):
    model, tokenizer = tiny
    if choose_step(model, "auto")[0] != "compiled":
        pytest.skip(f"the compiled step cannot run here: {choose_step(model, 'auto')[1]}")
    engine = build_engine(model, tokenizer, EngineConfig(max_seqs=2, token_budget=16, kv_bytes=2**20))
    compiled, decode_step = [], engine.runner.decode_step

    def counted(rows):
        compiled.append(len(rows.ids))  # the bucket: warm-up steps are padding only
        return decode_step(rows)

    engine.runner.decode_step = counted
    heard = []
    seconds = compile_buckets(engine, heard.append)
    assert heard == [(1, 2)] and compiled == [1, 2] and seconds > 0
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    expected = paged_engine(model, tokenizer, max_seqs=2, token_budget=16, kv_bytes=2**20).generate(["a b", "c"], params)
    assert [r.token_ids for r in engine.generate(["a b", "c"], params)] == [r.token_ids for r in expected]


def test_compile_buckets_has_nothing_to_do_for_the_eager_step(tiny):
    model, tokenizer = tiny
    engine = build_engine(model, tokenizer, EngineConfig(step="eager"))
    heard = []
    assert compile_buckets(engine, heard.append) is None and heard == [] and step_of(engine) == "eager"


def test_eager_is_stage_07s_engine_with_the_same_tokens(tiny):
    model, tokenizer = tiny
    config = EngineConfig(max_seqs=2, token_budget=16, kv_bytes=2**20, step="eager")
    engine = build_engine(model, tokenizer, config)
    assert not isinstance(engine.runner, CompiledPagedRunner)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    expected = paged_engine(model, tokenizer, max_seqs=2, token_budget=16, kv_bytes=2**20).generate(["a b", "c"], params)
    assert [r.token_ids for r in engine.generate(["a b", "c"], params)] == [r.token_ids for r in expected]


def test_without_a_compiler_auto_runs_eager_and_says_why(tiny, no_compiler):
    model, tokenizer = tiny
    notes = []
    engine = build_engine(model, tokenizer, EngineConfig(), on_note=notes.append)
    assert not isinstance(engine.runner, CompiledPagedRunner)
    assert len(notes) == 1 and "C++ compiler" in notes[0] and "Fix: install g++" in notes[0]
    with pytest.warns(UserWarning, match="the eager step runs, because compiling for the CPU needs a C\\+\\+"):
        build_engine(model, tokenizer, EngineConfig())


def test_compiled_where_it_cannot_run_is_refused_with_the_fix(tiny, no_compiler):
    model, tokenizer = tiny
    with pytest.raises(StepUnavailable, match="C\\+\\+ compiler.*Fix: install g\\+\\+.*or take step='eager'"):
        build_engine(model, tokenizer, EngineConfig(step="compiled"))


def test_choose_step_refuses_a_step_it_does_not_know(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="step='fast' is not one of 'auto', 'eager', 'compiled'"):
        choose_step(model, "fast")


def test_a_model_the_step_cannot_compute_runs_eager(tiny_dir, tiny):
    _, tokenizer = tiny
    bf16 = LlamaModel.from_pretrained(tiny_dir, dtype=torch.bfloat16, activations=torch.bfloat16)
    step, why = choose_step(bf16, "auto")
    assert step == "eager" and "activations" in why and "Fix:" in why
    with pytest.raises(StepUnavailable, match="activations"):
        choose_step(bf16, "compiled")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # eager asked for: nothing to say
        assert choose_step(bf16, "eager") == ("eager", None)
        build_engine(bf16, tokenizer, EngineConfig(step="eager"))


def test_a_device_without_a_compiled_step_is_named(monkeypatch, tiny_dir):
    model = LlamaModel.from_pretrained(tiny_dir)  # its own: the shared one's weight must not be patched
    monkeypatch.setattr(engine_config, "compiled_step_refusal", lambda m: None)
    on_meta = torch.nn.Parameter(model.embed_tokens.weight.to("meta"), requires_grad=False)
    monkeypatch.setattr(model.embed_tokens, "weight", on_meta)  # where the step finds the model's device
    assert "not meta" in engine_config.compiled_step_unavailable(model)
    assert "not mps" in engine_config.no_compiler_for("mps")  # what the CLI asks before it loads a model


def test_the_servers_step_is_checked_by_name(tmp_path):
    from aie_lessons.server.config import ServeConfig, ServeConfigError, load_config

    with pytest.raises(ServeConfigError, match="step='fast' is invalid: it must be auto or eager or compiled"):
        ServeConfig(step="fast")
    path = tmp_path / "serve.yaml"
    path.write_text("step: eager\n")
    assert load_config(path, environ={}).step == "eager"
    path.write_text("step: 1\n")
    with pytest.raises(ServeConfigError, match="field 'step' must be str"):
        load_config(path, environ={})


# --- bf16 weights: the compiled step's arithmetic, decided from a measurement -------------------


@pytest.fixture()
def measured(monkeypatch):
    """bf16_product_cost replaced by a figure (None: it must not be measured at all)."""
    calls = []

    def use(cost):
        def fake(model, rows):
            calls.append(rows)
            if cost is None:
                raise AssertionError("measured, though nothing needed measuring")
            return cost
        monkeypatch.setattr(engine_config, "bf16_product_cost", fake)
        return calls
    return use


@pytest.fixture(scope="module")
def tiny_bf16(tiny_dir):
    return LlamaModel.from_pretrained(tiny_dir, dtype=torch.bfloat16)


@pytest.mark.parametrize("cost, arithmetic, packed", [
    (5.0, "auto", torch.float32),  # a CPU without bf16 instructions: fp32 arithmetic, and a note
    (0.6, "auto", torch.bfloat16),  # with them: bf16
    (None, "float32", torch.float32),  # asked for: nothing measured
    (None, "bf16", torch.bfloat16),
])
def test_bf16_weights_multiply_in_the_arithmetic_this_cpu_does_fast(tiny, tiny_bf16, measured, cost, arithmetic,
                                                                       packed):
    _, tokenizer = tiny
    calls, notes = measured(cost), []
    engine = build_engine(tiny_bf16, tokenizer, EngineConfig(max_seqs=2, token_budget=16, kv_bytes=2**20,
                                                             step="compiled", arithmetic=arithmetic),
                          on_note=notes.append)
    assert engine.runner.block.dtype == packed
    assert calls == ([2] if cost is not None else [])  # measured at max_seqs rows
    assert bool(notes) == (arithmetic == "auto" and packed == torch.float32)
    if notes:
        assert "multiplies the bf16 weights in fp32" in notes[0] and "5.0x" in notes[0]


def test_fp32_arithmetic_on_bf16_weights_keeps_the_eager_engines_tokens(tiny, tiny_bf16, measured):
    """The eager engine converts bf16 weights to fp32 before each product: fp32 arithmetic on the
    same values, so the compiled step packed in fp32 gives its greedy tokens."""
    _, tokenizer = tiny
    if choose_step(tiny_bf16, "auto")[0] != "compiled":
        pytest.skip(f"the compiled step cannot run here: {choose_step(tiny_bf16, 'auto')[1]}")
    measured(5.0)
    settings = dict(max_seqs=2, token_budget=16, kv_bytes=2**20)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    compiled = build_engine(tiny_bf16, tokenizer, EngineConfig(**settings), on_note=lambda note: None)
    expected = paged_engine(tiny_bf16, tokenizer, **settings).generate(["a b", "c"], params)
    assert [r.token_ids for r in compiled.generate(["a b", "c"], params)] == [r.token_ids for r in expected]


def test_fp32_weights_are_never_measured(tiny, measured):
    model, tokenizer = tiny
    measured(None)
    assert build_engine(model, tokenizer, EngineConfig(max_seqs=2, token_budget=16, kv_bytes=2**20,
                                                       step="compiled")).runner.block.dtype == torch.float32


def test_the_measurement_is_a_ratio_and_leaves_the_random_state(tiny_bf16):
    state = torch.random.get_rng_state()
    cost = engine_config.bf16_product_cost(tiny_bf16, 2)
    assert cost > 0 and torch.equal(torch.random.get_rng_state(), state)


def test_one_request_at_a_time_keeps_bf16_without_measuring(tiny, tiny_bf16, measured):
    """max_seqs=1 has only the one-row bucket, whose product converts each bf16 weight as it reads
    it on any CPU: nothing to measure, and no fp32 copy of the weights."""
    _, tokenizer = tiny
    measured(None)
    engine = build_engine(tiny_bf16, tokenizer, EngineConfig(max_seqs=1, token_budget=16, kv_bytes=2**20,
                                                             step="compiled"))
    assert engine.runner.buckets == (1,) and engine.runner.block.dtype == torch.bfloat16
