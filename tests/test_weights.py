"""Weight loading: shared tied storage, peak memory, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from aie_lessons.config import ModelConfig
from aie_lessons.model import LlamaModel
from aie_lessons.weights import WeightsError, load_weights

PEAK_SCRIPT = """
import json, sys, torch
from aie_lessons.config import ModelConfig
from aie_lessons.instrument import peak_memory_bytes
from aie_lessons.model import LlamaModel

# Warm up torch's lazy initialisation (it costs ~150 MB once) before taking the baseline, which
# is the high-water mark so far: anything above it was allocated by loading.
with torch.device('meta'):
    LlamaModel(ModelConfig.from_json(sys.argv[1]))
base = peak_memory_bytes()
model = LlamaModel.from_pretrained(sys.argv[1], dtype=getattr(torch, sys.argv[2]))
peak = peak_memory_bytes()
size = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"extra": peak - base, "model": size}))
"""


def test_tied_embedding_is_shared_not_copied(tiny_dir):
    model = LlamaModel.from_pretrained(tiny_dir)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert (model.lm_head.weight.untyped_storage().data_ptr()
            == model.embed_tokens.weight.untyped_storage().data_ptr())


def test_untied_checkpoint_keeps_its_own_head(tiny_untied_dir):
    model = LlamaModel.from_pretrained(tiny_untied_dir)
    assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)


def test_dtype_and_prefix(tiny_dir):
    weights = load_weights(tiny_dir, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert "embed_tokens.weight" in weights and not any(k.startswith("model.") for k in weights)


@pytest.mark.oracle
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from /proc/self/status")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_peak_memory_stays_near_model_size(real_model_dir, dtype):
    """Loading tensor by tensor: peak extra memory ≤ 1.25 × the final model (plus 64 MB slack)."""
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(real_model_dir), dtype],
                         capture_output=True, text=True, check=True)
    numbers = json.loads(out.stdout)
    assert numbers["extra"] <= 1.25 * numbers["model"] + 64e6, numbers


def test_missing_weights_name_the_path_and_the_fix(tmp_path):
    with pytest.raises(WeightsError, match=r"no \.safetensors weights at .*aie fetch-model"):
        load_weights(tmp_path)


def test_corrupt_weights_name_the_file_and_the_fix(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(WeightsError, match=r"model\.safetensors is not a readable.*--force"):
        load_weights(tmp_path)


def test_missing_config_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="aie fetch-model"):
        ModelConfig.from_json(tmp_path)


def test_config_from_real_checkpoint(real_model_dir):
    config = ModelConfig.from_json(real_model_dir)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (30, 9, 3, 64)
    assert config.queries_per_kv_head == 3 and config.tie_word_embeddings


def test_an_attention_name_is_refused_with_the_fix(tiny_dir):
    """Attention used to be chosen by name: a string now names the functions to pass instead."""
    with pytest.raises(TypeError, match="attention must be a kernel function.*got 'flashy'.*sdpa_attention"):
        LlamaModel.from_pretrained(tiny_dir, attention="flashy")
