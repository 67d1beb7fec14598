"""Stage 05: tiled online softmax and the Triton kernel (interpreter on CPU, compiled on GPU)."""

from __future__ import annotations

import inspect
import linecache
import textwrap
import types

import pytest
import torch
import torch.nn.functional as F

import aie_lessons.flash_attention as flash
from aie_lessons.checks import stage05 as checks
from aie_lessons.sampling import SamplingParams
from aie_lessons.cached_generate import generate_cached
from aie_lessons.model import LlamaModel
from aie_lessons.tokenizer import Tokenizer

from check_expect import mutants, names_the_mistake

needs_triton = pytest.mark.skipif(
    not flash.HAS_TRITON,
    reason="triton is not installed (no macOS build): the Triton kernel cannot be tested here",
)
# A compiled kernel reads GPU memory only; the interpreter (no GPU) reads the CPU's.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: compiled Triton kernels run only there"
)

# (batch, q heads, kv heads, q_len, kv_len, head_dim): GQA, ragged, cache offsets, decode.
SHAPES = [(1, 4, 2, 37, 37, 64), (2, 9, 3, 20, 20, 64), (1, 4, 1, 5, 29, 64),
          (2, 6, 3, 1, 33, 64), (1, 2, 2, 18, 18, 128)]


def reference(q, k, v, causal):
    q_len, kv_len = q.shape[-2], k.shape[-2]
    mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - q_len) if causal else None
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    scores = q.float() @ k.float().repeat_interleave(groups, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return out, torch.logsumexp(scores, -1)


def inputs(shape, dtype=torch.float32, device="cpu", seed=0):
    b, hq, hkv, s, t, d = shape
    g = torch.Generator(device=device).manual_seed(seed)
    make = lambda *size: torch.randn(*size, generator=g, device=device).to(dtype)  # noqa: E731
    return make(b, hq, s, d), make(b, hkv, t, d), make(b, hkv, t, d)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_tiled_pytorch_matches_sdpa(shape, causal):
    q, k, v = inputs(shape)
    out, lse = flash.tiled_attention(q, k, v, causal=causal, block_m=16, block_n=16)
    expected, expected_lse = reference(q, k, v, causal)
    assert (out - expected).abs().max() <= 1e-5
    assert (lse - expected_lse).abs().max() <= 1e-4


@needs_triton
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_triton_kernel_matches_sdpa(shape, causal, dtype, tolerance):
    q, k, v = inputs(shape, dtype, DEVICE)
    out, lse = flash.triton_flash_attention(q, k, v, causal=causal)
    expected, expected_lse = reference(q, k, v, causal)
    assert out.dtype == dtype
    assert (out.float() - expected).abs().max() <= tolerance
    assert (lse - expected_lse).abs().max() <= 1e-3  # the kernel really ran the online softmax


@needs_triton
def test_bf16_under_the_interpreter_is_refused():
    if not flash.interpreted():
        pytest.skip("only the interpreter computes bf16 wrongly")
    q, k, v = inputs(SHAPES[0], torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16 is computed wrongly"):
        flash.triton_flash_attention(q, k, v)


@needs_triton
def test_a_copying_group_queries_is_refused_not_silently_ignored(monkeypatch):
    """The wrapper writes the output through stage 02's group_queries view: a copy would leave the
    real output unwritten, so it must fail loudly."""
    monkeypatch.setattr(flash, "group_queries", lambda q, kv_heads: q.reshape(
        q.shape[0], kv_heads, q.shape[1] // kv_heads, *q.shape[2:]).clone())
    with pytest.raises(ValueError, match="group_queries .exercise 2.3. returned a copy"):
        flash.triton_flash_attention(*inputs(SHAPES[0], device=DEVICE))


def test_flash_kernel_refuses_padding_masks():
    q, k, v = inputs(SHAPES[0], device=DEVICE)
    with pytest.raises(ValueError, match="without a padding mask; for padded batches and engine steps use sdpa_attention"):
        flash.flash_attention(q, k, v, mask=torch.ones(1, 1, 37, 37, dtype=torch.bool, device=DEVICE))


@needs_triton
@pytest.mark.parametrize("q_shape, kv_shape, message", [
    ((2, 4, 20, 64), (1, 2, 20, 64), "batch and head_dim must match"),
    ((1, 4, 20, 64), (1, 2, 20, 32), "batch and head_dim must match"),
    ((1, 4, 20, 64), (1, 3, 20, 64), "multiple of Hkv"),
    ((1, 4, 30, 64), (1, 2, 20, 64), "at most T"),
])
def test_triton_kernel_refuses_mismatched_shapes(q_shape, kv_shape, message):
    """A k that does not fit q would be read out of bounds by the kernel: refuse it first."""
    q, k = torch.randn(q_shape, device=DEVICE), torch.randn(kv_shape, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        flash.triton_flash_attention(q, k, k.clone())


@needs_triton
def test_compiled_triton_refuses_cpu_tensors_and_the_kernel_falls_back(monkeypatch):
    """Compiled Triton cannot read CPU tensors: the wrapper says so, the backend uses the tiles."""
    monkeypatch.setattr(flash, "interpreted", lambda: False)
    q, k, v = inputs(SHAPES[2])
    with pytest.raises(ValueError, match="compiled Triton reads GPU memory only"):
        flash.triton_flash_attention(q, k, v)
    assert (flash.flash_attention(q, k, v) - reference(q, k, v, True)[0]).abs().max() <= 1e-5


@needs_triton
def test_the_kernel_runs_bf16_on_the_tiles_under_the_interpreter():
    if not flash.interpreted():
        pytest.skip("only the interpreter computes bf16 wrongly")
    q, k, v = inputs(SHAPES[2], torch.bfloat16)
    got = flash.flash_attention(q, k, v)
    assert got.dtype == torch.bfloat16
    assert (got.float() - reference(q, k, v, True)[0]).abs().max() <= 2e-2


def test_without_triton_the_kernel_runs_the_pytorch_tiles(monkeypatch):
    """macOS has no Triton: the backend must still work (on the tiles) and the kernels say why not."""
    monkeypatch.setattr(flash, "HAS_TRITON", False)
    q, k, v = inputs(SHAPES[2])
    assert (flash.flash_attention(q, k, v) - reference(q, k, v, True)[0]).abs().max() <= 1e-5
    for run in (lambda: flash.triton_flash_attention(q, k, v), lambda: flash.scale_vector(q.flatten(), 2.0),
                lambda: flash.softmax_rows(q[0, 0])):
        with pytest.raises(RuntimeError, match="triton is not installed"):
            run()


def test_flash_kernel_generates_the_sdpa_tokens(tiny_dir):
    model = LlamaModel.from_pretrained(tiny_dir, device=DEVICE)
    tokenizer = Tokenizer.from_pretrained(tiny_dir)
    prompt = [tokenizer.encode("The quick brown fox")]
    params = SamplingParams(max_new_tokens=6)
    expected = generate_cached(model, tokenizer, prompt, params)[0].token_ids
    model.use_attention(flash.flash_attention)
    assert generate_cached(model, tokenizer, prompt, params)[0].token_ids == expected


def test_flash_kernel_gives_the_sdpa_logits_through_a_cache(tiny_untied_dir):
    """Logits, not only tokens: a prefill and single-token decode steps, flash against sdpa (on the
    CPU, where a machine with CUDA runs the tiles: the generation test above runs the kernel)."""
    from aie_lessons.kv_cache import KVCache

    from stepwise import prefill_then_decode

    model = LlamaModel.from_pretrained(tiny_untied_dir)
    ids = torch.randint(3, model.config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        expected = prefill_then_decode(model, ids, KVCache(model.config, 1, 21), prefill=17)
        model.use_attention(flash.flash_attention)
        got = prefill_then_decode(model, ids, KVCache(model.config, 1, 21), prefill=17)
    assert got.shape == expected.shape == (1, 21, model.config.vocab_size)
    assert (got - expected).abs().max().item() <= 1e-4


@needs_gpu
@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seq", [128, 1000, 4096])
def test_compiled_kernel_on_gpu(dtype, seq):
    q, k, v = inputs((2, 9, 3, seq, seq, 64), dtype, "cuda")
    out, lse = flash.triton_flash_attention(q, k, v, causal=True)
    expected, expected_lse = reference(q, k, v, True)
    assert (out.float() - expected).abs().max() <= 2e-2
    assert (lse - expected_lse).abs().max() <= 1e-2


@needs_gpu
@needs_triton
@pytest.mark.gpu
def test_the_triton_checks_pass_on_gpu():
    """The checks move their tensors to the GPU when there is one: a compiled kernel reads only GPU
    memory."""
    checks.check_scale_vector(flash.scale_vector, True)
    checks.check_softmax_rows(flash.softmax_rows, True)
    checks.check_flash_kernel(flash.triton_flash_attention, True)


# ---------------------------------------------------------------- the checks name the mistake
# 5.1 and 5.2: wrong PyTorch functions. 5.3–5.5: real Triton kernels, each the reference kernel
# with one plausible mistake edited into its source (so a mutant runs exactly as a learner's
# kernel would, in the interpreter here or compiled on a GPU).


def _update_with(mistake):
    def wrong(m, l, acc, scores, v):
        m_new = scores.amax(-1) if mistake == "block max" else torch.maximum(m, scores.amax(-1))
        alpha = torch.exp(m_new - m) if mistake == "inverted" else torch.exp(m - m_new)
        p = torch.exp(scores - (m if mistake == "old max" else m_new)[..., None])
        l_new = (l if mistake == "no l rescale" else l * alpha) + p.sum(-1)
        acc_new = (acc if mistake == "no acc rescale" else acc * alpha[..., None]) + p @ v
        return m_new, l_new, acc_new

    wrong.__name__ = mistake.replace(" ", "_")
    return wrong


@mutants("5.1", [
    (_update_with("no acc rescale"), "forgot to rescale the accumulator"),
    (_update_with("no l rescale"), "forgot to rescale the running sum"),
    (_update_with("block max"), "running max forgot the old blocks"),
    (_update_with("inverted"), "correction factor is inverted"),
    (_update_with("old max"), "exps were taken against the old max"),
])
def test_online_softmax_check_names_the_mistake(wrong, message):
    with names_the_mistake("5.1", message):
        checks.check_online_softmax_update(wrong)


def end_before_diagonal(s, m, q, kv):
    return min(kv, kv - q + s + m - 1)


def end_unclamped(s, m, q, kv):
    return kv - q + s + m


def end_without_offset(s, m, q, kv):
    return min(kv, s + m)


@mutants("5.2", [
    (end_before_diagonal, "off by one on the diagonal block"),
    (end_unclamped, "clamp it"),
    (end_without_offset, "cache offset"),
])
def test_causal_key_end_check_names_the_mistake(wrong, message):
    with names_the_mistake("5.2", message):
        checks.check_causal_key_end(wrong)


def kernel_mutant(wrapper: str, kernel: str, name: str, *edits: tuple[str, str]):
    """``flash.<wrapper>`` running ``flash.<kernel>`` with its source edited (each ``old`` must occur
    exactly once). Both live in a copy of the module's globals, as a learner's notebook has its own:
    the check finds the mutant kernel through the wrapper's globals, and the module is untouched.
    Without triton (the tests that use it are skipped) the mutant is the unedited wrapper."""
    function = getattr(flash, wrapper)
    namespace = dict(vars(flash))
    if flash.HAS_TRITON:
        source = textwrap.dedent(inspect.getsource(getattr(flash, kernel).fn))
        for old, new in edits:
            assert source.count(old) == 1, f"the edit {old!r} does not match the reference kernel once"
            source = source.replace(old, new)
        filename = f"<mutant {kernel} {name}>"
        # @triton.jit reads its function's source through linecache: serve the edited text there.
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        exec(compile(source, filename, "exec"), namespace)
    wrong = types.FunctionType(function.__code__, namespace, name, function.__defaults__, function.__closure__)
    wrong.__kwdefaults__ = function.__kwdefaults__
    return wrong


def interpreter_only(wrong):
    """Mark a mutant whose mistake only the interpreter's watch sees (an unmasked load whose extra
    lanes are never stored): a compiled kernel's reads cannot be watched."""
    wrong.interpreter_only = True
    return wrong


def skip_if_unwatched(wrong) -> None:
    if getattr(wrong, "interpreter_only", False) and not flash.interpreted():
        pytest.skip("only the Triton interpreter lets the check watch a kernel's reads")


SCALE = ("scale_vector", "_scale_kernel")


@needs_triton
@mutants("5.3", [
    (kernel_mutant(*SCALE, "every_program_the_first_block",
                   ("offs = pid * BLOCK + tl.arange(0, BLOCK)", "offs = tl.arange(0, BLOCK) + 0 * pid")),
     "every program handled the first block"),
    (kernel_mutant(*SCALE, "store_unmasked", (", x * factor, mask=inside)", ", x * factor)")),
     "past the end .* were written"),
    (kernel_mutant(*SCALE, "mask_includes_n", ("inside = offs < n", "inside = offs <= n")),
     "off by one: element n = \\d+ was written"),
    (kernel_mutant(*SCALE, "mask_stops_at_n_minus_1", ("inside = offs < n", "inside = offs < n - 1")),
     "last element was not written"),
    (kernel_mutant(*SCALE, "no_factor", ("x * factor", "x")), "multiply by factor"),
    (interpreter_only(kernel_mutant(*SCALE, "load_unmasked", ("tl.load(X + offs, mask=inside)", "tl.load(X + offs)"))),
     "X was read at or past n"),
])
def test_scale_check_names_the_mistake(wrong, message):
    skip_if_unwatched(wrong)
    with names_the_mistake("5.3", message):
        checks.check_scale_vector(wrong, True)


SOFTMAX = ("softmax_rows", "_softmax_rows_kernel")


@needs_triton
@mutants("5.4", [
    (kernel_mutant(*SOFTMAX, "tail_loaded_as_zero", ('other=float("-inf")', "other=0.0")),
     "loaded as 0 and joined the max and the sum"),
    (kernel_mutant(*SOFTMAX, "max_not_subtracted", ("tl.exp(x - tl.max(x, 0))", "tl.exp(x)")),
     "subtract the row's max"),
    (kernel_mutant(*SOFTMAX, "n_cols_as_row_stride", ("row * stride_x", "row * n_cols"),
                   ("row * stride_y", "row * n_cols")),
     "not r · n_cols"),
    (kernel_mutant(*SOFTMAX, "store_unmasked", ("e / tl.sum(e, 0), mask=inside)", "e / tl.sum(e, 0))")),
     "written past the end of a row"),
    (kernel_mutant(*SOFTMAX, "not_divided", ("e / tl.sum(e, 0)", "e")), "do not sum to 1"),
    (kernel_mutant(*SOFTMAX, "load_unmasked", (', mask=inside, other=float("-inf"))', ")")),
     "lanes past n_cols = \\d+ were read"),
    (kernel_mutant(*SOFTMAX, "computed_in_float16", (".to(tl.float32)", "")),
     "never converted to float32|Expected dtype"),
])
def test_softmax_rows_check_names_the_mistake(wrong, message):
    with names_the_mistake("5.4", message):
        checks.check_softmax_rows(wrong, True)


FLASH = ("triton_flash_attention", "_flash_forward")


@needs_triton
@mutants("5.5", [
    (kernel_mutant(*FLASH, "acc_not_rescaled", ("acc = acc * alpha[:, None] + tl.dot", "acc = acc + tl.dot")),
     "forgot to rescale acc"),
    (kernel_mutant(*FLASH, "l_not_rescaled", ("l_i = l_i * alpha + ", "l_i = l_i + ")),
     "forgot to rescale the running sum"),
    (kernel_mutant(*FLASH, "max_of_the_tile_only", ("tl.maximum(m_i, tl.max(scores, 1))", "tl.max(scores, 1)")),
     "wrong max update"),
    (kernel_mutant(*FLASH, "diagonal_masked", ("<= offset + offs_m[:, None]", "< offset + offs_m[:, None]")),
     "off by one"),
    (kernel_mutant(*FLASH, "no_cache_offset", ("<= offset + offs_m[:, None]", "<= offs_m[:, None]")),
     "forgot the offset"),
    (kernel_mutant(*FLASH, "no_tail_mask", ("visible = offs_n[None, :] < kv_len", "visible = offs_n[None, :] >= 0")),
     "forgot the tail mask"),
    (kernel_mutant(*FLASH, "normalised_in_the_loop", ("m_i = m_new\n", "m_i = m_new\n        acc = acc / l_i[:, None]\n"),
                   ("out = acc / l_i[:, None]", "out = acc")),
     "normalised before the loop ends"),
    (kernel_mutant(*FLASH, "head_dim_as_row_stride", ("offs_n[:, None] * stride_ks", "offs_n[:, None] * HEAD_DIM"),
                   ("offs_n[:, None] * stride_vs", "offs_n[:, None] * HEAD_DIM")),
     "wrong stride"),
    (kernel_mutant(*FLASH, "loop_stops_before_the_diagonal", ("(block + 1) * BLOCK_M", "block * BLOCK_M")),
     "stops before the diagonal tile"),
    (kernel_mutant(*FLASH, "unscaled_scores", ("input_precision=PRECISION) * scale", "input_precision=PRECISION)")),
     "not scaled"),
    (kernel_mutant(*FLASH, "lse_without_m", ("m_i + tl.log(l_i)", "tl.log(l_i)")),
     "stored only one of the two terms"),
    (kernel_mutant(*FLASH, "o_store_unmasked", ("out.to(O.dtype.element_ty), mask=offs_m[:, None] < q_len)",
                                                "out.to(O.dtype.element_ty))")),
     "O store must be masked to rows below q_len"),
    (kernel_mutant(*FLASH, "lse_store_unmasked", ("tl.log(l_i), mask=offs_m < q_len)", "tl.log(l_i))")),
     "LSE store must be masked to rows below q_len"),
    (interpreter_only(kernel_mutant(*FLASH, "q_load_unmasked", (
        "tl.load(q_ptrs, mask=offs_m[:, None] < q_len, other=0.0)", "tl.load(q_ptrs)"))),
     "Q load must be masked to rows below q_len"),
    (kernel_mutant(*FLASH, "no_causal_skip", ("end = tl.minimum(kv_len, offset + (block + 1) * BLOCK_M)",
                                              "end = kv_len")),
     "must end at the query block's causal end"),
    (kernel_mutant(*FLASH, "python_causal_key_end", ("end = tl.minimum(kv_len, offset + (block + 1) * BLOCK_M)",
                                                     "end = causal_key_end(block * BLOCK_M, BLOCK_M, q_len, kv_len)")),
     "calls the Python function causal_key_end"),
    (kernel_mutant(*FLASH, "pv_without_precision", ("tl.dot(p.to(v.dtype), v, input_precision=PRECISION)",
                                                    "tl.dot(p.to(v.dtype), v)")),
     "has no input_precision=PRECISION"),
])
def test_flash_kernel_check_names_the_mistake(wrong, message):
    skip_if_unwatched(wrong)
    with names_the_mistake("5.5", message):
        checks.check_flash_kernel(wrong, True)


def test_triton_checks_say_they_cannot_run_without_triton(capsys):
    for check, exercise in ((checks.check_scale_vector, "5.3"), (checks.check_softmax_rows, "5.4"),
                            (checks.check_flash_kernel, "5.5")):
        check(None, False)
        assert f"Exercise {exercise} cannot run here: triton is not installed" in capsys.readouterr().out


def test_reference_implementations_pass():
    checks.check_online_softmax_update(flash.online_softmax_update)
    checks.check_causal_key_end(flash.causal_key_end)
    if flash.HAS_TRITON:
        checks.check_scale_vector(flash.scale_vector, True)
        checks.check_softmax_rows(flash.softmax_rows, True)
        checks.check_flash_kernel(flash.triton_flash_attention, True)
