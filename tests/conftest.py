"""Shared fixtures: a tiny random checkpoint built in-process, and the real course model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from aie_lessons.infra.paths import CACHE_DIR, DEFAULT_MODEL_NAME, MODELS_DIR

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Numbers like 2024 and 3.14159 appear in text; so do tabs\tand  double  spaces.",
    "中文测试：你好，世界。机器学习很有趣。",
    "emoji 🤗 👍🏽 ✨ café naïve résumé",
    "def forward(self, x):\n    return self.proj(x) + x\n",
]


def build_tiny_tokenizer():
    """A byte-level BPE tokenizer trained in a second on a few lines, with ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TINY_CORPUS, trainer)
    return tok


def tiny_config(vocab_size: int, tie: bool = True) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": vocab_size,
        "tie_word_embeddings": tie,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def random_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """HuggingFace-named random weights for ``cfg`` (fixed seed, so every run is the same)."""
    g = torch.Generator().manual_seed(seed)
    h, f, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    hq, hkv, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]

    def rand(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale

    w = {"model.embed_tokens.weight": rand(v, h, scale=0.5), "model.norm.weight": 1 + rand(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": 1 + rand(h),
            p + "post_attention_layernorm.weight": 1 + rand(h),
            p + "self_attn.q_proj.weight": rand(hq * d, h),
            p + "self_attn.k_proj.weight": rand(hkv * d, h),
            p + "self_attn.v_proj.weight": rand(hkv * d, h),
            p + "self_attn.o_proj.weight": rand(h, hq * d),
            p + "mlp.gate_proj.weight": rand(f, h),
            p + "mlp.up_proj.weight": rand(f, h),
            p + "mlp.down_proj.weight": rand(h, f),
        }
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = rand(v, h, scale=0.5)
    return w


def write_checkpoint(directory: Path, tie: bool = True) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer()
    tok.save(str(directory / "tokenizer.json"))
    cfg = tiny_config(tok.get_vocab_size(), tie=tie)
    cfg["bos_token_id"] = tok.token_to_id("<|im_start|>")
    cfg["eos_token_id"] = tok.token_to_id("<|im_end|>")
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "bos_token": "<|im_start|>",
        "chat_template": CHATML_TEMPLATE,
    }))
    save_file(random_weights(cfg), str(directory / "model.safetensors"))
    return directory


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_untied_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama-untied", tie=False)


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The converted SmolLM2 checkpoint; `make test` fetches it before running pytest."""
    model_dir = MODELS_DIR / DEFAULT_MODEL_NAME
    if not (model_dir / "model.safetensors").exists():
        pytest.fail(f"the course model is not at {model_dir}. Fix: run `aie fetch-model` "
                    "(make test does this for you).")
    return model_dir


@pytest.fixture(scope="session")
def gguf_file() -> Path:
    path = CACHE_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        pytest.fail(f"{path} is missing. Fix: run `aie fetch-model`.")
    return path
