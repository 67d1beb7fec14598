"""Our engine against HuggingFace transformers reading the shipped GGUF itself (the oracle).

The reference shares nothing with us: transformers reads the config, the weights (dequantised
by its own code) and the tokenizer from the GGUF file, so a mistake in our conversion, our
config.json or our chat template shows up here too.
"""

from __future__ import annotations

import pytest
import torch

from aie_lessons.generate import generate
from aie_lessons.sampling import SamplingParams
from aie_lessons.model import LlamaModel
from aie_lessons.tokenizer import Tokenizer

import transformers  # a dev dependency: a broken install must fail these tests, not skip them

pytestmark = pytest.mark.oracle

PROMPTS = [
    "The history of the lighthouse begins with fires on hills.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Numbers: 3.14159, 2024-11-29; 中文 and emoji 🤗 in one line.",
]
TOKENIZER_TEXTS = PROMPTS + [
    "  leading spaces, trailing tabs\t\t\nand\r\nnewlines  ",
    "你好，世界！这是一个测试。日本語のテキストも。한국어 텍스트.",
    "👍🏽🤗✨🚀 emoji sequences 👨‍👩‍👧 with joiners",
    "1234567890 000 1,000,000 v2.0.1 x^2+y^2=z^2",
    "<|im_start|>user\nHi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def ours(real_model):
    return real_model


@pytest.fixture(scope="module")
def tokenizer(real_model_dir):
    return Tokenizer.from_pretrained(real_model_dir)


@pytest.fixture(scope="module")
def theirs(gguf_reference):
    return gguf_reference


@pytest.fixture(scope="module")
def their_tokenizer(gguf_file):
    return transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


def test_our_config_json_says_what_transformers_reads_from_the_gguf(real_model_dir, theirs):
    from aie_lessons.config import ModelConfig

    ours_config, reference = ModelConfig.from_json(real_model_dir), theirs.config
    rope_theta = (getattr(reference, "rope_parameters", None) or {}).get("rope_theta", getattr(reference, "rope_theta", None))
    assert (ours_config.vocab_size, ours_config.hidden_size, ours_config.intermediate_size) == \
        (reference.vocab_size, reference.hidden_size, reference.intermediate_size)
    assert (ours_config.num_layers, ours_config.num_heads, ours_config.num_kv_heads, ours_config.head_dim) == \
        (reference.num_hidden_layers, reference.num_attention_heads, reference.num_key_value_heads, reference.head_dim)
    assert ours_config.rope_theta == rope_theta
    assert ours_config.rms_norm_eps == pytest.approx(reference.rms_norm_eps, rel=1e-6)
    assert ours_config.max_position_embeddings == reference.max_position_embeddings
    assert ours_config.tie_word_embeddings == reference.tie_word_embeddings


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(ours, theirs, tokenizer, prompt):
    ids = torch.tensor([tokenizer.encode(prompt)])
    with torch.inference_mode():
        mine = ours(ids)
        reference = theirs(ids).logits
    assert mine.shape == reference.shape
    assert (mine - reference).abs().max().item() <= 1e-4


def test_32_greedy_tokens_match_transformers(ours, theirs, tokenizer):
    prompt_ids = tokenizer.encode_chat("Write a short poem about the sea.")
    result = generate(ours, tokenizer, prompt_ids, SamplingParams(max_new_tokens=32))
    with torch.inference_mode():
        out = theirs.generate(
            torch.tensor([prompt_ids]), max_new_tokens=32, do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
    assert len(result.token_ids) == 32, result.finish_reason
    assert result.token_ids == out[0, len(prompt_ids):].tolist()


def test_tokenizer_matches_transformers_gguf_tokenizer(tokenizer, their_tokenizer):
    """transformers builds its own tokenizer from the GGUF file: an independent reading of it."""
    reference = their_tokenizer
    for text in TOKENIZER_TEXTS:
        assert tokenizer.encode(text) == reference.encode(text, add_special_tokens=False), text
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == reference.decode(ids), text


def test_chat_template_matches_the_one_in_the_gguf(tokenizer, their_tokenizer):
    """The template transformers reads from the GGUF, rendered by transformers: not ours."""
    for messages in ([{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🤗"}]):
        expected = their_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tokenizer.apply_chat_template(messages) == expected
        assert tokenizer.encode(tokenizer.apply_chat_template(messages)) == \
            their_tokenizer.encode(expected, add_special_tokens=False)


def test_converted_tensors_equal_transformers_gguf_loader(real_model_dir, theirs):
    """transformers dequantizes and un-permutes the GGUF itself; our conversion must agree."""
    from safetensors.torch import load_file

    reference = theirs.state_dict()
    converted = load_file(str(real_model_dir / "model.safetensors"))
    assert set(converted) == set(reference) - {"lm_head.weight"}  # tied: stored once
    for name, tensor in converted.items():
        assert torch.equal(tensor, reference[name]), name
