"""Shared fixtures: a tiny random checkpoint built in-process, and the real course model."""

from __future__ import annotations

import getpass
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from aie_lessons.infra.compile_cache import INDUCTOR_CACHE_ENV, cache_folder
from aie_lessons.infra.paths import CACHE_DIR, DEFAULT_MODEL_NAME, MODELS_DIR

# Without a GPU, Triton can only interpret. Choose that before any test file, torch.compile or
# transformers gets to import Triton, so that no test's outcome depends on the import order.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `aie generate` points inductor's cache at data/cache/inductor (stage 09's compiled decoder, its
# ahead-of-time packages in aot/), which a fresh clone has empty. The CLI's subprocesses here share
# the machine's default cache instead, as every in-process compile does, so that CI does not compile
# each graph again; a test of the cache folder itself sets its own. A run that lowers the vector
# instructions (ATEN_CPU_CAPABILITY=avx2, to stand in for an AVX2-only CPU) gets a subfolder, so that
# it never hands its code to a later run without that variable (compile_cache.cache_folder).
os.environ.setdefault(INDUCTOR_CACHE_ENV, str(cache_folder(
    Path(tempfile.gettempdir()) / ("torchinductor_" + getpass.getuser()))))  # inductor's default

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

    # The final norm's weight is centred on 0, not 1. With a tied head the logits are
    # norm(x) · E, and x is mostly the last token's own embedding e: a weight near 1 makes
    # e · e the largest logit, so greedy decoding repeats the last token forever and no token
    # test can tell working code from broken. Signs that vary per coordinate break that echo.
    w = {"model.embed_tokens.weight": rand(v, h, scale=0.5), "model.norm.weight": rand(h, scale=1.0)}
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


# Fixtures that need the course model downloaded: a test using one is an oracle test, whatever
# its own marks say, so `make test-fast` (-m "not oracle") never needs the model.
REAL_MODEL_FIXTURES = {"real_model_dir", "gguf_file", "real_model", "gguf_reference"}


def pytest_collection_modifyitems(items):
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.oracle)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed browser test shows what the page showed: one more screenshot, and all their paths."""
    outcome = yield
    report = outcome.get_result()
    screens = getattr(item, "screens", None)
    if screens is None or report.when != "call" or not report.failed:
        return
    try:
        screens.shot("at_failure")
    except Exception as exc:  # a page that crashed cannot be shot; say so beside the others
        report.sections.append(("screenshot at failure", f"not taken: {exc}"))
    report.sections.append(("screenshots, then the server's log",
                            "\n".join(str(p) for p in [*screens.paths, screens.log])))


@pytest.fixture(scope="session")
def real_model(real_model_dir):
    """Our fp32 model of the course checkpoint, loaded once for the tests that only read it."""
    from aie_lessons.model import LlamaModel

    return LlamaModel.from_pretrained(real_model_dir)


@pytest.fixture(scope="session")
def gguf_reference(gguf_file):
    """transformers' own reading of the shipped GGUF — its config, its dequantisation, its model.

    Nothing of ours goes into it (not our config.json, not our converted weights), so comparing
    with it checks our conversion and our config as well as our model.
    """
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def gguf_file() -> Path:
    path = CACHE_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        pytest.fail(f"{path} is missing. Fix: run `aie fetch-model`.")
    return path
