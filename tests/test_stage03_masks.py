"""Stage 03: masks, left padding, batched generation equal to one-by-one and to transformers."""

from __future__ import annotations

import pytest
import torch

from aie_lessons.checks import stage03 as checks
from aie_lessons.generate import generate
from aie_lessons.sampling import SamplingParams
from aie_lessons.masks import attention_mask, causal_mask, to_additive
from aie_lessons.model import AttentionMetadata, LlamaModel
from aie_lessons.padded_batch import PaddedBatch, generate_batch, left_pad
from aie_lessons.tokenizer import Tokenizer

from check_expect import mutants, names_the_mistake

QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colours.",
    "Write a haiku about autumn leaves falling on a quiet river.",
    "Give me one tip for learning to cook.",
)


def test_padded_rows_never_produce_nan(tiny_dir):
    model = LlamaModel.from_pretrained(tiny_dir)
    batch = left_pad([[5, 6, 7, 8, 9], [10]], pad_id=0)
    mask = attention_mask(batch.is_real, 5)
    with torch.inference_mode():
        logits = model(batch.input_ids, batch.positions, AttentionMetadata(mask=mask))
    assert torch.isfinite(logits).all()


def test_padding_does_not_change_a_sequences_logits(tiny_dir):
    model = LlamaModel.from_pretrained(tiny_dir)
    short = [11, 12, 13]
    batch = left_pad([short, list(range(20, 30))], pad_id=0)
    with torch.inference_mode():
        padded = model(batch.input_ids, batch.positions, AttentionMetadata(mask=attention_mask(batch.is_real, 10)))[0, -3:]
        alone = model(torch.tensor([short]))[0]
    assert torch.allclose(padded, alone, atol=1e-5)


def test_additive_and_boolean_masks_agree():
    mask = causal_mask(3, 5)
    scores = torch.randn(3, 5)
    assert torch.equal(
        torch.softmax(scores + to_additive(mask), -1),
        torch.softmax(scores.masked_fill(~mask, torch.finfo(torch.float32).min), -1),
    )


def test_batch_generation_equals_one_by_one_on_tiny_model(tiny_dir):
    model, tokenizer = LlamaModel.from_pretrained(tiny_dir), Tokenizer.from_pretrained(tiny_dir)
    prompts = [tokenizer.encode(t) for t in ("The quick", "中文", "emoji 🤗 and more text here", "a")]
    params = SamplingParams(max_new_tokens=8)
    together = generate_batch(model, tokenizer, prompts, params)
    for prompt, result in zip(prompts, together):
        assert result.token_ids == generate(model, tokenizer, prompt, params).token_ids


@pytest.mark.oracle
def test_batch_of_four_matches_alone_and_transformers(real_model_dir):
    import transformers
    model, tokenizer = LlamaModel.from_pretrained(real_model_dir), Tokenizer.from_pretrained(real_model_dir)
    prompts = [tokenizer.encode_chat(q) for q in QUESTIONS]
    assert len({len(p) for p in prompts}) == len(prompts)
    params = SamplingParams(max_new_tokens=16)
    together = generate_batch(model, tokenizer, prompts, params)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(real_model_dir).eval()
    for prompt, result in zip(prompts, together):
        assert result.token_ids == generate(model, tokenizer, prompt, params).token_ids
        with torch.inference_mode():
            out = theirs.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                  pad_token_id=tokenizer.eos_token_id)
        reference = out[0, len(prompt):].tolist()
        eos = tokenizer.eos_token_id
        assert result.token_ids == (reference[: reference.index(eos)] if eos in reference else reference)


def causal_top_left(q_len, kv_len, device=None):
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(0)


def causal_without_diagonal(q_len, kv_len, device=None):
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len - 1)


def causal_inverted(q_len, kv_len, device=None):
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).triu(kv_len - q_len + 1)


def causal_as_floats(q_len, kv_len, device=None):
    return torch.ones(q_len, kv_len, device=device).tril(kv_len - q_len)


def causal_on_the_cpu(q_len, kv_len, device=None):
    return torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)


@mutants("3.1", [
    (causal_top_left, "top-left"),
    (causal_without_diagonal, "diagonal is masked"),
    (causal_inverted, "inverted"),
    (causal_as_floats, "boolean"),
    (causal_on_the_cpu, "on the device asked for"),
])
def test_causal_mask_check_names_the_mistake(wrong, message):
    with names_the_mistake("3.1", message):
        checks.check_causal_mask(wrong)


def right_pad(sequences, pad_id, device="cpu"):
    width = max(map(len, sequences))
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in sequences])
    real = torch.tensor([[True] * len(s) + [False] * (width - len(s)) for s in sequences])
    return PaddedBatch(ids, real, torch.arange(width).expand(len(sequences), width))


def pad_positions_from_zero(sequences, pad_id, device="cpu"):
    batch = left_pad(sequences, pad_id)
    return PaddedBatch(batch.input_ids, batch.is_real, torch.arange(batch.input_ids.shape[1]).expand_as(batch.input_ids))


