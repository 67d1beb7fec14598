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
# # Stage 09 — Profiling and the roofline
#
# Every stage so far has timed something and compared it with something else. This stage asks
# the question behind all of those timings: **how fast could it be, on this machine?** A step of
# the engine does two things — it moves bytes from memory and it does arithmetic on them — and
# the machine has a ceiling for each. Whichever ceiling a step hits first is its limit.
#
# ```
#   attainable FLOP/s = min( peak FLOP/s ,  bandwidth × arithmetic intensity )
#                                            └─ FLOPs per byte read ─┘
# ```
#
# Drawn on log–log axes this is the **roofline**: a slope (memory-bound: more FLOPs per byte,
# more speed) that meets a flat roof (compute-bound: the arithmetic units are busy) at the
# **ridge point**, `peak / bandwidth` FLOPs per byte. Stage 04 found a batch-1 decode step far
# below the ridge: it reads every weight to do two FLOPs with it. Batching shares each weight
# read among the requests of a step, so the intensity grows with the batch — until the step
# turns compute-bound. Where that happens on your machine is this stage's first question:
#
# 1. measure the ceilings (section 1);
# 2. count a decode step's FLOPs and bytes — your exercise — and predict the batch where decode
#    turns compute-bound (section 2);
# 3. measure tokens/s against the batch size, with the prediction drawn (section 3);
# 4. profile a decode step and an engine step, to see where the time goes (section 4).

# %%
# Stages you committed with `aie commit` are imported below; this checks them first.
from aie_lessons.course.progress import verify_committed_stages

verify_committed_stages(before="09")

# %%
import math

import matplotlib.pyplot as plt
import torch

from aie_lessons import checks
from aie_lessons.infra.paths import default_model_dir
from aie_lessons.kv_cache import KVCache
from aie_lessons.model import LlamaModel
from aie_lessons.quantize import bytes_read_per_token, quantize_model
from aie_lessons.roofline import read_bandwidth
from aie_lessons.tokenizer import Tokenizer

torch.manual_seed(0)
MODEL_DIR = default_model_dir()
model = LlamaModel.from_pretrained(MODEL_DIR)
tokenizer = Tokenizer.from_pretrained(MODEL_DIR)
config = model.config

# %% [markdown]
# ## 1. The machine's ceilings
#
# Three probes, each timing what it names on data far larger than the CPU's caches (or, for
# the arithmetic, on matrices large enough to keep every core busy):
#
# * **read bandwidth** (stage 04's `read_bandwidth`): a sum and a matrix–vector product over
#   512 MiB. Decoding reads weights and cached keys and writes almost nothing, so this is the
#   bandwidth of the roofline.
# * **copy bandwidth**: `dst.copy_(src)` over 256 MiB, counting the bytes read and the bytes
#   written. It is shown for contrast: a copy's traffic is half writes, a decode step's is
#   almost all reads, so a roofline of decode built on the copy figure would be the wrong one.
# * **peak arithmetic**: a 2048 × 2048 matrix multiplication in fp32 and bf16 (`2n³` FLOPs), and
#   the integer multiplication `torch._int_mm` in int8 (operations, counted the same way). The
#   int8 × int8 product is the ceiling of a step that computed entirely in integers; stage 08's
#   kernels multiply int8 weights by bf16 activations, so bf16's peak is theirs.
#
# The best of a few runs is the ceiling: the machine reached it, so it can.

