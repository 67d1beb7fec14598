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
# 4. profile a decode step and an engine step, to see where the time goes (section 4);
# 5. climb a ladder of decoders, one measured change per rung, toward the roofline (section 5);
# 6. compile the engine's decode step for a few batch sizes, and measure it against the eager
#    engine (section 6);
# 7. on a GPU, where there is one: its ceilings, the Triton kernels of stages 05 and 07 against
#    PyTorch, and the engine's decode speed (section 7).

# %%
# Stages you committed with `aie commit` are imported below; this checks them first.
from aie_lessons.course.progress import verify_committed_stages

verify_committed_stages(before="09")

# %%
import math
import statistics
import time

import matplotlib.pyplot as plt
import torch

from aie_lessons import checks
from aie_lessons.infra.compile_cache import use_compile_cache
from aie_lessons.infra.paths import default_model_dir
from aie_lessons.kv_cache import KVCache
from aie_lessons.model import LAST_POSITION, AttentionMetadata, LlamaModel
from aie_lessons.quantize import bytes_read_per_token, quantize_model
from aie_lessons.roofline import read_bandwidth
from aie_lessons.tokenizer import Tokenizer

use_compile_cache()  # what torch.compile builds is kept in data/cache/inductor, a folder per instruction set
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
# * **peak arithmetic**: a square matrix multiplication in fp32 and bf16 (`2n³` FLOPs), and
#   the integer multiplication `torch._int_mm` in int8 (operations, counted the same way). The
#   int8 × int8 product is the ceiling of a step that computed entirely in integers; stage 08's
#   kernels multiply int8 weights by bf16 activations, so bf16's peak is theirs.
#
# The best of a few runs is the ceiling: the machine reached it, so it can. The matrices' size
# is not fixed, because the same product takes 0.01 s on one CPU and seconds on another: a CPU
# with bf16 or int8 dot-product instructions (AVX-512 BF16, AMX, VNNI) multiplies those types
# at or above fp32's speed, while one without them (an AVX2-only CPU such as AMD Zen 3) takes a
# fallback path many times slower. So the probe **sizes itself**: it
# doubles the side from 64 until one product takes a tenth of a second (2048 at most), and
# measures there. A slow path still gets measured, on small matrices, so you see the cliff
# without waiting minutes for it. `aie env` (and stage 00) names the instructions your CPU has.

