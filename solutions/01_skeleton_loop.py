# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stage 01 — The skeleton loop
#
# An inference engine does four things, over and over:
#
# ```
#  weights on disk ──► (1) weight loader ──► nn.Module
#  "What is ..."   ──► (2) input preprocessing (tokenizer, chat template) ──► token ids
#  token ids       ──► (3) forward pass ──► logits for the next token
#  logits          ──► (4) output postprocessing (greedy pick or sampling, streaming text) ──► text
# ```
#
# In this stage you build the simplest engine that does all four for a real model,
# SmolLM2-135M-Instruct, and you time every part from the start. It is deliberately naive:
# every new token recomputes the whole sequence. At the end you will *measure* what that costs,
# and stage 04 (the KV cache) removes it.
#
# Cells that start with `# export: NAME` become the module `aie_lessons/NAME.py`: later stages
# import your code from there. Each exercise is followed by a check cell; run it and it tells you
# exactly what is wrong.

# %%
import time

import matplotlib.pyplot as plt
import torch

from aie_lessons import checks
from aie_lessons.infra.paths import default_model_dir

torch.manual_seed(0)
MODEL_DIR = default_model_dir()
print("model directory:", MODEL_DIR.relative_to(MODEL_DIR.parents[2]))

# %% [markdown]
# ## 1. The weight loader
#
# A checkpoint is two files: `config.json` (the architecture's numbers) and `model.safetensors`
# (named tensors). We read the config into a frozen dataclass, so a typo in a field name fails
# loudly instead of silently creating a new attribute.

# %%
# export: config
"""The model's architecture numbers, read from a HuggingFace ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class ConfigError(ValueError):
    """A config.json that cannot be read as a Llama-family model's config."""


class UnsupportedConfigError(ConfigError):
    """A checkpoint asks for an architecture feature this model does not implement."""


# Fields of a HuggingFace config whose non-default values change the computation in ways our
# model does not implement. Loading such a checkpoint would run and print plausible-looking
# nonsense, so it is refused instead, naming the field.
UNSUPPORTED_FIELDS = {
    "attention_bias": "biases on the q/k/v/o projections",
    "mlp_bias": "biases on the MLP projections",
    "sliding_window": "sliding-window attention",
    "no_rope_layers": "layers without RoPE",
    "no_rope_layer_interval": "layers without RoPE",
    "partial_rotary_factor": "RoPE on part of each head",
    "attn_logit_softcapping": "soft-capped attention scores",
    "final_logit_softcapping": "soft-capped logits",
    "logits_scaling": "scaled logits",
    "embedding_multiplier": "scaled embeddings",
    "residual_multiplier": "scaled residual branches",
    "attention_multiplier": "a non-standard attention scale",
}
# Values of those fields that mean "off", i.e. the plain Llama computation.
NEUTRAL_VALUES = (None, False, 0, [], {}, 1, 1.0)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "smollm3")
SUPPORTED_ACTIVATIONS = ("silu",)


def rope_theta_of(cfg: dict) -> float:
    """RoPE's base frequency: newer configs nest it in ``rope_parameters``, older ones do not."""
    nested = cfg.get("rope_parameters") or {}
    if nested and "rope_theta" not in nested and "rope_theta" not in cfg:
        raise UnsupportedConfigError(
            f"config.json has rope_parameters {sorted(nested)} but no rope_theta (per-layer RoPE "
            "settings?): this model needs one base frequency. Fix: use a plain Llama-family checkpoint."
        )
    return float(nested.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def refuse_unsupported(cfg: dict) -> None:
    """Raise ``UnsupportedConfigError`` naming the first field our model would silently ignore."""
    model_type = cfg.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedConfigError(
            f"config.json has model_type={model_type!r}; this model implements {SUPPORTED_MODEL_TYPES} "
            "(others differ in ways a config does not always say, e.g. Qwen2's q/k/v biases). "
            "Fix: use a Llama-family checkpoint."
        )
    rope = cfg.get("rope_parameters") or {}
    for name, feature in UNSUPPORTED_FIELDS.items():
        value = cfg.get(name, rope.get(name))  # newer configs keep RoPE's settings together
        if name == "sliding_window" and not cfg.get("use_sliding_window", True):
            continue  # Qwen-style configs carry a window size but switch it off
        if name == "no_rope_layers" and value and all(value):
            continue  # SmolLM3 lists 1 for every layer that does use RoPE: all of them is fine
        if name == "no_rope_layer_interval" and "no_rope_layers" in cfg:
            continue  # only the default for the list above, which was given and checked
        if value is True or value not in NEUTRAL_VALUES:
            raise UnsupportedConfigError(
                f"config.json sets {name}={value!r} ({feature}), which this Llama model does not "
                "implement: it would load and produce wrong text. Fix: use a plain Llama-family "
                "checkpoint (e.g. `aie fetch-model` for SmolLM2-135M)."
            )
    for field in ("rope_parameters", "rope_scaling"):  # the newer name, then the older
        rope = cfg.get(field) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            break
    if rope_type != "default":
        raise UnsupportedConfigError(
            f"config.json sets {field}.rope_type={rope_type!r} (scaled RoPE); only plain RoPE "
            "('default') is implemented. Fix: use a checkpoint without RoPE scaling."
        )
    activation = cfg.get("hidden_act", "silu")
    if activation not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedConfigError(
            f"config.json sets hidden_act={activation!r}; the MLP implements {SUPPORTED_ACTIVATIONS}. "
            "Fix: use a Llama-family checkpoint."
        )


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder; every stage reads its sizes from here."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        refuse_unsupported(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        num_heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta_of(cfg),
            max_position_embeddings=cfg["max_position_embeddings"],
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise FileNotFoundError(
                f"no model config at {path}. Fix: run `aie fetch-model` (or point "
                "AIE_MODEL_DIR at a HuggingFace checkpoint folder)."
            )
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON ({exc}). Fix: restore the file, e.g. "
                              "with `aie fetch-model --force`") from exc
        try:
            return cls.from_dict(cfg)
        except KeyError as exc:
            raise ConfigError(f"{path} has no {exc.args[0]!r}, which every Llama config gives. "
                              "Fix: restore the file, e.g. with `aie fetch-model --force`") from exc

    @property
    def queries_per_kv_head(self) -> int:
        """Grouped-query attention: how many query heads share one key/value head."""
        return self.num_heads // self.num_kv_heads


# %%
config = ModelConfig.from_json(MODEL_DIR)
config

# %% [markdown]
# Weights are read with `safetensors`' `safe_open`, which *memory-maps* the file: a tensor is
# only read from disk when we ask for it. Converting one tensor at a time to the dtype we want
# keeps peak memory near the size of the final model instead of "whole file + whole model".
# Errors name the file and the fix: a learner should never have to read a traceback from deep
# inside a library to learn that they forgot to download the model.

# %%
# export: weights
"""Load safetensors checkpoints tensor by tensor, so peak memory stays near the model's size."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

# HuggingFace prefixes the decoder's tensors with "model."; our module tree has no such level.
HF_PREFIX = "model."


class WeightsError(RuntimeError):
    """A checkpoint is missing or unreadable; the message names the file and the fix."""


def weight_files(path: str | Path) -> list[Path]:
    """The ``.safetensors`` files of a checkpoint folder (several when it is sharded)."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(
            f"no .safetensors weights at {path}. Fix: run `aie fetch-model` to download and "
            "convert the course model, or `aie fetch-model --from DIR` for your own checkpoint."
        )
    return files


def load_weights(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Read every tensor of a checkpoint, converted to ``dtype`` on ``device`` one at a time.

    The file is opened (memory-mapped) again for each tensor: pages of the file that were read
    count as this process's memory for as long as the map is open, so one map held across the
    whole loop would cost "file + converted model" at its peak. Re-opening costs ~1 ms a tensor.
    """
    weights: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                names = list(f.keys())
            for name in names:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    tensor = f.get_tensor(name).to(device=device, dtype=dtype)
                weights[name.removeprefix(HF_PREFIX)] = tensor
        except (SafetensorError, OSError) as exc:
            raise WeightsError(
                f"{file} is not a readable safetensors file ({exc}). Fix: delete it and run "
                "`aie fetch-model --force` to convert the model again."
            ) from exc
    return weights


# %%
weights = load_weights(MODEL_DIR)
total_bytes = sum(t.numel() * t.element_size() for t in weights.values())
print(f"{len(weights)} tensors, {total_bytes / 1e6:.0f} MB in fp32")
for name in list(weights)[:4]:
    print(f"  {name:40s} {tuple(weights[name].shape)}")

# %% [markdown]
# There is no `lm_head.weight`: SmolLM2 *ties* its output projection to the input embedding,
# so the 49152 × 576 matrix is stored once and used twice. We will share it, not copy it.
#
# ## 2. Input preprocessing: the tokenizer
#
# The model never sees text, only integer token ids. SmolLM2 uses *byte-level BPE*: text is
# turned into UTF-8 bytes, each byte is drawn as a printable character (`Ġ` is a space), and
# learned merges glue frequent pairs into tokens. Its pre-tokenizer first splits every digit on
# its own, so numbers are spelled digit by digit. An instruct model also expects a *chat
# template* around the user's words; it is a Jinja template that ships with the tokenizer.

# %%
# export: tokenizer
"""Text <-> token ids, the chat template, and a streaming detokenizer."""

from __future__ import annotations

import codecs
import json
from functools import lru_cache
from pathlib import Path

import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """Map each printable character that byte-level BPE uses back to the byte it stands for.

    GPT-2 style tokenizers draw the 256 byte values as 256 printable characters: bytes that are
    already printable stand for themselves, the rest (space, control bytes, ...) are shifted to
    code points from 256 upward, so that "Ġ" (U+0120) is the space byte 0x20.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    alphabet, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(256 + shifted)] = byte
            shifted += 1
    return alphabet


