"""Stage 09's compiled engine step: padded to batch buckets, it must keep the eager engine's tokens
and cache, write padding only to its scratch block, and refuse what it cannot run."""

from __future__ import annotations

import pytest
import torch

from aie_lessons.engine.compiled_runner import (CompiledPagedRunner, DecodeRows, DecodeStep, bucket_for,
                                                compiled_engine, pad_rows)
from aie_lessons.engine.paged_batch import PagedBatch
from aie_lessons.engine.paged_engine import paged_engine
from aie_lessons.engine.paged_runner import PagedModelRunner
from aie_lessons.kv_cache import kv_cache_bytes
from aie_lessons.model import LlamaModel
from aie_lessons.precision import agreement
from aie_lessons.sampling import SamplingParams
from aie_lessons.tokenizer import Tokenizer
from weight_block import assert_in_one_block

PROMPTS = ["hello world", "the quick brown fox jumps over", "a", "over the lazy dog and far away"]
# Different lengths, so that requests finish at different steps and the batch moves between buckets.
PARAMS = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (14, 6, 9)] + [
    SamplingParams(max_new_tokens=11, ignore_eos=True, temperature=0.9, top_k=20, seed=3)]
BLOCK = 4  # small blocks: prompts and outputs cross block boundaries


def decode_rows(batch: PagedBatch) -> DecodeRows:
    """The rows of a decode-only ``PagedBatch`` prepared for gathering, as stage 07 gives them."""
    return DecodeRows(batch.input_ids[0], batch.positions[0], batch.slots, batch.decode_slots,
                      batch.decode_mask[:, 0, 0])


@pytest.fixture()
def fresh_dynamo():
    """A test that counts compilations starts from an empty dynamo cache: compiled versions are
    kept per function for the whole process, so an earlier test would have compiled them."""
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = limit


def engines(model_dir, dtype=torch.float32, compile=False, max_seqs=4, token_budget=16, kv_tokens=64, **kwargs):
    """The eager engine (stage 07's, gathering) and the compiled one, on the same weights and budget."""
    model = LlamaModel.from_pretrained(model_dir, dtype=dtype)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    kv_bytes = kv_cache_bytes(model.config, kv_tokens, 4, dtype)
    eager = paged_engine(model, tokenizer, max_seqs=max_seqs, token_budget=token_budget, kv_bytes=kv_bytes,
                         block_size=BLOCK, decode="gather")
    compiled = compiled_engine(model, tokenizer, max_seqs=max_seqs, token_budget=token_budget, kv_bytes=kv_bytes,
                               block_size=BLOCK, compile=compile, **kwargs)
    run = compiled.runner.run

    def one_row_per_sampling_chunk(batch):  # the sampler would silently ignore extra rows
        logits = run(batch)
        assert logits.shape == (len(batch.logits_at), model.config.vocab_size)
        return logits

    compiled.runner.run = one_row_per_sampling_chunk
    return eager, compiled


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_the_compiled_engine_keeps_the_eager_engines_tokens_and_cache(tiny_untied_dir, compile, fresh_dynamo):
    eager, compiled = engines(tiny_untied_dir, compile=compile)
    decode_calls = []
    step = compiled.runner.decode_step
    compiled.runner.decode_step = lambda rows: decode_calls.append(len(rows.ids)) or step(rows)
    want = [r.token_ids for r in eager.generate(PROMPTS, PARAMS)]
    got = [r.token_ids for r in compiled.generate(PROMPTS, PARAMS)]
    assert got == want
    one_token_steps = [s for s in compiled.stats if all(length == 1 for _, _, length in s.chunks)]
    assert len(decode_calls) == len(one_token_steps) > 0  # steps with longer prompt chunks ran eagerly
    assert set(decode_calls) >= {4, 2, 1}  # 4 rows, then 3 padded to 4, 2, then 1
    blocks = compiled.runner.allocator.num_blocks
    assert compiled.runner.cache.keys.shape[1] == blocks + 1 == eager.runner.cache.keys.shape[1] + 1
    for mine, theirs in ((compiled.runner.cache.keys, eager.runner.cache.keys),
                         (compiled.runner.cache.values, eager.runner.cache.values)):
        torch.testing.assert_close(mine[:, :blocks], theirs, atol=1e-5, rtol=1e-5)