# %%
# export: ceilings
"""What this machine can do at most: bytes per second moved, and operations per second."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def best_seconds(call: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` calls after one warm-up call (which may fault pages in)."""
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes per second that a copy moves, reads and writes both counted."""
    source = torch.ones(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    return 2 * source.nbytes / best_seconds(lambda: target.copy_(source), repeats)


def matmul_throughput(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """Operations per second of a ``size``-square matrix product (2·size³ per product): FLOP/s
    in floating point, integer operations per second for ``torch.int8`` (``torch._int_mm``)."""
    if dtype == torch.int8:
        a = torch.randint(-128, 128, (size, size), dtype=torch.int8)
        b = torch.randint(-128, 128, (size, size), dtype=torch.int8)
        product = lambda: torch._int_mm(a, b)  # noqa: E731 - int8 in, int32 out
    else:
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        product = lambda: a @ b  # noqa: E731
    return 2 * size**3 / best_seconds(product, repeats)


# %%
# NBVAL_IGNORE_OUTPUT
from aie_lessons.ceilings import best_seconds, copy_bandwidth, matmul_throughput

read_bytes_per_s, _ = read_bandwidth()
ceilings = {"read": read_bytes_per_s, "copy": copy_bandwidth()}
peaks = {name: matmul_throughput(dtype) for name, dtype in
         (("fp32", torch.float32), ("bf16", torch.bfloat16), ("int8", torch.int8))}
print(f"read bandwidth  {ceilings['read'] / 1e9:7.1f} GB/s")
print(f"copy bandwidth  {ceilings['copy'] / 1e9:7.1f} GB/s (read + written)")
for name, peak in peaks.items():
    print(f"{name:>4} matmul     {peak / 1e9:7.1f} G{'FL' if name != 'int8' else ''}OP/s"
          f" → ridge at {peak / ceilings['read']:5.1f} operations per byte read")

# %% [markdown]
# The **ridge point** of each precision is printed last: a step needs at least that many
# operations per byte it reads before the arithmetic, not the memory, limits it.
#
# ## 2. A decode step in FLOPs and bytes
#
# One decode step takes one new token for each of `batch` requests, each of which has `context`
# positions to attend to (its cache plus the new token). Count:
#
# * **FLOPs** of the matrix products (the elementwise work — norms, RoPE, softmax, SiLU — is a
#   rounding error beside them, and `FlopCounterMode`, which the check compares with, counts
#   products only). Every weight matrix multiplies every request's vector: a multiply and an add
#   per weight and request — 2 FLOPs. That is the 7 projections of every block (q, k, v, o, gate, up,
#   down: their shapes follow from `hidden_size`, `num_heads × head_dim`, `num_kv_heads ×
#   head_dim` and `intermediate_size`) and the output head (`vocab_size × hidden_size`; the
#   embedding lookup is a copy, not arithmetic). Attention adds, per block and request, the
#   scores `q·k` and the weighted sum of values: for each query head, `2 × head_dim` FLOPs per
#   position for each of the two. With grouped-query attention, query heads share key and value
#   heads — the arithmetic is per *query* head.
# * **Bytes.** The weights are read once per step, whatever the batch: that is the point of
#   batching. Every request reads its own cached keys and values, `context` positions of them,
#   stored per *key-value* head (stage 04's `kv_cache_bytes`).
#
# ### Exercise 9.1 — the cost of a decode step
#
# `decode_step_cost(config, batch, context, weight_bytes, kv_dtype)` returns a `DecodeCost` with
# the step's `flops` and `bytes` as integers. `weight_bytes` is what the weights take (stage
# 08's `bytes_read_per_token`: fp32, bf16 or quantized alike); `kv_dtype` is the cache's dtype.

# %%
# export: step_cost
"""A decode step's arithmetic and memory traffic, counted from the model's shape."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aie_lessons.config import ModelConfig
from aie_lessons.kv_cache import kv_cache_bytes


@dataclass(frozen=True)
class DecodeCost:
    """One step's floating-point operations (a multiply-add is 2) and the bytes it reads."""

    flops: int
    bytes: int

    @property
    def intensity(self) -> float:
        """FLOPs per byte read: where the step sits on the roofline's x axis."""
        return self.flops / self.bytes