class Tokenizer:
    """A byte-level BPE tokenizer plus the chat template and special tokens of a checkpoint."""

    def __init__(self, backend: _HFTokenizer, tokenizer_config: dict | None = None):
        self.backend = backend
        self.config = tokenizer_config or {}
        self.special_ids = {
            i for i, added in backend.get_added_tokens_decoder().items() if added.special
        }
        self._template = None
        if self.config.get("chat_template"):
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(self.config["chat_template"])

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "Tokenizer":
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"no tokenizer at {path}. Fix: run `aie fetch-model`.")
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        return cls(_HFTokenizer.from_file(str(path)), config)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        eos = self.config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        return None if eos is None else self.token_id(eos)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise ValueError(
                "this checkpoint has no chat template (tokenizer_config.json lacks "
                "'chat_template'). Fix: generate without --chat, or use an instruct model."
            )
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.config.get("bos_token") or "",
            eos_token=self.config.get("eos_token") or "",
        )

    def encode_chat(self, user_message: str) -> list[int]:
        return self.encode(self.apply_chat_template([{"role": "user", "content": user_message}]))

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for (special tokens: their UTF-8 text)."""
        token = self.backend.id_to_token(token_id)
        if token is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary of {self.vocab_size}")
        if token_id in self.special_ids:
            return token.encode("utf-8")
        alphabet = byte_level_alphabet()
        try:
            return bytes(alphabet[ch] for ch in token)
        except KeyError as exc:
            raise ValueError(
                f"token {token!r} is not byte-level BPE; the streaming detokenizer supports "
                "byte-level tokenizers (GPT-2, Llama 3, SmolLM families)"
            ) from exc


# %%
tokenizer = Tokenizer.from_pretrained(MODEL_DIR)
text = "Year 2024: 世界 🤗!"
ids = tokenizer.encode(text)
print(ids)
print([tokenizer.token_bytes(i) for i in ids])

# %% [markdown]
# Look at the bytes: the digits came out one per token, and the emoji 🤗 (four UTF-8 bytes) is
# split across tokens. Keep that in mind for the last part of the loop, turning tokens back into
# text.
#
# The chat template wraps a message in the special tokens the instruct model was trained with:

# %%
print(tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))

# %% [markdown]
# ## 3. The forward pass
#
# SmolLM2 is a Llama-family decoder: an embedding, 30 identical blocks, a final norm and the
# (tied) output projection. Each block is
#
# ```
#  x ─► RMSNorm ─► attention (q, k, v projections, RoPE, softmax(q·kᵀ/√d)·v, o projection) ─► + ─►
#  └──────────────────────────────────────────────────────────────────────────────────────┘   │
#  ┌──────────────────────────────────────────────────────────────────────────────────────────┘
#  x ─► RMSNorm ─► MLP (down(silu(gate(x)) · up(x))) ─► + ─► next block
#  └──────────────────────────────────────────────────┘
# ```
#
# You write most of it: the norm, the rotation, the MLP, the block and the whole forward pass are
# exercises; the projections and attention itself are given (stage 02 opens attention up).
#
# **RMSNorm** rescales each vector to unit root-mean-square, then multiplies by a learned
# weight. Unlike LayerNorm it does not subtract the mean. It is computed in fp32 even when the
# model runs in bf16 or fp16, for two reasons, both shown by the cell below.
#
# - *Range.* fp16's largest number is 65504, so squaring a coordinate of a few hundred already
#   gives infinity; the mean of the squares is then infinite, and the vector comes out as zeros.
# - *Precision of the sum.* mean(x²) adds up as many squares as the vector has coordinates (576
#   for SmolLM2), and bf16 keeps only 8 significant bits. PyTorch's own reductions (`.mean()`,
#   `.sum()`) quietly keep their running sum in fp32 even for bf16 inputs, so
#   `x.bfloat16().pow(2).mean()` comes out close; but a kernel written with a bf16 running sum
#   (you write kernels in stage 05) would not. The cell imitates one: it adds up the squares of
#   256 vectors as wide as SmolLM2's hidden state, once with an fp32 running sum and once with a
#   bf16 one, and compares torch's own bf16 mean.
#
# **RoPE** (rotary position embedding) encodes position by rotating pairs of q and k
# coordinates by an angle `position × frequency`. Then `q·k` depends only on the *distance*
# between the two positions. HuggingFace pairs coordinate `i` with `i + D/2` ("rotate half");
# stage 02 shows the other convention and why the GGUF conversion had to permute rows.
#
# **Attention** is pluggable in two ways. The *kernel*, the function that turns q, k and v into
# the output, is passed to the model when it is built: PyTorch's `scaled_dot_product_attention`
# for now, your hand-written one in stage 02, a flash kernel in stage 05. And each forward pass
# takes an `AttentionMetadata`: everything a pass tells attention besides q, k and v. Here it is
# empty; stage 03 puts a `mask` in it, stage 04 a KV `cache`, and stages 06 and 07 replace it with
# a whole batch's worth of slots and block tables. The model never looks inside: every layer hands
# q, k, v, its own index and the kernel to the metadata's `attend`, and the metadata decides where
# the keys are stored and which ones each query reads.
#
# One more detail, for later: the projections are `Linear` layers that compute in the dtype of
# their *input*, whatever their weights are stored in. So weights can be stored in bf16 (half
# the bytes) while the arithmetic stays fp32 — the model's `activations`, fp32 unless you ask
# otherwise — and the logits always leave the model in fp32. Stage 04 measures why.

# %%
def mean_of_squares_error(x: torch.Tensor, accumulate: torch.dtype) -> torch.Tensor:
    """Signed relative error of mean(x²) per row when the running sum is kept in ``accumulate``.

    The sum is written as one add per column so that every partial sum is rounded to
    ``accumulate``, as a kernel with that accumulator would (elementwise adds round the same
    way on every processor, so these numbers do not depend on the machine).
    """
    squares = x.pow(2)
    running = torch.zeros(x.shape[0], dtype=accumulate)
    for column in squares.to(accumulate).unbind(-1):
        running = running + column
    exact = squares.double().mean(-1)
    return (running.double() / x.shape[-1] - exact) / exact


large = torch.tensor([300.0, -250.0, 20.0])
print(f"in fp16 the squares of {large.tolist()} are {large.half().pow(2).tolist()} (largest fp16: "
      f"{torch.finfo(torch.float16).max:g}); their mean is {large.half().pow(2).mean().item()} in fp16, "
      f"{large.pow(2).mean().item():.0f} in fp32")

hidden_states = torch.randn(256, 576, generator=torch.Generator().manual_seed(0))
bf16_error = mean_of_squares_error(hidden_states, torch.bfloat16)
fp32_error = mean_of_squares_error(hidden_states, torch.float32)
print(f"bf16 running sum: mean(x²) too small on every vector: {bool((bf16_error < 0).all())}, by "
      f"{-bf16_error.median():.1%} (median over {len(bf16_error)} vectors) and at least {-bf16_error.max():.1%}")
print(f"fp32 running sum: every error below 1e-5: {bool((fp32_error.abs() < 1e-5).all())}")
exact = hidden_states.double().pow(2).mean(-1)
torch_bf16 = hidden_states.bfloat16().pow(2).mean(-1).double()  # torch's reduction, bf16 in and out
print(f"torch's own bf16 mean: every error below 1%: {bool(((torch_bf16 - exact) / exact).abs().max() < 0.01)}")
near_300 = torch.tensor(300.0, dtype=torch.bfloat16)
print(f"in bf16: 300 + 0.9 = {(near_300 + 0.9).item():g}, 300 + 1.9 = {(near_300 + 1.9).item():g}")

# %% [markdown]
# In fp16 the first square is already infinite, and so is the mean: the norm would divide the
# vector by infinity. A bf16 running sum comes out too small on *every* vector, by several
# percent (the median and the smallest error are printed above), so the norm's scale
# 1/√mean(x²) would come out too large. The last line shows why: once the sum has grown to a few
# hundred, bf16 numbers are 2 apart, and adding a square below 1 changes nothing. The fp32 sums
# stay within 1e-5 of the exact ones, and torch's bf16 mean within 1%, because it sums in fp32
# inside. Rather than rely on that, the exercise converts x to fp32 itself, normalizes, and
# converts back only at the end.
#
# The model's module starts with the attention kernel and the step contract; the exercises fill in
# the pieces after it.

# %%
# export: model
"""A Llama-family decoder; what attention does with a pass's keys is the pass's metadata's job."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