def test_a_decode_step_is_prepared_as_stage_07_prepares_it(tiny_untied_dir):
    """The compiled runner packs decode-only steps itself; what it packs must be what the compiled
    step would get from stage 07's PagedBatch: the same rows, padded alike, the same columns
    visible, the same sampled rows.
    A budget of 4 tokens for 4 requests leaves one-token prompt chunks beside decode rows: steps
    whose rows do not all sample."""
    _, compiled = engines(tiny_untied_dir, token_budget=4)
    runner, prepared = compiled.runner, []
    own = runner.prepare

    def both(schedule):
        mine, stage07 = own(schedule), PagedModelRunner.prepare(runner, schedule)
        if isinstance(mine, DecodeStep):
            rows = len(schedule.chunks)
            want = pad_rows(decode_rows(stage07), bucket_for(rows, runner.buckets), runner.scratch_slot)
            for name in ("ids", "positions", "slots"):
                assert torch.equal(getattr(mine.rows, name), getattr(want, name)), name
            # A row sees its own positions' slots, in order, and nothing past them (any width will
            # do); the columns it does not see are slots of blocks the allocator hands out.
            width = want.visible.shape[1]
            assert mine.rows.visible.shape[1] >= width and not mine.rows.visible[:, width:].any()
            assert torch.equal(mine.rows.visible[:, :width], want.visible)
            assert torch.equal(mine.rows.columns[mine.rows.visible], want.columns[want.visible])
            assert 0 <= mine.rows.columns[:rows].min() and mine.rows.columns[:rows].max() < runner.scratch_slot
            assert torch.equal(mine.logits_at, stage07.logits_at)
            prepared.append((rows, len(mine.logits_at)))
        else:
            assert stage07.chunks  # only steps with a longer prompt chunk go to stage 07
        return mine

    runner.prepare = both
    compiled.generate(PROMPTS, PARAMS)
    assert {rows for rows, _ in prepared} >= {4, 2, 1}  # the batch shrinks; 3 would pad to 4
    assert any(sampled < rows for rows, sampled in prepared)


def test_padding_rows_write_only_the_scratch_block(tiny_untied_dir):
    _, compiled = engines(tiny_untied_dir)
    runner = compiled.runner
    empty = torch.empty(0, dtype=torch.long)
    nothing = DecodeRows(empty, empty, empty, empty.view(0, 3), empty.view(0, 3).bool())
    logits = runner.decode_step(pad_rows(nothing, 4, runner.scratch_slot))
    assert torch.isfinite(logits).all() and logits.shape == (4, runner.config.vocab_size)
    blocks = runner.allocator.num_blocks
    assert not runner.cache.keys[:, :blocks].any() and not runner.cache.values[:, :blocks].any()
    assert runner.cache.keys[:, blocks].any()


def test_bf16_weights_agree_with_the_eager_bf16_engine(tiny_untied_dir):
    """Compiled, bf16 products round the activations to bf16; eager, the weights go to fp32.
    Every decode step is run both ways on the same cache and the logits compared."""
    _, compiled = engines(tiny_untied_dir, dtype=torch.bfloat16)
    runner, eager, mine, schedules = compiled.runner, [], [], []
    own = runner.prepare

    def keep(schedule):
        schedules.append(schedule)
        return own(schedule)

    def both(batch):
        logits = CompiledPagedRunner.run(runner, batch)
        if isinstance(batch, DecodeStep):  # the engine's own step, then the eager one on stage 07's batch
            eager.append(PagedModelRunner.run(runner, PagedModelRunner.prepare(runner, schedules[-1])))
            mine.append(logits)
        return logits

    runner.prepare, runner.run = keep, both
    compiled.generate(PROMPTS, [SamplingParams(max_new_tokens=8, ignore_eos=True)] * len(PROMPTS))
    result = agreement(torch.cat(eager), torch.cat(mine))
    assert result.positions >= 20
    assert result.top1 >= 0.9 and result.mean_kl < 1e-2, result


@pytest.mark.slow
def test_after_warm_up_no_step_compiles_again(tiny_untied_dir, fresh_dynamo):
    """Each bucket is compiled once, by warm_up; the cached positions and the pool's slots are
    symbols, so longer requests, padded and full steps, and another KV budget, run what it compiled."""
    _, compiled = engines(tiny_untied_dir, compile=True, buckets=(1, 2, 4))
    compiled.runner.warm_up()
    _, other_budget = engines(tiny_untied_dir, compile=True, buckets=(1, 2, 4), kv_tokens=96)
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled.generate(PROMPTS, PARAMS)
        other_budget.generate(PROMPTS + ["a", "b"], PARAMS + PARAMS[:2])