# %%
# export: step_cost
def decode_step_cost(config: ModelConfig, batch: int, context: int, weight_bytes: int,
                     kv_dtype: torch.dtype = torch.float32) -> DecodeCost:
    """FLOPs and bytes of one decode step: ``batch`` requests, each attending to ``context``
    positions; the weights (``weight_bytes``) are read once for the whole batch."""
    # BEGIN EXERCISE 9.1: count 2 FLOPs per weight and request for every block's 7 projections and the output head, add attention's scores and weighted sum over the context for every query head, and add to the weights' bytes every request's cached keys and values
    # Hint 1: Arithmetic grows with the batch, the weights' bytes do not; attention's arithmetic follows the query heads, the cache's bytes the key-value heads.
    # Hint 2: Per block, the projections hold hidden × (heads × head_dim) twice (q, o), hidden × (kv_heads × head_dim) twice (k, v) and hidden × intermediate three times; add vocab × hidden for the head; times 2 FLOPs, plus 4 × heads × head_dim × context per block for attention, all times batch; bytes are weight_bytes plus kv_cache_bytes for context positions and batch rows.
    hidden, head_dim = config.hidden_size, config.head_dim
    q_width, kv_width = config.num_heads * head_dim, config.num_kv_heads * head_dim
    block_weights = 2 * hidden * q_width + 2 * hidden * kv_width + 3 * hidden * config.intermediate_size
    weights = config.num_layers * block_weights + config.vocab_size * hidden
    attention = config.num_layers * 4 * config.num_heads * head_dim * context
    flops = batch * (2 * weights + attention)
    return DecodeCost(flops, weight_bytes + kv_cache_bytes(config, context, batch, kv_dtype))
    # END EXERCISE 9.1


# %%
# Check exercise 9.1
checks.stage09.check_decode_step_cost(decode_step_cost)

# %% [markdown]
# The check counted the FLOPs of a real step with `torch.utils.flop_counter.FlopCounterMode`,
# which records every matrix product PyTorch runs. Here is the same count on the course model:
# your formula beside PyTorch's own tally of one decode step (the `manual` attention backend of
# stage 02, whose products the counter sees; the fused kernel of the default backend it does
# not count).

# %%
from torch.utils.flop_counter import FlopCounterMode

import aie_lessons.attention  # noqa: F401 - registers stage 02's "manual" backend

from aie_lessons.step_cost import decode_step_cost as committed_step_cost


def counted_decode_flops(batch: int, context: int) -> int:
    """What FlopCounterMode records for one decode step of the course model."""
    ids = torch.randint(0, config.vocab_size, (batch, context))
    positions = torch.arange(context).expand(batch, context)
    cache = KVCache(config, batch, context)
    backend = model.layers[0].self_attn.backend
    model.set_attention_backend("manual")
    try:
        with torch.inference_mode():
            model(ids[:, :-1], positions[:, :-1], cache=cache, cache_start=0, last_position_only=True)
            with FlopCounterMode(display=False) as counter:
                model(ids[:, -1:], positions[:, -1:], cache=cache, cache_start=context - 1)
    finally:
        model.set_attention_backend(backend)
    return counter.get_total_flops()


for batch, context in ((1, 64), (4, 200)):
    formula = committed_step_cost(config, batch, context, bytes_read_per_token(model)).flops
    print(f"batch {batch}, context {context}: formula {formula:,} FLOPs, counted {counted_decode_flops(batch, context):,}")

# %% [markdown]
# Now the prediction. At batch 1 a step does about 2 FLOPs per weight it reads — 0.5 FLOPs per
# byte in fp32 — far left of every ridge. Each request added to the batch adds its FLOPs but
# reads the same weights, so the intensity grows almost in proportion to the batch — until the
# requests' own caches, which grow with the batch too, take over the bytes. Then the intensity
# levels off at one request's FLOPs over one request's cache bytes, whatever the batch, and a
# ridge above that level is never reached at this context. Write a step's cost as `F·b` FLOPs
# and `W + C·b` bytes (weights `W`, a request's FLOPs `F` and cache bytes `C`); it reaches the
# ridge `R` where `F·b = R·(W + C·b)`, at `b* = R·W / (F − R·C)` — if `F > R·C` at all.
#
# The quantized variants compute in bf16 (stage 08's kernels), so they are placed against
# bf16's ridge:

# %%
# NBVAL_IGNORE_OUTPUT
CONTEXT = 128
batches = [2**k for k in range(0, 11)]
bf16 = torch.bfloat16
variants = {  # name: (model, cache dtype, the peak its arithmetic runs at)
    "fp32": (model, torch.float32, "fp32"),
    "bf16": (LlamaModel.from_pretrained(MODEL_DIR, dtype=bf16, activations=bf16), bf16, "bf16"),
    "int8": (quantize_model(LlamaModel.from_pretrained(MODEL_DIR, activations=bf16), "int8"), bf16, "bf16"),
    "int4-g32": (quantize_model(LlamaModel.from_pretrained(MODEL_DIR, activations=bf16), "int4-g32"), bf16, "bf16"),
}