# An attention kernel takes q (B, Hq, S, D), k and v (B, Hkv, T, D) and an optional boolean mask
# (B or 1, 1, S, T), True where a query may look; it returns (B, Hq, S, D). No mask means causal
# attention with the S queries as the *last* S of the T positions (S == T without a cache; S < T
# after a cache has returned the past). Stage 03 builds masks, stage 04 makes T > S.
AttentionFn = Callable[..., torch.Tensor]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None):
    """PyTorch's fused attention; ``enable_gqa`` lets 9 query heads share 3 key/value heads.

    Without a mask, the S queries are the last S of the T positions. PyTorch's ``is_causal``
    aligns its triangle to the top-left corner, which is only right when S == T, so for
    S < T we build the bottom-right-aligned triangle ourselves (one query needs none).
    """
    seq, kv_len = q.shape[-2], k.shape[-2]
    if mask is None and 1 < seq != kv_len:
        mask = torch.ones(seq, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - seq)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None and seq > 1, enable_gqa=True
    )


def check_kernel(kernel: object) -> None:
    """Refuse anything but a kernel function when a model is built, not deep inside its first pass."""
    if not callable(kernel):
        raise TypeError(f"attention must be a kernel function, fn(q, k, v, mask=None), got {kernel!r}. Fix: "
                        "pass the function itself: sdpa_attention (aie_lessons.model), stage 02's "
                        "manual_attention (aie_lessons.attention) or stage 05's flash_attention")


# The logits_at of a generation step: only the last position predicts the next token.
LAST_POSITION = slice(-1, None)


@dataclass(eq=False)  # compared by identity: == on masks would compare tensors
class AttentionMetadata:
    """What one forward pass tells attention besides q, k and v: the model's step contract.

    The model passes it, unread, to every layer, and each layer calls ``attend``; so a caller
    changes where keys live and which ones a query reads by passing other metadata, never by
    changing the model. This class is the lessons' own: an optional ``mask`` (stage 03), an
    optional contiguous KV ``cache`` that stores a pass's keys from column ``cache_start`` on
    (stage 04: the caller says where, as only the caller knows how far each sequence is), and
    ``logits_at``, the positions whose logits are wanted (an index or a slice of the sequence
    axis; None for all), so that the output head skips the others. Stages 06 and 07 subclass it
    with a packed batch's slots or block tables and their own ``attend``.
    """

    mask: torch.Tensor | None = None
    cache: Any = None  # stage 04's KVCache, or anything with update(layer, k, v, start) -> keys, values so far
    cache_start: int | torch.Tensor | None = None  # the cache column of the pass's first token
    logits_at: slice | torch.Tensor | None = None  # a slice or 1-D positions of the sequence axis

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
               kernel: AttentionFn) -> torch.Tensor:
        """Layer ``layer``'s attention output for q (B, Hq, S, D) and the pass's new k, v (B, Hkv, S, D)."""
        if self.cache is None:
            return kernel(q, k, v, mask=self.mask)
        if self.cache_start is None:
            raise ValueError("a cache needs cache_start, the column where these tokens' keys go: "
                             "AttentionMetadata(cache=cache, cache_start=...) (the caller owns how far "
                             "each sequence is)")
        k, v = self.cache.update(layer, k, v, self.cache_start)  # (B, Hkv, T, D), the cache's dtype
        return kernel(q, k.to(q.dtype), v.to(q.dtype), mask=self.mask)  # a bf16 cache: a copy per step


# %% [markdown]
# ### Exercise 1.1 — RMSNorm
#
# `rms_norm(x, weight, eps)` takes `x` of any shape (..., hidden) and a `weight` of shape
# (hidden,). Each vector along the last dimension is divided by its root-mean-square,
# √(mean(x²) + eps), and the result is multiplied coordinate by coordinate by `weight`. `eps`
# keeps a vector of zeros finite; it goes *inside* the root because that is the formula the
# model was trained with (outside, it gives other numbers for small vectors, and the check has
# some). Do the arithmetic in fp32 whatever `x`'s dtype is (the measurements above), and return
# a tensor of `x`'s shape and dtype.

# %%
# export: model
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Scale each vector (last dimension) to unit root-mean-square, then by ``weight``."""
    # BEGIN EXERCISE 1.1: return each vector of x divided by its root-mean-square (eps inside the root), times weight; arithmetic in fp32, result in x's dtype
    # Hint 1: RMSNorm gives every vector the same scale: it divides the vector by the square root of the mean of its squared coordinates (plus eps), then a learned weight rescales each coordinate. Unlike LayerNorm, nothing is subtracted.
    # Hint 2: Convert x to float32 first; take the mean of the squares over the last dimension, keeping that dimension so it broadcasts; multiply by the reciprocal square root (torch.rsqrt) of that mean plus eps, then by the weight as float32, and convert back to x's dtype last.
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)
    # END EXERCISE 1.1


# %%
# Check exercise 1.1
checks.stage01.check_rms_norm(rms_norm)

# %% [markdown]
# RoPE needs two things: the angle tables, computed once per forward pass from the positions
# (exercise 1.3), and the rotation itself, applied to q and k in every layer. The rotation comes
# first. `rotate_half` maps each pair (a, b) = (x[i], x[i + D/2]) to (−b, a), the pair turned
# by 90°.

# %%
# export: model
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension: a 90° turn of each pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


# %% [markdown]
# ### Exercise 1.2 — applying RoPE
#
# `apply_rope(x, cos, sin)` rotates q or k, shaped (B, H, S, D), by the angles whose cosines and
# sines are given, shaped (B, S, D) (exercise 1.3 builds them): every head of a position turns by
# the same angles. Each pair (a, b) = (x[i], x[i + D/2]) becomes (a·cos θ − b·sin θ, b·cos θ + a·sin θ).
# Return a tensor of `x`'s shape and dtype, also when the tables come in another dtype (fp32
# tables with a bf16 `x`).

# %%
# export: model
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate q or k, shaped (B, H, S, D), by the angles in cos/sin, shaped (B, S, D)."""
    # BEGIN EXERCISE 1.2: return x with each pair (x[i], x[i + D/2]) turned by the angle whose cos and sin are given for its position
    # Hint 1: RoPE turns each pair of coordinates (x[i], x[i + D/2]) in its own plane by the angle its position gives it; every head of a position turns by the same angles, and a turn changes a pair's direction, never its length.
    # Hint 2: Multiply x by cos, multiply rotate_half of x by sin, and add; cos and sin are (B, S, D) while x is (B, H, S, D), so insert a size-1 head axis at dimension 1 first. Return the result in x's dtype.
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos + rotate_half(x) * sin).to(x.dtype)
    # END EXERCISE 1.2


# %%
# Check exercise 1.2
checks.stage01.check_apply_rope(apply_rope)

# %% [markdown]
# ### Exercise 1.3 — the rotation angles (warm-up)
#
# `rope_cos_sin(positions, head_dim, theta)` builds the tables `apply_rope` reads. `positions` is
# an integer tensor (B, S); the result is `(cos, sin)`, each float32 of shape (B, S, D) with
# D = `head_dim`. Pair `i` (for i = 0 … D/2 − 1) turns at the frequency `theta^(−2i/D)`, so at
# position p its angle is p · theta^(−2i/D): the first pairs turn fast, the last ones slowly.
# Coordinates `i` and `i + D/2` form pair `i`, so both halves of a table hold the same D/2
# angles, in the same order.

