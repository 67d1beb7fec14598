"""Stage 07: decode attention over a paged KV cache (gather reference, PyTorch, Triton)."""

from __future__ import annotations

import pytest
import torch

import aie_lessons.engine.paged_attention as paged

needs_triton = pytest.mark.skipif(
    not paged.HAS_TRITON,
    reason="triton is not installed (no macOS build): the Triton kernel cannot be tested here",
)
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: compiled Triton kernels run only there"
)
# Under the interpreter (no GPU) the kernel reads CPU tensors; compiled, it reads CUDA ones.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GARBAGE = 0  # the pool block the padded table entries point at: never any sequence's
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_case(lengths: list[int], heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
              block_size: int = 4, dtype: torch.dtype = torch.float32, device: str = "cpu",
              seed: int = 0, extra_blocks: int = 3):
    """A pool whose unused memory is NaN, and shuffled tables for sequences of ``lengths``.

    Every slot no sequence owns (block GARBAGE, spare blocks, the tail of each last block) is NaN,
    so a version that reads one position too many returns NaN instead of a plausible number.
    """
    g = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = 1 + sum(needed) + extra_blocks
    shape = (num_blocks, block_size, kv_heads, head_dim)
    keys = torch.full(shape, float("nan"))
    values = torch.full(shape, float("nan"))
    order = (1 + torch.randperm(num_blocks - 1, generator=g)).tolist()  # non-contiguous, any order
    tables = torch.full((len(lengths), max(needed) + 1), GARBAGE, dtype=torch.long)
    for i, (length, count) in enumerate(zip(lengths, needed)):
        blocks, order = order[:count], order[count:]
        tables[i, :count] = torch.tensor(blocks)
        flat_k = torch.randn(length, kv_heads, head_dim, generator=g)
        flat_v = torch.randn(length, kv_heads, head_dim, generator=g)
        for pos in range(length):
            keys[blocks[pos // block_size], pos % block_size] = flat_k[pos]
            values[blocks[pos // block_size], pos % block_size] = flat_v[pos]
    q = torch.randn(len(lengths), heads, head_dim, generator=g)
    seq_lens = torch.tensor(lengths, dtype=torch.long)
    to = lambda t: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)  # noqa: E731
    return to(q), to(keys), to(values), to(tables), to(seq_lens), head_dim**-0.5


def dense_attention(q, keys, values, tables, seq_lens, scale):
    """An independent reference: rebuild each sequence token by token, then fp64 softmax."""
    out = []
    block_size, groups = keys.shape[1], q.shape[1] // keys.shape[2]
    for i, length in enumerate(seq_lens.tolist()):
        slots = [(int(tables[i, p // block_size]), p % block_size) for p in range(length)]
        k = torch.stack([keys[b, o] for b, o in slots], dim=1).double()  # (Hkv, length, D)
        v = torch.stack([values[b, o] for b, o in slots], dim=1).double()
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        weights = torch.einsum("hd,hld->hl", q[i].double(), k).mul(scale).softmax(-1)
        out.append(torch.einsum("hl,hld->hd", weights, v))
    return torch.stack(out)


# Lengths of 1, at block boundaries (4, 8) and just past them (5, 9), with block_size 4.
LENGTHS = [[1, 5, 9], [4, 8, 1], [12, 3, 7]]


def test_gather_kv_reads_blocks_in_table_order():
    q, keys, values, tables, seq_lens, scale = make_case([9])
    gathered = paged.gather_kv(keys, tables[0], 9)
    assert gathered.shape == (2, 9, 16)
    for pos in range(9):
        assert torch.equal(gathered[:, pos], keys[tables[0, pos // 4], pos % 4])


@pytest.mark.parametrize("lengths", LENGTHS)
def test_gather_reference_matches_dense(lengths):
    case = make_case(lengths)
    out = paged.gather_decode_attention(*case)
    assert out.dtype == torch.float32 and not out.isnan().any()
    torch.testing.assert_close(out.double(), dense_attention(*case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (9, 3), (2, 2)])
def test_paged_torch_matches_gather_fp32(lengths, heads, kv_heads):
    case = make_case(lengths, heads=heads, kv_heads=kv_heads, head_dim=32)
    out = paged.paged_decode_attention_torch(*case)
    assert out.dtype == torch.float32 and not out.isnan().any(), "a masked NaN leaked into the result"
    torch.testing.assert_close(out, paged.gather_decode_attention(*case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_torch_low_precision(dtype):
    case = make_case([1, 5, 9, 16], heads=9, kv_heads=3, dtype=dtype, block_size=8)
    out = paged.paged_decode_attention_torch(*case)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), paged.gather_decode_attention(*case).float(),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_paged_torch_rejects_length_past_its_table():
    q, keys, values, tables, seq_lens, scale = make_case([5])
    with pytest.raises(ValueError, match="seq_lens must be in"):
        paged.paged_decode_attention_torch(q, keys, values, tables, seq_lens + 8, scale)


def test_dispatcher_uses_torch_on_cpu(monkeypatch):
    def no_kernel(*args):
        raise AssertionError("the dispatcher ran the Triton kernel on CPU tensors")
    monkeypatch.setattr(paged, "paged_decode_attention_triton", no_kernel)
    case = make_case([5, 9])
    torch.testing.assert_close(paged.paged_decode_attention(*case),
                               paged.gather_decode_attention(*case), atol=1e-5, rtol=1e-5)


def test_triton_without_triton_says_so(monkeypatch):
    monkeypatch.setattr(paged, "HAS_TRITON", False)
    with pytest.raises(RuntimeError, match="triton is not installed"):
        paged.paged_decode_attention_triton(*make_case([5]))


@needs_triton
@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2), (2, 2)])  # groups 2, 3 (padded to 4), 1
def test_triton_matches_gather_fp32(lengths, heads, kv_heads):
    case = make_case(lengths, heads=heads, kv_heads=kv_heads, device=KERNEL_DEVICE)
    out = paged.paged_decode_attention_triton(*case)
    assert out.dtype == torch.float32 and not out.isnan().any(), "a masked NaN leaked into the result"
    torch.testing.assert_close(out, paged.gather_decode_attention(*case), atol=1e-5, rtol=1e-5)


@needs_triton
def test_triton_fp16_head_dim_32():
    case = make_case([1, 5, 9], heads=4, kv_heads=2, head_dim=32, dtype=torch.float16,
                     device=KERNEL_DEVICE)
    out = paged.paged_decode_attention_triton(*case)
    assert out.dtype == torch.float16 and not out.isnan().any()
    torch.testing.assert_close(out.float(), paged.gather_decode_attention(*case).float(),
                               atol=TOLERANCE[torch.float16], rtol=TOLERANCE[torch.float16])


@needs_triton
def test_triton_reads_strided_q():
    q, keys, values, tables, seq_lens, scale = make_case([5, 9], device=KERNEL_DEVICE)
    wide = torch.zeros(q.shape[0], q.shape[1], 2 * q.shape[2], device=q.device)
    wide[..., ::2] = q  # a non-contiguous last dimension: the wrapper must copy it
    strided = wide[..., ::2]
    out = paged.paged_decode_attention_triton(strided, keys, values, tables, seq_lens, scale)
    torch.testing.assert_close(out, paged.gather_decode_attention(q, keys, values, tables, seq_lens,
                                                                  scale), atol=1e-5, rtol=1e-5)


@needs_triton
def test_triton_rejects_block_size_not_power_of_two():
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        paged.paged_decode_attention_triton(*make_case([5], block_size=3, device=KERNEL_DEVICE))


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="only the interpreter computes bf16 wrongly")
def test_interpreter_refuses_bf16():
    with pytest.raises(TypeError, match="bfloat16"):
        paged.paged_decode_attention_triton(*make_case([5], dtype=torch.bfloat16))


@pytest.mark.gpu
@needs_gpu
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_kernel_model_shapes(dtype):
    # The model's heads (9 over 3), head_dim 64, block 16; long and boundary lengths.
    case = make_case([1, 16, 17, 300, 1024], heads=9, kv_heads=3, head_dim=64, block_size=16,
                     dtype=dtype, device="cuda")
    out = paged.paged_decode_attention(*case)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), paged.gather_decode_attention(*case).float(),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    torch.testing.assert_close(out.float(), paged.paged_decode_attention_torch(*case).float(),
                               atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.gpu
@needs_gpu
@needs_triton
def test_compiled_kernel_refuses_cpu_tensors():
    case = make_case([5])
    with pytest.raises(ValueError, match="GPU memory only"):
        paged.paged_decode_attention_triton(*case)


# --- every prompt chunk of a step in one attention call (block_attention) -----------------------


@pytest.mark.parametrize("budget", [64, 12])
def test_the_prompt_chunks_of_a_step_are_one_attention_call_with_each_chunks_own_result(tiny_untied_dir, budget):
    """Three prompts of 5, 9 and 17 tokens arriving together: with a budget of 64 one step
    prefills all three (three chunks of different lengths in one call per layer); with 12 the
    long prompt is cut into chunks that continue beside the others. Either way each request's
    prefill logits are those of the model run on its prompt alone, and the greedy tokens are
    stage 04's."""
    from aie_lessons.cached_generate import generate_cached
    from aie_lessons.engine.paged_engine import paged_engine
    from aie_lessons.kv_cache import kv_cache_bytes
    from aie_lessons.model import LlamaModel, sdpa_attention
    from aie_lessons.sampling import SamplingParams
    from aie_lessons.tokenizer import Tokenizer

    model = LlamaModel.from_pretrained(tiny_untied_dir)
    tokenizer = Tokenizer.from_pretrained(tiny_untied_dir)
    calls = []

    def counting(q, k, v, mask=None):
        calls.append(tuple(q.shape))
        return sdpa_attention(q, k, v, mask)

    engine = paged_engine(model, tokenizer, max_seqs=4, token_budget=budget, block_size=4, decode="gather",
                          kv_bytes=kv_cache_bytes(model.config, 128, 4, torch.float32), attention=counting)
    prompts = [list(range(3, 3 + n)) for n in (5, 9, 17)]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    prepare, run, schedules, prefills = engine.runner.prepare, engine.runner.run, [], {}

    def remembering(schedule):
        schedules.append(schedule)
        return prepare(schedule)

    def recording(batch):  # the logits of each request's first sample: its prefill's last position
        logits = run(batch)
        for row, chunk in zip(logits, [c for c in schedules[-1].chunks if c.samples]):
            if not chunk.request.output_ids:
                prefills[chunk.request.id] = row
        return logits

    engine.runner.prepare, engine.runner.run = remembering, recording
    while engine.has_work():
        engine.step()
    layers = model.config.num_layers
    if budget == 64:  # the first step: the three chunks padded to 17 queries, once per layer
        assert calls[:layers] == [(3, model.config.num_heads, 17, model.config.head_dim)] * layers
    with torch.no_grad():
        for request, prompt in zip(requests, prompts):
            alone = model(torch.tensor([prompt]))[0, -1]
            assert (prefills[request.id] - alone).abs().max().item() <= 1e-4, request.id
    expected = generate_cached(model, tokenizer, prompts, params)
    assert [r.output_ids for r in requests] == [e.token_ids for e in expected]