@pytest.mark.parametrize("scenario", ["preemption and prefix hits", "one-token chunks that do not sample",
                                      "one-token prompts", "nothing samples"])
def test_the_compiled_engine_keeps_the_tokens_when_steps_are_unusual(tiny_untied_dir, scenario):
    kwargs, prompts, params = {
        # a small pool: requests are preempted and recomputed; shared prompts hit the prefix cache
        "preemption and prefix hits": ({"kv_tokens": 12}, ["the quick brown fox jumps over"] * 3 + ["hello world"],
                                       [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (20, 14, 17, 9)]),
        # a budget of 4 tokens cuts prompts into chunks, some of one token beside decode rows
        "one-token chunks that do not sample": ({"token_budget": 4}, PROMPTS, PARAMS),
        "one-token prompts": ({}, ["a", "b", "a"], [SamplingParams(max_new_tokens=5, temperature=0.8, seed=i)
                                                  for i in range(3)]),
        "nothing samples": ({"max_seqs": 1, "token_budget": 1}, PROMPTS[:2], PARAMS[:2]),
    }[scenario]
    eager, compiled = engines(tiny_untied_dir, **kwargs)
    want = [r.token_ids for r in eager.generate(prompts, params)]
    assert [r.token_ids for r in compiled.generate(prompts, params)] == want
    if scenario == "preemption and prefix hits":
        assert any(s.preempted for s in compiled.stats) and compiled.runner.allocator.hit_tokens


def test_products_seconds_times_fp32_and_bf16_matrices():
    from aie_lessons.ceilings import products_seconds

    matrices = [torch.randn(64, 32), torch.randn(32, 64).bfloat16()]
    assert products_seconds(matrices, 4, repeats=1) > 0


def test_buckets_are_the_smallest_that_holds_the_rows():
    assert [bucket_for(n, (1, 2, 4, 8)) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    with pytest.raises(ValueError, match="more than the largest bucket \\(8\\).*max_seqs"):
        bucket_for(9, (1, 2, 4, 8))


def test_the_engine_compiles_a_bucket_for_its_most_requests(tiny_untied_dir):
    _, compiled = engines(tiny_untied_dir, buckets=(1, 2, 8))
    assert compiled.runner.buckets == (1, 2, 4)  # 8 would pad 4 requests to 8: 4 is compiled instead
    assert engines(tiny_untied_dir, buckets=(1,))[1].runner.buckets == (1, 4)


@pytest.mark.parametrize("how, message", [
    ({"activations": torch.bfloat16}, "activations=torch.float32"),
    ({"dtype": torch.float16}, "fp32 or bf16 weights"),
    ("quantized", "int4 CPU kernel takes groups of"),
])
def test_what_the_step_cannot_run_is_refused(tiny_untied_dir, how, message):
    if how == "quantized":  # groups of 16: stage 08 makes them, PyTorch's int4 kernel does not read them
        from aie_lessons.quantize import QuantScheme, quantize_model

        model = quantize_model(LlamaModel.from_pretrained(tiny_untied_dir), QuantScheme("int4-g16", 4, 16))
    else:
        model = LlamaModel.from_pretrained(tiny_untied_dir, **how)
    with pytest.raises(ValueError, match=message):
        CompiledPagedRunner(model, num_blocks=8, compile=False)


def test_layers_per_call_and_buckets_below_one_are_refused(tiny_untied_dir):
    model = LlamaModel.from_pretrained(tiny_untied_dir)
    for kwargs, name in (({"layers_per_call": 0}, "layers_per_call"), ({"buckets": (0, 4)}, "buckets"),
                         ({"buckets": ()}, "buckets")):
        with pytest.raises(ValueError, match=f"{name} must be .*at least 1"):
            CompiledPagedRunner(model, num_blocks=8, compile=False, **kwargs)


@pytest.mark.parametrize("scheme", ["int8", "int4-g32"])
@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_quantized_weights_run_in_the_compiled_step_as_in_the_batch_1_decoder(tiny_untied_dir, scheme, compile,
                                                                              fresh_dynamo, monkeypatch):
    """The engine's compiled step reads stage 08's integers through the same kernels and the same
    layer as ``QuantizedFastDecoder``: each request's greedy tokens are the decoder's, alone or
    four at once (padded to buckets of 1, 2 and 4 as requests finish). Compiled, with PyTorch's
    kernels: the course's round each input to int8 steps, which the compiled inputs, a float
    rounding away from the eager decoder's, can cross, so equal tokens there would be luck (their
    own tests bound the difference: test_int_kernels, test_fast_decode, test_ahead_of_time)."""
    from aie_lessons.fast_decode import QuantizedFastDecoder
    from aie_lessons.infra import int_kernels
    from aie_lessons.quantize import quantize_model

    if compile:
        monkeypatch.setattr(int_kernels, "unavailable", lambda: "this test compares tokens: PyTorch's kernels")

    model = quantize_model(LlamaModel.from_pretrained(tiny_untied_dir), scheme)
    tokenizer = Tokenizer.from_pretrained(tiny_untied_dir)
    decoder = QuantizedFastDecoder(model, compile=False)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (14, 6, 9, 11)]
    expected = [list(decoder.tokens(ids, p)) for ids, p in zip(prompts, params)]
    for max_seqs in (1, 4):
        engine = compiled_engine(model, tokenizer, max_seqs=max_seqs, kv_bytes=kv_cache_bytes(model.config, 64, 4, torch.float32),
                                 block_size=BLOCK, compile=compile)
        assert engine.runner.quantized
        if int_kernels.unavailable() is None:  # the course's kernels read the integers: their block
            assert_in_one_block(engine.runner.block,
                                [m for call in engine.runner.calls for _, _, tensors in call for m in tensors[:4]])
        results = engine.generate(prompts, params)
        assert [r.token_ids for r in results] == expected, f"max_seqs={max_seqs}"