# %%
# export: model
def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, (B, S, D), for integer ``positions`` (B, S).

    Pair ``i`` (coordinates i and i + D/2) turns at frequency ``theta^(-2i/D)``; both halves
    of the returned tables repeat the same D/2 angles so they line up with ``rotate_half``.
    """
    # BEGIN EXERCISE 1.3: return the cos and sin, (B, S, D) float32, of the angle position · theta^(-2i/D) of each pair i, repeated in both halves of the last dimension
    # Hint 1: Every pair of coordinates has its own speed of rotation, from one radian per position for pair 0 down to nearly nothing for the last pair; the angle of a pair at a position is the position times that speed, and the two coordinates of a pair, i and i + D/2, share it.
    # Hint 2: Make the D/2 frequencies from the even numbers 0, 2, … D−2 divided by D, as powers of theta with a minus sign; multiply the positions (as float, with a new last axis) by them to get (B, S, D/2) angles; concatenate the angles with themselves along the last axis; return their cosine and sine.
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32)
    inv_freq = 1.0 / (theta ** (exponents / head_dim))  # (D/2,)
    angles = positions.float()[..., None] * inv_freq  # (B, S, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (B, S, D)
    return angles.cos(), angles.sin()
    # END EXERCISE 1.3


# %%
# Check exercise 1.3
checks.stage01.check_rope_cos_sin(rope_cos_sin)

# %% [markdown]
# The projections and attention are given. `Linear` computes in its input's dtype; `RMSNorm`
# holds the weight your `rms_norm` multiplies by; `Attention` projects x to q, k and v, rotates
# q and k with your `apply_rope`, and hands them to the pass's metadata with its kernel.

# %%
# export: model
class Linear(nn.Linear):
    """``nn.Linear`` that computes in its input's dtype, whatever dtype its weight is stored in.

    Storage and arithmetic are separate choices: bf16 weights halve the bytes every token reads,
    while fp32 activations keep the results close to the fp32 model (stage 04 measures both).
    A weight stored in another dtype is converted ``UPCAST_ROWS`` rows at a time, never as a
    whole: converting the 49152-row output head at once would write a 113 MB fp32 copy out to
    memory and read it back, for every token.
    """

    UPCAST_ROWS = 1024

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, None if self.bias is None else self.bias.to(x.dtype)
        if weight.dtype == x.dtype:
            return F.linear(x, weight, bias)
        flat = x.reshape(-1, x.shape[-1])
        out = torch.empty(weight.shape[0], flat.shape[0], dtype=x.dtype, device=x.device)
        for start in range(0, weight.shape[0], self.UPCAST_ROWS):
            rows = weight[start:start + self.UPCAST_ROWS]
            # Assigned, not mm(out=...), which autograd refuses when the weights require grad.
            out[start:start + rows.shape[0]] = rows.to(x.dtype) @ flat.T
        out = out.T.reshape(*x.shape[:-1], weight.shape[0])
        return out if bias is None else out + bias


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, kernel: AttentionFn = sdpa_attention):
        super().__init__()
        self.config = config
        self.kernel = kernel
        self.layer_index = layer_index
        d, hq, hkv = config.head_dim, config.num_heads, config.num_kv_heads
        self.q_proj = Linear(config.hidden_size, hq * d, bias=False)
        self.k_proj = Linear(config.hidden_size, hkv * d, bias=False)
        self.v_proj = Linear(config.hidden_size, hkv * d, bias=False)
        self.o_proj = Linear(hq * d, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        batch, seq, _ = x.shape
        d, hq, hkv = self.config.head_dim, self.config.num_heads, self.config.num_kv_heads
        q = self.q_proj(x).view(batch, seq, hq, d).transpose(1, 2)  # (B, Hq, S, D)
        k = self.k_proj(x).view(batch, seq, hkv, d).transpose(1, 2)  # (B, Hkv, S, D)
        v = self.v_proj(x).view(batch, seq, hkv, d).transpose(1, 2)  # (B, Hkv, S, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attn.attend(q, k, v, self.layer_index, self.kernel)  # (B, Hq, S, D)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, hq * d))


# %% [markdown]
# ### Exercise 1.4 — the SwiGLU MLP (warm-up)
#
# `MLP.forward(x)` takes hidden states (..., hidden_size) and returns the same shape. SwiGLU
# projects x twice up to `intermediate_size` (1536 for SmolLM2), with `gate_proj` and with
# `up_proj`; the gate goes through SiLU, silu(z) = z·sigmoid(z), and multiplies the up projection
# feature by feature; `down_proj` brings the product back to `hidden_size`. The projections are
# `Linear` layers: call them, and your code works for any dtype the weights are stored in.

# %%
# export: model
class MLP(nn.Module):
    """SwiGLU: a SiLU-gated linear unit, ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # BEGIN EXERCISE 1.4: return down_proj of the SiLU-gated product of the gate and up projections of x
        # Hint 1: SwiGLU lets one projection of x gate another: the gate passes through SiLU (z·sigmoid(z), near 0 for negative z and near z for positive z), so each feature of the up projection is let through, damped or blocked depending on the input.
        # Hint 2: Project x with gate_proj and with up_proj; apply F.silu to the gate projection only; multiply the two elementwise; project that product with down_proj.
        gate = F.silu(self.gate_proj(x))  # (..., intermediate)
        return self.down_proj(gate * self.up_proj(x))
        # END EXERCISE 1.4


# %%
# Check exercise 1.4
checks.stage01.check_mlp(MLP)

# %% [markdown]
# ### Exercise 1.5 — the pre-norm residual block
#
# `DecoderLayer.forward(x, cos, sin, attn)` is one block of the diagram at
# the top of this section. `x` is the *residual stream*, (B, S, hidden). The block has two
# halves, in this order, and each one reads a normalized copy of the stream and *adds* its result
# to the stream:
#
# 1. attention reads `input_layernorm` of the stream; call `self.self_attn` with that and with
#    `cos, sin` and the metadata `attn` exactly as received (stage 03's masks and stage 04's KV
#    cache reach attention inside it);
# 2. the MLP reads `post_attention_layernorm` of the stream *as the attention half left it*.
#
# Return the stream after both additions. The stream itself is never normalized inside a block
# ("pre-norm"; the original Transformer normalized after each addition, "post-norm").

# %%
# export: model
class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, kernel: AttentionFn = sdpa_attention):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index, kernel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        # BEGIN EXERCISE 1.5: return x after the attention half and then the MLP half, each reading its own norm of the stream and adding its output to it
        # Hint 1: In a pre-norm block the residual stream x is only ever added to: each half reads a normalized copy of x and adds its output back onto x itself, so what earlier layers wrote reaches the end unchanged, and the MLP sees the stream after attention's contribution.
        # Hint 2: First add to x the output of self_attn on input_layernorm(x), passing cos, sin and attn along; then add to that updated x the output of mlp on post_attention_layernorm of the updated x.
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))
        # END EXERCISE 1.5


# %%
# Check exercise 1.5
checks.stage01.check_decoder_layer(DecoderLayer)

# %% [markdown]
# ### Exercise 1.6 — the forward pass
#
# `LlamaModel.forward(input_ids, positions, attn)` turns
# token ids (B, S) into logits (B, S, vocab): the pipeline of the diagram above, embedding →
# every block of `self.layers` in order → final norm `self.norm` → output head `self.lm_head`.
# The rules:
#
# - `positions` (B, S) say where each token is, for RoPE. When none are given the tokens are the
#   whole sequence (there is no cache then), so the positions are 0 … S−1 in every row — still
#   shaped (B, S).
# - The residual stream is computed in `self.activations`. RoPE's tables are made once per call
#   from the positions and the config's `rope_theta` (every checkpoint picks its own base), and
#   reach the layers in the stream's dtype.
# - Every layer receives the metadata `attn` as the model was given it (stages 03–07 rely on it);
#   when the caller gives none, the lines before the exercise make it an empty `AttentionMetadata()`.
# - The logits are fp32 whatever `activations` is, and computed in fp32: the output head itself
#   runs on fp32 input (a result rounded in bf16 and converted afterwards would keep bf16's
#   coarse steps, and close candidates would tie).
# - `attn.logits_at` picks the positions whose logits are wanted, the same ones in every row: a
#   slice of the sequence axis (`LAST_POSITION`, the slice `-1:`, in a generation step) or a 1-D
#   tensor of positions (stage 06's packed batches), never an int — the sequence axis stays — or
#   None for all. The norm and the output head run on those positions only: saving the head's work
#   on the others is the point. The result is (B, K, vocab) for K kept.
#
# The class is long because of loading; the exercise is `forward` only.

# %%
# export: model
class LlamaModel(nn.Module):
    """Token ids (B, S) -> next-token logits (B, S, vocab), always fp32. Names match HuggingFace.

    ``activations`` is the dtype the hidden states are computed in, whatever the weights are
    stored in: fp32 by default, so bf16 weights only halve the bytes (stage 04 measures the
    choice). The logits leave in fp32 either way: in bf16, logits near 25 are 0.125 apart, so
    close candidates would tie and argmax would pick the lower id.
    """

    def __init__(self, config: ModelConfig, attention: AttentionFn = sdpa_attention,
                 activations: torch.dtype = torch.float32):
        super().__init__()
        check_kernel(attention)
        if activations not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"activations must be torch.float32, torch.bfloat16 or torch.float16, got {activations!r}")
        self.config = config
        self.activations = activations
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, attention) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def attention(self) -> AttentionFn:
        """The kernel every layer computes attention with."""
        return self.layers[0].self_attn.kernel

    def use_attention(self, kernel: AttentionFn) -> None:
        """Compute attention with ``kernel`` from now on (the lessons compare kernels on one loaded
        model; an engine binds its kernel when it is built, never per step)."""
        check_kernel(kernel)
        for layer in self.layers:
            layer.self_attn.kernel = kernel

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        attention: AttentionFn = sdpa_attention,
        activations: torch.dtype = torch.float32,
    ) -> "LlamaModel":
        """Build the module without allocating, then adopt the loaded tensors as parameters.

        ``dtype`` is how the weights are stored, ``activations`` what the model computes in.
        Constructing on the ``meta`` device allocates nothing, and ``assign=True`` makes the
        loaded tensors *become* the parameters: the weights are in memory exactly once.
        """
        config = ModelConfig.from_json(model_dir)
        with torch.device("meta"):
            model = cls(config, attention, activations)
        state = load_weights(model_dir, dtype=dtype, device=device)
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight  # assign=True broke the tie
            missing = [m for m in missing if m != "lm_head.weight"]
        if missing or unexpected:
            raise WeightsError(
                f"checkpoint {model_dir} does not fit the model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}. Fix: check that config.json matches the weights."
            )
        return model.eval()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attn: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        """Logits (B, K, vocab), fp32, for token ids (B, S): every position, or ``attn.logits_at``'s.

        ``positions`` (B, S) are the RoPE positions (default 0..S-1 when there is no cache);
        ``attn`` is what attention needs besides q, k and v (a mask, a cache and where to write
        it, or a whole engine step's slots), handed to every layer unread. Nothing here is
        derived from what a cache holds: only the caller knows how far each sequence is.
        Generation only needs the last position's logits: ``logits_at`` spares the output head
        (S × 576 × 49152 multiply-adds) the others.
        """
        if isinstance(attn, torch.Tensor):
            raise TypeError("the third argument is the pass's AttentionMetadata, not a tensor. Fix: for a "
                            "mask, model(ids, positions, AttentionMetadata(mask=mask))")
        attn = AttentionMetadata() if attn is None else attn
        if attn.cache is not None and positions is None:
            raise ValueError("with a cache, pass positions (B, S): the caller owns how far each sequence is")
        # BEGIN EXERCISE 1.6: return the logits (fp32) of the ids: embeddings in self.activations, every layer with RoPE tables of the positions and the metadata, the final norm and the output head, at attn.logits_at's positions only if set
        # Hint 1: The model is a pipeline over one residual stream of shape (B, S, hidden): the embeddings go in, every block adds to it in turn, and only at the end is it normalized and projected onto the vocabulary. Positions enter only through RoPE's angle tables, built once and shared by every layer.
        # Hint 2: Fill in default positions for every row when none are given; embed the ids in the compute dtype; make the angle tables once from the positions and the config's RoPE settings, in the stream's dtype; let each layer in turn update the stream, handing on the metadata; if logits_at is set, index the stream's sequence axis with it; normalize, and project onto the vocabulary in fp32.
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = self.embed_tokens(input_ids).to(self.activations)  # (B, S, hidden)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        if attn.logits_at is not None:
            x = x[:, attn.logits_at]  # (B, K, hidden): the head runs on these positions only
        return self.lm_head(self.norm(x).float())  # (B, K, vocab), fp32
        # END EXERCISE 1.6