def compute_bound_from(weight_bytes: int, kv_dtype: torch.dtype, ridge: float) -> float | None:
    """The batch b* where a decode step's intensity reaches ``ridge`` (None: never, at CONTEXT)."""
    one, two = (committed_step_cost(config, b, CONTEXT, weight_bytes, kv_dtype) for b in (1, 2))
    per_request_cache = two.bytes - one.bytes
    weights = one.bytes - per_request_cache
    if one.flops <= ridge * per_request_cache:
        return None
    return ridge * weights / (one.flops - ridge * per_request_cache)


turns = {}
for name, (variant, kv_dtype, peak_name) in variants.items():
    size = bytes_read_per_token(variant)
    at = {b: committed_step_cost(config, b, CONTEXT, size, kv_dtype).intensity for b in (1, 64, 10**6)}
    ridge = peaks[peak_name] / ceilings["read"]
    turns[name] = compute_bound_from(size, kv_dtype, ridge)
    print(f"{name:>8}: intensity at batch 1 {at[1]:5.2f}, 64 {at[64]:5.1f}, a million {at[10**6]:5.1f} "
          f"FLOPs/byte; {peak_name} ridge {ridge:5.1f} → compute-bound "
          + (f"from batch {math.ceil(turns[name])}" if turns[name] else f"never at context {CONTEXT}"))

# %% [markdown]
# The roofline itself, with every variant's decode step drawn at each batch size:

# %%
fig, ax = plt.subplots(figsize=(7, 4.2))
intensity_axis = [2**k for k in range(-3, 11)]
for peak_name, peak in peaks.items():
    ax.plot(intensity_axis, [min(peak, ceilings["read"] * i) / 1e9 for i in intensity_axis],
            label=f"roofline, {peak_name} peak", linewidth=1.5)
for (name, (variant, kv_dtype, peak_name)), marker in zip(variants.items(), "osD^"):
    costs = [committed_step_cost(config, b, CONTEXT, bytes_read_per_token(variant), kv_dtype) for b in batches]
    peak = peaks[peak_name]
    ax.scatter([c.intensity for c in costs], [min(peak, ceilings["read"] * c.intensity) / 1e9 for c in costs],
               marker=marker, s=22, label=f"decode step, {name} (batch 1 … 1024)", zorder=3)
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("arithmetic intensity (operations per byte read)")
ax.set_ylabel("attainable G(FL)OP/s")
ax.set_title(f"Decode steps on this machine's roofline (context {CONTEXT})")
ax.legend(fontsize=7)
ax.grid(alpha=0.3, which="both")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## 3. Measured: tokens per second against the batch
#
# The prediction says how many tokens per second a step could give at each batch:
# `batch / max(FLOPs / peak, bytes / bandwidth)`. Here is the fp32 model, one decode step at
# position 127 (attending to 128 positions), at batch 1 … 64, with that line drawn.

# %%
# NBVAL_IGNORE_OUTPUT
def decode_step_seconds(variant: LlamaModel, batch: int, context: int, kv_dtype: torch.dtype) -> float:
    """The fastest of five decode steps (after a warm-up) of ``batch`` requests at position
    ``context - 1``: the step least disturbed by the rest of the machine. The cache is not
    prefilled: attention over ``context`` positions costs the same whatever they hold."""
    ids = torch.randint(0, config.vocab_size, (batch, 1))
    positions = torch.full((batch, 1), context - 1)
    cache = KVCache(config, batch, context, dtype=kv_dtype)
    with torch.inference_mode():
        return best_seconds(lambda: variant(ids, positions, cache=cache, cache_start=context - 1), repeats=5)


measured_batches = [1, 2, 4, 8, 16, 32, 64]
measured = {b: b / decode_step_seconds(model, b, CONTEXT, torch.float32) for b in measured_batches}
predicted = {}
for b in batches:
    cost = committed_step_cost(config, b, CONTEXT, bytes_read_per_token(model))
    predicted[b] = b / max(cost.flops / peaks["fp32"], cost.bytes / ceilings["read"])
