"""Reading config.json: the numbers transformers reads, and refusal of what our model lacks."""

from __future__ import annotations

import pytest
import transformers

from aie_lessons.config import ModelConfig, UnsupportedConfigError

SMALL = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def test_a_config_written_by_transformers_reads_the_same_numbers():
    """transformers 5 nests rope_theta in rope_parameters; the value must not fall back to 10000."""
    theirs = transformers.LlamaConfig(**SMALL, rope_theta=123456.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                      eos_token_id=[2, 7])
    ours = ModelConfig.from_dict(theirs.to_dict())
    assert ours.rope_theta == 123456.0 == theirs.rope_parameters["rope_theta"]
    assert (ours.num_heads, ours.num_kv_heads, ours.head_dim) == (4, 2, theirs.head_dim)
    assert (ours.num_layers, ours.rms_norm_eps, ours.tie_word_embeddings) == (2, 1e-5, True)
    assert ours.eos_token_ids == (2, 7)


def test_a_flat_rope_theta_still_reads():
    assert ModelConfig.from_dict({**{"num_hidden_layers": 2, **SMALL}, "rope_theta": 5e5}).rope_theta == 5e5


@pytest.mark.parametrize("theirs, field", [
    (transformers.LlamaConfig(**SMALL, attention_bias=True), "attention_bias"),
    (transformers.LlamaConfig(**SMALL, mlp_bias=True), "mlp_bias"),
    (transformers.LlamaConfig(**SMALL, rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_type='linear'"),
    (transformers.LlamaConfig(**SMALL, hidden_act="gelu"), "hidden_act='gelu'"),
    (transformers.MistralConfig(**SMALL, sliding_window=64), "sliding_window=64"),
    (transformers.SmolLM3Config(**{**SMALL, "num_hidden_layers": 8}), r"no_rope_layers=\[1, 1, 1, 0"),
    (transformers.Qwen2Config(**SMALL, use_sliding_window=False), "model_type='qwen2'"),
    (transformers.GraniteConfig(**SMALL), "model_type='granite'"),
    (transformers.LlamaConfig(**SMALL, partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
], ids=["attention-bias", "mlp-bias", "scaled-rope", "gelu", "sliding-window", "no-rope-layers", "qwen2",
        "granite", "partial-rope"])
def test_features_our_model_lacks_are_refused_naming_the_field(theirs, field):
    with pytest.raises(UnsupportedConfigError, match=rf"{field}.*Fix:"):
        ModelConfig.from_dict(theirs.to_dict())


@pytest.mark.parametrize("theirs", [
    transformers.LlamaConfig(**SMALL),
    transformers.MistralConfig(**SMALL, sliding_window=None),
    transformers.SmolLM3Config(**SMALL, no_rope_layers=[1, 1]),
], ids=["llama", "mistral-no-window", "smollm3-rope-everywhere"])
def test_switched_off_features_are_accepted(theirs):
    ModelConfig.from_dict(theirs.to_dict())


def test_rope_parameters_without_a_theta_are_refused():
    cfg = {**SMALL, "num_hidden_layers": 2,
           "rope_parameters": {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}}
    with pytest.raises(UnsupportedConfigError, match="no rope_theta"):
        ModelConfig.from_dict(cfg)


def test_a_llama_config_with_granite_style_multipliers_is_refused():
    cfg = {**transformers.LlamaConfig(**SMALL).to_dict(), "embedding_multiplier": 12.0}
    with pytest.raises(UnsupportedConfigError, match=r"embedding_multiplier=12.0 \(scaled embeddings\)"):
        ModelConfig.from_dict(cfg)