# %%
# Check exercise 1.6
checks.stage01.check_llama_forward(LlamaModel)


# %% [markdown]
# Now load the real model. Building it on the `meta` device allocates nothing; the loaded
# tensors then become its parameters. The tied output head really is the embedding, the same
# storage, not a copy:

# %%
model = LlamaModel.from_pretrained(MODEL_DIR)
n_params = sum(p.numel() for p in model.parameters())
shared = model.lm_head.weight.untyped_storage().data_ptr() == model.embed_tokens.weight.untyped_storage().data_ptr()
print(f"{n_params / 1e6:.1f} M parameters; output head shares the embedding's storage: {shared}")

# %% [markdown]
# ## 4. Output postprocessing: from logits to the next token
#
# The model returns a score (logit) for every vocabulary entry *at every position*: position `t`
# predicts token `t + 1`. Generation only needs the prediction after the last token. Greedy
# decoding takes the highest-scoring token.
#
# The sampling module starts with what a request asks for: `SamplingParams`, one per request,
# checked when it is made.

# %%
# export: sampling
"""From logits to the next token: the greedy pick, sampling, and the parameters of both."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class SamplingParamsError(ValueError):
    """A sampling parameter is outside the range where it means something."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop: one per request, never changed (frozen).

    ``temperature=0`` means greedy decoding; it is the default because every comparison with
    transformers' greedy tokens (and every later stage's oracle) relies on it. ``seed`` gives
    the request its own random stream, so a sampled answer can be reproduced exactly.
    """

    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks: always generate max_new_tokens
    temperature: float = 0.0  # 0 = greedy; otherwise logits are divided by it before sampling
    top_k: int = 0  # keep only the k best tokens; 0 = no limit
    top_p: float = 1.0  # keep the fewest best tokens whose probabilities reach p; 1 = all
    repetition_penalty: float = 1.0  # > 1 makes tokens already in the sequence less likely
    seed: int | None = None  # None: a fresh random stream for every request

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            raise SamplingParamsError(f"stop={self.stop!r} is one string; it must be a sequence "
                                      f"of strings. Fix: stop=({self.stop!r},)")
        if self.stop is None:
            raise SamplingParamsError("stop=None is invalid: it must be a sequence of strings "
                                      "(empty for none). Fix: stop=()")
        object.__setattr__(self, "stop", tuple(self.stop))  # a list is fine; store it frozen
        integers = {"max_new_tokens": (self.max_new_tokens, "an integer ≥ 0"),
                    "top_k": (self.top_k, "an integer ≥ 0 (0 = no limit)")}
        for name, (value, allowed) in integers.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise SamplingParamsError(f"{name}={value!r} is invalid: it must be {allowed}.")
        if not all(isinstance(text, str) for text in self.stop):
            raise SamplingParamsError(f"stop={self.stop!r} is invalid: it must be a sequence of strings.")
        numbers = {
            "temperature": (self.temperature, self.temperature >= 0, "a number ≥ 0 (0 = greedy)"),
            "top_p": (self.top_p, 0 < self.top_p <= 1, "a number in (0, 1] (1 = keep all)"),
            "repetition_penalty": (self.repetition_penalty, self.repetition_penalty > 0,
                                   "a number > 0 (1 = no penalty)"),
        }
        for name, (value, in_range, allowed) in numbers.items():
            is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not is_number or not math.isfinite(value) or not in_range:
                raise SamplingParamsError(f"{name}={value!r} is invalid: it must be {allowed}.")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise SamplingParamsError(f"seed={self.seed!r} is invalid: it must be an integer or None.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no penalty: the next token is the argmax of the raw logits, nothing else."""
        return self.greedy and self.repetition_penalty == 1.0


def params_per_row(params: SamplingParams | Sequence[SamplingParams], rows: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per sequence of a batch: the same for all, or one each."""
    if isinstance(params, SamplingParams):
        return [params] * rows
    params = list(params)
    if len(params) != rows:
        raise SamplingParamsError(f"got {len(params)} SamplingParams for {rows} prompts. Fix: give one "
                                  "SamplingParams for all, or one per prompt")
    return params


# %% [markdown]
# ### Exercise 1.7 — the greedy step
#
# `greedy_step(logits)` takes the model's logits, (B, S, vocab), and returns the next token of
# each of the B sequences: a tensor of B integer token ids, shape (B,), each the highest-scoring
# vocabulary entry of the prediction made after that sequence's last token.

# %%
# export: sampling
def greedy_step(logits: torch.Tensor) -> torch.Tensor:
    """Next token ids (B,) from logits (B, S, vocab): the best-scoring token at the last position."""
    # BEGIN EXERCISE 1.7: return, for each sequence, the id of the best token predicted after its last position
    # Hint 1: A causal LM's logits at position t are its guess for token t + 1, so the next token is predicted by the last position alone; greedy decoding takes the most likely entry of that prediction.
    # Hint 2: Select the last position along the sequence axis (dimension 1) of every row, then take the index (not the value) of the largest logit along the vocabulary axis.
    return logits[:, -1, :].argmax(dim=-1)
    # END EXERCISE 1.7


# %%
# Check exercise 1.7
checks.stage01.check_greedy_step(greedy_step)

# %% [markdown]
# ### Streaming text
#
# Text should appear as it is generated, but one character can span several tokens. Decoding the
# tokens of `"Year 2024: 世界 🤗!"` one at a time prints replacement characters (`�`) for the
# pieces of the emoji:

# %%
print([tokenizer.decode([i]) for i in ids])

# %% [markdown]
# ### Exercise 1.8 — the streaming detokenizer
#
# Complete `StreamingDetokenizer.push(token_id)`: it is called once per generated token and
# returns a `str`, only the text that this token *completes*, holding back the bytes of an
# unfinished character until the tokens that finish it arrive (so it may return `""`). Pushing
# every token of a text and then calling `flush()` must give back exactly that text. A model can
# also generate bytes that never become a character: those show as U+FFFD (`�`), the way
# `tokenizer.decode` shows them, and the text after them keeps coming; an unfinished character
# left when the answer ends comes out of `flush()` as U+FFFD too.

# %%
# export: tokenizer
class StreamingDetokenizer:
    """Turn token ids into text as they arrive, never emitting half a character.

    One character can span several tokens: "世" is three UTF-8 bytes and byte-level BPE may put
    them in different tokens. Decoding each token on its own would print U+FFFD (the replacement
    character) for the pieces. Instead we feed each token's bytes into an incremental UTF-8
    decoder, which holds back an incomplete character until its last byte arrives.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        # "replace": bytes that can never become a character (a model can generate those) show
        # as U+FFFD, like tokenizer.decode does; an unfinished character is simply held back.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        # BEGIN EXERCISE 1.8: return the text completed by this token's bytes
        # Hint 1: One character can take up to four UTF-8 bytes, and byte-level BPE may cut between them, so a token's bytes must wait until they complete whole characters before they become text.
        # Hint 2: Ask the tokenizer for the raw bytes this token stands for (token_bytes) and feed them to the incremental UTF-8 decoder kept in self._utf8: it returns only complete characters and keeps an unfinished one for the next call.
        return self._utf8.decode(self.tokenizer.token_bytes(token_id))
        # END EXERCISE 1.8

    def flush(self) -> str:
        """End of stream: an incomplete character left over is shown as U+FFFD, not dropped."""
        return self._utf8.decode(b"", final=True)


# %%
# Check exercise 1.8
checks.stage01.check_streaming_detokenizer(StreamingDetokenizer, tokenizer)

# %% [markdown]
# ### Sampling: when the best token is not the only choice
#
# Greedy decoding always answers the same way, and on open-ended prompts it tends to loop. A
# chat model is usually *sampled*: the logits become probabilities (a softmax) and the next
# token is drawn at random from them. Four knobs shape the draw, applied in this order:
#
# 1. **repetition penalty** makes every token already in the sequence less likely;
# 2. **temperature** divides the logits: below 1 sharpens the distribution, above 1 flattens it
#    (and 0 is the greedy limit);
# 3. **top-k** keeps only the k highest-scoring tokens;
# 4. **top-p** ("nucleus") keeps the fewest best tokens whose probabilities add up to at least p.
#
# Removing a token means setting its logit to −∞, so the softmax gives it probability 0 and
# renormalises the rest. The order and the exact rules are the ones HuggingFace `transformers`
# uses, so the course's tests can compare our filters with theirs on the real model's logits.
#
# ### Exercise 1.9 — the repetition penalty (warm-up)
#
# The CTRL paper's rule: a token that already occurs in the sequence has its logit *divided* by
# the penalty if it is positive and *multiplied* by it if it is negative, so both move down. A
# token counts once, however often it occurred.

# %%
# export: sampling
def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor, penalty: float) -> torch.Tensor:
    """``logits`` (vocab,) with the tokens in ``history`` (n,) made less likely by ``penalty``.

    Returns a new tensor: the caller's logits stay as they were.
    """
    # BEGIN EXERCISE 1.9: return a copy of logits where each token id in history has its logit divided by penalty if positive, multiplied by it otherwise
    # Hint 1: A repeated token should become less likely whichever sign its logit has: shrinking a positive logit towards 0 and pushing a negative one further from 0 both lower it. A token seen three times is penalized once, like a token seen once.
    # Hint 2: Read the logits at the history's ids (gather), compute their penalized values with torch.where on their sign, and write them into a new tensor with the out-of-place scatter; a repeated id just writes the same value twice.
    seen = logits.gather(-1, history)
    seen = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits.scatter(-1, history, seen)
    # END EXERCISE 1.9