for b in measured_batches:
    print(f"batch {b:>3}: {measured[b]:7.1f} tok/s measured, {predicted[b]:8.1f} predicted "
          f"({measured[b] / predicted[b]:.0%} of it)")

# %%
fig, ax = plt.subplots(figsize=(6.5, 3.8))
ax.plot(batches, [predicted[b] for b in batches], color="tab:red", label="roofline prediction")
ax.plot(measured_batches, [measured[b] for b in measured_batches], marker="o", label="measured, fp32")
if turns["fp32"]:
    ax.axvline(math.ceil(turns["fp32"]), color="grey", linewidth=1, linestyle="--")
    ax.annotate("predicted turn to compute-bound", (math.ceil(turns["fp32"]), 0.05), xycoords=("data", "axes fraction"),
                xytext=(4, 0), textcoords="offset points", fontsize=8, color="grey")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("requests per decode step (batch)")
ax.set_ylabel("tokens/s")
ax.set_title("Decode throughput against the batch, fp32")
ax.legend(fontsize=8)
ax.grid(alpha=0.3, which="both")
fig.tight_layout()
plt.show()

# %% [markdown]
# Read the chart against the prediction: while the step is memory-bound, tokens/s grows with
# the batch, because each step's weight reads serve more requests; past the turn the line
# flattens, because every request now costs arithmetic the roof caps. The gap between the two
# lines is what the rest of this stage is about: the measured step falls short of its ceiling
# — by how much is printed above — and a profile says where the time goes.
#
# ## 4. Where the time goes: the profiler
#
# `torch.profiler` records every operator PyTorch runs, with its start, its end and the
# operators it called. Its table sorts them by the time spent in each operator itself (*self*
# time, without the operators it called): the first rows are where a step's time goes. First,
# one eager decode step of the fp32 model at batch 1, after a 127-token prompt:


# %%
# NBVAL_IGNORE_OUTPUT
from torch.profiler import ProfilerActivity, profile

ids = torch.randint(0, config.vocab_size, (1, CONTEXT))
positions = torch.arange(CONTEXT)[None]
cache = KVCache(config, 1, CONTEXT)
with torch.inference_mode():
    model(ids[:, :-1], positions[:, :-1], cache=cache, cache_start=0, last_position_only=True)
    step = lambda: model(ids[:, -1:], positions[:, -1:], cache=cache, cache_start=CONTEXT - 1)  # noqa: E731
    for _ in range(3):
        step()  # warm-up: first calls allocate and pick kernels
    with profile(activities=[ProfilerActivity.CPU]) as decode_profile:
        step()
events = decode_profile.key_averages()
print(events.table(sort_by="self_cpu_time_total", row_limit=10))
products = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))
print(f"matrix products: {products / sum(e.self_cpu_time_total for e in events):.0%} of the step's self time")

# %% [markdown]
# The table is a sum; the **trace** keeps every call in order. `export_chrome_trace` writes it
# as JSON in the Chrome trace format: open it at <https://ui.perfetto.dev> (drag the file in;
# it is read in your browser, nothing is uploaded) or in Chrome at `chrome://tracing`, and zoom
# into one step. The file lands in `data/cache/traces/`. The same events, drawn here: every
# operator called directly by the model's Python code (not those nested inside another), on a
# time line.

# %%
# NBVAL_IGNORE_OUTPUT
import json

from aie_lessons.infra.paths import CACHE_DIR

trace_path = CACHE_DIR / "traces" / "decode_step_fp32_batch1.json"
trace_path.parent.mkdir(parents=True, exist_ok=True)
decode_profile.export_chrome_trace(str(trace_path))
print(f"trace: {trace_path} ({trace_path.stat().st_size / 1e6:.1f} MB)")

