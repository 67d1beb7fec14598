"""Stage 09's compiled engine step: padded to batch buckets, it must keep the eager engine's tokens
and cache, write padding only to its scratch block, and refuse what it cannot run."""

from __future__ import annotations

import pytest
import torch

from aie_lessons.engine.compiled_runner import (CompiledPagedRunner, DecodeRows, bucket_for, compiled_engine,
                                                pad_rows)
from aie_lessons.engine.paged_engine import paged_engine
from aie_lessons.engine.paged_runner import PagedModelRunner
from aie_lessons.kv_cache import kv_cache_bytes
from aie_lessons.model import LlamaModel
from aie_lessons.precision import agreement
from aie_lessons.sampling import SamplingParams
from aie_lessons.tokenizer import Tokenizer

PROMPTS = ["hello world", "the quick brown fox jumps over", "a", "over the lazy dog and far away"]
# Different lengths, so that requests finish at different steps and the batch moves between buckets.
PARAMS = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (14, 6, 9)] + [
    SamplingParams(max_new_tokens=11, ignore_eos=True, temperature=0.9, top_k=20, seed=3)]
BLOCK = 4  # small blocks: prompts and outputs cross block boundaries


def engines(model_dir, dtype=torch.float32, compile=False, **kwargs):
    model = LlamaModel.from_pretrained(model_dir, dtype=dtype)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    kv_bytes = kv_cache_bytes(model.config, 64, 4, dtype)
    eager = paged_engine(model, tokenizer, max_seqs=4, token_budget=16, kv_bytes=kv_bytes, block_size=BLOCK,
                         decode="gather")
    compiled = compiled_engine(model, tokenizer, max_seqs=4, token_budget=16, kv_bytes=kv_bytes, block_size=BLOCK,
                               compile=compile, **kwargs)
    return eager, compiled


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_the_compiled_engine_keeps_the_eager_engines_tokens_and_cache(tiny_untied_dir, compile):
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
    runner, eager, mine = compiled.runner, [], []

    def both(batch):
        logits = CompiledPagedRunner.run(runner, batch)
        if not batch.chunks:
            eager.append(PagedModelRunner.run(runner, batch))
            mine.append(logits)
        return logits

    runner.run = both
    compiled.generate(PROMPTS, [SamplingParams(max_new_tokens=8, ignore_eos=True)] * len(PROMPTS))
    result = agreement(torch.cat(eager), torch.cat(mine))
    assert result.positions >= 20
    assert result.top1 >= 0.9 and result.mean_kl < 1e-2, result


@pytest.mark.slow
def test_after_warm_up_no_step_compiles_again(tiny_untied_dir):
    """Each bucket is compiled once; the number of cached positions is a symbol, so longer requests
    and every batch size up to the largest bucket run what warm_up compiled."""
    _, compiled = engines(tiny_untied_dir, compile=True, buckets=(1, 2, 4))
    compiled.runner.warm_up()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled.generate(PROMPTS, PARAMS)


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
    ("quantized", "QuantizedFastDecoder"),
])
def test_what_the_step_cannot_run_is_refused(tiny_untied_dir, how, message):
    if how == "quantized":
        from aie_lessons.quantize import quantize_model

        model = quantize_model(LlamaModel.from_pretrained(tiny_untied_dir), "int8")
    else:
        model = LlamaModel.from_pretrained(tiny_untied_dir, **how)
    with pytest.raises(ValueError, match=message):
        CompiledPagedRunner(model, num_blocks=8, compile=False)


def test_layers_per_call_and_buckets_below_one_are_refused(tiny_untied_dir):
    model = LlamaModel.from_pretrained(tiny_untied_dir)
    for kwargs in ({"layers_per_call": 0}, {"buckets": (0, 4)}, {"buckets": ()}):
        with pytest.raises(ValueError, match="at least 1"):
            CompiledPagedRunner(model, num_blocks=8, compile=False, **kwargs)