# %%
# Check exercise 1.9
checks.stage01.check_repetition_penalty(apply_repetition_penalty)

# %% [markdown]
# ### Exercise 1.10 — top-k and top-p
#
# Both filters take logits of shape (B, vocab) and return a *new* tensor of the same shape with
# the removed tokens at −∞ (the caller's logits stay as they were). Each row is filtered on its
# own. The rules, exactly:
#
# - **top-k** (`top_k > 0`): keep every token whose logit is at least the k-th highest of its
#   row (a token tied with the k-th stays). `top_k = 0`, or a k of at least the vocabulary size,
#   keeps all.
# - **top-p** (`top_p < 1`), applied *after* top-k: take the softmax of the logits top-k left
#   (so the kept tokens' probabilities sum to 1) and rank the tokens by it; keep a token if the
#   tokens ranked above it hold less than `p` of the probability. The best token is therefore
#   always kept. `top_p = 1` keeps all. Add the probabilities up in float64: a float32 running
#   sum over 49,152 tokens drifts enough to drop tokens that sit right at the boundary (the
#   check has a row of that size, and says so when it happens).

# %%
# export: sampling
def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``logits`` (B, vocab) with every token outside the top-k and then the top-p set at −inf."""
    # BEGIN EXERCISE 1.10: set to -inf the logits of tokens below the k-th best (if top_k > 0), then of tokens whose better-ranked tokens already hold top_p of the probability (if top_p < 1)
    # Hint 1: Both filters decide which tokens may be drawn: top-k by rank, top-p by how much probability the better-ranked tokens already hold; a removed token gets −∞, so the softmax gives it 0 and shares its probability among the others.
    # Hint 2: Top-k: each row's k-th best value is a threshold, and every token strictly below it goes. Top-p: rank each row's tokens, turn the ranked logits into probabilities in float64, find for every token how much probability the tokens ranked above it hold, mark those where that already reaches p, and carry the marks from ranked order back to token order before removing them.
    if 0 < top_k < logits.shape[-1]:
        kth_best = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    if top_p < 1.0:
        ranked, order = logits.sort(dim=-1, descending=True)
        # float64: a float32 running sum over thousands of tokens drifts, and would drop
        # tokens right at the boundary that the exact rule keeps
        probs = ranked.softmax(dim=-1, dtype=torch.float64)
        above = probs.cumsum(dim=-1) - probs  # probability held by the better-ranked tokens
        drop = (above >= top_p).scatter(-1, order, above >= top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits
    # END EXERCISE 1.10


# %%
# Check exercise 1.10
checks.stage01.check_top_k_top_p(filter_top_k_top_p)

# %% [markdown]
# With both in place, one function picks the next token of each row of a batch, each row with
# its own `SamplingParams` and its own `torch.Generator`, seeded from `SamplingParams.seed`: a
# request's draws then depend on its seed alone, never on which other requests share the batch
# (stage 06 relies on this when it batches strangers together). When every row is plain greedy,
# the pick is your `greedy_step` from exercise 1.7, once for the whole batch.

# %%
# export: sampling
def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own random stream: reproducible with a seed, fresh without one."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator,
               history: list[int]) -> int:
    """One token id from one row's last-position logits (vocab,), fp32."""
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(history, dtype=torch.long, device=logits.device)
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        return int(logits.argmax())
    # The best logit is moved to 0 first: dividing by a tiny temperature then gives -inf for
    # the others, never +inf (which would make the softmax NaN). Probabilities do not change.
    logits = (logits - logits.max()) / params.temperature
    logits = filter_top_k_top_p(logits[None], params.top_k, params.top_p)[0]
    return int(torch.multinomial(logits.softmax(dim=-1), 1, generator=generator))


def sample_next(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
                histories: list[list[int]]) -> list[int]:
    """The next token id of every row, from the model's logits (B, S, vocab), fp32.

    Row i is picked with ``params[i]`` and ``generators[i]``; ``histories[i]`` is its prompt and
    output so far (for the repetition penalty). When every row is plain greedy there is nothing
    to draw: one ``greedy_step`` for the whole batch.
    """
    if all(p.plain_greedy for p in params):
        return greedy_step(logits).tolist()
    return [sample_row(row[-1], p, generator, history)
            for row, p, generator, history in zip(logits, params, generators, histories)]


# %% [markdown]
# What the filters do to a real distribution: the model's probabilities for the first token of
# the answer to "What is the capital of France?", at temperature 0.8, with the tokens that
# top-k = 10 and top-p = 0.6 keep.

# %%
france_ids = tokenizer.encode_chat("What is the capital of France?")
with torch.inference_mode():
    first_logits = model(torch.tensor([france_ids]))[0, -1]  # (vocab,) fp32
scaled = first_logits / 0.8
best = scaled.topk(20).indices
kept_k = torch.isfinite(filter_top_k_top_p(scaled[None], 10, 1.0)[0])[best]
kept_p = torch.isfinite(filter_top_k_top_p(scaled[None], 0, 0.6)[0])[best]
probs = scaled.softmax(-1)[best]
labels = [repr(tokenizer.decode([i]))[1:-1] for i in best.tolist()]
fig, ax = plt.subplots(figsize=(8, 3.5))
colors = ["tab:green" if p else ("tab:blue" if k else "lightgray") for k, p in zip(kept_k, kept_p)]
ax.bar(range(20), probs, color=colors)
ax.set_xticks(range(20), labels, rotation=60, fontsize=8)
ax.set_yscale("log")
ax.axvline(9.5, color="black", linestyle="--", linewidth=1)
ax.text(9.6, probs.max(), " top-k = 10 cuts here", fontsize=8, va="top")
ax.set_xlabel("token")
ax.set_ylabel("probability at temperature 0.8")
ax.set_title("First answer token: kept by top-p 0.6 (green), by top-k 10 only (blue), neither (gray)",
             fontsize=9)
plt.tight_layout()
plt.show()
print(f"top-k 10 keeps {int(kept_k.sum())} of these 20 tokens, top-p 0.6 keeps {int(kept_p.sum())}; "
      f"the best token has probability {probs[0]:.2f}")

# %% [markdown]
# The output side of the loop: a stream of token ids becomes text. The loop must stop on the
# end-of-sequence token, on `max_new_tokens`, or on a stop string — which may arrive split
# across tokens, so text that could be the start of one is held back.

# %%
# export: output
"""Generated token ids -> streamed text, stop rules and the finished result, for every loop."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


class StopStrings:
    """Cut generated text at the first stop string, holding back text that might start one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to show, whether a stop string was reached)."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            safe, self.pending = self.pending[: min(hits)], ""
            return safe, True
        hold = max((self._partial_match(s) for s in self.stops), default=0)
        cut = len(self.pending) - hold
        safe, self.pending = self.pending[:cut], self.pending[cut:]
        return safe, False

    def _partial_match(self, stop: str) -> int:
        """Length of the longest tail of ``pending`` that is a head of ``stop``."""
        for n in range(min(len(stop) - 1, len(self.pending)), 0, -1):
            if self.pending.endswith(stop[:n]):
                return n
        return 0

    def flush(self) -> str:
        safe, self.pending = self.pending, ""
        return safe


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"  # "eos", "stop" or "length"
    step_seconds: list[float] = field(default_factory=list)  # one forward pass per token

    @property
    def timings(self) -> dict[str, float]:
        steps = self.step_seconds
        decode = steps[1:]
        return {
            "first_token_s": steps[0] if steps else 0.0,
            "total_s": sum(steps),
            "tokens": len(self.token_ids),
            "decode_tokens_per_s": len(decode) / sum(decode) if decode else 0.0,
        }


