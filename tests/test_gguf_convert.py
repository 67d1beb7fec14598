"""The GGUF conversion: the q/k row permutation, names, and perplexity on real prose."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from aie_lessons.infra.gguf_convert import GGUFConversionError, hf_name, unpermute_rope_rows
from aie_lessons.model import LlamaModel
from aie_lessons.infra.paths import DATA_DIR
from aie_lessons.tokenizer import Tokenizer

PROSE = DATA_DIR / "prose" / "lighthouses.txt"


def llama_cpp_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert script: within each head, interleave the two halves' rows."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@pytest.mark.parametrize("n_heads", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permute(n_heads):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((n_heads * 64, 576)).astype(np.float32)
    permuted = llama_cpp_permute(weight, n_heads)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, n_heads), weight)


def test_unpermute_pairs_row_i_with_row_i_plus_half():
    """Row order per head in GGUF is (0, D/2, 1, D/2+1, ...); unpermuted it is (0, 1, ..., D-1)."""
    head_dim = 8
    gguf_rows = np.array([[0], [4], [1], [5], [2], [6], [3], [7]], dtype=np.float32)
    assert unpermute_rope_rows(gguf_rows, 1)[:, 0].tolist() == list(range(head_dim))


def test_unpermute_rejects_shapes_that_do_not_split_into_heads():
    with pytest.raises(GGUFConversionError, match="9 heads"):
        unpermute_rope_rows(np.zeros((10, 4), dtype=np.float32), 9)


def test_tensor_names_map_to_huggingface():
    assert hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    with pytest.raises(GGUFConversionError, match="unknown GGUF tensor"):
        hf_name("blk.0.attn_qkv.weight")


def perplexity(model: LlamaModel, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        log_probs = torch.log_softmax(model(ids)[0, :-1].float(), dim=-1)
    nll = -log_probs.gather(-1, ids[0, 1:, None]).mean()
    return math.exp(nll.item())


@pytest.mark.oracle
def test_perplexity_on_prose_equals_transformers_and_needs_the_unpermute(real_model_dir, gguf_reference):
    """Ours against transformers reading the GGUF itself, to 0.1%, on the file's first 1,024
    tokens: the old band of 10–40 let a wrong rope_theta through (on the whole file, perplexity
    34.7 instead of 27.6); a missing un-permute is 10x off."""
    tokenizer = Tokenizer.from_pretrained(real_model_dir)
    text_ids = tokenizer.encode(PROSE.read_text())
    assert 1800 <= len(text_ids) <= 2200, f"{PROSE.name} changed: {len(text_ids)} tokens"
    ids = torch.tensor([text_ids[:1024]])
    model = LlamaModel.from_pretrained(real_model_dir)
    fixed = perplexity(model, ids)
    with torch.inference_mode():
        log_probs = torch.log_softmax(gguf_reference(ids).logits[0, :-1].float(), dim=-1)
    reference = math.exp(-log_probs.gather(-1, ids[0, 1:, None]).mean().item())
    assert fixed == pytest.approx(reference, rel=1e-3), (fixed, reference)
    # Put llama.cpp's permutation back: the model runs, but reads positions wrongly.
    config = model.config
    with torch.no_grad():
        for layer in model.layers:
            attn = layer.self_attn
            q = llama_cpp_permute(attn.q_proj.weight.numpy(), config.num_heads)
            k = llama_cpp_permute(attn.k_proj.weight.numpy(), config.num_kv_heads)
            attn.q_proj.weight = torch.nn.Parameter(torch.from_numpy(q.copy()))
            attn.k_proj.weight = torch.nn.Parameter(torch.from_numpy(k.copy()))
    assert perplexity(model, ids) > 10 * fixed


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """ggml's Q8_0, written from its block layout: per 32 weights an fp16 scale d and 32 int8 q;
    weight = d · q. ``blocks`` is (rows, n_blocks · 34) raw bytes."""
    rows = blocks.reshape(blocks.shape[0], -1, 34)
    d = rows[..., :2].copy().view(np.float16).astype(np.float32)  # (rows, n_blocks, 1)
    q = rows[..., 2:].copy().view(np.int8).astype(np.float32)  # (rows, n_blocks, 32)
    return (d * q).reshape(blocks.shape[0], -1)


def dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    """ggml's Q4_1: per 32 weights an fp16 scale d, an fp16 minimum m and 16 bytes of 4-bit
    codes, the low nibbles for weights 0–15 and the high ones for 16–31; weight = d · code + m."""
    rows = blocks.reshape(blocks.shape[0], -1, 20)
    d = rows[..., 0:2].copy().view(np.float16).astype(np.float32)
    m = rows[..., 2:4].copy().view(np.float16).astype(np.float32)
    codes = rows[..., 4:]
    nibbles = np.concatenate([codes & 0x0F, codes >> 4], axis=-1).astype(np.float32)  # (rows, n_blocks, 32)
    return (d * nibbles + m).reshape(blocks.shape[0], -1)


@pytest.mark.parametrize("gguf_name, ours, dequantize", [
    ("token_embd.weight", "model.embed_tokens.weight", dequantize_q8_0),
    ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", dequantize_q4_1),
    ("blk.29.ffn_gate.weight", "model.layers.29.mlp.gate_proj.weight", dequantize_q4_1),
])
def test_dequantisation_agrees_with_the_block_format_written_out(real_model_dir, gguf_file, gguf_name, ours,
                                                                 dequantize):
    """Our converter and transformers both call the gguf library to dequantise; this reads the raw
    blocks with the format spelled out by hand, so a shared mistake would show."""
    from gguf import GGUFReader
    from safetensors import safe_open

    tensor = next(t for t in GGUFReader(gguf_file).tensors if t.name == gguf_name)
    expected = dequantize(np.asarray(tensor.data))
    with safe_open(real_model_dir / "model.safetensors", "pt") as weights:
        converted = weights.get_tensor(ours).numpy()
    assert converted.shape == expected.shape
    np.testing.assert_allclose(converted, expected, rtol=1e-6, atol=1e-7)
