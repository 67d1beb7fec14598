"""The tiny random models must be able to tell working code from broken code.

Every fast token test relies on them, so these tests guard what makes them useful: greedy
decoding produces varied tokens, and our logits equal transformers' on the same checkpoint —
which fails at once if attention, RoPE or the cache is broken. No real model needed.
"""

from __future__ import annotations

import pytest
import torch
import transformers  # a dev dependency: a broken install must fail here, not skip

from aie_lessons.generate import generate
from aie_lessons.model import LlamaModel
from aie_lessons.sampling import SamplingParams
from aie_lessons.tokenizer import Tokenizer

# Every prompt the fast token tests use.
PROMPTS = ("The quick brown fox", "hello world", "the quick brown fox jumps over", "中文", "emoji 🤗 here",
           "The quick", "The")


@pytest.fixture(scope="module", params=["tied", "untied"])
def tiny_model(request, tiny_dir, tiny_untied_dir):
    directory = tiny_dir if request.param == "tied" else tiny_untied_dir
    return directory, LlamaModel.from_pretrained(directory), Tokenizer.from_pretrained(directory)


def test_greedy_decoding_on_the_tiny_models_produces_varied_tokens(tiny_model):
    _, model, tokenizer = tiny_model
    distinct = [len(set(generate(model, tokenizer, tokenizer.encode(p),
                                 SamplingParams(max_new_tokens=12, ignore_eos=True)).token_ids))
                for p in PROMPTS]
    assert min(distinct) >= 2 and sum(distinct) / len(distinct) >= 4, distinct


def test_tiny_model_logits_equal_transformers(tiny_model):
    """The architecture against transformers' own Llama, no real weights needed."""
    directory, model, _ = tiny_model
    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert (model(ids) - theirs(ids).logits).abs().max().item() <= 1e-5


def greedy_answers(model, tokenizer) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    return [generate(model, tokenizer, tokenizer.encode(p), params).token_ids for p in PROMPTS]


@pytest.mark.parametrize("breakage", ["attention zeroed", "no causal mask", "RoPE off"])
def test_the_tiny_models_answer_differently_when_attention_breaks(tiny_model, monkeypatch, breakage):
    """Varied tokens are not enough: the answers must depend on attention, order and position."""
    import torch.nn.functional as F

    import aie_lessons.model as model_module

    _, model, tokenizer = tiny_model
    working = greedy_answers(model, tokenizer)
    broken = {"attention zeroed": lambda q, k, v, mask=None: torch.zeros_like(q),
              "no causal mask": lambda q, k, v, mask=None: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)}
    if breakage in broken:
        for layer in model.layers:
            monkeypatch.setattr(layer.self_attn, "kernel", broken[breakage])
    else:
        real = model_module.rope_cos_sin
        monkeypatch.setattr(model_module, "rope_cos_sin",
                            lambda positions, head_dim, theta: real(torch.zeros_like(positions), head_dim, theta))
    assert greedy_answers(model, tokenizer) != working
