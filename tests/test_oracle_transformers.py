"""Our engine against HuggingFace transformers running the same weights (the oracle)."""

from __future__ import annotations

import pytest
import torch

from aie_lessons.generate import generate
from aie_lessons.sampling import SamplingParams
from aie_lessons.model import LlamaModel
from aie_lessons.tokenizer import Tokenizer

pytestmark = pytest.mark.oracle
transformers = pytest.importorskip("transformers", reason="the oracle tests need `pip install -e .[dev]`")

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
def ours(real_model_dir):
    return LlamaModel.from_pretrained(real_model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer(real_model_dir):
    return Tokenizer.from_pretrained(real_model_dir)


@pytest.fixture(scope="module")
def theirs(real_model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32)
    return model.eval()


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


def test_tokenizer_matches_transformers_gguf_tokenizer(tokenizer, gguf_file):
    """transformers builds its own tokenizer from the GGUF file: an independent reading of it."""
    reference = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    for text in TOKENIZER_TEXTS:
        assert tokenizer.encode(text) == reference.encode(text, add_special_tokens=False), text
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == reference.decode(ids), text


def test_chat_template_matches_transformers(tokenizer, real_model_dir):
    reference = transformers.AutoTokenizer.from_pretrained(real_model_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(messages) == expected


def test_converted_tensors_equal_transformers_gguf_loader(real_model_dir, gguf_file):
    """transformers dequantizes and un-permutes the GGUF itself; our conversion must agree."""
    from safetensors.torch import load_file

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    ).state_dict()
    converted = load_file(str(real_model_dir / "model.safetensors"))
    assert set(converted) == set(reference) - {"lm_head.weight"}  # tied: stored once
    for name, tensor in converted.items():
        assert torch.equal(tensor, reference[name]), name


def test_tiny_random_model_matches_transformers(tiny_dir, tiny_untied_dir):
    """The architecture, tied and untied, on a random model (no real weights needed)."""
    for directory in (tiny_dir, tiny_untied_dir):
        ours_tiny = LlamaModel.from_pretrained(directory)
        theirs_tiny = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
        ids = torch.randint(0, ours_tiny.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            assert (ours_tiny(ids) - theirs_tiny(ids).logits).abs().max().item() <= 1e-5