# %%
# export: ceilings
"""What this machine can do at most: bytes per second moved, and operations per second."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch


def best_seconds(call: Callable[[], object], repeats: int, device: torch.device | str = "cpu") -> float:
    """The fastest of ``repeats`` calls after one warm-up call (which may fault pages in). On a
    GPU, which runs asynchronously, each call is waited for, so the time is the GPU's."""
    def wait() -> None:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    call()
    wait()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        wait()
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth(megabytes: int = 256, repeats: int = 5, device: torch.device | str = "cpu") -> float:
    """Bytes per second that a copy moves, reads and writes both counted."""
    source = torch.ones(megabytes * 2**20 // 4, device=device)
    target = torch.empty_like(source)
    return 2 * source.nbytes / best_seconds(lambda: target.copy_(source), repeats, device)


class Peak(NamedTuple):
    """A measured arithmetic ceiling, and the side of the square matrices it was measured on."""

    per_second: float
    size: int


def square_product(dtype: torch.dtype, size: int, device: torch.device | str = "cpu") -> Callable[[], object]:
    """A ``size``-square matrix product in ``dtype``, ready to call: ``torch._int_mm`` for
    ``torch.int8`` (int8 in, int32 out), ``F.linear`` otherwise."""
    if dtype == torch.int8:
        a = torch.randint(-128, 128, (size, size), dtype=torch.int8, device=device)
        b = torch.randint(-128, 128, (size, size), dtype=torch.int8, device=device)
        return lambda: torch._int_mm(a, b)
    x, weight = (torch.randn(size, size, dtype=dtype, device=device) for _ in range(2))
    # F.linear, the model's own layout (weight rows are output features): without bf16
    # instructions, PyTorch's fallback for `a @ b` is several times slower still, so a peak
    # measured that way would sit below what the model's products reach.
    return lambda: torch.nn.functional.linear(x, weight)


def matmul_throughput(dtype: torch.dtype, size: int | None = None, repeats: int = 5,
                      device: torch.device | str = "cpu", seconds: float = 0.1, max_size: int = 2048) -> Peak:
    """Operations per second of a square matrix product (2·size³ per product): FLOP/s in
    floating point, integer operations per second for ``torch.int8``.

    Without ``size`` the probe sizes itself: it doubles the side from 64 until one product (its
    second call, past any first-call set-up) takes ``seconds``, or the side reaches ``max_size``.
    Small matrices under-use a fast unit, so a fast path grows to a size that shows its peak;
    a slow path stops early, so its probe stays short on every CPU: about (repeats + 3) products
    of ``seconds`` each at the size it stops at, plus the smaller ones before it.
    """
    if size is None:
        size = 64
        while size < max_size:
            product = square_product(dtype, size, device)
            if best_seconds(product, 1, device) >= seconds:
                break
            size *= 2
    return Peak(2 * size**3 / best_seconds(square_product(dtype, size, device), repeats, device), size)


# %%
# NBVAL_IGNORE_OUTPUT
from aie_lessons.ceilings import best_seconds, copy_bandwidth, matmul_throughput
from aie_lessons.infra.environment import bf16_line, cpu_facts, int8_line

read_bytes_per_s, _ = read_bandwidth()
ceilings = {"read": read_bytes_per_s, "copy": copy_bandwidth()}
measured_peaks = {name: matmul_throughput(dtype) for name, dtype in
                  (("fp32", torch.float32), ("bf16", torch.bfloat16), ("int8", torch.int8))}
peaks = {name: peak.per_second for name, peak in measured_peaks.items()}
print(f"read bandwidth  {ceilings['read'] / 1e9:7.1f} GB/s")
print(f"copy bandwidth  {ceilings['copy'] / 1e9:7.1f} GB/s (read + written)")
for name, (peak, size) in measured_peaks.items():
    print(f"{name:>4} matmul     {peak / 1e9:7.1f} G{'FL' if name != 'int8' else ''}OP/s at {size:>4} × {size:<4}"
          f" → ridge at {peak / ceilings['read']:5.1f} operations per byte read")
cpu = cpu_facts()
for name, units in (("bf16", bf16_line(cpu)), ("int8", int8_line(cpu))):
    stopped = measured_peaks[name].size < measured_peaks["fp32"].size
    print(f"{name}: {peaks[name] / peaks['fp32']:.2f}× fp32's speed"
          f"{' (measured smaller: its products reached a tenth of a second sooner)' if stopped else ''}; "
          f"this CPU's {name} instructions: {units}")

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
"""A decode step's arithmetic and memory traffic: counted from the model's shape, and recorded
operator by operator as a step runs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

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
# your formula beside PyTorch's own tally of one decode step (with stage 02's `manual_attention`
# kernel, whose products the counter sees; PyTorch's fused kernel, the default, it does not
# count).

# %%
from torch.utils.flop_counter import FlopCounterMode

from aie_lessons.attention import manual_attention  # stage 02's kernel: its matmuls are counted

from aie_lessons.step_cost import decode_step_cost as committed_step_cost


def counted_decode_flops(batch: int, context: int) -> int:
    """What FlopCounterMode records for one decode step of the course model."""
    ids = torch.randint(0, config.vocab_size, (batch, context))
    positions = torch.arange(context).expand(batch, context)
    cache = KVCache(config, batch, context)
    kernel = model.attention
    model.use_attention(manual_attention)
    try:
        with torch.inference_mode():
            model(ids[:, :-1], positions[:, :-1], AttentionMetadata(cache=cache, cache_start=0, logits_at=LAST_POSITION))
            with FlopCounterMode(display=False) as counter:
                model(ids[:, -1:], positions[:, -1:], AttentionMetadata(cache=cache, cache_start=context - 1))
    finally:
        model.use_attention(kernel)
    return counter.get_total_flops()


for batch, context in ((1, 64), (4, 200)):
    formula = committed_step_cost(config, batch, context, bytes_read_per_token(model)).flops
    print(f"batch {batch}, context {context}: formula {formula:,} FLOPs, counted {counted_decode_flops(batch, context):,}")

# %% [markdown]
# Now the prediction. At batch 1 a step does about 2 FLOPs per weight it reads — 0.5 FLOPs per
# byte in fp32 — left of the ridges a CPU with fast units has (section 1 printed yours: a CPU
# without bf16 or int8 instructions has such a low peak for them that even batch 1 can sit
# right of their ridge). Each request added to the batch adds its FLOPs but
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
# ### Every operator on the roofline
#
# The step's totals hide its parts. Each operator of a step has an intensity of its own: a
# matrix product at batch 64 does 64 multiply-adds per weight it reads, while RMSNorm, RoPE,
# SiLU and the residual adds do about one operation per number they read and write, whatever
# the batch. `op_costs` runs a step under a `TorchDispatchMode` — the mechanism
# `FlopCounterMode` is built on — and records every operator PyTorch dispatches: its FLOPs by
# `FlopCounterMode`'s own formulas (`flop_registry`: the products; stage 08's integer kernels,
# which it has no formula for, count a multiply-add per weight and row, like `mm`), and its
# bytes, the tensors it reads and writes. Views move no data and are left out; an embedding lookup reads only the
# rows it returns.

# %%
# export: step_cost
@dataclass(frozen=True)
class OpCost:
    """One dispatched operator: its name, FLOPs (FlopCounterMode's formulas; 0 for operators
    it does not count, such as elementwise ones and reductions), the bytes it reads and writes,
    and the elements of its largest operand (about one operation each, for an operator the
    formulas do not count: an elementwise one touches each once, a reduction each input)."""

    name: str
    flops: int
    bytes: int
    elements: int

    @property
    def intensity(self) -> float:
        """Operations per byte: the counted FLOPs, or one per element written if none counted."""
        return (self.flops or self.elements) / self.bytes


def _integer_kernel_flops(flat: torch.Tensor, weights: torch.Tensor, *args: object, out_val: torch.Tensor) -> int:
    """PyTorch's int8 and int4 CPU kernels (stage 08), which ``flop_registry`` has no formula
    for: a multiply-add per weight and row, as for ``mm``."""
    return 2 * flat.shape[0] * flat.shape[1] * out_val.shape[1]


EXTRA_FLOPS = {torch.ops.aten._weight_int8pack_mm: _integer_kernel_flops,
               torch.ops.aten._weight_int4pack_mm_for_cpu: _integer_kernel_flops}


class _OpRecorder(TorchDispatchMode):
    """Runs every operator as usual and appends its ``OpCost`` to ``costs``."""

    def __init__(self) -> None:
        super().__init__()
        self.costs: list[OpCost] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func._overloadpacket
        formulas = {**flop_registry, **EXTRA_FLOPS}
        if packet not in formulas:  # a composite (linear, matmul): record what it is made of,
            with self:                   # as FlopCounterMode does, so its products are counted
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        returns = func._schema.returns
        if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
            return out  # a view: a new way to read existing memory, no data moved
        flops = formulas[packet](*args, **kwargs, out_val=out) if packet in formulas else 0
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if packet is torch.ops.aten.embedding:
            inputs = outputs  # a lookup reads the rows it returns, not the whole table
        self.costs.append(OpCost(str(packet).removeprefix("aten."), int(flops),
                                 sum(t.nbytes for t in inputs + outputs),
                                 max((t.numel() for t in inputs + outputs), default=0)))
        return out


def op_costs(run: Callable[[], object]) -> list[OpCost]:
    """The ``OpCost`` of every operator ``run()`` dispatches, in order. On the ``meta`` device
    nothing is computed — only shapes — so a whole prefill at batch 64 costs milliseconds."""
    recorder = _OpRecorder()
    with recorder:
        run()
    return recorder.costs


# %% [markdown]
# Decode and prefill (a 128-token prompt), at batch 1, 16 and 64, in fp32, bf16 and stage 08's
# int8 and int4: the fp32 and bf16 models run on the `meta` device, where operators compute
# shapes only, and so do the quantized prefills, which take stage 08's plain path at any batch.
# A quantized decode step of up to 16 rows runs PyTorch's integer kernels, which `meta` does not
# take, so those run for real. Attention uses stage 02's `manual_attention` kernel, whose
# products the formulas count. Each operator is drawn on the roof at its own intensity; an operator that
# `FlopCounterMode` does not count is drawn at one operation per element of its output.

# %%
# NBVAL_IGNORE_OUTPUT
from aie_lessons.step_cost import op_costs

PROMPT_TOKENS = 128


def step_ops(variant_name: str, phase: str, batch: int) -> list:
    """Every operator of one step of ``variant_name`` (see ``variants``), on meta where faithful."""
    dtype, activations, scheme = {"fp32": (torch.float32, torch.float32, None),
                                  "bf16": (bf16, bf16, None),
                                  "int8": (torch.float32, bf16, "int8"),
                                  "int4-g32": (torch.float32, bf16, "int4-g32")}[variant_name]
    real = scheme is not None and phase == "decode" and batch <= 16  # the integer kernels: run them
    device = "cpu" if real else "meta"
    if real:
        step_model = variants[variant_name][0]
    else:
        with torch.device("meta"):
            step_model = LlamaModel(config, manual_attention, activations).to(dtype)
        if scheme:
            quantize_model(step_model, scheme)
    kernel = step_model.attention
    step_model.use_attention(manual_attention)
    tokens = 1 if phase == "decode" else PROMPT_TOKENS
    start = PROMPT_TOKENS if phase == "decode" else 0
    cache = KVCache(config, batch, PROMPT_TOKENS + 1, dtype=variants[variant_name][1], device=device)
    ids = torch.zeros(batch, tokens, dtype=torch.long, device=device)
    positions = (start + torch.arange(tokens, device=device)).expand(batch, tokens)
    step = AttentionMetadata(cache=cache, cache_start=start, logits_at=LAST_POSITION)
    run = lambda: step_model(ids, positions, step)  # noqa: E731
    try:
        with torch.inference_mode():
            if real:
                run()  # the kernels' weight layout is made on first use: not part of a step
            return op_costs(run)
    finally:
        step_model.use_attention(kernel)


op_table = {(name, phase, batch): step_ops(name, phase, batch)
            for name in variants for phase in ("decode", "prefill") for batch in (1, 16, 64)}
print(f"{'':>8} {'phase':>8} {'batch':>5} {'operators':>9} {'FLOPs counted':>14} {'bytes':>9} "
      f"{'bytes in memory-bound operators':>32}")
for (name, phase, batch), ops in op_table.items():
    ridge = peaks[variants[name][2]] / ceilings["read"]
    total = sum(op.bytes for op in ops)
    bound = sum(op.bytes for op in ops if op.bytes and op.intensity < ridge)
    print(f"{name:>8} {phase:>8} {batch:>5} {len(ops):>9,} {sum(op.flops for op in ops) / 1e9:>11.2f} G "
          f"{total / 1e6:>7.0f} MB {bound / total:>31.0%}")

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
all_intensities = [op.intensity for ops in op_table.values() for op in ops if op.bytes]
op_axis = [2**k for k in range(math.floor(math.log2(min(all_intensities))), 12)]
kind_of = {"mm": "matrix products", "addmm": "matrix products", "bmm": "attention products",
           "_weight_int8pack_mm": "integer kernels", "_weight_int4pack_mm_for_cpu": "integer kernels"}
kind_colors = {"matrix products": "tab:blue", "attention products": "tab:orange", "integer kernels": "tab:purple",
               "not counted (1 op/element)": "tab:grey"}
sizes = {1: 10, 16: 30, 64: 70}
for ax, phase in zip(axes, ("decode", "prefill")):
    for peak_name, peak in peaks.items():
        ax.plot(op_axis, [min(peak, ceilings["read"] * i) / 1e9 for i in op_axis], linewidth=1, color="black",
                alpha=0.3 + 0.2 * list(peaks).index(peak_name))
        ax.annotate(f"{peak_name} peak", (op_axis[-1], peak / 1e9), fontsize=7, ha="right", va="bottom")
    for (name, op_phase, batch), ops in op_table.items():
        if op_phase != phase:
            continue
        peak = peaks[variants[name][2]]
        for kind, color in kind_colors.items():
            chosen = [op for op in ops if kind_of.get(op.name, "not counted (1 op/element)") == kind and op.bytes]
            if not chosen:
                continue
            intensity = [op.intensity for op in chosen]
            ax.scatter(intensity, [min(peak, ceilings["read"] * i) / 1e9 for i in intensity], s=sizes[batch],
                       color=color, alpha=0.25, edgecolors="none")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity of the operator (operations per byte)")
    ax.set_title(f"one {phase} step" + (" (128 tokens per request)" if phase == "prefill" else ""), fontsize=9)
    ax.grid(alpha=0.3, which="both")
axes[0].set_ylabel("attainable G(FL)OP/s on this machine")
fig.suptitle("Every operator on the roofline: fp32, bf16, int8, int4; batch 1, 16, 64 (small to large)", fontsize=10)
axes[1].legend(handles=[plt.Line2D([], [], marker="o", linestyle="none", color=c) for c in kind_colors.values()],
               labels=list(kind_colors), fontsize=7, loc="lower right")
fig.tight_layout()
plt.show()

# %% [markdown]
# Read the two panels with the table's last column, the share of a step's bytes that moves
# through memory-bound operators. In a decode step the products slide right with the batch but
# start far left of every ridge of a fast unit. A prefill gives each weight 128 tokens per request, and its
# products climb toward the roof — while the elementwise operators stay where they were, at
# about one operation per element, memory-bound at any batch. That is why fusing them into the
# products' loops (section 5) matters, and matters more the faster the products get.


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
        step = AttentionMetadata(cache=cache, cache_start=context - 1)
        return best_seconds(lambda: variant(ids, positions, step), repeats=5)


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
    model(ids[:, :-1], positions[:, :-1], AttentionMetadata(cache=cache, cache_start=0, logits_at=LAST_POSITION))
    decode = AttentionMetadata(cache=cache, cache_start=CONTEXT - 1)
    step = lambda: model(ids[:, -1:], positions[:, -1:], decode)  # noqa: E731
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
    while not engine.stats or engine.stats[-1].prefill_tokens or engine.stats[-1].decode_rows < running:
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

# %% [markdown]
# ## 5. The decoder ladder
#
# Section 4's profile of the eager step showed two costs: the matrix products, most of the
# step, and a long tail of small operators, each a call for almost no arithmetic. A decoder built for batch 1 attacks both, one change at a time. Each rung
# below is one change, in one cell, measured: tokens per second and the share of the read
# roofline (bandwidth ÷ the bytes a step reads — that rung's own bytes).
#
# 1. **Eager with cache** — stage 04's loop, the starting point.
# 2. **One-token step, static buffers** — a decode step written for exactly one new token: the
#    RoPE angles come from a table made once per request, the cache row is written in place,
#    the step returns the next token instead of a vocabulary of logits, and attention for the
#    one query is spelled out (your exercise 9.2). It is written for the compiler of rung 4;
#    run eagerly, as here, it is not meant to be faster.
# 3. **Fused projections** — q, k and v read the same input, so they become one matrix, as do
#    gate and up: fewer, larger passes over memory.
# 4. **Compiled step** — `torch.compile` turns each layer into a handful of loops of generated
#    C++: every weight streamed once, on every core, with the norms, RoPE, the cache write and
#    the residual adds fused into those loops instead of dispatched one by one. The products
#    are written as what they are, `(W * x).sum(-1)`, so the compiler can fuse them.
# 5. **bf16 weights, fp32 activations** — half the bytes per weight; a token's activations are
#    a few kilobytes, so they stay fp32 and the inner loop converts each weight as it reads it
#    (stage 04, section 7 measured what fp32 activations keep).
# 6. **Packed in reading order, in huge pages** — every matrix a step reads moves into one
#    block of memory, in the order the step reads it, which Linux is asked to back with 2 MB
#    pages instead of 4 KB ones. Every address is translated through the TLB, a small cache of
#    page-table entries; streaming in 4 KB pages misses it at every page, and each miss stalls
#    the hardware prefetcher, which stops at page edges. Same bytes, fewer misses.
# 7. **Several layers per compiled call** — each call from Python into compiled code has a
#    fixed cost (guards, the wrapper, allocating outputs) paid while the memory idles; one call
#    for five layers pays it for five layers at once (the cell prints the calls per step). The
#    compiler unrolls the layers, so its code grows with them.
# 8. **int8 and int4 weights** — stage 08's schemes, read by integer kernels (the course's own
#    on x86, PyTorch's elsewhere) inside the compiled step: fewer bytes again (each rung prints
#    its bytes per step).
#
# The decoders are stage 04's contract — same prompt, same tokens — so each rung's cell also
# says whether its tokens changed. First the building blocks, then your rung.

# %%
# NBVAL_IGNORE_OUTPUT
from aie_lessons.cached_generate import cached_steps, generate_cached
from aie_lessons.roofline import decode_bytes_per_token
from aie_lessons.sampling import SamplingParams

ladder_prompt = tokenizer.encode_chat("Write a long story about a lighthouse keeper and the sea.")
LADDER_STEPS = 32  # decode steps timed per rung, after one untimed warm-up step
ladder_params = SamplingParams(max_new_tokens=LADDER_STEPS + 2, ignore_eos=True)
ladder_context = len(ladder_prompt) + LADDER_STEPS // 2  # the middle timed step's context
ladder_bandwidth, _ = read_bandwidth()  # the best pass: what the memory can do (the median unused)
print(f"prompt: {len(ladder_prompt)} tokens; each rung times {LADDER_STEPS} decode steps, the median "
      f"counts; read bandwidth now: {ladder_bandwidth / 1e9:.1f} GB/s")


def steps_per_second(steps) -> float:
    """Median decode rate of a token iterator (``FastDecoder.tokens`` or stage 04's
    ``cached_steps``): its first ``next()`` is the prefill and its second a warm-up step, both
    untimed; then LADDER_STEPS steps, one at a time."""
    next(steps), next(steps)
    seconds = []
    for _ in range(LADDER_STEPS):
        start = time.perf_counter()
        next(steps)
        seconds.append(time.perf_counter() - start)
    return 1 / statistics.median(seconds)


ladder = {}  # rung name: (tokens/s, bytes a step reads)


def measure_rung(name: str, tokens_per_s: float, step_bytes: int) -> None:
    """Record a rung and print its speed against the read roofline of its own bytes."""
    ladder[name] = (tokens_per_s, step_bytes)
    roof = ladder_bandwidth / step_bytes
    print(f"{name}: {tokens_per_s:6.1f} tokens/s, {step_bytes / 1e6:5.0f} MB per step, "
          f"{tokens_per_s / roof:4.0%} of its roofline ({roof:5.1f} tokens/s)")


reference_tokens = generate_cached(model, tokenizer, [ladder_prompt], ladder_params)[0].token_ids
measure_rung("1. eager with cache", steps_per_second(cached_steps(model, [ladder_prompt], [ladder_params])),
             decode_bytes_per_token(model, ladder_context, torch.float32))

# %% [markdown]
# The building blocks: the one product a decode step does (`gemv`), the weights grouped by the
# input they read, and the packing of rung 6. `decode_groups` lists every matrix a step reads,
# in the order it reads them; a group is stacked into one matrix (rung 3) and, packed, all of
# them become views of one block (rung 6).

# %%
# export: fast_decode
"""Batch-1 decoding near the memory roofline: fused weights, a compiled step, packed or quantized weights."""

from __future__ import annotations

import mmap
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from aie_lessons.generate import check_prompt, collect, open_streams
from aie_lessons.infra import int_kernels
from aie_lessons.kv_cache import KVCache, kv_cache_bytes
from aie_lessons.model import LAST_POSITION, AttentionMetadata, LlamaModel, rms_norm, rope_cos_sin
from aie_lessons.quantize import (INT4_KERNEL_GROUP_SIZES, QuantizedLinear, QuantScheme, kernel_fits,
                                  kernel_layout, kernel_matmul)
from aie_lessons.quantized_checkpoint import layer_schemes
from aie_lessons.sampling import SamplingParams, make_generator, sample_next


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (1, K) fp32 times weight (N, K) transposed -> (1, N) fp32: a batch-1 step's only matmul.

    Under ``torch.compile`` it is spelled as an elementwise product and a row sum, which
    inductor compiles into one vectorised, multi-threaded loop that reads each weight once —
    converting bf16 weights to fp32 on the fly — and fuses whatever elementwise work produced
    ``x`` into the same loop. Run eagerly it is ``F.linear``, a BLAS call, doing the same
    arithmetic (a bf16 weight is first copied to fp32: slow, but this path is for comparison).
    It takes any number of rows, but past one it reads the weights once per row: ``linear``
    is the product for a batch.
    """
    if torch.compiler.is_compiling():
        return (weight.float() * x[..., None, :]).sum(-1)
    return F.linear(x, weight.float())


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (B, K) fp32 times weight (N, K) transposed -> (B, N) fp32, in the weight's dtype: a
    real matrix product (BLAS or oneDNN, also inside compiled code), which reads each weight
    once for all B rows — the product of the engine's batched step (section 6)."""
    return F.linear(x.to(weight.dtype), weight).float()


MatVec = Callable[[torch.Tensor, Any], torch.Tensor]
"""``matvec(x, weight)``: x (B, K) fp32 times one packed matrix -> (B, N) fp32. ``gemv`` for
plain tensors at batch 1, ``linear`` for a batch; a decoder for stage 08's quantized weights
packs its matrices differently and brings its own (``quantized_matvec``)."""


def matrix_bytes(weight: Any) -> int:
    """Bytes of one packed matrix as ``matvec`` reads it: a tensor, anything else with an
    ``nbytes`` (``KernelMatrix``), or a tuple of those (a decoder may keep a group unfused)."""
    if isinstance(weight, (tuple, list)):
        return sum(matrix_bytes(w) for w in weight)
    return weight.nbytes


@dataclass
class LayerWeights:
    """One decoder layer's weights, projections that share an input stacked into one matrix.

    The four matrices are whatever the decoder's ``pack`` made of them and its ``matvec``
    reads: plain tensors here, ``KernelMatrix`` in ``QuantizedFastDecoder``.
    """

    qkv: Any  # (Hq·D + 2·Hkv·D, hidden)
    o: Any  # (hidden, Hq·D)
    gate_up: Any  # (2·intermediate, hidden)
    down: Any  # (hidden, intermediate)
    input_norm: torch.Tensor  # (hidden,) fp32
    post_norm: torch.Tensor  # (hidden,) fp32

    def tensors(self) -> tuple[Any, ...]:
        """The fields in ``decode_layer``'s argument order, from ``qkv`` on."""
        return self.qkv, self.o, self.gate_up, self.down, self.input_norm, self.post_norm


def layer_weights(model: LlamaModel, matrices: list[Any]) -> list[LayerWeights]:
    """Each layer's ``LayerWeights``: its four matrices from ``matrices`` (one per
    ``decode_groups`` group, as a decoder packed them) and its two norms in fp32."""
    return [LayerWeights(*matrices[4 * i:4 * i + 4], layer.input_layernorm.weight.detach().float(),
                         layer.post_attention_layernorm.weight.detach().float())
            for i, layer in enumerate(model.layers)]


HUGE_PAGE = 2 * 2**20  # bytes in one x86-64 / arm64 huge page


def huge_page_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor in memory that Linux is asked to back with 2 MB pages.

    Streamed weights then miss the TLB 512 times less often (rung 6 of the ladder). This is
    the transparent-huge-page request (``madvise``); where it does not exist (macOS,
    Windows) or the system declines it, the memory is ordinary and only the speed differs.
    """
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(numel, dtype=dtype)
    block = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    block.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(block, dtype=torch.uint8)  # the tensor keeps the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE  # huge pages need 2 MB-aligned addresses
    return raw[start:start + nbytes].view(dtype)


def huge_page_bytes(tensor: torch.Tensor) -> int | None:
    """Bytes of huge pages backing the memory mapping that holds ``tensor`` (Linux's
    AnonHugePages in /proc/self/smaps): whether ``huge_page_empty``'s request was granted. None
    where the system does not say (no /proc: macOS, Windows)."""
    smaps = Path("/proc/self/smaps")
    if not smaps.exists():
        return None
    address, inside = tensor.data_ptr(), False
    for line in smaps.read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's header: start-end perms ...
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return None


def decode_modules(model: LlamaModel) -> list[list[torch.nn.Module]]:
    """Every linear layer a decode step runs, in the order it runs them, grouped by shared input.

    Per layer: [q, k, v], [o], [gate, up], [down]; then [the output head]. A group is read as
    one stacked matrix: three (or two) passes over memory become one. Layers, not weights, so
    that a quantized model (stage 08), whose layers hold integers, is grouped the same way.
    """
    groups = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        groups += [[attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], [mlp.gate_proj, mlp.up_proj],
                   [mlp.down_proj]]
    return groups + [[model.lm_head]]


def decode_groups(model: LlamaModel) -> list[list[torch.Tensor]]:
    """The weights of ``decode_modules(model)``, group by group: a float model's matrices."""
    return [[layer.weight.detach() for layer in group] for group in decode_modules(model)]


def pack_weights(model: LlamaModel, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Copy every matrix a decode step reads into one block, in reading order, in ``dtype``
    (default: the weights' own; fp32 for bf16 weights makes the products fp32 arithmetic).

    Returns the block and one matrix per ``decode_groups`` group, each a view of the block.
    On CPU the block is in huge pages (``huge_page_empty``). The model is left untouched — its
    own weights keep serving the prefill — at the price of a second copy of the weights in
    memory (rung 6 prints its size): a decoder that re-pointed
    the model's parameters into its block instead would change an object it was only lent.
    """
    groups = decode_groups(model)
    total = sum(w.numel() for group in groups for w in group)
    first = groups[0][0]
    dtype = dtype or first.dtype
    block = (huge_page_empty(total, dtype) if first.device.type == "cpu"
             else torch.empty(total, dtype=dtype, device=first.device))
    matrices, offset = [], 0
    for group in groups:
        rows, cols = sum(w.shape[0] for w in group), group[0].shape[1]
        matrix = block[offset:offset + rows * cols].view(rows, cols)
        torch.cat(group, out=matrix)
        matrices.append(matrix)
        offset += rows * cols
    return block, matrices


# %% [markdown]
# ### Exercise 9.2 — attention for one new token
#
# Stage 02's attention takes a whole block of queries and a mask. A decode step has one query
# per head and no mask — every cached position is in the past — so its attention is a few
# broadcasts and sums, which the compiler of rung 4 turns into a few more loops of the step
# instead of a call into a separate kernel whose fixed cost dwarfs the work at one query.
#
# `decode_attention(q, keys, values)`: `q` is `(Hq, D)` fp32, `keys` and `values` are
# `(Hkv, T, D)` — this layer's cache up to and including the new token, in the cache's dtype.
# They are views of the first `T` positions of the live cache: not contiguous in memory, and
# not yours to change. Query heads share key-value heads in adjacent runs of `Hq / Hkv`
# (grouped-query attention, stage 02). Return `(Hq, D)` in fp32. Write it with broadcasts,
# sums and elementwise functions: that is what the compiled step fuses into its loops.
# (`softmax` and `matmul` give the same numbers, and pass the check; they compile into calls
# of their own.)

# %%
# export: fast_decode


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One query per head against T cached positions: q (Hq, D), keys/values (Hkv, T, D) -> (Hq, D).

    Written with broadcasts and sums, like ``gemv``, so that inside the compiled step it
    becomes a few more generated loops rather than a call into a separate attention kernel
    whose fixed cost dwarfs the work at a single query. The Hq / Hkv query heads that share
    a key/value head are grouped next to it (grouped-query attention, as in stage 02). The
    softmax is spelled out too: every cached position is real, so there is no mask to apply,
    and exp, max and sum are loops the compiler fuses with the products around them.
    """
    # BEGIN EXERCISE 9.2: attend one query per head to every cached position: group the Hq query heads so that each adjacent run of Hq / Hkv shares one key-value head, score q·k / √D, take a softmax over the positions (largest score subtracted first) and return the weighted sum of the values as fp32 (Hq, D), with broadcasts and sums only
    # Hint 1: A score is a dot product: an elementwise product summed over D. Broadcasting every query head of a group against its one key-value head gives all the scores at once; the softmax is then exp(score − row max) divided by its sum, and the output a probability-weighted sum of the values.
    # Hint 2: Give q the shape (Hkv, group, 1, D) and the cache (Hkv, 1, T, D) with keys[:, None].float(): their product summed over the last axis is the scores (Hkv, group, T); after the softmax over T, broadcast the probabilities (…, T, 1) against the values (Hkv, 1, T, D), sum over T, and reshape to (Hq, D).
    num_kv_heads, _, head_dim = keys.shape
    q = q.view(num_kv_heads, -1, 1, head_dim)  # (Hkv, group, 1, D)
    scores = (q * keys[:, None].float()).sum(-1) * head_dim**-0.5  # (Hkv, group, T)
    weights = (scores - scores.amax(dim=-1, keepdim=True)).exp()
    probs = weights / weights.sum(dim=-1, keepdim=True)
    out = (probs[..., None] * values[:, None].float()).sum(-2)  # (Hkv, group, D)
    return out.reshape(-1, head_dim)
    # END EXERCISE 9.2


# %%
# Check exercise 9.2
checks.stage09.check_decode_attention(decode_attention)


# %% [markdown]
# The step itself: one layer (`decode_layer`), the output head with the argmax fused in
# (`decode_head`), several layers per call (`decode_layers`), and the decoder that runs the
# ordinary model for the prefill and these for every step. The layer is written for B new
# tokens, one per row, though the decoder here has one: section 6's engine step runs this very
# function over a batch, so the layer's math exists once. What differs between the two is
# passed in — `matvec`, how a product is done, and `attend`, where the keys live (here
# `cached_attention`: one request's cache, around your exercise 9.2). The decoder's `pack` and
# `matvec` are where later rungs plug in other weights.

# %%
# export: fast_decode
LayerInputs = tuple[torch.Tensor, torch.Tensor, tuple[Any, ...]]  # keys, values, the matrices and norms


class Call(list):
    """The layers of one compiled call, a list of ``LayerInputs``, built once per request (or
    runner) and passed at every step. A plain list that can be weakly referenced: a compiler may
    then remember what it made of it (``AheadOfTime`` keeps its flat tensors) for exactly as long
    as the list lives, never keeping a finished request's cache alive."""


Stored = tuple[torch.Tensor, ...]
"""Vectors a compiled step returns only so that inductor stores them once: it inlines cheap
elementwise work into the loops that read it, so an RMSNorm feeding a matrix–vector product
would be redone for every row of the matrix, but what a compiled function returns is always
computed once and stored. Callers ignore them."""


def rope_one_token(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Stage 02's ``apply_rope`` for one position: x (H, D) fp32, cos/sin (D,) -> (H, D) — or
    one position per row: x (B, H, D), cos/sin (B, 1, D) (the engine's step, section 6).

    The same rotation — coordinates i and i + D/2 turned together — but the half swap is a
    flip of the (…, 2, D/2) view times (−1, +1), where ``rotate_half`` concatenates: inductor
    writes each piece of a ``torch.cat`` in a loop of its own (with a wait after each), while a
    flip is only index arithmetic inside one loop.
    """
    pairs = x.view(*x.shape[:-1], 2, -1)
    sign = torch.tensor([-1.0, 1.0], device=x.device).view(2, 1)
    return x * cos + (pairs.flip(-2) * sign).view(x.shape) * sin


Attend = Callable[..., torch.Tensor]
"""``attend(q, k, v, *cache)``: a step's new rows — q (B, Hq, D), k and v (B, Hkv, D), RoPE
applied — written into ``cache`` (its tensors, and where the rows go), and the attention
output (B, Hq, D) fp32. Where a step keeps its keys is the only thing that differs between
the batch-1 decoder (``cached_attention``: one request's cache) and the engine's step (section
6: slots of the paged pool), so it is the one argument of the layer that does."""


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor, t: int) -> torch.Tensor:
    """``Attend`` for one request (B = 1) and its own cache, keys/values (Hkv, max_len, D):
    row ``t`` written in place, then the query against rows 0 to t (exercise 9.2).

    Everything is looked up *inside* the compiled function (``narrow``), so after its first two
    calls ``torch.compile`` treats ``t`` as a symbol and never recompiles.
    """
    keys.narrow(1, t, 1).copy_(k.transpose(0, 1))  # (1, Hkv, D) -> (Hkv, 1, D)
    values.narrow(1, t, 1).copy_(v.transpose(0, 1))
    return decode_attention(q[0], keys.narrow(1, 0, t + 1), values.narrow(1, 0, t + 1))[None]


def decode_layer(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    kv_heads: int,
    matvec: MatVec,
    attend: Attend,
    cache: tuple[Any, ...],
    qkv: Any,
    o: Any,
    gate_up: Any,
    down: Any,
    input_norm: torch.Tensor,
    post_norm: torch.Tensor,
) -> tuple[torch.Tensor, Stored]:
    """One decoder layer for B new tokens, one per row: x after the layer, and ``Stored``.

    x (B, hidden) fp32; cos/sin (B, 1, D), each row's RoPE angles. The layer's math is written
    once, here, for the batch-1 decoder and for the engine's batched step (section 6): how a
    product is done is ``matvec``'s business and where keys live ``attend``'s (with ``cache``,
    its tensors), so fusions and layouts are options of this function, not copies of it. Sizes
    come from the tensors' shapes, so one compiled function serves every layer. The matrices
    are only ever handed to ``matvec``.
    """
    batch, head_dim = x.shape[0], cos.shape[-1]
    kv_size = kv_heads * head_dim
    normed = rms_norm(x, input_norm, eps)
    projected = matvec(normed, qkv)
    q, k, v = projected.split([projected.shape[-1] - 2 * kv_size, kv_size, kv_size], dim=-1)
    q = rope_one_token(q.reshape(batch, -1, head_dim), cos, sin)  # (B, Hq, D)
    k = rope_one_token(k.reshape(batch, kv_heads, head_dim), cos, sin)
    attended = attend(q, k, v.reshape(batch, kv_heads, head_dim), *cache)
    x = x + matvec(attended.reshape(batch, -1), o)
    normed_mid = rms_norm(x, post_norm, eps)
    gate, up = matvec(normed_mid, gate_up).chunk(2, dim=-1)
    return x + matvec(F.silu(gate) * up, down), (normed, normed_mid)


def decode_head(
    x: torch.Tensor, norm: torch.Tensor, eps: float, head: Any, matvec: MatVec, greedy: bool
) -> tuple[torch.Tensor, Stored]:
    """Final norm and output head of B rows: each row's greedy next token (B,) if ``greedy``,
    else the logits (B, vocab).

    Greedy decoding fuses the argmax in, so the 49152 logits never leave the compiled code.
    """
    normed = rms_norm(x, norm, eps)
    logits = matvec(normed, head)
    return (logits.argmax(-1) if greedy else logits), (normed,)


def decode_layers(
    x: torch.Tensor, t: int, cos: torch.Tensor, sin: torch.Tensor, eps: float, matvec: MatVec,
    layers: list[LayerInputs],
) -> tuple[torch.Tensor, Stored]:
    """``decode_layer`` over a few consecutive layers in one call: x after them, and ``Stored``.

    Every compiled call costs some Python — dynamo's guards, the wrapper, allocating outputs —
    while the memory sits idle, so fewer, larger calls pay (rung 7 of stage 09's ladder), most
    of all in bf16, whose step is shorter. The compiler unrolls the loop, so its work grows
    with the layers per call, which is why not all of them.

    Here the step is one request's: x (1, hidden), the position ``t`` and the request's
    (max_len, D) RoPE tables, from which the row ``t`` is looked up inside the compiled code.
    """
    stored: Stored = ()
    cos, sin = cos[t].view(1, 1, -1), sin[t].view(1, 1, -1)
    for keys, values, weights in layers:
        x, more = decode_layer(x, cos, sin, eps, keys.shape[0], matvec, cached_attention, (keys, values, t),
                               *weights)
        stored += more
    return x, stored


Compiler = Callable[[Callable], Callable]
"""What turns a step function into its compiled version, as ``torch.compile(fn)`` does."""


def step_compiler(compile: bool | Compiler, **options: Any) -> Compiler:
    """The compiler a ``compile`` option names: ``torch.compile`` for True (with ``options``),
    none for False (the step runs eagerly, to compare), or the compiler given — the runtime's
    ``AheadOfTime``, whose compiled code a later process loads instead of compiling again.

    ``torch.compile`` keeps one cache of compiled versions per function, and every decoder (its
    dtype, layers per call, matvec) adds its own: past the default limit of 8 dynamo would
    quietly run the next ones eagerly. So using it raises dynamo's process-wide
    ``recompile_limit`` to at least 64 — raised, never lowered.
    """
    if callable(compile):
        return compile
    if not compile:
        return lambda function: function
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # Inductor's Python wrapper re-checks every input's size and stride on each call, after
    # dynamo's guards have checked them to pick the compiled code: a cost per call, skipped.
    return lambda function: torch.compile(function, options={"size_asserts": False}, **options)


class FastDecoder:
    """Batch-1 generation: the ordinary model for the prefill, a fused step to decode.

    With ``compile=True`` (the point of it) the first request — or ``warm_up`` — compiles
    ``decode_layers`` and ``decode_head`` with ``torch.compile``, which needs a C++ compiler
    on CPU; inductor's on-disk cache spares later processes most of that wait. ``compile``
    may also be another compiler (``step_compiler``). ``compile=False`` runs the same fused
    step eagerly. ``layers_per_call`` trades compile work for speed (stage 09's ladder
    measures the speed).
    Building a decoder copies the model's weights: with ``packed`` into one block in reading
    order (``pack_weights``), without it into one matrix per group. The model is not changed.

    A decoder compiled by ``torch.compile`` raises dynamo's process-wide ``recompile_limit`` to
    at least 64 (``step_compiler`` says why).

    Two methods are meant to be overridden, so that a later stage can decode with other
    weights without editing this one: ``pack`` (how the matrices are stored) and ``matvec``
    (how a vector is multiplied by one of them).
    """

    def __init__(self, model: LlamaModel, compile: bool | Compiler = True, layers_per_call: int = 5,
                 packed: bool = True):
        if layers_per_call < 1:
            raise ValueError(f"layers_per_call must be at least 1, got {layers_per_call}")
        if model.activations != torch.float32:
            raise ValueError(f"the fused step computes in fp32, but this model's activations are "
                             f"{model.activations}: its prefill would differ from its decode. Fix: "
                             "load the model with activations=torch.float32 (the default)")
        self.layers_per_call, self.packed = layers_per_call, packed
        self.model = model
        matrices = self.pack(model)
        self.layers = layer_weights(model, matrices)
        self.head = matrices[-1]
        self.embed = model.embed_tokens.weight.detach()
        self.final_norm = model.norm.weight.detach().float()
        self.eps = model.config.rms_norm_eps
        compiler = step_compiler(compile)
        self.decode_layers, self.decode_head = compiler(decode_layers), compiler(decode_head)

    def pack(self, model: LlamaModel) -> list[Any]:
        """The matrices of ``decode_groups(model)``, in that order, as ``matvec`` will read them.

        Packed, they are views of one block, kept as ``self.block``; otherwise each group is
        stacked into a matrix of its own and ``self.block`` is None. An override stores its
        matrices however its ``matvec`` wants (``QuantizedFastDecoder``: its integers' block).
        """
        if not self.packed:
            self.block = None
            return [torch.cat(group) for group in decode_groups(model)]
        self.block, matrices = pack_weights(model)
        return matrices

    @staticmethod
    def matvec(x: torch.Tensor, weight: Any) -> torch.Tensor:
        """x (B, K) fp32 times one packed matrix -> (B, N) fp32."""
        return gemv(x, weight)

    def bytes_per_token(self, context: int) -> int:
        """Bytes one step reads when its token attends to ``context`` positions: every matrix
        and norm, one row of the embedding table, and the cache — the roofline's numerator."""
        weights = (sum(matrix_bytes(w) for layer in self.layers for w in layer.tensors())
                   + matrix_bytes(self.head) + self.final_norm.nbytes)
        cache = kv_cache_bytes(self.model.config, context, 1, self.embed.dtype)
        return weights + self.embed[0].nbytes + cache

    def layer_inputs(self, cache: KVCache) -> list[list[LayerInputs]]:
        """Each call's layers' (keys, values, weights), gathered once per request.

        Indexing the cache and building the argument tuples anew at every step would add
        Python work to every step; done once, it is free.
        """
        inputs = [(cache.keys[i, 0], cache.values[i, 0], w.tensors()) for i, w in enumerate(self.layers)]
        return [Call(inputs[i:i + self.layers_per_call]) for i in range(0, len(inputs), self.layers_per_call)]

    def step(self, token: int, t: int, calls: list[list[LayerInputs]], cos: torch.Tensor, sin: torch.Tensor,
             greedy: bool = True) -> torch.Tensor:
        """Decode ``token`` at position ``t``: the next token's id (1,) if greedy, else the logits (1, vocab).

        ``calls`` is ``layer_inputs(cache)`` of this request's cache, whose row ``t`` this
        writes; ``cos``/``sin`` are its (max_len, D) RoPE tables.
        """
        x = self.embed[token].float()[None]
        for layers in calls:
            x, _ = self.decode_layers(x, t, cos, sin, self.eps, self.matvec, layers)
        out, _ = self.decode_head(x, self.final_norm, self.eps, self.head, self.matvec, greedy)
        return out

    def tokens(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
        """The continuation of ``prompt_ids``, one token per ``next()``, at most ``params.max_new_tokens``.

        The first ``next()`` runs the prefill, each later one a single decode step, so that a
        caller can time, interleave or stop them one at a time: ``generate`` is this loop plus
        streaming and stop rules, and ``benchmarks/decode.py`` alternates two decoders' steps
        with bandwidth probes. A prompt that does not fit is refused here, before any work.
        """
        check_prompt(prompt_ids, params, self.model.config)
        return self._decode(prompt_ids, params)

    def _prefill(self, prompt_ids: list[int], max_len: int) -> tuple[list[list[LayerInputs]], torch.Tensor,
                                                                      torch.Tensor, torch.Tensor]:
        """A request's per-call inputs, RoPE tables and prefill logits (1, 1, vocab); its cache
        (``max_len`` rows, the prompt's written) is held by the inputs.

        Every request sizes its cache and tables by its own length, so their length is marked
        dynamic: the step is compiled once for any length (``warm_up`` then covers every later
        request) instead of once more for each new one.
        """
        model, device = self.model, self.embed.device
        cache = KVCache(model.config, 1, max_len, dtype=self.embed.dtype, device=device)
        positions = torch.arange(max_len, device=device)[None]
        cos, sin = (t[0] for t in rope_cos_sin(positions, model.config.head_dim, model.config.rope_theta))
        prefill = AttentionMetadata(cache=cache, cache_start=0, logits_at=LAST_POSITION)
        logits = model(torch.tensor([prompt_ids], device=device), positions[:, :len(prompt_ids)], prefill)
        calls = self.layer_inputs(cache)
        for table in (cos, sin):
            torch._dynamo.mark_dynamic(table, 0)
        for layers in calls:
            for keys, values, _ in layers:
                torch._dynamo.mark_dynamic(keys, 1)
                torch._dynamo.mark_dynamic(values, 1)
        return calls, cos, sin, logits

    @torch.no_grad()
    def forced_logits(self, prompt_ids: list[int], continuation: list[int]) -> torch.Tensor:
        """The logits (len(continuation), vocab) from which each token of ``continuation`` would
        be chosen, the decoder being fed those very tokens (teacher forcing): two decoders that
        would soon pick different tokens are compared on the same contexts all the way. The last
        token is never fed, so the prompt and all but the last token must fit the context."""
        if not continuation:
            return torch.empty(0, self.model.config.vocab_size, device=self.embed.device)
        check_prompt(prompt_ids + continuation[:-1], SamplingParams(max_new_tokens=0), self.model.config)
        n = len(prompt_ids)
        calls, cos, sin, logits = self._prefill(prompt_ids, n + len(continuation) - 1)
        rows = [logits[0, -1]]
        for t, token in enumerate(continuation[:-1], start=n):
            rows.append(self.step(token, t, calls, cos, sin, greedy=False)[0])
        return torch.stack(rows)

    # no_grad, not inference_mode: tensors made under inference_mode differ from the compiled
    # step's outputs in a way torch.compile guards on, which would compile every layer twice.
    @torch.no_grad()
    def _decode(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
        """``tokens``' generator: the prefill on the first ``next()``, then one step per ``next()``."""
        if params.max_new_tokens == 0:
            return
        n, max_len = len(prompt_ids), len(prompt_ids) + params.max_new_tokens
        calls, cos, sin, logits = self._prefill(prompt_ids, max_len)
        generators, history = [make_generator(params.seed, self.embed.device)], list(prompt_ids)
        token = sample_next(logits, [params], generators, [history])[0]
        for t in range(n, max_len):  # t: the position (and cache row) of the token just chosen
            history.append(token)
            yield token
            if t + 1 == max_len:
                return
            out = self.step(token, t, calls, cos, sin, params.plain_greedy)
            token = int(out) if params.plain_greedy else sample_next(out[None], [params], generators, [history])[0]

    def warm_up(self, params: SamplingParams = SamplingParams()) -> None:
        """Compile now, before a request: two steps of a one-token prompt. The first compiles the
        step for its position, the second for any position; ``params`` says whether the head
        returns a token (greedy) or logits (sampling), which are two compiled versions."""
        for _ in self.tokens([0], replace(params, max_new_tokens=3, stop=())):
            pass

    def generate(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        params: SamplingParams = SamplingParams(),
        on_text: Callable[[str], None] | None = None,
    ) -> GenerationResult:
        """Same contract as ``generate_cached`` for one prompt (same tokens in fp32)."""
        streams = open_streams(self.model.config, tokenizer, [prompt_ids], [params],
                               on_text and (lambda _, text: on_text(text)))
        return collect(([token] for token in self.tokens(prompt_ids, params)), streams)[0]


# %% [markdown]
# Now the rungs, built from the cells above — so they run your `decode_attention`, and a
# mistake there shows as changed tokens. Rung 2 is the one-token step of `FastDecoder` run
# eagerly, with every matrix kept apart (q, k and v read one after the other): a subclass
# overrides `pack` to keep each group as a tuple and `matvec` to multiply by each of its
# matrices.

# %%
# NBVAL_IGNORE_OUTPUT
class UnfusedDecoder(FastDecoder):
    """The one-token step with each projection its own matrix: rung 2, for comparison."""

    def pack(self, model: LlamaModel) -> list:
        self.block = None
        return [tuple(w.clone() for w in group) for group in decode_groups(model)]

    @staticmethod
    def matvec(x: torch.Tensor, weights: tuple) -> torch.Tensor:
        return torch.cat([gemv(x, w) for w in weights], dim=-1)


kept = {}  # rung name: whether it continued the prompt with stage 04's tokens


def same_tokens(name: str, decoder: FastDecoder) -> bool:
    """Whether ``decoder`` continues the ladder's prompt with stage 04's greedy tokens (recorded)."""
    kept[name] = decoder.generate(tokenizer, ladder_prompt, ladder_params).token_ids == reference_tokens
    return kept[name]


rung2 = UnfusedDecoder(model, compile=False, layers_per_call=1)
print("same tokens as stage 04's loop:", same_tokens("2", rung2))
measure_rung("2. one-token step", steps_per_second(rung2.tokens(ladder_prompt, ladder_params)),
             rung2.bytes_per_token(ladder_context))

# %%
# NBVAL_IGNORE_OUTPUT
rung3 = FastDecoder(model, compile=False, layers_per_call=1, packed=False)
print("same tokens as stage 04's loop:", same_tokens("3", rung3))
measure_rung("3. fused projections", steps_per_second(rung3.tokens(ladder_prompt, ladder_params)),
             rung3.bytes_per_token(ladder_context))
print("one layer's matrices: q/k/v", tuple(rung3.layers[0].qkv.shape), "o", tuple(rung3.layers[0].o.shape),
      "gate/up", tuple(rung3.layers[0].gate_up.shape), "down", tuple(rung3.layers[0].down.shape))

# %% [markdown]
# Rung 4 compiles. `warm_up` compiles before the first request (the cell prints how long it
# took); inductor keeps what it compiled on disk, so a later process with the same step loads
# it instead, and the printed time is then mostly tracing.

# %%
# NBVAL_IGNORE_OUTPUT
rung4 = FastDecoder(model, layers_per_call=1, packed=False)
start = time.perf_counter()
rung4.warm_up()
print(f"warm-up (compiling, or loading inductor's cache): {time.perf_counter() - start:.0f} s")
print("same tokens as stage 04's loop:", same_tokens("4", rung4))
measure_rung("4. compiled step", steps_per_second(rung4.tokens(ladder_prompt, ladder_params)),
             rung4.bytes_per_token(ladder_context))

# %% [markdown]
# From rung 5 on the weights change, so the tokens may too: a bf16 or integer weight is not the
# fp32 one. Instead of comparing tokens, each decoder is fed the fp32 decoder's tokens (teacher
# forcing, `FastDecoder.forced_logits`) and its next-token predictions are compared with fp32's
# at every step, with stage 04's `agreement`.

# %%
# NBVAL_IGNORE_OUTPUT
from aie_lessons.precision import Agreement, agreement

fp32_logits = rung4.forced_logits(ladder_prompt, reference_tokens)
agreements = {}


def against_fp32(name: str, decoder: FastDecoder) -> None:
    """Record and print how ``decoder``'s predictions along the fp32 tokens agree with fp32's."""
    agreements[name] = agreement(fp32_logits, decoder.forced_logits(ladder_prompt, reference_tokens))
    print(f"against fp32 on {len(reference_tokens)} steps: top-1 {agreements[name].top1:.0%}, "
          f"mean KL {agreements[name].mean_kl:.1e}")


bf16_model = LlamaModel.from_pretrained(MODEL_DIR, dtype=torch.bfloat16)  # fp32 activations
rung5 = FastDecoder(bf16_model, layers_per_call=1, packed=False)
against_fp32("5. bf16 weights", rung5)
measure_rung("5. bf16 weights", steps_per_second(rung5.tokens(ladder_prompt, ladder_params)),
             rung5.bytes_per_token(ladder_context))

# %%
# NBVAL_IGNORE_OUTPUT
rung6 = FastDecoder(bf16_model, layers_per_call=1)
block = rung6.block
granted = huge_page_bytes(block)
print(f"one block of {block.nbytes / 1e6:.0f} MB: {block.nbytes // 2**12:,} pages of 4 KB, or "
      f"{-(-block.nbytes // 2**21):,} of 2 MB; huge pages granted: "
      + ("the system does not say" if granted is None else f"{granted / 1e6:.0f} MB"))
print("none of the model's own weights lives in the block:",
      all(not (block.data_ptr() <= p.data_ptr() < block.data_ptr() + block.nbytes) for p in bf16_model.parameters()))
against_fp32("6. packed, huge pages", rung6)
measure_rung("6. packed, huge pages", steps_per_second(rung6.tokens(ladder_prompt, ladder_params)),
             rung6.bytes_per_token(ladder_context))

# %%
# NBVAL_IGNORE_OUTPUT
rung7 = FastDecoder(bf16_model, layers_per_call=5)
start = time.perf_counter()
rung7.warm_up()
print(f"warm-up (compiling, or loading inductor's cache): {time.perf_counter() - start:.0f} s")
against_fp32("7. five layers per call", rung7)
calls_per_step = -(-config.num_layers // rung7.layers_per_call) + 1  # ceil, then the head
print(f"compiled calls per step: {calls_per_step}, against {config.num_layers + 1} at one layer per call")
measure_rung("7. five layers per call", steps_per_second(rung7.tokens(ladder_prompt, ladder_params)),
             rung7.bytes_per_token(ladder_context))

# %% [markdown]
# The last rung reads stage 08's integers. PyTorch's CPU kernels multiply one bf16 row by int8
# weights with a scale per row, or by int4 weights in its own tiled layout with a scale and a
# zero per group — the layout `QuantizedLinear.kernel_weights` makes. Without AVX-512 they turn
# each weight into a float before multiplying, which makes them limited by that arithmetic
# rather than by the bytes they read. So on x86 CPUs the course brings its own
# (`aie_lessons/infra/int_kernels.cpp`, built with the C++ compiler at first use): it rounds the
# input row to int8 in blocks of 32 — one scale a block, like llama.cpp's Q8_0 — and multiplies
# 32 weight bytes by 32 input bytes in one AVX2 instruction, with stage 08's integers regrouped
# so that four weight rows are read as one stream (their blocks of 32 interleaved: four
# independent sums a pass over one run of bytes). Rounding the input moves each product's
# outputs a little: each rung-8 cell prints by how much, on the first layer's real inputs, and
# the check after the ladder says whether the tokens still agree with fp32.
# Elsewhere (an Arm Mac, no compiler) PyTorch's kernels take the call.
#
# `QuantizedFastDecoder` takes a model quantized by stage 08's `quantize_model` — so the prefill
# runs the same quantized layers — and stacks each group's integers and scales into one kernel
# matrix (a row's int8 scale, or an int4 group, never spans two layers, so stacking changes no
# number), then moves the integers into one block of huge pages, as rung 6 did. Its `matvec`
# takes and returns fp32 rows (PyTorch's kernels get them rounded to bf16, as stage 08's layers
# do). The model is loaded in bf16 here, so that the output head, which stays unquantized as in
# stage 08, reads half fp32's bytes. (Remember stage 08's finding when
# reading their agreement with fp32: the checkpoint was a 4-bit file with groups of 32, so
# int4-g32 finds its grid exactly, and int8, one scale per row, cannot.)

# %%
# export: fast_decode
@dataclass
class KernelMatrix:
    """One group of quantized layers stacked, in the layout its kernel reads: the course's
    integer kernels (``kernel="aie"``, ``infra/int_kernels``) or PyTorch's (``"pytorch"``)."""

    weights: torch.Tensor
    scales: torch.Tensor
    scheme: QuantScheme
    kernel: str = "pytorch"

    @property
    def nbytes(self) -> int:
        """What a step reads of it: the integers in the kernel's layout and their scales."""
        return self.weights.nbytes + self.scales.nbytes


def kernel_matrix(group: list[QuantizedLinear]) -> KernelMatrix:
    """A group of layers quantized with one scheme as one ``KernelMatrix``: for the course's
    integer kernels where they run and take the layers, PyTorch's otherwise. A row's int8 scale
    and an int4 group lie within one layer's row, so stacking the integers, scales and zeros
    changes no number; a single PyTorch-kernel layer lends its own layout."""
    scheme = group[0].scheme
    rows = sum(layer.out_features for layer in group)
    ours = int_kernels.unavailable() is None and int_kernels.fits(scheme.bits, scheme.group_size,
                                                                   group[0].in_features, rows)
    if len(group) == 1 and not ours:
        return KernelMatrix(*group[0].kernel_weights(), scheme)
    q, scale, zero = (torch.cat([getattr(layer, name) for layer in group]) for name in ("q", "scale", "zero"))
    if not ours:
        return KernelMatrix(*kernel_layout(q, scale, zero, scheme), scheme)
    if scheme.bits == 8:
        return KernelMatrix(int_kernels.tiled(q), scale, scheme, "aie")
    return KernelMatrix(*int_kernels.int4_layout(q, scale, zero), scheme, "aie")


def quantized_matvec(x: torch.Tensor, weight: Any) -> torch.Tensor:
    """``matvec`` for a quantized model: x (B, K) fp32 times a ``KernelMatrix``, a tuple of
    matrices (a group of mixed schemes), or a float matrix -> (B, N) fp32. The course's kernels
    round x to int8 per block of 32, PyTorch's take it rounded to bf16 (as stage 08's layers do
    with bf16 activations): either way the tokens can differ from those of the same model run
    with fp32 activations. A float matrix (an unquantized head) is ``gemv``'s at batch 1 and
    ``linear``'s for a batch."""
    if isinstance(weight, tuple):
        return torch.cat([quantized_matvec(x, part) for part in weight], dim=-1)
    if isinstance(weight, KernelMatrix) and weight.kernel == "aie":
        if weight.scheme.bits == 8:
            return int_kernels.int8_linear(x, weight.weights, weight.scales)
        return int_kernels.int4_linear(x, weight.weights, weight.scales, weight.scheme.group_size)
    if isinstance(weight, KernelMatrix):
        return kernel_matmul(x.to(torch.bfloat16), weight.weights, weight.scales, weight.scheme).float()
    return gemv(x, weight) if x.shape[0] == 1 else linear(x, weight)


def kernel_refusal(name: str, layer: QuantizedLinear) -> str | None:
    """Why PyTorch's CPU kernel cannot read ``layer`` (None: it can), with the fix."""
    if layer.scheme.bits == 4 and layer.scheme.group_size not in INT4_KERNEL_GROUP_SIZES:
        return (f"{name} ({layer.scheme.name}): PyTorch's int4 CPU kernel takes groups of "
                f"{', '.join(map(str, INT4_KERNEL_GROUP_SIZES))} only. Fix: quantize with int4-g32 or int4-g64, "
                "or run this model without a compiled step (eagerly)")
    if not kernel_fits(layer.scheme, layer.out_features):
        return (f"{name} ({layer.scheme.name}): {layer.out_features} outputs, but PyTorch's int4 CPU kernel works "
                "in tiles of 16. Fix: leave this layer unquantized (overrides), or run this model without a "
                "compiled step (eagerly)")
    return None


def quantized_refusal(model: LlamaModel) -> str | None:
    """Why PyTorch's CPU kernels cannot read ``model``'s quantized layers inside a compiled
    step, naming the layer and the fix; None when they can (or nothing is quantized)."""
    layers = [(name, layer) for name, layer in model.named_modules() if isinstance(layer, QuantizedLinear)]
    if layers and model.embed_tokens.weight.device.type != "cpu":
        return ("stage 08's quantized weights are read through PyTorch's CPU kernels: load the model on the CPU, "
                "or decode bf16 weights instead")
    return next(filter(None, (kernel_refusal(name, layer) for name, layer in layers)), None)


def pack_quantized(model: LlamaModel) -> tuple[torch.Tensor | None, list[Any]]:
    """The matrices of ``decode_modules(model)`` for ``quantized_matvec``, per group: one
    ``KernelMatrix``, a tuple of them (mixed schemes), or a float matrix (nothing quantized).

    On the CPU the integer weights are then moved into one block of huge pages, in reading
    order, each still in its kernel's layout — rung 6's lesson again: fewer TLB misses, and the
    CPU's prefetchers, which stop at a page's end, run on for 2 MB. Returns the block (None
    where the course's kernels read nothing, or the system has no huge pages) and the
    matrices."""
    matrices: list[Any] = []
    for group in decode_modules(model):
        quantized = [isinstance(layer, QuantizedLinear) for layer in group]
        if all(quantized) and len({layer.scheme for layer in group}) == 1:
            matrices.append(kernel_matrix(group))
        elif any(quantized):
            matrices.append(tuple(kernel_matrix([layer]) if isinstance(layer, QuantizedLinear)
                                  else layer.weight.detach() for layer in group))
        else:
            matrices.append(torch.cat([layer.weight.detach() for layer in group]))
    # Only the matrices made for the course's kernels: they are the decoder's own copies, where a
    # lone PyTorch-kernel layer lends the layer's tensors, which a move would duplicate. Without
    # huge pages (macOS, Windows) a move would buy nothing.
    kernels = [m for item in matrices for m in (item if isinstance(item, tuple) else (item,))
               if isinstance(m, KernelMatrix) and m.kernel == "aie"]
    if not kernels or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None, matrices
    line = 64  # each matrix starts on a cache line
    starts = [0]
    for matrix in kernels:
        starts.append(starts[-1] + -(-matrix.weights.nbytes // line) * line)
    block = huge_page_empty(starts[-1], torch.uint8)
    for matrix, start in zip(kernels, starts):
        weights = block[start:start + matrix.weights.nbytes].view(matrix.weights.dtype).view(matrix.weights.shape)
        matrix.weights = weights.copy_(matrix.weights)
    return block, matrices


class QuantizedFastDecoder(FastDecoder):
    """``FastDecoder`` for a model quantized by stage 08: integer weights read by the course's
    integer kernels (or PyTorch's, where those cannot run) inside the compiled step, float
    layers (an unquantized head) as before.

    PyTorch's kernels exist on the CPU, for int8 and for int4 in groups of 32, 64, 128 or 256
    with outputs in tiles of 16: anything neither they nor the course's kernels take is refused
    here, naming the layer. A group whose layers have different schemes (stage 08's
    ``overrides``) is kept as a tuple of matrices, one kernel call each. The course kernels'
    integers lie in one block of huge pages where the system has them, each matrix in its
    kernel's own layout (``pack_quantized``), not in ``FastDecoder``'s packed block.
    """

    def __init__(self, model: LlamaModel, compile: bool | Compiler = True, layers_per_call: int = 5):
        if not layer_schemes(model):
            raise ValueError("this model has no quantized layers. Fix: quantize it with quantize_model(model, "
                             "scheme) first, or decode it with FastDecoder")
        refusal = quantized_refusal(model)
        if refusal:
            raise ValueError(refusal)
        super().__init__(model, compile, layers_per_call, packed=False)

    def pack(self, model: LlamaModel) -> list[Any]:
        """Per group: one ``KernelMatrix``, a tuple of them (mixed schemes), or a float matrix."""
        self.block, matrices = pack_quantized(model)
        return matrices

    matvec = staticmethod(quantized_matvec)


# %%
# NBVAL_IGNORE_OUTPUT
def input_rounding_cost(quantized: LlamaModel) -> str:
    """How far the kernel's rounding of the input moves the first layer's q projection, on the
    ladder prompt's real inputs to it: the largest change, as a share of the largest output."""
    layer = quantized.layers[0]
    ids = torch.tensor([ladder_prompt])
    with torch.no_grad():
        x = layer.input_layernorm(quantized.embed_tokens(ids))[0].float()
        matrix = kernel_matrix([layer.self_attn.q_proj])
        exact = x @ layer.self_attn.q_proj.dequantized().float().T
        moved = (quantized_matvec(x, matrix) - exact).abs().max() / exact.abs().max()
    kernel = "the course's kernel (input rounded to int8 per 32)" if matrix.kernel == "aie" else \
        "PyTorch's kernel (input rounded to bf16)"
    return f"{kernel} moved the first q projection's outputs by at most {moved:.2%} of the largest"


def quantized_rung(scheme: str) -> None:
    """Rung 8 with ``scheme``'s weights: compiled, compared with fp32, measured."""
    quantized = quantize_model(LlamaModel.from_pretrained(MODEL_DIR, dtype=torch.bfloat16), scheme)
    print(input_rounding_cost(quantized))
    rung8 = QuantizedFastDecoder(quantized)
    name = f"8. {scheme} weights"
    start = time.perf_counter()
    rung8.warm_up()
    print(f"warm-up (compiling, or loading inductor's cache): {time.perf_counter() - start:.0f} s")
    against_fp32(name, rung8)
    measure_rung(name, steps_per_second(rung8.tokens(ladder_prompt, ladder_params)),
                 rung8.bytes_per_token(ladder_context))


quantized_rung("int8")

# %%
# NBVAL_IGNORE_OUTPUT
quantized_rung("int4-g32")


# %% [markdown]
# The whole ladder, each rung's speed with its own roofline drawn above it:

# %%
# NBVAL_IGNORE_OUTPUT
fig, ax = plt.subplots(figsize=(8, 3.8))
names = list(ladder)
speeds = [ladder[n][0] for n in names]
roofs = [ladder_bandwidth / ladder[n][1] for n in names]
ax.bar(range(len(names)), speeds, color="tab:blue", label="measured tokens/s")
ax.scatter(range(len(names)), roofs, marker="_", s=600, color="tab:red", zorder=3,
           label="read roofline (bandwidth ÷ the rung's bytes per step)")
for i, (speed, roof) in enumerate(zip(speeds, roofs)):
    ax.annotate(f"{speed / roof:.0%}", (i, speed), ha="center", va="bottom", fontsize=7)
ax.set_xticks(range(len(names)), [n.split(". ", 1)[1] for n in names], rotation=30, ha="right", fontsize=8)
ax.set_ylabel("tokens/s, batch 1")
ax.set_title("The decoder ladder: each rung against its roofline")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()
for before, after in zip(names, names[1:]):
    before = "7. five layers per call" if after.startswith("8.") else before  # both 8s against rung 7
    print(f"{after}: {ladder[after][0] / ladder[before][0]:.2f}x {before}")
print(f"rung 7 against rung 1: {ladder['7. five layers per call'][0] / ladder['1. eager with cache'][0]:.1f}x")

# %% [markdown]
# What the chart says, rung by rung, in the ratios printed under it:
#
# * Rungs 2 and 3 run eagerly. The one-token step is written for the compiler, not for eager
#   execution: its spelled-out attention builds a product per cached position, and the split
#   matrices add calls, so rung 2 is no faster than stage 04's loop, and may be slower. Fusing
#   the projections (rung 3) takes back a few calls.
# * Rung 4 compiles the same arithmetic into a few generated loops: the small operators between
#   the products go, and the products stream at the speed of the compiled loops.
# * Rung 5 halves the weights' bytes, but everything that is not reading weights — attention,
#   RoPE, the calls — stays: its gain is less than its bytes fell, and its share of its
#   (twice higher) roofline drops.
# * Rungs 6 and 7 trim what is left between the reads.
# * Rung 8 reads fewer bytes again, through kernels built for small matrix products rather than
#   for one row at the memory's speed: compare its share of its roofline with rung 7's.
#
# The numbers move from run to run on a shared machine; the checks below hold on any of them.

# %%
print("every fp32 rung kept stage 04's tokens:", all(kept.values()))
print("every lower-precision rung agrees with fp32 on at least 80% of the steps, with a mean KL under 0.01:",
      all(a.top1 >= 0.8 and a.mean_kl < 0.01 for a in agreements.values()))


# %% [markdown]
# ## 6. The engine's decode step, compiled
#
# The ladder decoded one request. The engine of stages 06–07 decodes many at once: a step in
# which every running request adds one token is a batch of B rows through the same weights.
# Section 4's profile showed the eager forward pass is almost all of such a step, so the
# compiler's gains at batch 1 — fewer operators, no Python between them — should carry over.
# One thing is new: **the batch size changes from step to step** as requests arrive and finish,
# and compiled code is specialised to its input shapes. Compiling for every B that shows up
# would stall the engine each time a new B appears; letting the compiler treat B as a symbol
# gives up the specialisation. The usual answer (vLLM captures its CUDA graphs the same way) is
# a few **buckets**: compile for B = 1, 2, 4, 8, 16, …, and pad each step up to the smallest
# bucket that holds it.
#
# ```
#   running: r0 r1 r2 r3 r4           (5 rows)
#   bucket:  r0 r1 r2 r3 r4 ·  ·  ·   (8 rows: 3 padding rows, computed and thrown away)
# ```
#
# Padding rows go through every layer, so they write keys and values into the cache like any
# row — which is where padding can do harm. The compiled runner keeps one **scratch block**
# beyond the pool that no request ever owns; a padding row writes there, and attends only to
# that scratch slot, so its arithmetic stays finite and touches nobody.
#
# Only decode-only steps take the compiled path. A step with prompt chunks in it runs the eager
# model, as before: prefill is one step per request, decode is all the others.

# %% [markdown]
# The step's inputs, one row per running request, and the bucket they pad to:

# %%
# export: engine.compiled_runner
"""The engine's decode-only steps, compiled once per batch-size bucket, over stage 07's paged cache."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from aie_lessons.engine.block_manager import PagedAllocator, blocks_for
from aie_lessons.engine.engine import Engine
from aie_lessons.engine.paged_batch import PagedBatch, chunk_slots
from aie_lessons.engine.paged_cache import blocks_for_budget, slot_pool_bytes
from aie_lessons.engine.paged_runner import PagedModelRunner
from aie_lessons.engine.preemption import PagedScheduler
from aie_lessons.engine.scheduler import SchedulerConfig
from aie_lessons.fast_decode import (Call, Compiler, LayerInputs, MatVec, Stored, decode_head, decode_layer, gemv,
                                     layer_weights, linear, pack_quantized, pack_weights, quantized_matvec,
                                     quantized_refusal, step_compiler)
from aie_lessons.model import AttentionFn, LlamaModel, rope_cos_sin, sdpa_attention
from aie_lessons.output import stop_token_ids
from aie_lessons.quantized_checkpoint import layer_schemes

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aie_lessons.engine.scheduler import Schedule
    from aie_lessons.tokenizer import Tokenizer

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket_for(rows: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds ``rows``: the batch size the step is compiled for."""
    for bucket in sorted(buckets):
        if bucket >= rows:
            return bucket
    raise ValueError(f"{rows} rows is more than the largest bucket ({max(buckets)}). Fix: add a bucket, or "
                     f"run at most {max(buckets)} requests at once (max_seqs)")


@dataclass(frozen=True, eq=False)
class DecodeRows:
    """A step's one-token chunks, row i the i-th: a request's new token, or a one-token prompt
    chunk (n rows; T, the columns' width, at least the longest row's positions).

    Frozen: a step hands the same rows to each of its compiled calls, and a compiler may
    remember what an argument flattens to (``AheadOfTime`` does) only if its fields cannot be
    replaced between the calls."""

    ids: torch.Tensor  # (n,) token ids
    positions: torch.Tensor  # (n,) each token's position (RoPE)
    slots: torch.Tensor  # (n,) the cache slot each token's keys and values are written to
    columns: torch.Tensor  # (n, T) the slot of each position a row attends to, padded to T
    visible: torch.Tensor  # (n, T) bool: which of a row's columns are its own positions


@dataclass(frozen=True, eq=False)
class DecodeStep:
    """A decode-only step as the compiled runner runs it: its rows, padded to their bucket, and
    the rows whose logits the step returns (those that sample), (K,) in schedule order."""

    rows: DecodeRows
    logits_at: torch.Tensor


# %% [markdown]
# ### Exercise 9.3 — pad a step to its bucket
#
# `pad_rows(rows, bucket, scratch)` returns the step's rows followed by `bucket - n` padding
# rows, as a new `DecodeRows`. The real rows come first, unchanged and in order: the runner
# reads the logits of row i as request i's. A padding row must be harmless: it writes its keys
# and values only into the `scratch` slot (no request owns it), and it reads only that slot,
# through at least one visible column — a softmax over no positions is 0 / 0 = NaN, and NaN
# keys left in the scratch slot would poison any row that ever read it, even masked (0 · NaN is
# NaN); reading the slot it has just written keeps every number finite. Its token id must be one
# the embedding table has. Keep every tensor's dtype and device, and do not change the inputs:
# they are the batch the engine prepared. When `n == bucket` there is nothing to add (returning
# `rows` itself or a copy are both fine). A step may have no real rows at all: `warm_up`
# compiles each bucket with a step of padding only.

# %%
# export: engine.compiled_runner


def pad_rows(rows: DecodeRows, bucket: int, scratch: int) -> DecodeRows:
    """``rows`` followed by ``bucket - n`` padding rows that write and read only slot ``scratch``."""
    # BEGIN EXERCISE 9.3: return a DecodeRows of bucket rows: the step's rows first, unchanged, then padding rows that write and read only the scratch slot and see at least one column
    # Hint 1: Each field grows by bucket − n rows filled with one value: token id 0 and position 0 (valid for any model), the scratch slot for the slots and for the columns (what a padding row writes and reads), False for visibility — and then one column of each padding row made visible, so that its softmax has a position to weigh.
    # Hint 2: tensor.new_full(shape, value) makes padding with the tensor's dtype and device, and torch.cat puts it below the real rows in a new tensor (the input stays untouched); set the visible column on that new tensor, for the padding rows only.
    pad = bucket - len(rows.ids)
    if pad == 0:
        return rows

    def extend(tensor: torch.Tensor, value: Any) -> torch.Tensor:
        return torch.cat([tensor, tensor.new_full((pad, *tensor.shape[1:]), value)])

    visible = extend(rows.visible, False)
    visible[len(rows.ids):, 0] = True
    return DecodeRows(extend(rows.ids, 0), extend(rows.positions, 0), extend(rows.slots, scratch),
                      extend(rows.columns, scratch), visible)
    # END EXERCISE 9.3


# %%
# Check exercise 9.3
checks.stage09.check_pad_rows(pad_rows)

# %% [markdown]
# The batched step is the ladder's step — the very `decode_layer` of section 5, which was
# written for B rows — with two other arguments: an `attend` that writes each row's keys and
# values at its slot and attends over each row's gathered columns with the padding masked, and
# a `matvec` for a batch. A product of B rows by a weight matrix is a real matrix product, so it
# is `linear` (`F.linear`, a BLAS or oneDNN call inside the compiled code) rather than the
# ladder's broadcast-and-sum, which would read the weights once per row; a bucket of one row
# keeps the ladder's `gemv`. With bf16
# weights the product's inputs are rounded to bf16 and multiplied in bf16, accumulating in fp32:
# by the CPU's bf16 units where it has them (AMX, or AVX-512 BF16), and then faster than the
# eager engine, which converts each weight row to fp32 first; by a fallback path whose time grows
# with every row where it has none (AVX2 only: section 1's bf16 line says which). Either way it is not the same
# arithmetic as the eager engine's: the cells below measure both.

# %%
# export: engine.compiled_runner


def rows_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Each row's query heads against its own gathered positions: q (B, Hq, D) fp32, keys/values
    (B, T, Hkv, D), visible (B, T) -> (B, Hq, D) fp32.

    Exercise 9.2's attention with a batch and a mask: rows have different lengths, so the
    positions past a row's own are masked out before the softmax. Broadcasts and sums again, so
    that the gather of the columns from the pool fuses into the loops that read them.
    """
    rows, _, num_kv_heads, head_dim = keys.shape
    q = q.view(rows, 1, num_kv_heads, -1, head_dim)  # (B, 1, Hkv, group, D)
    scores = (q * keys[:, :, :, None].float()).sum(-1) * head_dim**-0.5  # (B, T, Hkv, group)
    scores = scores.masked_fill(~visible[:, :, None, None], float("-inf"))
    weights = (scores - scores.amax(dim=1, keepdim=True)).exp()
    probs = weights / weights.sum(dim=1, keepdim=True)
    out = (probs[..., None] * values[:, :, :, None].float()).sum(1)  # (B, Hkv, group, D)
    return out.reshape(rows, -1, head_dim)


def pool_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   rows: DecodeRows) -> torch.Tensor:
    """``Attend`` for the engine's rows over the paged pool, keys/values flattened to (slots,
    Hkv, D): each row's k and v written at its slot, in place, then each row's query against its
    gathered columns."""
    keys.index_copy_(0, rows.slots, k.to(keys.dtype))
    values.index_copy_(0, rows.slots, v.to(values.dtype))
    return rows_attention(q, keys[rows.columns], values[rows.columns], rows.visible)


def rows_layers(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: DecodeRows, eps: float,
                matvec: MatVec, layers: list[LayerInputs]) -> tuple[torch.Tensor, Stored]:
    """The ladder's ``decode_layer`` over a few layers in one compiled call, for B rows: x (B,
    hidden) fp32 after them, and ``Stored`` (which ``gemv``, the one-row bucket's product,
    needs; ``F.linear`` materialises its inputs anyway). cos/sin (B, 1, D); each layer's inputs
    are (keys, values, weights), the keys and values its flattened pool."""
    stored: Stored = ()
    for keys, values, weights in layers:
        x, more = decode_layer(x, cos, sin, eps, keys.shape[1], matvec, pool_attention, (keys, values, rows),
                               *weights)
        stored += more
    return x, stored


# %% [markdown]
# The runner: stage 07's `PagedModelRunner` with one block more in its cache than its
# allocator hands out (the scratch block), the weights packed as in rung 6, a `prepare` that
# packs a decode-only step straight into its `DecodeRows`, padded to its bucket (stage 07's
# `PagedBatch` holds much more, for every kind of step), and a `run` that sends those rows
# through the compiled functions.
#
# Two details decide whether a bucket compiles once or again and again. The number of cached
# positions, T, grows as the requests do, so it is marked as a symbol (`mark_dynamic`), and so is the
# number of slots in the pool, which differs from one KV budget to the next. And the compiled
# code is run under `torch.no_grad()`, never under `torch.inference_mode()` as the eager model
# is: tensors made in inference mode are a different kind of input to the compiler, so a step
# padded inside it and one that was not would each get a version of their own.

# %%
# export: engine.compiled_runner


class CompiledPagedRunner(PagedModelRunner):
    """A paged runner whose decode-only steps run compiled, padded to batch-size buckets.

    Steps with a prompt chunk of more than one token — and steps of more rows than the largest
    bucket — run the eager model (stage 07's ``run``, reading the cache by gathering, also on a
    GPU). Each bucket compiles on first use, or in ``warm_up``. ``compile=False`` runs the same
    step eagerly (to compare). The layer is the ladder's ``decode_layer``: a bucket of one row
    multiplies as the batch-1 decoder does (``gemv``, converting each weight as it is read), a
    larger one by ``linear``. Activations fp32; weights fp32 or bf16, copied into one packed
    block, so the model is not changed — in ``arithmetic``, the dtype the batched products are
    computed in (default: the weights'; fp32 for bf16 weights on a CPU whose bf16 products are
    slow, at twice the bytes) — or stage 08's int8 / int4 weights, read by the course's integer
    kernels (PyTorch's where those cannot run) as ``QuantizedFastDecoder`` reads them, their
    integers in a block of their own (``pack_quantized``). ``compile`` is ``FastDecoder``'s option:
    ``torch.compile``, False, or another compiler (``step_compiler``).
    """

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int = 16,
                 attention: AttentionFn = sdpa_attention, kv_dtype: torch.dtype | None = None,
                 prefix_caching: bool = True, compile: bool | Compiler = True,
                 layers_per_call: int = 5, buckets: tuple[int, ...] = BATCH_BUCKETS,
                 arithmetic: torch.dtype | None = None):
        refusal = compiled_step_refusal(model)
        if refusal:
            raise ValueError(refusal)
        if layers_per_call < 1:
            raise ValueError(f"layers_per_call must be at least 1, got {layers_per_call}")
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be batch sizes of at least 1, got {buckets}")
        if arithmetic not in (None, torch.float32, torch.bfloat16):
            raise ValueError(f"arithmetic must be torch.float32 or torch.bfloat16 (or None: the weights'), "
                             f"got {arithmetic}")
        # The cache gets one block more than the allocator hands out: the scratch block, which
        # padding rows write to. (The parent's allocator, for all the blocks, is replaced.)
        super().__init__(model, num_blocks + 1, block_size, attention, kv_dtype, prefix_caching, decode="gather")
        self.allocator = PagedAllocator(num_blocks, block_size, prefix_caching)
        self.scratch_slot = num_blocks * block_size
        # Row b: the slots of block b, scratch block included (prepare looks a step's tables up in it).
        self.block_slots = torch.arange((num_blocks + 1) * block_size, device=self.device).view(-1, block_size)
        self.buckets = tuple(sorted(set(buckets)))
        self.quantized = bool(layer_schemes(model))
        if self.quantized:
            self.block, matrices = pack_quantized(model)
        else:
            self.block, matrices = pack_weights(model, arithmetic)
        pools = [(self.cache.keys[i].flatten(0, 1), self.cache.values[i].flatten(0, 1)) for i in range(len(model.layers))]
        for pool in (p for pair in pools for p in pair):
            torch._dynamo.mark_dynamic(pool, 0)  # one compiled version for any KV budget
        layers = [(keys, values, weights.tensors())
                  for (keys, values), weights in zip(pools, layer_weights(model, matrices))]
        self.calls = [Call(layers[i:i + layers_per_call]) for i in range(0, len(layers), layers_per_call)]
        self.head, self.final_norm = matrices[-1], model.norm.weight.detach().float()
        self.embed = model.embed_tokens.weight.detach()
        # RoPE's tables, read by row: a lookup is one operation a step where computing a step's
        # rows takes several. Only the positions the pool can hold: a long-context model's own
        # limit would make tables of gigabytes.
        positions = min(model.config.max_position_embeddings, num_blocks * block_size)
        everywhere = torch.arange(positions, device=self.device)[None]
        self.cos, self.sin = (t[0] for t in rope_cos_sin(everywhere, self.config.head_dim, self.config.rope_theta))
        # dynamic=False: each bucket is its own specialised version; only the axes marked
        # dynamic (positions, pool slots) stay symbols.
        compiler = step_compiler(compile, dynamic=False)
        self.rows_layers, self.rows_head = compiler(rows_layers), compiler(decode_head)

    def prepare(self, schedule: Schedule) -> PagedBatch | DecodeStep:
        """A decode-only step (every chunk one token, no more rows than the largest bucket)
        straight to its padded rows; any other step packed by stage 07, which also refuses a
        block table too short for its chunk.

        Why not from stage 07's ``PagedBatch``: it builds some fifteen small tensors, for every
        kind of attention call, of which a decode step reads five, and at batch 1 a quantized
        step is short enough for their cost to show (benchmarks/single_prompt.py). Here the
        columns are whole blocks, looked up in ``block_slots``: T is a multiple of the block
        size, and the columns past a row's own positions are masked — as in stage 07, a table
        shorter than the step's longest is padded with block 0, which holds finite numbers like
        every block a request has written."""
        chunks, size = schedule.chunks, self.cache.block_size
        if (not chunks or len(chunks) > self.buckets[-1]
                or any(c.length != 1 or len(c.kv) * size <= c.start for c in chunks)):
            return super().prepare(schedule)

        def tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        blocks = blocks_for(max(c.start for c in chunks) + 1, size)
        tables = tensor([c.kv[:blocks] + [0] * (blocks - len(c.kv[:blocks])) for c in chunks])
        positions = tensor([c.start for c in chunks])
        rows = DecodeRows(tensor([c.request.token_ids(c.start, c.start + 1)[0] for c in chunks]), positions,
                          tensor([chunk_slots(c, size)[0] for c in chunks]),
                          self.block_slots[tables].view(len(chunks), blocks * size),
                          torch.arange(blocks * size, device=self.device) <= positions[:, None])
        return DecodeStep(pad_rows(rows, bucket_for(len(chunks), self.buckets), self.scratch_slot),
                          tensor([i for i, c in enumerate(chunks) if c.samples]))

    def run(self, batch: PagedBatch | DecodeStep) -> torch.Tensor:
        """Logits (K, vocab), fp32: compiled for a ``DecodeStep``, eager for any other step."""
        if not isinstance(batch, DecodeStep):
            return super().run(batch)
        with torch.no_grad():
            logits = self.decode_step(batch.rows)
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        return logits[batch.logits_at]

    def decode_step(self, rows: DecodeRows) -> torch.Tensor:
        """Logits (B, vocab) fp32 of padded rows, through the compiled functions (call under no_grad)."""
        if rows.columns.shape[1] < 2:  # one position: a masked second column keeps T a symbol
            rows = replace(rows, columns=F.pad(rows.columns, (0, 1), value=self.scratch_slot),
                           visible=F.pad(rows.visible, (0, 1), value=False))
        torch._dynamo.mark_dynamic(rows.columns, 1)
        torch._dynamo.mark_dynamic(rows.visible, 1)
        cos, sin = self.cos[rows.positions, None], self.sin[rows.positions, None]  # (B, 1, D)
        x = self.embed[rows.ids].float()
        matvec = self.matvec(len(rows.ids))
        for layers in self.calls:
            x, _ = self.rows_layers(x, cos, sin, rows, self.config.rms_norm_eps, matvec, layers)
        logits, _ = self.rows_head(x, self.final_norm, self.config.rms_norm_eps, self.head, matvec, False)
        return logits

    def matvec(self, bucket: int) -> MatVec:
        """The product a bucket's step multiplies with: the kernels' for quantized weights;
        else, for one row, the batch-1 decoder's ``gemv`` (which reads each weight once and
        converts it as it goes, whatever the CPU's bf16 support), and ``linear`` for more."""
        if self.quantized:
            return quantized_matvec
        return gemv if bucket == 1 else linear

    @torch.no_grad()
    def warm_up(self, max_rows: int | None = None) -> None:
        """Compile (or load from inductor's cache) every bucket up to ``max_rows``: a step of
        padding only, which writes nothing but the scratch block."""
        empty = torch.empty(0, dtype=torch.long, device=self.device)
        nothing = DecodeRows(empty, empty, empty, empty.view(0, 2), empty.view(0, 2).bool())
        largest = self.buckets[-1] if max_rows is None else bucket_for(min(max_rows, self.buckets[-1]), self.buckets)
        for bucket in self.buckets:
            if bucket <= largest:
                self.decode_step(pad_rows(nothing, bucket, self.scratch_slot))


def compiled_step_refusal(model: LlamaModel) -> str | None:
    """Why the compiled step cannot run ``model``, or None: it multiplies fp32 or bf16 weights,
    or stage 08's int8 / int4 ones that CPU integer kernels read, with fp32 activations."""
    if model.activations != torch.float32:
        return (f"the compiled step computes in fp32, but this model's activations are {model.activations}. "
                "Fix: load the model with activations=torch.float32 (the default)")
    refusal = quantized_refusal(model)
    if refusal:
        return f"the compiled step cannot read this model's quantized weights: {refusal}"
    dtype = model.embed_tokens.weight.dtype
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the compiled step takes fp32 or bf16 weights, got {dtype}. Fix: load the model in one of them"
    return None


def compiled_engine(model: LlamaModel, tokenizer: Tokenizer, max_seqs: int = SchedulerConfig.max_seqs,
                    token_budget: int = SchedulerConfig.token_budget,
                    kv_bytes: int | None = None, block_size: int = 16, prefix_caching: bool = True,
                    aging_rate: float = 1.0, attention: AttentionFn = sdpa_attention,
                    kv_dtype: torch.dtype | None = None,
                    clock: Callable[[], float] = time.perf_counter, compile: bool | Compiler = True,
                    buckets: tuple[int, ...] = BATCH_BUCKETS, stats_capacity: int = 10_000,
                    arithmetic: torch.dtype | None = None) -> Engine:
    """Stage 07's ``paged_engine`` with a ``CompiledPagedRunner``: the same arguments, scheduler,
    sampler and KV budget (the scratch block comes on top of ``kv_bytes``). The step is compiled
    for the ``buckets`` below ``max_seqs`` and for ``max_seqs`` itself, the largest batch it gets."""
    dtype = kv_dtype or model.embed_tokens.weight.dtype
    kv_bytes = slot_pool_bytes(model.config, 16, 1024, block_size, dtype) if kv_bytes is None else kv_bytes
    runner = CompiledPagedRunner(model, blocks_for_budget(model.config, kv_bytes, block_size, dtype), block_size,
                                 attention, kv_dtype, prefix_caching, compile,
                                 buckets=tuple(b for b in buckets if b < max_seqs) + (max_seqs,),
                                 arithmetic=arithmetic)
    config = SchedulerConfig(max_seqs, token_budget, aging_rate)
    return Engine(runner, tokenizer, stop_token_ids(model.config, tokenizer), config, clock, PagedScheduler,
                  stats_capacity)


# %% [markdown]
# Now the engine itself, eager (stage 07's `paged_engine`) against compiled, with 1, 4 and 16
# requests decoding at once, in fp32 first. Both engines get the same prompts and the same KV
# budget; `decode_rate` counts only the steps in which every request decodes (prompt steps run
# the eager model in both), and drops the first two. The compiled engine is given the buckets
# 1, 4 and 16 only — the batch sizes measured here — and warms up first, in a cell of its own
# (it prints how long that took: compiling on a first run, loading inductor's cache after); a
# serving engine keeps the default buckets, 1, 2, 4, 8, … up to `max_seqs`.

# %%
# NBVAL_IGNORE_OUTPUT
from aie_lessons.engine.engine import drive
from aie_lessons.engine.paged_runner import PagedModelRunner

ENGINE_ROWS = (1, 4, 16)
engine_prompts = [tokenizer.encode(f"Lighthouse fact number {i}:") for i in range(64)]  # 64: section 7
engine_params = SamplingParams(max_new_tokens=48, ignore_eos=True)


def decode_rate(engine, running: int) -> tuple[float, list[list[int]]]:
    """Decode tokens/s of ``engine`` serving the first ``running`` prompts together, and their tokens."""
    first_step = len(engine.stats)
    requests = [engine.add_request(prompt, engine_params) for prompt in engine_prompts[:running]]
    drive(engine)
    decoding = [s for s in engine.stats[first_step:] if s.prefill_tokens == 0][2:]
    return (sum(s.decode_rows for s in decoding) / sum(s.total_s for s in decoding),
            [r.output_ids for r in requests])


def engine_pair(weights_model):
    """The eager and the compiled engine on ``weights_model``, with the same budget; the compiled one warmed up."""
    eager = paged_engine(weights_model, tokenizer, max_seqs=max(ENGINE_ROWS), kv_bytes=128 * 2**20)
    compiled = compiled_engine(weights_model, tokenizer, max_seqs=max(ENGINE_ROWS), kv_bytes=128 * 2**20,
                               buckets=ENGINE_ROWS)
    start = time.perf_counter()
    compiled.runner.warm_up(max(ENGINE_ROWS))
    print(f"{weights_model.embed_tokens.weight.dtype}: warm-up of {len(compiled.runner.buckets)} buckets "
          f"(compiling, or loading inductor's cache): {time.perf_counter() - start:.0f} s")
    return eager, compiled


fp32_engines = engine_pair(model)

# %%
# NBVAL_IGNORE_OUTPUT
engine_speed = {}  # (weights, running, "eager" or "compiled"): decode tokens/s
same_engine_tokens = {}
for running in ENGINE_ROWS:
    (eager_rate, eager_tokens), (compiled_rate, compiled_tokens) = (decode_rate(e, running) for e in fp32_engines)
    engine_speed["fp32", running, "eager"], engine_speed["fp32", running, "compiled"] = eager_rate, compiled_rate
    same_engine_tokens[running] = compiled_tokens == eager_tokens
    print(f"fp32, {running:>2} running: eager {eager_rate:6.1f} tok/s, compiled {compiled_rate:6.1f} "
          f"({compiled_rate / eager_rate:.2f}x); the same greedy tokens: {same_engine_tokens[running]}")

# Requests that finish one by one: the batch shrinks through sizes that are not buckets, and is padded.
staggered = [SamplingParams(max_new_tokens=8 + 3 * i, ignore_eos=True) for i in range(max(ENGINE_ROWS))]
first_step = len(fp32_engines[1].stats)
eager_tokens, compiled_tokens = ([r.token_ids for r in e.generate(engine_prompts[:len(staggered)], staggered)]
                                 for e in fp32_engines)
same_engine_tokens["staggered"] = compiled_tokens == eager_tokens
padded_steps = [(len(s.chunks), bucket_for(len(s.chunks), fp32_engines[1].runner.buckets))
                for s in fp32_engines[1].stats[first_step:] if all(length == 1 for _, _, length in s.chunks)]
print(f"{len(staggered)} requests finishing one by one: the same greedy tokens: {same_engine_tokens['staggered']}; "
      f"{sum(b - n for n, b in padded_steps)} padding rows computed in {sum(b > n for n, b in padded_steps)} of "
      f"{len(padded_steps)} decode steps")

# %% [markdown]
# The tokens are the same — also when the batch shrank through sizes that are not buckets and
# padding rows ran beside the real ones: they wrote only to the scratch block. But the gain is
# small, smallest with many rows. Section 4's profile of a 16-row step said why: most of it is
# matrix products, and compiling removes only what lies between them. `products_seconds` times
# a step's products alone, with the model's own matrices, and the table below sets each time
# against the roofline of section 1 (the larger of FLOPs ÷ peak and bytes ÷ read bandwidth),
# in fp32 and in bf16 weights, for one row and for 16:

# %%
# export: ceilings


def products_seconds(matrices: list[torch.Tensor], rows: int, repeats: int = 3) -> float:
    """Seconds of one product of ``rows`` rows by each matrix (N, K), in the matrix's dtype, with
    nothing between them: the least time a step of ``rows`` requests through these matrices can
    take in this library."""
    inputs = {(w.shape[1], w.dtype): torch.randn(rows, w.shape[1], dtype=w.dtype, device=w.device) for w in matrices}

    def products() -> None:
        for w in matrices:
            torch.nn.functional.linear(inputs[w.shape[1], w.dtype], w)

    return best_seconds(products, repeats, matrices[0].device if matrices else "cpu")


# %%
# NBVAL_IGNORE_OUTPUT
from aie_lessons.fast_decode import decode_groups

rows16 = max(ENGINE_ROWS)
products_time = {}  # (weights, rows): seconds of a step's products alone
for weights, weights_model in (("fp32", model), ("bf16", bf16_model)):
    step_matrices = [torch.cat(group) for group in decode_groups(weights_model)]
    step_bytes = sum(w.nbytes for w in step_matrices)
    for rows in (1, rows16):
        products_time[weights, rows] = products_seconds(step_matrices, rows)
        flops = sum(2 * rows * w.numel() for w in step_matrices)
        roof = max(flops / peaks[weights], step_bytes / ceilings["read"])
        print(f"{weights}, {rows:>2} row{'s' * (rows > 1)}: the products alone take {products_time[weights, rows] * 1e3:5.1f} ms, "
              f"{roof / products_time[weights, rows]:4.0%} of their roofline"
              + (" (above it: these products beat section 1's square-matrix peak)" if roof > products_time[weights, rows] else ""))
    del step_matrices
for weights in ("fp32", "bf16"):
    print(f"{weights}: the products of {rows16} rows take {products_time[weights, rows16] / products_time[weights, 1]:.1f}x "
          "the time of one row's")
eager16, compiled16 = (rows16 / engine_speed["fp32", rows16, kind] for kind in ("eager", "compiled"))
print(f"fp32, {rows16} running: the eager step takes {eager16 * 1e3:.1f} ms, the compiled one {compiled16 * 1e3:.1f} ms; "
      f"with only the products left, a step could be at most {eager16 / products_time['fp32', rows16]:.2f}x faster "
      "than the eager one")

# %% [markdown]
# Read the table by rows, and the two lines under it: what 16 rows cost against one, in each
# dtype, although they read the same bytes. In fp32 these thin products (16 rows against
# 576-wide matrices) are done by the fp32 units well below the roofline, and compiling cannot
# change that. In bf16 the instruction set decides. A CPU with bf16 units (AMX, or AVX-512
# BF16) does the extra rows' arithmetic almost for free, so 16 rows cost little more than one,
# and the compiled bf16 step should gain most where many requests run. A CPU without them
# (AVX2 only) multiplies bf16 in a fallback path whose time grows with every row: there the
# bf16 line is the worse one. (At one row
# the compiled step does not beat the ladder's rung 7, whose broadcast-and-sum product streams
# the weights faster than a library call for a single row.)
#
# Eager, the engine converts each bf16 weight row to fp32 before the product (stage 04's
# `Linear`) — a baseline whose speed against fp32 depends on the CPU; compiled, the activations are
# rounded to bf16 instead. So the tokens may differ, and each step is checked instead:
# `compared_steps` runs every decode step of the compiled bf16 engine both ways on the same
# cache, and stage 04's `agreement` compares the logits.

# %%
# NBVAL_IGNORE_OUTPUT
bf16_engines = engine_pair(bf16_model)

# %%
# NBVAL_IGNORE_OUTPUT
for running in ENGINE_ROWS:
    (eager_rate, _), (compiled_rate, _) = (decode_rate(e, running) for e in bf16_engines)
    engine_speed["bf16", running, "eager"], engine_speed["bf16", running, "compiled"] = eager_rate, compiled_rate
    print(f"bf16, {running:>2} running: eager {eager_rate:6.1f} tok/s, compiled {compiled_rate:6.1f} "
          f"({compiled_rate / eager_rate:.2f}x), {compiled_rate / engine_speed['fp32', running, 'eager']:.2f}x "
          f"the eager fp32 engine, {compiled_rate / engine_speed['fp32', running, 'compiled']:.2f}x the compiled fp32 one")

# %%
# NBVAL_IGNORE_OUTPUT
def compared_steps(engine, running: int) -> Agreement:
    """``agreement`` of the eager and the compiled logits of every decode step of ``running`` requests."""
    runner, eager, compiled, schedules = engine.runner, [], [], []

    def keep(schedule):
        schedules.append(schedule)
        return CompiledPagedRunner.prepare(runner, schedule)

    def both(batch):
        logits = CompiledPagedRunner.run(runner, batch)
        if isinstance(batch, DecodeStep):  # then the eager step, on stage 07's batch: the cache rewritten alike
            eager.append(PagedModelRunner.run(runner, PagedModelRunner.prepare(runner, schedules[-1])))
            compiled.append(logits)
        return logits

    runner.prepare, runner.run = keep, both
    try:
        decode_rate(engine, running)
    finally:
        del runner.prepare, runner.run
    return agreement(torch.cat(eager), torch.cat(compiled))


bf16_agreement = compared_steps(bf16_engines[1], rows16)
print(f"bf16, compiled against eager on {bf16_agreement.positions} rows of decode steps: top-1 "
      f"{bf16_agreement.top1:.0%}, mean KL {bf16_agreement.mean_kl:.1e}")
del fp32_engines, bf16_engines

# %%
fig, ax = plt.subplots(figsize=(6.5, 3.6))
width = 0.2
for i, (weights, kind) in enumerate([(w, k) for w in ("fp32", "bf16") for k in ("eager", "compiled")]):
    bars = ax.bar([j + (i - 1.5) * width for j in range(len(ENGINE_ROWS))],
           [engine_speed[weights, r, kind] for r in ENGINE_ROWS], width, label=f"{weights}, {kind}",
           color=["tab:blue", "tab:orange"][kind == "compiled"], alpha=1.0 if weights == "bf16" else 0.55)
    ax.bar_label(bars, fmt="%.0f", fontsize=6)
ax.set_xticks(range(len(ENGINE_ROWS)), [f"{r} running" for r in ENGINE_ROWS])
ax.set_ylabel("decode tokens/s (all requests)")
ax.set_title("The engine's decode step: eager against compiled")
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()

# %%
print("the compiled fp32 engine kept the eager engine's greedy tokens, at", ENGINE_ROWS, "running and with "
      "requests finishing one by one:", all(same_engine_tokens.values()))
print("compiled bf16 agrees with eager bf16 on at least 90% of the steps' next tokens, mean KL under 0.01:",
      bf16_agreement.top1 >= 0.9 and bf16_agreement.mean_kl < 0.01)

# %% [markdown]
# ### One engine configuration
#
# Everything that runs the engine for real — `aie serve`, `aie generate` with several prompts,
# the benchmarks — builds it in one place, `build_engine`, from one dataclass of settings,
# `EngineConfig`. It holds the scheduler's limits (stage 06's defaults: 16 requests at once, 256
# tokens per step), the paged pool (stage 07's: the bytes of 16 slots of 1024 tokens, blocks of
# 16) and `step`, which picks the step this section compiled or stage 07's eager one:
#
# * `"eager"`: the model, as stages 06 and 07 ran it;
# * `"compiled"`: `CompiledPagedRunner`, its buckets those of `buckets` below `max_seqs` and
#   `max_seqs` itself; refused, with the reason, where it cannot run;
# * `"auto"` (the default): compiled where it can run, eager where not — and the engine says why.
#
# The compiled step needs fp32 activations, weights in fp32, bf16 or stage 08's int8 / int4
# (read by the CPU kernels of rung 8), and a compiler for the device: a C++ compiler for a CPU,
# Triton for a GPU. Compiling costs time once (each bucket, or loading inductor's cache of it),
# so `aie serve`, which runs for hours, takes `"auto"` and compiles every bucket
# (`compile_buckets`) before it says it is ready (the compiled step also keeps a second, packed
# copy of the weights: as many bytes again as the model's). `aie generate` runs one prompt
# through the same engine, with the one bucket of one row compiled *ahead of time* — exported
# once into a library that a later process loads in a fraction of a second
# (`infra/ahead_of_time.py`, given to the runner as its compiler) — and several prompts eager
# unless `--step` says otherwise.
#
# With bf16 weights the compiled step multiplies in bf16 — fast with bf16 instructions, a
# fallback path many times slower than fp32 without them (section 1 measured this CPU's). So
# `arithmetic="auto"` (the default) times one bf16 and one fp32 product of `max_seqs` rows by a
# matrix of the model's shape, and where bf16 is the slower, packs the step's weights in fp32
# (fp32 arithmetic, twice the bytes) and says so; `"bf16"` or `"float32"` decide without it.

# %%
# export: engine.engine_config
"""One set of engine settings, and the one function that builds the engine the runtime runs."""

from __future__ import annotations

import importlib.util
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from aie_lessons.ceilings import products_seconds
from aie_lessons.engine.compiled_runner import (BATCH_BUCKETS, CompiledPagedRunner, compiled_engine,
                                                compiled_step_refusal)
from aie_lessons.engine.engine import Engine
from aie_lessons.engine.paged_engine import paged_engine
from aie_lessons.engine.scheduler import SchedulerConfig
from aie_lessons.fast_decode import Compiler
from aie_lessons.model import LlamaModel
from aie_lessons.quantized_checkpoint import layer_schemes

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aie_lessons.tokenizer import Tokenizer

STEPS = ("auto", "eager", "compiled")
ARITHMETIC = ("auto", "bf16", "float32")


@dataclass(frozen=True)
class EngineConfig:
    """How an engine runs. The defaults are the course's one set: the scheduler's (stage 06),
    the paged pool's (stage 07) and this stage's buckets; the CLI and the server start from them."""

    max_seqs: int = SchedulerConfig.max_seqs  # requests running at once (and the largest bucket)
    token_budget: int = SchedulerConfig.token_budget  # tokens per step, prefill chunks included
    aging_rate: float = SchedulerConfig.aging_rate
    kv_bytes: int | None = None  # the paged pool; None: the bytes of 16 slots of 1024 tokens
    block_size: int = 16
    prefix_caching: bool = True
    kv_dtype: torch.dtype | None = None  # None: the weights' dtype
    step: str = "auto"  # "eager", "compiled", or "auto": compiled where it can run
    buckets: tuple[int, ...] = BATCH_BUCKETS  # the compiled step's batch sizes (up to max_seqs)
    # the compiled step's products with bf16 weights: "bf16", "float32", or "auto": bf16 where a
    # bf16 product of max_seqs rows is measured no slower than an fp32 one on this machine
    arithmetic: str = "auto"
    stats_capacity: int = 10_000  # how many of the latest steps' StepStats the engine keeps

    def __post_init__(self) -> None:
        if self.step not in STEPS:
            raise ValueError(f"step={self.step!r} is not one of {', '.join(map(repr, STEPS))}")
        if self.arithmetic not in ARITHMETIC:
            raise ValueError(f"arithmetic={self.arithmetic!r} is not one of {', '.join(map(repr, ARITHMETIC))}")
        self.scheduler()  # the scheduler's own checks, each with its fix
        if not self.buckets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in self.buckets):
            raise ValueError(f"buckets={self.buckets!r} must be batch sizes of at least 1, e.g. (1, 2, 4, 8)")
        if self.kv_bytes is not None and self.kv_bytes <= 0:
            raise ValueError(f"kv_bytes={self.kv_bytes!r} must be a positive number of bytes, or None for the default")
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size!r} must be at least 1 token")

    def scheduler(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_seqs, self.token_budget, self.aging_rate)


class StepUnavailable(ValueError):
    """``step="compiled"`` asked for where the compiled step cannot run: the message says why and
    what to do. Its own class, so that a caller can tell it from a bad setting or a bad checkpoint."""


def compiled_step_unavailable(model: LlamaModel) -> str | None:
    """Why the compiled step cannot run ``model`` here, with the fix, or None: the model's reasons
    (``compiled_step_refusal``), then the machine's."""
    return compiled_step_refusal(model) or no_compiler_for(model.embed_tokens.weight.device)


def no_compiler_for(device: torch.device | str) -> str | None:
    """Why nothing here can compile the step for ``device``, with the fix, or None: a CPU needs a
    C++ compiler, a CUDA GPU needs Triton. A command line asks this before it loads a model."""
    device = torch.device(device).type
    if device == "cpu":
        from aie_lessons.infra.compile_cache import cpp_compiler

        if cpp_compiler() is None:
            return "compiling for the CPU needs a C++ compiler, and none was found. Fix: install g++ (or clang++)"
    elif device == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "compiling for a GPU needs Triton, which is not installed. Fix: pip install triton"
    else:
        return f"the compiled step is built for CPUs and CUDA GPUs, not {device}. Fix: run it on the CPU or a CUDA GPU"
    return None


def choose_step(model: LlamaModel, step: str) -> tuple[str, str | None]:
    """The step an engine for ``model`` runs, "eager" or "compiled", and why "auto" chose eager
    (None otherwise). "compiled" where it cannot run is refused, with the reason."""
    if step not in STEPS:
        raise ValueError(f"step={step!r} is not one of {', '.join(map(repr, STEPS))}")
    if step == "eager":
        return "eager", None
    why = compiled_step_unavailable(model)
    if why and step == "compiled":
        raise StepUnavailable(f"the compiled step cannot run here: {why}, or take step='eager'")
    return ("eager", why) if why else ("compiled", None)


def build_engine(model: LlamaModel, tokenizer: Tokenizer, config: EngineConfig = EngineConfig(),
                 clock: Callable[[], float] = time.perf_counter,
                 on_note: Callable[[str], None] | None = None, compiler: Compiler | None = None) -> Engine:
    """The engine ``config`` describes, over a paged cache: stage 07's ``paged_engine`` or this
    stage's ``compiled_engine``, whose step ``compiler`` compiles (default ``torch.compile``; the
    command line passes its ``AheadOfTime``). When "auto" falls back to eager, ``on_note`` hears
    why (default: a warning). The compiled step compiles each bucket on first use:
    ``compile_buckets`` does it before any request waits for it."""
    def tell(note: str) -> None:
        if on_note is None:
            warnings.warn(note, stacklevel=3)
        else:
            on_note(note)

    step, why = choose_step(model, config.step)
    if why:
        tell(f"the eager step runs, because {why}")
    settings = dict(max_seqs=config.max_seqs, token_budget=config.token_budget, kv_bytes=config.kv_bytes,
                    block_size=config.block_size, prefix_caching=config.prefix_caching,
                    aging_rate=config.aging_rate, kv_dtype=config.kv_dtype, clock=clock,
                    stats_capacity=config.stats_capacity)
    if step == "compiled":
        return compiled_engine(model, tokenizer, buckets=config.buckets, compile=compiler or True,
                               arithmetic=choose_arithmetic(model, config, tell), **settings)
    return paged_engine(model, tokenizer, **settings)


BF16_PAYS = 1.0  # a bf16 product at most this many times an fp32 one's time: the step multiplies in bf16


def bf16_product_cost(model: LlamaModel, rows: int) -> float:
    """The time of a bf16 product of ``rows`` rows by a matrix of the model's MLP shape over an
    fp32 one's, measured here: under 1 on a CPU with bf16 instructions, many times 1 on one
    without (its bf16 products take a fallback path). Some milliseconds; the global random
    state is left as it was."""
    config, device = model.config, model.embed_tokens.weight.device
    with torch.random.fork_rng(devices=[]):
        matrix = torch.randn(config.intermediate_size, config.hidden_size, device=device)
        return products_seconds([matrix.bfloat16()], rows) / products_seconds([matrix], rows)


def choose_arithmetic(model: LlamaModel, config: EngineConfig, tell: Callable[[str], None]) -> torch.dtype | None:
    """The dtype the compiled step multiplies in: None (the weights' own) unless the weights are
    bf16 and ``config.arithmetic`` is "float32", or "auto" and bf16 products are slow here —
    then fp32, and ``tell`` hears why (the packed weights take twice the bytes). An engine of
    one request at a time has only the bucket of one row, whose ``gemv`` converts each bf16
    weight as it reads it on any CPU: nothing to measure, no second copy in fp32. Stage 08's
    quantized weights go through their own kernels: nothing to decide either."""
    quantized = bool(layer_schemes(model))
    if (model.embed_tokens.weight.dtype != torch.bfloat16 or config.arithmetic == "bf16" or config.max_seqs == 1
            or quantized):
        return None
    if config.arithmetic == "float32":
        return torch.float32
    cost = bf16_product_cost(model, config.max_seqs)
    if cost <= BF16_PAYS:
        return None
    tell(f"the compiled step multiplies the bf16 weights in fp32 (packed in fp32, twice the bytes): a bf16 product "
         f"of {config.max_seqs} rows took {cost:.1f}x an fp32 one on this CPU, which has no fast bf16 arithmetic "
         "(arithmetic='bf16' keeps bf16)")
    return torch.float32


def step_of(engine: Engine) -> str:
    """The step ``engine`` runs, "compiled" or "eager" ("auto" has been decided by now)."""
    return "compiled" if isinstance(engine.runner, CompiledPagedRunner) else "eager"


def compile_buckets(engine: Engine, on_start: Callable[[tuple[int, ...]], None] | None = None) -> float | None:
    """Compile a compiled engine's step for every bucket now (or load it from inductor's cache),
    so that no request waits for the compiler; ``on_start`` hears the buckets first, since this
    takes seconds to minutes. The seconds it took, or None for an eager engine (nothing to do)."""
    if step_of(engine) != "compiled":
        return None
    if on_start is not None:
        on_start(engine.runner.buckets)
    start = time.perf_counter()
    engine.runner.warm_up()
    return time.perf_counter() - start


# %% [markdown]
# What `"auto"` picks for the models of this notebook, and for one it cannot compile (bf16
# activations); then a small engine built from a configuration, against stage 07's eager engine
# on the same prompts:

# %%
# NBVAL_IGNORE_OUTPUT
from aie_lessons.engine.engine_config import (BF16_PAYS, EngineConfig, bf16_product_cost, build_engine, choose_step,
                                              compile_buckets, step_of)

bf16_activations = LlamaModel.from_pretrained(MODEL_DIR, dtype=torch.bfloat16, activations=torch.bfloat16)
for name, candidate in (("fp32 weights", model), ("bf16 weights", bf16_model), ("bf16 activations", bf16_activations)):
    chosen, why = choose_step(candidate, "auto")
    print(f"{name:17}: {chosen}" + (f" ({why})" if why else ""))
del bf16_activations
cost = bf16_product_cost(bf16_model, 16)
print(f"bf16 weights, 16 rows: a bf16 product takes {cost:.2f}x an fp32 one on this CPU, so arithmetic='auto' "
      f"multiplies them in {'bf16' if cost <= BF16_PAYS else 'fp32'}")

small = EngineConfig(max_seqs=4, buckets=(1, 4), kv_bytes=64 * 2**20)
configured = build_engine(model, tokenizer, small)
seconds = compile_buckets(configured)
print(f"build_engine, max_seqs={small.max_seqs}, step={small.step!r}: the {step_of(configured)} step, "
      f"{type(configured.runner).__name__}" + ("" if seconds is None else
      f", buckets {configured.runner.buckets} compiled in {seconds:.0f} s"))
configured_tokens = [r.token_ids for r in configured.generate(engine_prompts[:4], engine_params)]
eager_tokens = [r.token_ids for r in paged_engine(model, tokenizer, max_seqs=4, kv_bytes=64 * 2**20)
                .generate(engine_prompts[:4], engine_params)]

# %%
print("where a C++ compiler exists, build_engine's default step is the compiled one:",
      step_of(configured) == choose_step(model, "auto")[0])
print("and it keeps stage 07's greedy tokens:", configured_tokens == eager_tokens)
del configured


# %% [markdown]
# ## 7. On a GPU
#
# Everything above ran on this machine's CPU. On a GPU the same questions have other answers:
# its memory reads several TB/s and its matrix units do hundreds of TFLOP/s, so the ridge point
# sits far to the right, and the Triton kernels of stages 05 and 07 compile instead of running
# in Triton's interpreter. This section measures, where a CUDA GPU is present:
#
# * the GPU's ceilings, with section 1's probes given `device="cuda"` (a sum for reading);
# * stage 05's flash-attention kernel against PyTorch's SDPA on prefill shapes, and stage 07's
#   paged decode kernel against gathering the blocks and calling SDPA, on decode shapes — time,
#   the bytes each reads per second against the read ceiling, and the largest difference;
# * decode tokens/s of the engine, eager and compiled, at 1, 16 and 64 running requests.
#
# Without a GPU the cells say so and measure nothing. On a machine with one, `make bench-gpu`
# measures the same with repeats: `benchmarks/flash_attention.py`,
# `benchmarks/paged_attention.py` and `benchmarks/engine_decode.py --device cuda`.

# %%
# export: gpu_kernels
"""Stage 05's and stage 07's Triton kernels against PyTorch's SDPA, timed on a GPU."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from aie_lessons.ceilings import best_seconds
from aie_lessons.engine.paged_attention import gather_decode_attention, paged_decode_attention_triton
from aie_lessons.flash_attention import HAS_TRITON, gpu_milliseconds, interpreted, triton_flash_attention


def gpu_skip_reason() -> str | None:
    """Why the GPU measurements cannot run here, or None when they can."""
    if not torch.cuda.is_available():
        return ("skipped: no CUDA GPU on this machine. The Triton kernels compile only for a GPU (on a CPU "
                "they run in Triton's interpreter, which is for correctness, not speed)")
    if not HAS_TRITON:
        return "skipped: triton is not installed, so the kernels of stages 05 and 07 cannot compile"
    return None


@dataclass
class KernelTiming:
    """One shape: our kernel and PyTorch's way, their milliseconds, the bytes the work must read
    at least, and the largest difference of our output from the fp32 reference."""

    kernel: str
    shape: str
    ours_ms: float
    torch_ms: float
    bytes_read: int
    max_error: float

    @property
    def speedup(self) -> float:
        """PyTorch's time over ours: above 1, our kernel is faster."""
        return self.torch_ms / self.ours_ms

    def read_rate(self, ms: float) -> float:
        """Bytes per second the work read, at least, when it took ``ms`` milliseconds."""
        return self.bytes_read / (ms / 1e3)


def gpu_read_bandwidth(device: torch.device | str = "cuda", megabytes: int = 1024, repeats: int = 10) -> float:
    """Bytes per second a sum reads from a buffer far larger than the GPU's caches: its read ceiling
    (stage 04's ``read_bandwidth`` is the CPU's, which also tries a BLAS product)."""
    buffer = torch.ones(megabytes * 2**20 // 4, device=device)
    return buffer.nbytes / best_seconds(buffer.sum, repeats, device)


def milliseconds(calls: list[Callable[[], object]], device: torch.device | str) -> list[float]:
    """Each call's time: CUDA events on a GPU (calls alternated), the best of a few on a CPU
    (where the kernels run in the interpreter: a check that the measurement runs, not a speed)."""
    if torch.device(device).type == "cuda":
        return gpu_milliseconds(calls)
    return [best_seconds(call, 2) * 1e3 for call in calls]


def flash_vs_sdpa(seq_lens: tuple[int, ...], batch: int, heads: int, kv_heads: int, head_dim: int,
                  dtype: torch.dtype, device: torch.device | str) -> list[KernelTiming]:
    """Stage 05's kernel and SDPA on causal prefill shapes (q, k, v of ``seq`` positions each)."""
    rows = []
    for seq in seq_lens:
        q = torch.randn(batch, heads, seq, head_dim, dtype=dtype, device=device)
        k, v = (torch.randn(batch, kv_heads, seq, head_dim, dtype=dtype, device=device) for _ in range(2))
        ours = triton_flash_attention(q, k, v, causal=True)[0]
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
        times = milliseconds([lambda: triton_flash_attention(q, k, v, causal=True),
                              lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)],
                             device)
        rows.append(KernelTiming("flash (stage 05)", f"B={batch} S={seq}", *times,
                                 sum(t.nbytes for t in (q, k, v)), (ours.float() - want).abs().max().item()))
    return rows


def paged_vs_sdpa(batch_sizes: tuple[int, ...], context: int, block_size: int, heads: int, kv_heads: int,
                  head_dim: int, dtype: torch.dtype, device: torch.device | str) -> list[KernelTiming]:
    """Stage 07's paged decode kernel against gathering each row's blocks and calling SDPA (what
    the engine does without the kernel), every row ``context`` positions in shuffled blocks."""
    rows = []
    for batch in batch_sizes:
        blocks_per_row = math.ceil(context / block_size)
        pool = (batch * blocks_per_row + 1, block_size, kv_heads, head_dim)
        keys, values = (torch.randn(pool, dtype=dtype, device=device) for _ in range(2))
        tables = torch.randperm(pool[0] - 1, device=device)[:batch * blocks_per_row].view(batch, blocks_per_row)
        lens = torch.full((batch,), context, device=device)
        q = torch.randn(batch, heads, head_dim, dtype=dtype, device=device)
        scale = head_dim**-0.5
        slots = (tables[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1)[:, :context]

        def gathered() -> torch.Tensor:
            k, v = (pool_.flatten(0, 1)[slots].transpose(1, 2) for pool_ in (keys, values))  # (B, Hkv, T, D)
            return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]

        ours = paged_decode_attention_triton(q, keys, values, tables, lens, scale)
        want = gather_decode_attention(q.float(), keys.float(), values.float(), tables, lens, scale)
        times = milliseconds([lambda: paged_decode_attention_triton(q, keys, values, tables, lens, scale), gathered],
                             device)
        read = 2 * batch * context * kv_heads * head_dim * keys.element_size() + q.nbytes
        rows.append(KernelTiming("paged decode (stage 07)", f"B={batch} T={context}", *times, read,
                                 (ours.float() - want).abs().max().item()))
    return rows


# %% [markdown]
# The GPU's ceilings, and where a decode step and a prefill sit against them:

# %%
# NBVAL_IGNORE_OUTPUT
gpu_reason = gpu_skip_reason()
if gpu_reason:
    print(gpu_reason)
else:
    gpu = torch.device("cuda")
    gpu_read = gpu_read_bandwidth(gpu)
    gpu_peaks = {name: matmul_throughput(dtype, 8192, 10, gpu).per_second for name, dtype in
                 (("fp32", torch.float32), ("bf16", torch.bfloat16), ("int8", torch.int8))}
    print(f"{torch.cuda.get_device_name()}: read {gpu_read / 1e9:.0f} GB/s, copy "
          f"{copy_bandwidth(1024, 10, gpu) / 1e9:.0f} GB/s (read + written)")
    for name, peak in gpu_peaks.items():
        print(f"{name:>4} matmul {peak / 1e12:7.1f} T{'FL' if name != 'int8' else ''}OP/s → ridge at "
              f"{peak / gpu_read:6.0f} operations per byte read")
    gpu_cost = committed_step_cost(config, 64, 1024, bytes_read_per_token(bf16_model), torch.bfloat16)
    print(f"a bf16 decode step of 64 requests at 1024 positions: {gpu_cost.intensity:.0f} FLOPs per byte, "
          f"{gpu_cost.intensity / (gpu_peaks['bf16'] / gpu_read):.0%} of the way to the bf16 ridge")

# %% [markdown]
# The two kernels against PyTorch. A decode kernel's work is reading the cache, so its speed is
# best read as bytes per second against the read ceiling; the flash kernel's is arithmetic.

# %%
# NBVAL_IGNORE_OUTPUT
if gpu_reason:
    print(gpu_reason)
else:
    timings = (flash_vs_sdpa((1024, 4096, 16384), 4, config.num_heads, config.num_kv_heads, config.head_dim,
                             torch.bfloat16, gpu)
               + paged_vs_sdpa((1, 16, 64, 256), 2048, 16, config.num_heads, config.num_kv_heads, config.head_dim,
                               torch.bfloat16, gpu))
    for row in timings:
        print(f"{row.kernel:<24} {row.shape:<14} ours {row.ours_ms:7.3f} ms, PyTorch {row.torch_ms:7.3f} ms "
              f"({row.speedup:4.2f}x); read at least {row.read_rate(row.ours_ms) / gpu_read:4.0%} of the read "
              f"ceiling; max difference {row.max_error:.1e}")

# %% [markdown]
# And the engine on the GPU: eager (stage 07's, reading blocks with the paged kernel) against
# compiled (section 6's runner, whose products and fused loops inductor now writes in Triton),
# bf16 weights, at 1, 16 and 64 running requests.

# %%
# NBVAL_IGNORE_OUTPUT
if gpu_reason:
    print(gpu_reason)
else:
    gpu_model = LlamaModel.from_pretrained(MODEL_DIR, dtype=torch.bfloat16, device=gpu)
    for running in (1, 16, 64):
        eager = paged_engine(gpu_model, tokenizer, max_seqs=running, kv_bytes=512 * 2**20)
        compiled = compiled_engine(gpu_model, tokenizer, max_seqs=running, kv_bytes=512 * 2**20, buckets=(running,))
        compiled.runner.warm_up()
        (eager_rate, _), (compiled_rate, _) = (decode_rate(e, running) for e in (eager, compiled))
        cost = committed_step_cost(config, running, 64, bytes_read_per_token(gpu_model), torch.bfloat16)
        roof = running / max(cost.flops / gpu_peaks["bf16"], cost.bytes / gpu_read)
        print(f"{running:>2} running: eager {eager_rate:7.0f} tok/s, compiled {compiled_rate:7.0f} "
              f"({compiled_rate / eager_rate:.2f}x); the roofline allows {roof:,.0f}")
    del gpu_model, eager, compiled


# %% [markdown]
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
# * The decoder ladder: a step written for one token (your decode attention, 9.2), fused
#   projections, the compiler, bf16 weights in fp32 arithmetic, packing in reading order, fewer
#   compiled calls and integer weights — each rung measured against its own roofline
#   (`fast_decode`: `FastDecoder`, `QuantizedFastDecoder`).
# * The engine's decode step compiled per batch-size bucket, padding rows kept harmless by a
#   scratch block (your `pad_rows`, 9.3): in fp32 the thin products of 16 rows are most of the
#   step, so compiling gains little; in bf16 the products run on the bf16 units where the CPU
#   has them, and slower with every row where it has none
#   (`engine.compiled_runner`: `CompiledPagedRunner`, `compiled_engine`).
# * One configuration for the engine the runtime runs, eager or compiled, compiled where it can
#   run (`engine.engine_config`: `EngineConfig`, `build_engine`).
# * On a GPU the same probes and the kernels of stages 05 and 07 against PyTorch's SDPA
#   (`gpu_kernels`).
#
# Commit the stage with `aie commit 09`.