def negative_pad_positions(sequences, pad_id, device="cpu"):
    batch = left_pad(sequences, pad_id)
    return PaddedBatch(batch.input_ids, batch.is_real, batch.is_real.long().cumsum(-1) - 1)


def positions_from_one(sequences, pad_id, device="cpu"):
    batch = left_pad(sequences, pad_id)
    return PaddedBatch(batch.input_ids, batch.is_real, batch.is_real.long().cumsum(-1))


def real_as_ints(sequences, pad_id, device="cpu"):
    batch = left_pad(sequences, pad_id)
    return PaddedBatch(batch.input_ids, batch.is_real.long(), batch.positions)


def positions_as_floats(sequences, pad_id, device="cpu"):
    batch = left_pad(sequences, pad_id)
    return PaddedBatch(batch.input_ids, batch.is_real, (batch.is_real.float().cumsum(-1) - 1).clamp(min=0))


def padded_on_the_cpu(sequences, pad_id, device="cpu"):
    return left_pad(sequences, pad_id)


@mutants("3.2", [
    (right_pad, "padded on the right"),
    (pad_positions_from_zero, "positions count the padding"),
    (negative_pad_positions, "negative positions"),
    (positions_from_one, "numbered 0, 1, 2, ... in each row"),
    (real_as_ints, "is_real should be a bool tensor"),
    (positions_as_floats, "positions have dtype torch.float32"),
    (padded_on_the_cpu, "device='meta'\\) returned tensors on"),
])
def test_left_pad_check_names_the_mistake(wrong, message):
    with names_the_mistake("3.2", message):
        checks.check_left_pad(wrong)


def mask_without_self(is_real, q_len):
    return (causal_mask(q_len, is_real.shape[1])[None] & is_real[:, None, :])[:, None]


def mask_without_padding(is_real, q_len):
    return causal_mask(q_len, is_real.shape[1])[None, None].expand(is_real.shape[0], 1, -1, -1)


def mask_not_causal(is_real, q_len):
    kv_len = is_real.shape[1]
    itself = torch.arange(kv_len)[None, :] == torch.arange(kv_len - q_len, kv_len)[:, None]
    return (is_real[:, None, :] | itself)[:, None]


def mask_self_at_top_left(is_real, q_len):
    kv_len = is_real.shape[1]
    itself = torch.arange(kv_len)[None, :] == torch.arange(q_len)[:, None]
    return ((causal_mask(q_len, kv_len)[None] & is_real[:, None, :]) | itself)[:, None]


def mask_without_head_axis(is_real, q_len):
    return attention_mask(is_real, q_len)[:, 0]


def mask_diagonal_on_the_cpu(is_real, q_len):
    """Right values, but the diagonal is built on the CPU: a crash once is_real is on a GPU."""
    kv_len = is_real.shape[1]
    itself = torch.arange(kv_len)[None, :] == torch.arange(kv_len - q_len, kv_len)[:, None]
    return ((causal_mask(q_len, kv_len, is_real.device)[None] & is_real[:, None, :]) | itself)[:, None]


def mask_hiding_the_first_key(is_real, q_len):
    """A mistake no rule names: the generic message must still say where, briefly."""
    mask = attention_mask(is_real, q_len).clone()
    mask[..., 0] = False
    return mask


@mutants("3.3", [
    (mask_without_self, "sees no key at all"),
    (mask_without_padding, "padding keys are visible"),
    (mask_not_causal, "future keys are visible"),
    (mask_self_at_top_left, "own key is in the wrong column"),
    (mask_without_head_axis, "expected the mask \\(prefill\\) of shape \\(4, 1, 7, 7\\)"),
    (mask_diagonal_on_the_cpu, "not on the expected device.*create every tensor on is_real's device"),
    (mask_hiding_the_first_key, "entries differ, the first at row b=0, query i=0, key j=0"),
])
def test_attention_mask_check_names_the_mistake(wrong, message):
    with names_the_mistake("3.3", message):
        checks.check_attention_mask(wrong)


def test_manual_kernel_generates_the_batch_like_sdpa(tiny_dir):
    """Stage 02's attention, with stage 03's padding masks, gives the batch the same tokens."""
    from aie_lessons.attention import manual_attention

    model, tokenizer = LlamaModel.from_pretrained(tiny_dir), Tokenizer.from_pretrained(tiny_dir)
    prompts = [tokenizer.encode(t) for t in ("The quick", "emoji 🤗 and more text here", "a")]
    params = SamplingParams(max_new_tokens=6)
    reference = generate_batch(model, tokenizer, prompts, params)
    model.use_attention(manual_attention)
    assert [r.token_ids for r in generate_batch(model, tokenizer, prompts, params)] == [r.token_ids for r in reference]


def test_reference_implementations_pass():
    checks.check_causal_mask(causal_mask)
    checks.check_left_pad(left_pad)
    checks.check_attention_mask(attention_mask)