def stop_token_ids(config: ModelConfig, tokenizer: Tokenizer) -> set[int]:
    """Tokens that end a sequence: the model config's and the tokenizer's end-of-sequence ids."""
    ids = set(config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


# %% [markdown]
# ### Exercise 1.11 — the stop rules
#
# Every loop of the course feeds each generated token to an `OutputStream`, one per sequence.
# Complete `OutputStream.push(token_id)`, which returns `True` once the sequence is finished and
# `False` before. The rules, in this order:
#
# 1. a token in `self.stop_ids` (the end-of-sequence tokens; empty with `ignore_eos`) finishes
#    the sequence with reason `"eos"`. It is *not* part of the answer: not in `token_ids`, not in
#    the text;
# 2. any other token is part of the answer (`self.result.token_ids`), and its text streams out
#    (into `result.text` and to `on_text`) as soon as it is safe to show: whole characters only
#    (exercise 1.8), and nothing that might be the start of a stop string;
# 3. a completed stop string finishes the sequence with reason `"stop"`, the stop string and
#    anything after it cut; otherwise, holding `max_new_tokens` tokens finishes it with `"length"`.
#
# The pieces are already in the class: the detokenizer, the stop-string filter (`StopStrings`,
# above), `_emit` and `_finish`. Every way of finishing goes through `_finish`, which releases
# the text still held back (except after a stop string) and marks the stream finished.

# %%
# export: output
class OutputStream:
    """One sequence's generated tokens -> streamed text, stop rules and the final result.

    Every generate loop in the course (one sequence here, batches in stages 03, 04 and 06) feeds
    each new token to one of these, so the rules for stopping and streaming live in one place.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        params: SamplingParams,
        stop_ids: set[int],
        on_text: Callable[[str], None] | None = None,
    ):
        self.result = GenerationResult(prompt_ids=list(prompt_ids))
        self.detokenizer = StreamingDetokenizer(tokenizer)
        self.stops = StopStrings(params.stop)
        self.max_new_tokens = params.max_new_tokens
        self.stop_ids = set() if params.ignore_eos else stop_ids
        self.on_text = on_text
        self.finished = params.max_new_tokens == 0

    def _emit(self, text: str) -> None:
        self.result.text += text
        if self.on_text and text:
            self.on_text(text)

    def _finish(self, reason: str) -> None:
        if reason != "stop":  # release text held back for a stop string or a partial character
            self._emit(self.stops.push(self.detokenizer.flush())[0] + self.stops.flush())
        self.result.finish_reason = reason
        self.finished = True

    def push(self, token_id: int) -> bool:
        """Add one generated token; return True once the sequence is finished."""
        # BEGIN EXERCISE 1.11: add one token by the stop rules (a stop token finishes without being kept; a stop string or max_new_tokens finishes after it), stream its text, and return whether the sequence is finished
        # Hint 1: The checks run in a fixed order: an end-of-sequence token ends the answer and is not part of it; any other token is part of the answer, its text may complete a stop string (cut, with everything after it), and the answer also ends when it holds max_new_tokens tokens.
        # Hint 2: If the id is one of self.stop_ids, finish with "eos" and return at once; otherwise append it to the result's token ids, pass its text through self.detokenizer and then self.stops, emit the safe part, and finish with "stop" if a stop string was reached, else with "length" when the count of kept tokens reaches self.max_new_tokens; finally report whether the stream has finished.
        if token_id in self.stop_ids:
            self._finish("eos")
            return True
        self.result.token_ids.append(token_id)
        text, stopped = self.stops.push(self.detokenizer.push(token_id))
        self._emit(text)
        if stopped:
            self._finish("stop")
        elif len(self.result.token_ids) >= self.max_new_tokens:
            self._finish("length")
        return self.finished
        # END EXERCISE 1.11


# %%
# Check exercise 1.11
checks.stage01.check_output_stream(OutputStream, tokenizer)


# %% [markdown]
# And the loop itself. It is written in two parts that the lesson loops of stages 03 and 04
# reuse: a *step iterator* that yields the next token of each sequence, one model call per
# `next()`, and `collect`, which times each step and feeds its tokens to the output streams
# until all have finished. A new loop (with a KV cache in stage 04, a compiled step after it) is
# then only a new step iterator; stage 06's engine, whose batch changes at every step, keeps the
# output streams and replaces `collect` with its scheduler. Positions are always passed to the
# model explicitly: the loop knows how far each sequence is, the model never guesses.
#
# The first part is given: the request checks, `collect`, and `run_batch`, which makes a batch
# loop from a step iterator (stages 03 and 04 use it). The step iterator is yours.

# %%
# export: generate
"""The skeleton generate loop, and the request checks and output plumbing every loop shares."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Callable, Iterator

import torch


class PromptError(ValueError):
    """A prompt the model cannot run: empty, with unknown token ids, or too long."""


class ContextLengthError(PromptError):
    """The request does not fit in the model's context window."""


def check_fits_context(prompt_len: int, max_new_tokens: int, context: int) -> None:
    """Refuse, with the numbers, a request that would run past the model's last position."""
    if prompt_len + max_new_tokens > context:
        raise ContextLengthError(
            f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} = "
            f"{prompt_len + max_new_tokens} tokens, but the model's context is {context} tokens. "
            f"Fix: shorten the prompt by {prompt_len + max_new_tokens - context} tokens or lower "
            "max_new_tokens."
        )


def check_prompt(prompt_ids: list[int], params: SamplingParams, config: ModelConfig) -> None:
    """Refuse a request the model cannot run, before any work: empty, unknown ids, too long."""
    if not prompt_ids:
        raise PromptError("the prompt is empty: give at least one token")
    bad = [i for i in prompt_ids if not 0 <= i < config.vocab_size]
    if bad:
        raise PromptError(f"prompt token ids {bad[:5]} are outside the vocabulary (0 to "
                         f"{config.vocab_size - 1}). Fix: encode the prompt with this model's tokenizer")
    check_fits_context(len(prompt_ids), params.max_new_tokens, config.max_position_embeddings)


def open_streams(
    config: ModelConfig,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    params: list[SamplingParams],
    on_text: Callable[[int, str], None] | None = None,
) -> list[OutputStream]:
    """Check every prompt, then one output stream each; ``on_text(i, text)`` streams prompt i."""
    for prompt, p in zip(prompts, params):
        check_prompt(prompt, p, config)
    stop_ids = stop_token_ids(config, tokenizer)
    return [OutputStream(tokenizer, prompt, p, stop_ids, on_text and (lambda text, i=i: on_text(i, text)))
            for i, (prompt, p) in enumerate(zip(prompts, params))]


def collect(steps: Iterator[list[int]], streams: list[OutputStream]) -> list[GenerationResult]:
    """Feed each step's tokens (one per sequence) to the streams until every one has finished.

    The time of each ``next()`` (one forward pass) is recorded for the sequences still running.
    A finished sequence ignores the tokens its row keeps producing while others continue. When
    all have finished the step iterator is closed, which frees what it holds (a KV cache).
    """
    try:
        while not all(stream.finished for stream in streams):
            start = time.perf_counter()
            tokens = next(steps, None)
            if tokens is None:
                running = [i for i, stream in enumerate(streams) if not stream.finished]
                raise RuntimeError(f"the step iterator ended while sequences {running} were still "
                                   "running: it must yield until max_new_tokens")
            elapsed = time.perf_counter() - start
            for stream, token in zip(streams, tokens):
                if not stream.finished:
                    stream.result.step_seconds.append(elapsed)
                    stream.push(token)
    finally:
        if hasattr(steps, "close"):
            steps.close()
    return [stream.result for stream in streams]


StepIterator = Callable[[LlamaModel, list[list[int]], list[SamplingParams]], Iterator[list[int]]]


def run_batch(
    steps: StepIterator,
    model: LlamaModel,
    tokenizer: Tokenizer,
    prompts: list[list[int]],
    params: SamplingParams | Sequence[SamplingParams],
    on_text: Callable[[int, str], None] | None = None,
) -> list[GenerationResult]:
    """A batch loop made from its step iterator: one ``SamplingParams`` for all prompts or one
    each, every prompt checked before any work, the results collected from the streams."""
    params = params_per_row(params, len(prompts))
    streams = open_streams(model.config, tokenizer, prompts, params, on_text)
    return collect(steps(model, prompts, params), streams)


# %% [markdown]
# ### Exercise 1.12 — the generate loop
#
# `skeleton_steps(model, prompt_ids, params)` is the step iterator of this stage's loop: a Python
# generator that yields the next token of the sequence, as a list with one token id (a batch of
# one; later loops yield one id per sequence), `params.max_new_tokens` times and then ends. The
# rules:
#
# - every step runs the model on the *whole* sequence so far — the prompt, then every token
#   yielded before — as a (1, S) tensor of ids on the model's device, with the positions
#   0 … S−1 passed explicitly, also shaped (1, S);
# - the next token is `sample_next`'s pick (above; it takes one entry per sequence), drawn with
#   the request's generator (made before the region, the same at every step) and given the whole
#   sequence so far as history (the repetition penalty needs it);
# - only new tokens are yielded, never the prompt, and the loop never stops early by itself:
#   end-of-sequence tokens and stop strings are the output streams' job, and `collect` closes
#   the iterator when every stream has finished.
#
# It is naive on purpose: every step pays for the whole sequence again — and for the output head
# at every position, although only the last position's logits are used (`logits_at` would
# skip the others; the timing table below shows the head's large output).