@pytest.mark.parametrize("head, head_is", [(True, "int4-g32"), ("int8", "int8")])
def test_a_quantized_head_runs_in_the_step_as_in_the_batch_1_decoder(tiny_untied_dir, head, head_is):
    """int4 blocks with an int4 or an int8 head (as `--quant-head` / `--quant-head-scheme int8`
    make): the step multiplies by the head in its own scheme, and every decode step's logits are
    the batch-1 decoder's, fed the same tokens, within twice the bound test_fast_decode gives
    the decoder against the model (8 eps(bf16) = 6.25 % of the largest logit; measured on an AVX2
    Zen 3: at most 2.7 % of it with an int4 head, 2.2 % with an int8 one, 1.4 % with a bf16 one).
    Eager, one request at a time: the batched and compiled steps read the head through the same
    ``quantized_matvec`` (the tests above run them on the blocks' kernels). Logits, not
    tokens: the kernels round each input to int8 steps, so the pool attention's last-bit
    differences from the decoder's can cross a step, and on a random tiny model, whose logits lie
    close together, that flips near-ties either way."""
    from aie_lessons.fast_decode import QuantizedFastDecoder
    from aie_lessons.quantize import quantize_model

    model = quantize_model(LlamaModel.from_pretrained(tiny_untied_dir), "int4-g32", head=head)
    tokenizer = Tokenizer.from_pretrained(tiny_untied_dir)
    engine = compiled_engine(model, tokenizer, max_seqs=1, kv_bytes=kv_cache_bytes(model.config, 64, 4, torch.float32),
                             block_size=BLOCK, compile=False)
    assert engine.runner.head.scheme.name == head_is
    steps, run = [], engine.runner.run

    def keep(batch):
        logits = run(batch)
        if isinstance(batch, DecodeStep):
            steps.append(logits[0])
        return logits

    engine.runner.run = keep
    prompts = [tokenizer.encode(p) for p in PROMPTS if len(tokenizer.encode(p)) > 1]  # every prefill many tokens
    results = engine.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    decoder = QuantizedFastDecoder(model, compile=False)
    # One request at a time (max_seqs=1): its decode steps in order, after its prefill.
    expected = [row for prompt, result in zip(prompts, results)
                for row in decoder.forced_logits(prompt, result.token_ids)[1:]]
    assert len(steps) == len(expected) == 7 * len(prompts)
    for got, want in zip(steps, expected):
        error = (got - want).abs().max().item()
        assert error <= 8 * torch.finfo(torch.bfloat16).eps * want.abs().max().item(), error
