"""Stage 09's FastDecoder: fused weights and a compiled step must not change a single token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aie_lessons.cached_generate import generate_cached
from aie_lessons.fast_decode import (
    HUGE_PAGE,
    FastDecoder,
    decode_attention,
    decode_groups,
    gemv,
    huge_page_bytes,
    huge_page_empty,
    rope_one_token,
)
from aie_lessons.infra import int_kernels
from aie_lessons.generate import ContextLengthError
from aie_lessons.sampling import SamplingParams
from aie_lessons.model import AttentionMetadata, LlamaModel, apply_rope, rope_cos_sin, sdpa_attention
from aie_lessons.tokenizer import Tokenizer

from low_precision import assert_greedy_agrees, int8_input_tolerance
from weight_block import assert_in_one_block

PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture()
def tiny(tiny_dir):
    return LlamaModel.from_pretrained(tiny_dir), Tokenizer.from_pretrained(tiny_dir)


def prompts(tokenizer: Tokenizer) -> list[list[int]]:
    return [tokenizer.encode("hello world"), tokenizer.encode("the quick brown fox jumps over")]


def test_packing_copies_the_weights_in_reading_order_and_leaves_the_model_alone(tiny):
    model, tokenizer = tiny
    ids = torch.tensor([prompts(tokenizer)[1]])
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    with torch.inference_mode():
        before = model(ids)
    decoder = FastDecoder(model, compile=False)
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == pointers
    assert model.embed_tokens.weight is model.lm_head.weight  # the tie is the model's business
    with torch.inference_mode():
        assert torch.equal(model(ids), before)
    groups = decode_groups(model)
    matrices = [m for layer in decoder.layers for m in layer.tensors()[:4]] + [decoder.head]
    assert len(matrices) == len(groups)
    offset = decoder.block.data_ptr()
    for matrix, group in zip(matrices, groups):  # back to back, in the order a step reads them
        assert matrix.data_ptr() == offset and torch.equal(matrix, torch.cat(group))
        offset += matrix.nbytes
    assert offset == decoder.block.data_ptr() + decoder.block.nbytes
    other = FastDecoder(model, compile=False)  # each decoder owns its copy
    assert other.block.data_ptr() != decoder.block.data_ptr()


class TransposedDecoder(FastDecoder):
    """Stores every matrix transposed and multiplies accordingly: both hooks must be used."""

    def pack(self, model):
        return [torch.cat(group).T.contiguous() for group in decode_groups(model)]

    @staticmethod
    def matvec(x, weight):
        return x @ weight.float()


def test_pack_and_matvec_can_be_overridden_without_editing_the_decoder(tiny_untied_dir):
    model, tokenizer = LlamaModel.from_pretrained(tiny_untied_dir), Tokenizer.from_pretrained(tiny_untied_dir)
    prompt = prompts(tokenizer)[1]
    expected = generate_cached(model, tokenizer, [prompt], PARAMS)[0].token_ids
    assert len(set(expected)) > 3, "the untied tiny model must produce varied tokens for this to mean anything"
    decoder = TransposedDecoder(model, compile=False)
    assert decoder.layers[0].qkv.shape[0] == model.config.hidden_size  # stored (K, N)
    assert decoder.generate(tokenizer, prompt, PARAMS).token_ids == expected


def test_sampled_decoding_matches_generate_cached_with_the_same_seed(tiny_untied_dir):
    model, tokenizer = LlamaModel.from_pretrained(tiny_untied_dir), Tokenizer.from_pretrained(tiny_untied_dir)
    prompt = prompts(tokenizer)[1]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=1.5, top_k=40, top_p=0.95,
                            repetition_penalty=1.2, seed=3)
    expected = generate_cached(model, tokenizer, [prompt], params)[0].token_ids
    assert expected != generate_cached(model, tokenizer, [prompt], PARAMS)[0].token_ids  # really sampled
    assert FastDecoder(model, compile=False).generate(tokenizer, prompt, params).token_ids == expected


def test_huge_page_memory_is_aligned_and_backed_by_huge_pages():
    numel = 4 * HUGE_PAGE // 4
    block = huge_page_empty(numel, torch.float32)
    assert block.dtype == torch.float32 and block.shape == (numel,)
    block.fill_(1.0)  # pages are allocated when first touched
    assert block.sum().item() == numel
    thp = Path("/sys/kernel/mm/transparent_hugepage")
    enabled = (thp / "enabled").read_text() if (thp / "enabled").exists() else "[never]"
    defrag = (thp / "defrag").read_text() if (thp / "defrag").exists() else "[never]"
    if "[never]" in enabled or "[never]" in defrag:
        # Whether memory gets huge pages is the kernel's setting, not our code's: with either
        # switch off, madvise is only advice, so only the alignment above can be asserted.
        pytest.skip(f"transparent huge pages are off here (enabled: {enabled.strip()}; defrag: "
                    f"{defrag.strip()}): the memory is ordinary (correct, slower)")
    assert block.data_ptr() % HUGE_PAGE == 0
    assert huge_page_bytes(block) >= HUGE_PAGE, "madvise(MADV_HUGEPAGE) did not give huge pages"


def test_decode_attention_equals_sdpa_with_grouped_heads():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(6, 16, generator=g), torch.randn(2, 9, 16, generator=g), torch.randn(2, 9, 16, generator=g)
    expected = sdpa_attention(q.view(1, 6, 1, 16), k[None], v[None]).view(6, 16)
    assert torch.allclose(decode_attention(q, k, v), expected, atol=1e-6)


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_rope_one_token_is_stage_02_rope(compile):
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_cos_sin(torch.tensor([[37]]), 16, 10000.0)  # (1, 1, 16): position 37
    expected = apply_rope(x.view(1, 6, 1, 16), cos, sin).view(6, 16)
    rope = torch.compile(rope_one_token) if compile else rope_one_token
    assert torch.allclose(rope(x, cos[0, 0], sin[0, 0]), expected, atol=1e-6)
    assert not torch.allclose(expected, x * cos[0, 0] + x.flip(-1) * sin[0, 0], atol=1e-3)  # pairs matter


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_gemv_multiplies_bf16_weights_in_fp32(compile):
    weight = torch.randn(5, 64).bfloat16()
    x = torch.randn(64)
    out = (torch.compile(gemv) if compile else gemv)(x, weight)
    assert out.dtype == torch.float32 and out.shape == (5,)
    assert torch.allclose(out.double(), weight.double() @ x.double(), atol=1e-5)  # x not rounded to bf16


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_same_tokens_as_generate_cached(tiny, compile):
    model, tokenizer = tiny
    expected = [generate_cached(model, tokenizer, [p], PARAMS)[0] for p in prompts(tokenizer)]
    decoder = FastDecoder(model, compile=compile)
    for prompt, reference in zip(prompts(tokenizer), expected):
        for _ in range(2):  # the second request runs with everything compiled already
            result = decoder.generate(tokenizer, prompt, PARAMS)
            assert result.token_ids == reference.token_ids
            assert result.text == reference.text
            assert len(result.step_seconds) == PARAMS.max_new_tokens


@pytest.mark.parametrize("layers_per_call", [1, 3])
def test_any_grouping_of_layers_per_call_gives_the_same_tokens(tiny, layers_per_call):
    model, tokenizer = tiny  # two layers: one call each, or one call of both
    prompt = prompts(tokenizer)[0]
    expected = generate_cached(model, tokenizer, [prompt], PARAMS)[0].token_ids
    decoder = FastDecoder(model, compile=False, layers_per_call=layers_per_call)
    assert decoder.generate(tokenizer, prompt, PARAMS).token_ids == expected


def test_layers_per_call_below_one_is_refused(tiny):
    with pytest.raises(ValueError, match="layers_per_call must be at least 1"):
        FastDecoder(tiny[0], compile=False, layers_per_call=0)


def test_stops_and_streams_like_generate_cached(tiny):
    model, tokenizer = tiny
    prompt = prompts(tokenizer)[0]
    reference = generate_cached(model, tokenizer, [prompt], SamplingParams(max_new_tokens=10))[0]
    streamed: list[str] = []
    result = FastDecoder(model, compile=False).generate(
        tokenizer, prompt, SamplingParams(max_new_tokens=10), on_text=streamed.append)
    assert (result.token_ids, result.finish_reason) == (reference.token_ids, reference.finish_reason)
    assert "".join(streamed) == result.text == reference.text


def test_tokens_come_one_step_at_a_time_and_stop_at_the_limit(tiny):
    model, tokenizer = tiny
    prompt = prompts(tokenizer)[1]
    reference = generate_cached(model, tokenizer, [prompt], PARAMS)[0].token_ids
    decoder = FastDecoder(model, compile=False)
    steps = decoder.tokens(prompt, PARAMS)
    assert [next(steps) for _ in range(3)] == reference[:3]  # a caller can pause between steps
    assert [*steps] == reference[3:]  # and the generator ends at max_new_tokens
    assert [*decoder.tokens(prompt, SamplingParams(max_new_tokens=0))] == []


def test_zero_new_tokens_gives_none(tiny):
    model, tokenizer = tiny
    result = FastDecoder(model, compile=False).generate(tokenizer, prompts(tokenizer)[0], SamplingParams(max_new_tokens=0))
    assert result.token_ids == [] and result.text == ""


def test_too_long_request_is_refused_with_the_numbers(tiny):
    model, tokenizer = tiny
    context = model.config.max_position_embeddings
    with pytest.raises(ContextLengthError, match=str(context)):
        FastDecoder(model, compile=False).generate(tokenizer, [1] * context, SamplingParams(max_new_tokens=5))
    with pytest.raises(ContextLengthError, match=str(context)):  # at the call, not at the first next()
        FastDecoder(model, compile=False).tokens([1] * context, SamplingParams(max_new_tokens=5))


# Chat prompts whose greedy answers run 32 tokens, with the most steps decisive for bf16: a small
# model's answers soon reach a near-tie (the France question's first token is one, by 0.08).
BF16_PROMPTS = (
    "Write a haiku about autumn leaves falling on a quiet river.",
    "Name the planets of the solar system in order.",
    "Translate 'good morning' into French, Spanish and German.",
    "What are the days of the week?",
    "Write a Python function that adds two numbers.",
)


@pytest.mark.oracle
def test_real_model_fast_decoder_matches_transformers_fp32_and_bf16(real_model_dir):
    """fp32 and bf16 (bf16 weights, fp32 activations) against transformers in fp32.

    The fused step runs eagerly here, compiling two decoders would double this test's time: the
    step compiled ahead of time gives the eager step's logits on this model in fp32, and on the
    tiny models in fp32 and bf16 (tests/test_ahead_of_time.py); torch.compile's step gives the
    eager one's on the tiny models (below) and runs on this model in stage 09's notebook.

    bf16 tokens are compared over the steps where fp32's choice is decisive for bf16
    (``assert_greedy_agrees``), up to each answer's first near-tie: 43 of the 160 steps here.
    The test fails when fewer are compared, so it cannot pass by comparing nothing.
    """
    import transformers
    tokenizer = Tokenizer.from_pretrained(real_model_dir)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    fp32 = FastDecoder(LlamaModel.from_pretrained(real_model_dir, dtype=torch.float32), compile=False)
    bf16 = FastDecoder(LlamaModel.from_pretrained(real_model_dir, dtype=torch.bfloat16), compile=False)
    params = SamplingParams(max_new_tokens=32)
    compared = {torch.float32: 0, torch.bfloat16: 0}
    for question in BF16_PROMPTS:
        prompt = tokenizer.encode_chat(question)
        with torch.inference_mode():
            out = theirs.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True, pad_token_id=tokenizer.eos_token_id)
        expected = [t for t in out.sequences[0, len(prompt):].tolist() if t != tokenizer.eos_token_id]
        reference_logits = torch.cat(out.logits)  # (steps, vocab): what each expected token was chosen from
        for dtype, decoder in ((torch.float32, fp32), (torch.bfloat16, bf16)):
            tokens = decoder.generate(tokenizer, prompt, params).token_ids
            compared[dtype] += assert_greedy_agrees(tokens, expected, reference_logits, dtype)
    assert compared[torch.float32] == 5 * 32, f"fp32 compared only {compared[torch.float32]} of 160 steps"
    assert compared[torch.bfloat16] >= 35, f"bf16 compared only {compared[torch.bfloat16]} steps, 43 expected"


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_every_decode_step_gives_the_eager_models_logits(tiny_untied_dir, compile):
    """Logits, not only tokens: each fused step at position t against one full forward pass."""
    from aie_lessons.kv_cache import KVCache

    model = LlamaModel.from_pretrained(tiny_untied_dir)
    decoder = FastDecoder(model, compile=compile, layers_per_call=1)
    ids = torch.randint(3, model.config.vocab_size, (1, 14), generator=torch.Generator().manual_seed(5))
    prefill, n = 5, ids.shape[1]
    with torch.no_grad():
        expected = model(ids)[0]  # (n, vocab)
        cache = KVCache(model.config, 1, n)
        positions = torch.arange(n)[None]
        cos, sin = (t[0] for t in rope_cos_sin(positions, model.config.head_dim, model.config.rope_theta))
        calls = decoder.layer_inputs(cache)
        model(ids[:, :prefill], positions[:, :prefill], AttentionMetadata(cache=cache, cache_start=0))
        for t in range(prefill, n):
            logits = decoder.step(int(ids[0, t]), t, calls, cos, sin, greedy=False)[0]
            assert logits.shape == expected[t].shape == (model.config.vocab_size,)
            assert (logits - expected[t]).abs().max().item() <= 1e-4, f"position {t}"


# --- stage 09: packing optional, bytes per step, teacher forcing, warm-up, quantized weights ---


def test_unpacked_decoder_gives_the_packed_ones_tokens_and_owns_no_block(tiny):
    model, tokenizer = tiny
    packed = FastDecoder(model, compile=False)
    unpacked = FastDecoder(model, compile=False, packed=False)
    assert unpacked.block is None and unpacked.layers[0].qkv.data_ptr() != packed.layers[0].qkv.data_ptr()
    for prompt in prompts(tokenizer):
        assert (unpacked.generate(tokenizer, prompt, PARAMS).token_ids
                == packed.generate(tokenizer, prompt, PARAMS).token_ids)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_per_token_is_stage_04s_count_plus_the_embedding_row(tiny_dir, tiny_untied_dir, dtype, tied):
    """Stage 04's ``decode_bytes_per_token`` counts every parameter once (the tied table as the
    head) and the cache; a step also reads the one embedding row of its token, and the decoder
    keeps its norms' weights in fp32 whatever the model stores."""
    from aie_lessons.roofline import decode_bytes_per_token

    model = LlamaModel.from_pretrained(tiny_dir if tied else tiny_untied_dir, dtype=dtype)
    decoder = FastDecoder(model, compile=False)
    size = model.embed_tokens.weight.element_size()
    row = model.config.hidden_size * size
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name) * (4 - size)
    for context in (1, 40):
        assert decoder.bytes_per_token(context) == decode_bytes_per_token(model, context, dtype) + row + norms