# %%
# export: generate
@torch.inference_mode()
def skeleton_steps(model: LlamaModel, prompt_ids: list[int], params: SamplingParams) -> Iterator[list[int]]:
    """Next tokens of one sequence, recomputing the whole sequence at every step (no cache)."""
    device = model.embed_tokens.weight.device
    generators = [make_generator(params.seed, device)]
    # BEGIN EXERCISE 1.12: yield the next token, as a one-element list, max_new_tokens times, each picked from a model run over the whole sequence so far
    # Hint 1: A decoder predicts one token at a time, and each prediction becomes part of the input of the next. Without a cache every step feeds the model the entire sequence (prompt plus everything generated) and uses only what its last position predicts.
    # Hint 2: Keep a list of ids that starts as a copy of the prompt; for each of max_new_tokens steps build a (1, S) tensor of the ids and a (1, S) tensor of positions 0 … S−1 on the model's device, call the model, pick with sample_next (params, generators and the ids as history, each wrapped for a batch of one), add the pick to the ids and yield it.
    ids = list(prompt_ids)
    for _ in range(params.max_new_tokens):
        positions = torch.arange(len(ids), device=device)[None]  # (1, S): 0 … S-1
        logits = model(torch.tensor([ids], device=device), positions)  # (1, S, vocab)
        token = sample_next(logits, [params], generators, [ids])
        ids += token
        yield token
    # END EXERCISE 1.12


# %%
# Check exercise 1.12
checks.stage01.check_skeleton_steps(skeleton_steps, model)

# %% [markdown]
# `generate` puts the parts together: it checks the request, opens the output stream and lets
# `collect` drive your step iterator.

# %%
# export: generate
def generate(
    model: LlamaModel,
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    params: SamplingParams = SamplingParams(),
    on_text: Callable[[str], None] | None = None,
) -> GenerationResult:
    """Generation that recomputes the whole sequence for every new token.

    ``on_text`` receives text as soon as it is complete (whole characters, stop strings cut),
    which is how the CLI streams to the terminal.
    """
    streams = open_streams(model.config, tokenizer, [prompt_ids], [params],
                           on_text and (lambda _, text: on_text(text)))
    return collect(skeleton_steps(model, prompt_ids, params), streams)[0]


# %% [markdown]
# ## 5. The whole loop
#
# Everything together: chat template → ids → forward → greedy pick → streaming text. The text is
# printed as it is produced.

# %%
prompt_ids = tokenizer.encode_chat("What is the capital of France?")
result = generate(model, tokenizer, prompt_ids, SamplingParams(max_new_tokens=32),
                  on_text=lambda t: print(t, end="", flush=True))
print()
print("finish reason:", result.finish_reason, "| token ids:", result.token_ids)

# %% [markdown]
# The same request, sampled: temperature 0.8 with top-p 0.9, three seeds. Expect some answers
# to wander: a 135M-parameter model is unsure even here (the plot above shows the probability of
# its best first token), and sampling gives the less likely tokens their chance — that is the
# model, not your filters. The exact words depend on the seed (and, through the last bits of the
# logits, on your processor), so this cell's text is not compared when grading; the cell after
# it checks what must hold everywhere.

# %%
# NBVAL_IGNORE_OUTPUT
for seed in (1, 2, 3):
    sampled = generate(model, tokenizer, prompt_ids, SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=seed))
    print(f"seed {seed}: {sampled.text!r}")

# %%
params = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=7)
first, again = (generate(model, tokenizer, prompt_ids, params).token_ids for _ in range(2))
print("the same seed gives the same tokens:", first == again)

# %% [markdown]
# ## 6. Timing built in from the start
#
# Where does the time go? Forward hooks on every submodule record how long it ran and how big
# its output was, without changing the model's code. Hooks are the same tool a profiler uses;
# stage 09 goes further with `torch.profiler` and a roofline chart.

# %%
# export: instrument
"""Per-module timing and memory, collected with forward hooks and shown as a table."""

from __future__ import annotations

import resource
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn


def peak_memory_bytes(device: torch.device | str = "cpu") -> int:
    """High-water mark of memory: the GPU allocator's on CUDA, the process's RSS on CPU.

    On Linux we read VmHWM, not ``getrusage``'s ru_maxrss: a child process inherits its
    parent's ru_maxrss, so a small script started from a big one would report the big one's peak.
    """
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


@dataclass
class ModuleStats:
    calls: int = 0
    seconds: float = 0.0
    largest_output_bytes: int = 0


class ModuleTimer:
    """Time every module of the given kinds while the ``with`` block runs.

    Rows are grouped by module class (all 30 ``Attention`` modules make one row), which is the
    question we usually ask: how much of a step is attention, how much the MLPs?
    """

    KINDS: tuple[type[nn.Module], ...] = (nn.Embedding, RMSNorm, Attention, MLP, nn.Linear)

    def __init__(self, model: nn.Module, kinds: tuple[type[nn.Module], ...] | None = None):
        self.model = model
        self.kinds = kinds or self.KINDS
        self.stats: dict[str, ModuleStats] = defaultdict(ModuleStats)
        self._handles = []
        self._starts: dict[int, float] = {}
        self._cuda = next(model.parameters()).is_cuda

    def _label(self, name: str, module: nn.Module) -> str:
        # The output head is a Linear too, but it is worth its own row: it is the largest matmul.
        return "lm_head" if name == "lm_head" else type(module).__name__

    def __enter__(self) -> "ModuleTimer":
        for name, module in self.model.named_modules():
            if not isinstance(module, self.kinds):
                continue
            # Linears inside Attention/MLP are already inside those rows' time.
            if isinstance(module, nn.Linear) and name != "lm_head":
                continue
            label = self._label(name, module)
            self._handles.append(module.register_forward_pre_hook(self._pre))
            self._handles.append(module.register_forward_hook(self._post_for(label)))
        return self

    def _now(self) -> float:
        if self._cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _pre(self, module, args) -> None:
        self._starts[id(module)] = self._now()

    def _post_for(self, label: str):
        def post(module, args, output) -> None:
            stats = self.stats[label]
            stats.calls += 1
            stats.seconds += self._now() - self._starts.pop(id(module))
            size = output.numel() * output.element_size()
            stats.largest_output_bytes = max(stats.largest_output_bytes, size)

        return post

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def table(self) -> str:
        total = sum(s.seconds for s in self.stats.values()) or 1.0
        lines = [f"{'module':<10} {'calls':>6} {'total ms':>9} {'ms/call':>8} {'share':>6} "
                 f"{'largest output':>15}"]
        for label, s in sorted(self.stats.items(), key=lambda kv: -kv[1].seconds):
            lines.append(
                f"{label:<10} {s.calls:>6} {s.seconds * 1e3:>9.1f} "
                f"{s.seconds * 1e3 / s.calls:>8.3f} {s.seconds / total:>6.1%} "
                f"{s.largest_output_bytes / 1e6:>12.2f} MB"
            )
        device = next(self.model.parameters()).device
        lines.append(f"peak memory of the process so far: {peak_memory_bytes(device) / 1e9:.2f} GB")
        return "\n".join(lines)


# %%
# NBVAL_IGNORE_OUTPUT
with ModuleTimer(model) as timer:
    generate(model, tokenizer, prompt_ids, SamplingParams(max_new_tokens=8))
print(timer.table())

# %% [markdown]
# The MLPs and attention blocks dominate; the output head (one 576 × 49152 matmul) is a single
# module but a big one. Note how large its output is: logits for *every position*, although we
# only use the last.
#
# ## 7. The cost of recomputing everything
#
# Our loop feeds the *whole* sequence through the model for every new token. The step that
# produces token `n + 1` is a forward pass over `n` positions, so the time per token should grow
# with the length. Let us measure it on this machine: time one step at several lengths (the best
# of three runs each, since other programs share the processor).

# %%
# NBVAL_IGNORE_OUTPUT
def step_seconds(n_tokens: int, repeats: int = 3) -> float:
    ids = torch.tensor([long_prompt[:n_tokens]])
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            greedy_step(model(ids))
            best = min(best, time.perf_counter() - start)
    return best


long_prompt = tokenizer.encode("The history of computing is a story of people and machines. " * 100)
lengths = [16, 64, 128, 256, 512, 768]
seconds = [step_seconds(n) for n in lengths]
plt.figure(figsize=(6, 3.5))
plt.plot(lengths, [s * 1e3 for s in seconds], marker="o")
plt.xlabel("sequence length when the token is produced")
plt.ylabel("ms per generated token")
plt.title("No KV cache: each step recomputes the whole sequence", fontsize=10)
plt.tight_layout()
plt.grid(alpha=0.3)
plt.show()

# %%
# NBVAL_IGNORE_OUTPUT
print(f"a step at 512 tokens costs {seconds[4] / seconds[0]:.0f}x a step at 16 tokens")

# %% [markdown]
# A step at 512 tokens costs many times a step at 16 tokens, although both produce exactly one
# token. Everything computed for the first 511 positions was computed before, in the previous
# step. Stage 04 keeps the keys and values of past positions in a *KV cache* and the time per
# token goes flat.
#
# ## Summary
#
# | part | module | what it does |
# |---|---|---|
# | weight loader | `aie_lessons.weights`, `config` | mmap safetensors, one tensor at a time |
# | preprocessing | `aie_lessons.tokenizer` | byte-level BPE, chat template |
# | forward | `aie_lessons.model` | RMSNorm, RoPE, GQA attention (pluggable), SwiGLU |
# | postprocessing | `aie_lessons.sampling`, `output`, `tokenizer` | greedy pick, sampling filters, stop rules, streaming text |
# | the loop | `aie_lessons.generate` | request checks, the step iterator, `collect` |
# | timing | `aie_lessons.instrument` | per-module time and memory |
#
# Try the engine from a terminal: `aie generate --chat "What is the capital of France?"`.