# %%
# NBVAL_IGNORE_OUTPUT
trace_events = [e for e in json.loads(trace_path.read_text())["traceEvents"]
                if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
trace_events.sort(key=lambda e: (e["ts"], -e["dur"]))
top_level, end_of_last = [], -1.0
for event in trace_events:  # an operator that starts after the previous top-level one ended
    if event["ts"] >= end_of_last:
        top_level.append(event)
        end_of_last = event["ts"] + event["dur"]
kinds = {"matrix products": ("aten::linear", "aten::matmul", "aten::mm", "aten::addmm"),
         "attention": ("aten::scaled_dot_product_attention",),
         "cache write": ("aten::copy_", "aten::index_put_", "aten::slice_scatter")}
colors = {"matrix products": "tab:blue", "attention": "tab:orange", "cache write": "tab:green",
          "everything else": "tab:grey"}
origin = top_level[0]["ts"]
fig, ax = plt.subplots(figsize=(10, 1.8))
for event in top_level:
    kind = next((k for k, names in kinds.items() if event["name"] in names), "everything else")
    ax.broken_barh([((event["ts"] - origin) / 1e3, max(event["dur"] / 1e3, 0.002))], (0, 1), color=colors[kind])
ax.set_yticks([])
ax.set_xlabel("ms since the step's first operator")
ax.set_title("One decode step, operator by operator (fp32, batch 1)")
ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()], labels=list(colors),
          fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.45))
fig.tight_layout()
plt.show()
time_in = {kind: sum(e["dur"] for e in top_level
                     if (next((k for k, names in kinds.items() if e["name"] in names), "everything else")) == kind)
           for kind in colors}
print(", ".join(f"{kind} {us / 1e3:.2f} ms" for kind, us in time_in.items()))

# %% [markdown]
# The engine's step is more than the model: stage 06's `Engine.step` schedules, prepares the
# batch's tensors, runs the model, samples and postprocesses, and records the seconds of each
# phase in its `StepStats`. Here is one decode step of stage 07's engine with 1 and with 16
# requests running, each profiled, and the phases as the engine itself measured them:

# %%
# NBVAL_IGNORE_OUTPUT
from aie_lessons.engine.paged_engine import paged_engine
from aie_lessons.sampling import SamplingParams


def profiled_engine_step(running: int):
    """Start ``running`` requests and step until all decode; profile a step, and return the
    ``StepStats`` of the next one, which runs without the profiler's cost."""
    engine = paged_engine(model, tokenizer, max_seqs=running, kv_bytes=256 * 2**20)
    prompt = tokenizer.encode("The history of computing is a story of people and machines.")
    for _ in range(running):
        engine.add_request(prompt, SamplingParams(max_new_tokens=64, ignore_eos=True))
    while engine.stats == [] or engine.stats[-1].prefill_tokens or engine.stats[-1].decode_rows < running:
        engine.step()
    for _ in range(2):  # the first profiled step pays the profiler's own start-up: keep the second
        with profile(activities=[ProfilerActivity.CPU]) as engine_profile:
            engine.step()
    engine.step()  # the phases of a step the profiler did not slow down
    return engine.stats[-1], engine_profile


for running in (1, 16):
    stats, engine_profile = profiled_engine_step(running)
    phases = {"schedule": stats.schedule_s, "prepare": stats.prepare_s, "run": stats.run_s,
              "sample": stats.sample_s, "postprocess": stats.postprocess_s}
    print(f"{running:>2} running: " + ", ".join(f"{name} {s * 1e3:.2f} ms" for name, s in phases.items())
          + f" → engine overhead {stats.overhead_s / stats.total_s:.0%} of the step")
    print(engine_profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=6))

# %% [markdown]
# The model's forward pass (`run`) is almost the whole step, and matrix products are most of the
# forward pass: the profile agrees with the roofline that a decode step is weight-reading. With
# 16 requests the same weights serve 16 rows, so `run` grows far less than 16-fold. The
# engine's own Python work — every phase but `run` — is the printed share of the step. It is
# small beside an eager model, but it does not shrink when the model gets faster: the faster
# the forward pass, the more it counts.
#
# ## Summary
#
# * The roofline: attainable speed is the lesser of the arithmetic peak and bandwidth ×
#   intensity; the ridge point separates memory-bound from compute-bound work.
# * A decode step does 2 FLOPs per weight per request and reads each weight once per step:
#   batching raises its intensity, until the caches' bytes, which grow with the batch, take over.
# * Measured ceilings turn the count (your exercise 9.1) into a prediction of the batch where
#   decode turns compute-bound, and of the tokens/s each batch could reach.
# * The profiler's table says which operators take the time, its trace (open it in Perfetto)
#   when; the engine's `StepStats` split a step into its phases.
#
# Commit the stage with `aie commit 09`.