def test_forced_logits_are_the_full_forward_passes_logits(tiny_untied_dir):
    """Teacher forcing: the logits before each token of a continuation, the decoder fed those
    tokens, equal one forward pass of the model over the prompt and the continuation."""
    model = LlamaModel.from_pretrained(tiny_untied_dir)
    ids = torch.randint(3, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    prompt, continuation = ids[:5], ids[5:]
    with torch.no_grad():
        expected = model(torch.tensor([ids]))[0, 4:-1]  # the logits that predict each continuation token
    forced = FastDecoder(model, compile=False).forced_logits(prompt, continuation)
    assert forced.shape == (len(continuation), model.config.vocab_size)
    assert (forced - expected).abs().max().item() <= 1e-4


def test_forced_logits_refuse_a_continuation_past_the_context_and_take_an_empty_one(tiny):
    model, _ = tiny  # its context: 64 positions
    decoder = FastDecoder(model, compile=False)
    assert decoder.forced_logits([1] * 40, [1] * 25).shape[0] == 25  # 40 + 24 fed positions fit
    with pytest.raises(ContextLengthError, match="context"):
        decoder.forced_logits([1] * 40, [1] * 26)
    assert decoder.forced_logits([1, 2], []).shape == (0, model.config.vocab_size)


def test_warm_up_leaves_the_next_request_unchanged(tiny):
    model, tokenizer = tiny
    decoder = FastDecoder(model, compile=False)
    before = decoder.generate(tokenizer, prompts(tokenizer)[1], PARAMS).token_ids
    decoder.warm_up(SamplingParams(temperature=0.8, seed=1))
    assert decoder.generate(tokenizer, prompts(tokenizer)[1], PARAMS).token_ids == before


@pytest.mark.slow
def test_after_warm_up_no_request_compiles_again(tiny_untied_dir):
    """The cache and the RoPE tables are sized by each request, their length marked dynamic: after
    ``warm_up`` requests of other lengths, greedy or sampled as warmed, run what was compiled."""
    model, tokenizer = LlamaModel.from_pretrained(tiny_untied_dir), Tokenizer.from_pretrained(tiny_untied_dir)
    decoder = FastDecoder(model, layers_per_call=2)
    decoder.warm_up()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompt, tokens in zip(prompts(tokenizer), (5, 17)):
            decoder.generate(tokenizer, prompt, SamplingParams(max_new_tokens=tokens, ignore_eos=True))


def _quantized(model_dir, scheme, **kwargs):
    from aie_lessons.quantize import quantize_model

    return quantize_model(LlamaModel.from_pretrained(model_dir), scheme, **kwargs)


@pytest.mark.parametrize("scheme, head", [("int8", False), ("int4-g32", False), ("int8", True), ("int4-g32", "int8")])
def test_quantized_decoder_gives_the_quantized_models_logits(tiny_untied_dir, scheme, head):
    """The decoder stacks each group's integers for its kernels; the model multiplies layer by
    layer in fp32. The kernels round the input vector (PyTorch's to bf16, the course's to int8
    per block of 32), so the logits agree within that rounding: eps(bf16) × the largest |logit|
    × 4, which the int8 rounding (half a step of 1/127 of a block's largest value) also meets."""
    from aie_lessons.fast_decode import QuantizedFastDecoder

    model = _quantized(tiny_untied_dir, scheme, head=head)
    ids = torch.randint(3, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([ids]))[0, 4:-1]
    forced = QuantizedFastDecoder(model, compile=False).forced_logits(ids[:5], ids[5:])
    error = (forced - expected).abs().max().item()
    assert error <= 4 * torch.finfo(torch.bfloat16).eps * expected.abs().max().item(), error


def test_quantized_decoder_stacks_a_group_of_one_scheme_and_keeps_mixed_groups_apart(tiny_untied_dir):
    from aie_lessons.fast_decode import KernelMatrix, QuantizedFastDecoder

    model = _quantized(tiny_untied_dir, "int4-g32", overrides={"layers.0.self_attn.k_proj": "int8"})
    decoder = QuantizedFastDecoder(model, compile=False)
    first, second = decoder.layers
    assert isinstance(first.qkv, tuple) and [m.scheme.name for m in first.qkv] == ["int4-g32", "int8", "int4-g32"]
    assert isinstance(second.qkv, KernelMatrix) and second.qkv.scheme.name == "int4-g32"
    assert second.qkv.kernel == ("aie" if int_kernels.unavailable() is None else "pytorch")  # ours where it runs
    assert isinstance(decoder.head, torch.Tensor)  # the head was not quantized: a float matrix
    if int_kernels.unavailable() is None:
        assert_in_one_block(decoder.block, [m for layer in decoder.layers for m in layer.tensors()[:4]])
    tokenizer = Tokenizer.from_pretrained(tiny_untied_dir)
    assert len(decoder.generate(tokenizer, prompts(tokenizer)[0], PARAMS).token_ids) == PARAMS.max_new_tokens


def test_a_layer_the_kernels_cannot_tile_keeps_pytorchs_kernel():
    """The course's kernels take outputs in tiles of four: a layer of 6 does not fit them alone,
    and keeps PyTorch's kernel; two of them stacked (12 outputs) do."""
    from aie_lessons.fast_decode import kernel_matrix
    from aie_lessons.quantize import QuantizedLinear, scheme_named

    six = [QuantizedLinear.quantize(torch.randn(6, 64), scheme_named("int8")) for _ in range(2)]
    assert kernel_matrix(six[:1]).kernel == "pytorch"
    assert kernel_matrix(six).kernel == ("aie" if int_kernels.unavailable() is None else "pytorch")


def test_quantized_decoder_refuses_what_the_kernels_cannot_read(tiny_untied_dir):
    from aie_lessons.fast_decode import QuantizedFastDecoder
    from aie_lessons.quantize import QuantScheme

    with pytest.raises(ValueError, match="no quantized layers. Fix"):
        QuantizedFastDecoder(LlamaModel.from_pretrained(tiny_untied_dir), compile=False)
    model = _quantized(tiny_untied_dir, QuantScheme("int4-g16", 4, 16))
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj \(int4-g16\).*groups of 32, 64, 128, 256"):
        QuantizedFastDecoder(model, compile=False)


@pytest.mark.slow
def test_compiled_quantized_decoder_gives_the_eager_ones_logits(tiny_untied_dir):
    from aie_lessons.fast_decode import QuantizedFastDecoder

    model = _quantized(tiny_untied_dir, "int4-g32")
    ids = list(range(3, 15))
    eager_decoder = QuantizedFastDecoder(model, compile=False)
    eager = eager_decoder.forced_logits(ids[:5], ids[5:])
    compiled = QuantizedFastDecoder(model, layers_per_call=2).forced_logits(ids[:5], ids[5:])
    assert (compiled - eager).abs().max().item() <= int8_input_tolerance(eager_decoder, eager)
