"""Checks for stage 02: splitting heads, attention weights, GQA grouping, the layer, the attention.

Every expected value is recomputed here from the formula (in float64, one head at a time where
that makes the formula obvious); the usual wrong answers are recomputed the same way, so that a
failure can say which mistake it was.
"""

from __future__ import annotations

import math
from collections import Counter
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from aie_lessons.checks.common import (
    CheckFailed,
    call,
    causal_reference,
    close,
    expect_shape,
    fail,
    isolated,
    passed,
)

MASKED = torch.finfo(torch.float32).min
HALF = (torch.bfloat16, torch.float16)
# Largest error accepted per dtype, for attention outputs of size about 1 against a float64
# reference computed from the same rounded q, k, v: fp32 differs by summation order only; bf16
# and fp16 round the scores and the weights before they multiply v (8 and 11 bits). Measured on
# the reference solution: 4e-7 (fp32), 6.4e-3 (bf16), 9.1e-4 (fp16); about 3× that is allowed.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 3e-3}
# Attention weights (size ≤ 1) against a reference computed from the *same* rounded q and k:
# what remains is the rounding of the q·kᵀ product and of the returned weights (measured on the
# reference solution: 2.3e-3 in bf16, 4.9e-4 in fp16; a softmax in half precision is refused by
# the NewTensors probe, not by these bounds).
WEIGHT_TOLERANCE = {torch.bfloat16: 8e-3, torch.float16: 2e-3}
HALF_HINT = ("float16 and bfloat16 scores cannot hold MASKED (float32's most negative number): "
             "turn the scores into float32 before masking them, and keep the softmax in float32")


def _generator(seed: int = 2) -> torch.Generator:
    """A seeded generator of the check's own: its inputs are the same on every run and machine,
    and the notebook's global random state is neither used nor disturbed."""
    return torch.Generator().manual_seed(seed)


def _split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reference for 2.1, lent to 2.4 so that a mistake in 2.1 does not also fail 2.4."""
    batch, seq, width = x.shape
    return x.view(batch, seq, num_heads, width // num_heads).transpose(1, 2)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    """Reference inverse of ``_split_heads``, lent to 2.4 for the same reason."""
    batch, heads, seq, head_dim = x.shape
    return x.transpose(1, 2).reshape(batch, seq, heads * head_dim)


def _attention(q, k, v, mask=None):
    """Reference attention (PyTorch's SDPA), lent to 2.4 in place of the learner's 2.5."""
    if mask is None:
        mask = causal_reference(q.shape[-2], k.shape[-2], q.device)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _model_layout(batch: int, heads: int, seq: int, head_dim: int, g: torch.Generator,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A (B, H, S, D) tensor laid out as the model makes it: ``split_heads`` of a projection,
    (B, S, H, D) in memory seen through a transpose. Not contiguous, so ``.view`` cannot merge
    its head and position axes: checks must see what the model will pass."""
    return torch.randn(batch, seq, heads, head_dim, generator=g).to(dtype).transpose(1, 2)


@contextmanager
def _given(fn, **helpers):
    """Like ``isolated``, and also lends helpers that ``fn``'s notebook has not defined *yet*:
    the layer (2.4) calls ``manual_attention``, which the learner writes afterwards (2.5)."""
    namespace = fn.__globals__
    lent = [name for name in helpers if name not in namespace]
    namespace.update({name: helpers[name] for name in lent})
    try:
        with isolated(fn, **helpers):
            yield
    finally:
        for name in lent:
            namespace.pop(name, None)


class NewTensors(TorchDispatchMode):
    """Records every tensor an operation creates: (operation, shape, dtype of its first input).

    Views share their input's memory, so they are left out; what remains is what cost memory.
    """

    VIEWS = {"view", "_unsafe_view", "unsqueeze", "transpose", "expand", "permute", "t", "squeeze",
             "unflatten", "select", "slice", "alias", "as_strided", "detach", "_reshape_alias"}

    def __init__(self):
        super().__init__()
        self.created: list[tuple[str, tuple[int, ...], torch.dtype | None, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if isinstance(out, torch.Tensor) and name not in self.VIEWS:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            self.created.append((name, tuple(out.shape), None if first is None else first.dtype, args[1:]))
        return out


def new_tensors(fn, *args) -> list[tuple[str, tuple[int, ...]]]:
    """The (operation, shape) of every tensor ``fn(*args)`` creates, views excluded."""
    with NewTensors() as log:
        fn(*args)
    return [(name, shape) for name, shape, _, _ in log.created]


def _half_softmax(log: NewTensors) -> str | None:
    """The dtype name of a softmax that ran in bfloat16 or float16, if any, else None.

    ``torch.softmax(x, dim, dtype=torch.float32)`` on a half ``x`` is recorded as ``_softmax``
    with ``half_to_float=True``: that one computes in float32 and is fine. The results cannot tell
    a half softmax apart within half tolerances, so the operation itself is inspected.
    """
    for name, _, dtype, rest in log.created:
        if name in ("_softmax", "softmax") and dtype in HALF and not (len(rest) > 1 and rest[1] is True):
            return str(dtype).removeprefix("torch.")
    return None


def _shares_memory(got: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether ``got`` is a view of ``source`` (same storage), not a copy of it."""
    return got.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()


# --- 2.1 -------------------------------------------------------------------------------------


def check_split_heads(split_heads, merge_heads) -> None:
    """2.1: each head's slice of every position, as a view, for 3 shapes (one with S = 1).

    Inputs count up (0, 1, 2, ...) so that any misplaced number is a different number, and the
    usual wrong splits are recomputed to name them; the result must share x's memory, as the task
    asks (a copy of every projection would cost a layer's activations once more).
    """
    g = _generator()
    for batch, seq, heads, head_dim in ((2, 5, 3, 4), (1, 7, 2, 6), (3, 1, 4, 8)):
        width = heads * head_dim
        x = torch.arange(batch * seq * width, dtype=torch.float32).view(batch, seq, width)
        x = x[torch.randperm(batch, generator=g)]
        got = call("2.1", split_heads, x, heads)
        expect_shape("2.1", "split_heads(x)", got, (batch, heads, seq, head_dim))
        if not torch.equal(got, _split_heads(x, heads)):
            if torch.equal(got, x.view(batch, heads, seq, head_dim)):
                fail("2.1", "you viewed (B, S, H·D) as (B, H, S, D) directly, which mixes positions "
                            "into heads. Split the last axis into (H, D) first, then move the heads "
                            "in front of the positions")
            if torch.equal(got, x.view(batch, seq, head_dim, heads).permute(0, 3, 1, 2)):
                fail("2.1", "you split the last axis as (D, H): a projection's outputs are head-major, "
                            "(H, D), so head h owns outputs h·D … h·D + D − 1")
            fail("2.1", "split_heads(x)[b, h, s] should be x[b, s, h·D:(h+1)·D]")
        if not _shares_memory(got, x):
            fail("2.1", "split_heads copied x (.contiguous(), .clone() or a reshape that copies): return "
                        "a view, which costs no memory: split the last axis, then transpose")
    back = call("2.1", merge_heads, got)
    if not torch.equal(back, x):
        fail("2.1", "merge_heads(split_heads(x)) does not give x back")
    passed("2.1", "heads split as (B, S, H, D) → (B, H, S, D) as a view and merged back, for 3 shapes")


# --- 2.2 -------------------------------------------------------------------------------------


def _weights(q, k, mask, scale=None, dim=-1) -> torch.Tensor:
    """softmax(q·kᵀ·scale) in float64, forbidden keys at float64's most negative number."""
    q, k = q.double(), k.double()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(torch.float64).min)
    return torch.softmax(scores, dim=dim)


def _padding_mask(batch: int, seq: int, kv_len: int, g: torch.Generator) -> torch.Tensor:
    """(B, 1, S, T): causal for the last S of T positions, each row left-padded at random, and
    every query allowed its own key (a padding query would otherwise see nothing)."""
    causal = causal_reference(seq, kv_len)
    first_real = torch.randint(1, kv_len, (batch,), generator=g)
    real = torch.arange(kv_len)[None, :] >= first_real[:, None]
    itself = torch.arange(kv_len)[None, :] == torch.arange(kv_len - seq, kv_len)[:, None]
    return ((causal[None] & real[:, None, :]) | itself)[:, None]


def check_attention_weights(attention_weights) -> None:
    """2.2: softmax(q·kᵀ/√D) over the keys with a padding mask, with no mask, with a query that
    may see nothing, and in bf16 and fp16 (the softmax itself in float32).

    The usual mistakes (scale after the softmax, 1/D, no mask, inverted mask, wrong axis) are
    recomputed in float64 and compared, so that the message names the one that was made.
    """
    g = _generator()
    d = 8
    q = torch.randn(2, 3, 4, d, generator=g) * 2
    k = torch.randn(2, 3, 6, d, generator=g) * 2
    mask = _padding_mask(2, 4, 6, g)
    got = call("2.2", attention_weights, q, k, mask)
    expect_shape("2.2", "the weights", got, (2, 3, 4, 6))
    expected = _weights(q, k, mask)
    if not close(got, expected, atol=1e-5):
        mistakes = {
            "scores were scaled after softmax: divide q·kᵀ by √D *before* the softmax "
            "(then each row of weights sums to 1)": _weights(q, k, mask, scale=1.0) * d**-0.5,
            "the scores are not scaled: divide q·kᵀ by √D": _weights(q, k, mask, scale=1.0),
            "you scaled by 1/D; the scale is 1/√D": _weights(q, k, mask, scale=1 / d),
            "masked keys got weight: fill the scores where mask is False with MASKED before "
            "the softmax": _weights(q, k, None),
            "the mask is inverted: True means the query *may* attend to that key":
                _weights(q, k, ~mask),
            "softmax over the wrong axis: normalize over the keys (the last axis), so that each "
            "query's weights sum to 1": _weights(q, k, mask, dim=-2),
        }
        for message, wrong in mistakes.items():
            if close(got, wrong.float(), atol=1e-5):
                fail("2.2", message)
        fail("2.2", f"weights differ from softmax(q·kᵀ/√D) by up to {(got - expected).abs().max():.3g}")
    free = call("2.2", attention_weights, q, k, None,
                hint="mask=None means that no key is forbidden: mask the scores only when a mask is given")
    if not close(free, _weights(q, k, None), atol=1e-5):
        fail("2.2", "with mask=None every key may be attended to, but your weights differ from the "
                    f"unmasked softmax(q·kᵀ/√D) by up to {(free - _weights(q, k, None)).abs().max():.3g}")
    empty = torch.zeros(4, 6, dtype=torch.bool)
    got_empty = call("2.2", attention_weights, q, k, empty)
    if not torch.isfinite(got_empty).all():
        fail("2.2", "a query whose every key is masked gave NaN: fill with MASKED (the most "
                    "negative float), not -inf, so the softmax stays finite")
    for dtype in HALF:
        name = str(dtype).removeprefix("torch.")
        q_half, k_half = q.to(dtype), k.to(dtype)
        with NewTensors() as log:
            got = call("2.2", attention_weights, q_half, k_half, mask, hint=HALF_HINT)
        if got.dtype != dtype:
            fail("2.2", f"for {name} inputs the weights came back as {got.dtype}: return them "
                        "in q's dtype, so that they can multiply v")
        in_half = _half_softmax(log)
        if in_half:
            fail("2.2", f"the softmax ran in {in_half}: turn the scores into float32 before masking "
                        "and the softmax, and only the weights back to q's dtype")
        expected_half = _weights(q_half, k_half, mask)  # from the same rounded inputs
        if not close(got, expected_half, atol=WEIGHT_TOLERANCE[dtype]):
            fail("2.2", f"in {name} the weights differ from softmax(q·kᵀ/√D) by up to "
                        f"{(got.double() - expected_half).abs().max():.3g} (allowed: "
                        f"{WEIGHT_TOLERANCE[dtype]:g}): compute the scores' scale, mask and softmax "
                        "in float32")
    passed("2.2", "softmax(q·kᵀ/√D) over the keys, masked keys at weight 0 (or no mask), in fp32, "
                  "bf16 and fp16")


# --- 2.3 -------------------------------------------------------------------------------------


def check_group_queries(group_queries) -> None:
    """2.3: query head j·G + g lands in group j, member g, as a view of q, for 4 shapes.

    The last q is laid out as the model passes it, (B, S, Hq, D) seen through a transpose: a
    ``q.contiguous()`` first would copy it, and stage 05's kernel, which writes its output through
    this view, would then write into the copy.
    """
    g = _generator(3)
    shapes = ((1, 6, 2, 2, 4, False), (2, 8, 2, 3, 2, False), (1, 3, 3, 1, 4, False), (2, 6, 2, 3, 4, True))
    for batch, heads, kv_heads, seq, head_dim, transposed in shapes:
        if transposed:
            q = _model_layout(batch, heads, seq, head_dim, g)
        else:
            q = torch.arange(batch * heads * seq * head_dim, dtype=torch.float32).view(batch, heads, seq, head_dim)
        got = call("2.3", group_queries, q, kv_heads)
        groups = heads // kv_heads
        expect_shape("2.3", "grouped q", got, (batch, kv_heads, groups, seq, head_dim))
        expected = q.view(batch, kv_heads, groups, seq, head_dim)
        if not torch.equal(got, expected):
            strided = q.view(batch, groups, kv_heads, seq, head_dim).transpose(1, 2)
            if torch.equal(got, strided):
                fail("2.3", "query head h went to kv head h % Hkv. In this model consecutive query "
                            "heads share a kv head: group j holds heads j·G … j·G + G − 1")
            fail("2.3", "grouped[b, j, g] should be query head j·G + g")
        if not _shares_memory(got, q):
            layout = (" q arrives from the model as (B, S, Hq, D).transpose(1, 2), not contiguous, and "
                      "splitting its head axis still needs no copy: do not make it contiguous first "
                      "(stage 05's kernel writes through this view)" if transposed else "")
            fail("2.3", f"group_queries copied q: a view of q costs no memory.{layout}")
    passed("2.3", "query heads j·G … j·G + G − 1 share kv head j, as a view of q (contiguous or "
                  "as the model lays it out), for 4 shapes")


# --- 2.4 -------------------------------------------------------------------------------------


def _recording_dims() -> tuple[type, list[tuple[int, ...]]]:
    """A ``Dims`` that also records the shape of every tensor it checks, lent to 2.4 to see that
    the layer checks q, k and v as its task asks (their values alone cannot show it)."""
    from aie_lessons.shapes import Dims

    checked: list[tuple[int, ...]] = []

    class RecordingDims(Dims):
        def check(self, name: str, tensor: torch.Tensor, spec: str) -> torch.Tensor:
            checked.append(tuple(tensor.shape))
            return super().check(name, tensor, spec)

    return RecordingDims, checked


def check_attention_layer(attention_layer, model) -> None:
    """2.4: the layer equals the model's attention (RoPE on q and k only, o_proj), with and
    without a padding mask, and checks q, k and v with ``dims``.

    2.1 and 2.5 are replaced by references while it runs, so that only 2.4's mistakes fail it.
    """
    from aie_lessons.model import apply_rope, rope_cos_sin

    attn = model.layers[0].self_attn
    config = attn.config
    g = _generator()
    x = torch.randn(2, 5, config.hidden_size, generator=g)
    positions = torch.arange(5).expand(2, 5)
    cos, sin = rope_cos_sin(positions, config.head_dim, config.rope_theta)
    mask = _padding_mask(2, 5, 5, g)
    recording_dims, checked = _recording_dims()
    helpers = dict(split_heads=_split_heads, merge_heads=_merge_heads, manual_attention=_attention,
                   Dims=recording_dims)
    with torch.no_grad(), _given(attention_layer, **helpers):
        got = call("2.4", attention_layer, attn, x, cos, sin)
        got_masked = call("2.4", attention_layer, attn, x, cos, sin, mask)
    expect_shape("2.4", "the layer output", got, x.shape)
    with torch.no_grad():
        q = _split_heads(attn.q_proj(x), config.num_heads)
        k = _split_heads(attn.k_proj(x), config.num_kv_heads)
        v = _split_heads(attn.v_proj(x), config.num_kv_heads)

        def layer(q, k, v, mask=None, out_proj=True):
            merged = _merge_heads(_attention(q, k, v, mask))
            return attn.o_proj(merged) if out_proj else merged

        rope = lambda t: apply_rope(t, cos, sin)  # noqa: E731
        expected = layer(rope(q), rope(k), v)
        mistakes = {
            "you rotated v too: RoPE goes on q and k only, v carries content": layer(rope(q), rope(k), rope(v)),
            "q and k are not rotated: apply RoPE to both": layer(q, k, v),
            "only q is rotated: k needs RoPE too, or q·k does not depend on the distance": layer(rope(q), k, v),
            "the output projection o_proj is missing: the merged heads go through it": layer(
                rope(q), rope(k), v, out_proj=False),
        }
    if not close(got, expected, atol=1e-4):
        for message, wrong in mistakes.items():
            if close(got, wrong, atol=1e-4):
                fail("2.4", message)
        fail("2.4", f"the layer output differs from the model's attention by up to "
                    f"{(got - expected).abs().max():.3g}")
    with torch.no_grad():
        expected_masked = layer(rope(q), rope(k), v, mask)
    if not close(got_masked, expected_masked, atol=1e-4):
        fail("2.4", "with a padding mask the layer's output is wrong: pass the mask on to "
                    "manual_attention")
    q_shape, kv_shape = tuple(q.shape), tuple(k.shape)
    needed = Counter({q_shape: 1})
    needed[kv_shape] += 2  # k and v
    seen = Counter({shape: count // 2 for shape, count in Counter(checked).items()})  # 2 calls
    if any(seen[shape] < count for shape, count in needed.items()):
        fail("2.4", "your layer did not check q, k and v with dims: check q as \"B Hq S D\" and k "
                    "and v as \"B Hkv S D\" right after splitting the heads, so that a wrong split "
                    "stops at the tensor that is wrong")
    passed("2.4", "the hand-written layer matches the model's attention (RoPE on q and k only), "
                  "with and without a padding mask, q, k and v checked with dims")


# --- 2.5 -------------------------------------------------------------------------------------


def _gqa(q, k, v, mask, scale=None, interleaved=False, dim=-1) -> torch.Tensor:
    """GQA from its definition, in float64: query head h reads kv head h // G (or h % Hkv)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    groups = heads // kv_heads
    kv_of = [h % kv_heads if interleaved else h // groups for h in range(heads)]
    k, v = k[:, kv_of].double(), v[:, kv_of].double()  # a copy per query head: fine in a check
    return _weights(q, k, mask, scale, dim) @ v


# (batch, query heads, kv heads, queries S, keys T, dtype, head size D, mask kind, k/v layout).
# q is always laid out as the model passes it (see _model_layout); k and v either the same way
# (a prefill: they come from split_heads too) or contiguous (as a KV cache holds them, stage 04).
ATTENTION_CASES = (
    (2, 6, 2, 5, 5, torch.float32, 16, "none", "model"),  # prefill, G = 3
    (2, 6, 2, 1, 9, torch.float32, 16, "none", "cache"),  # decode: one query, many keys
    (1, 8, 2, 3, 8, torch.float32, 8, "none", "cache"),  # a chunk: 3 queries after 5 cached keys, G = 4
    (3, 9, 3, 4, 7, torch.float32, 32, "padding", "model"),  # left-padded rows, B = Hkv
    (2, 4, 4, 2, 6, torch.float32, 8, "padding", "cache"),  # G = 1: plain multi-head attention
    (2, 9, 3, 1, 12, torch.bfloat16, 64, "padding", "cache"),
    (1, 6, 2, 4, 4, torch.float16, 16, "none", "model"),
    (2, 6, 3, 3, 10, torch.bfloat16, 16, "shared", "cache"),  # one (1, 1, S, T) mask for every row
)

VIEW_MESSAGE = ("q arrives from the model as (B, S, Hq, D).transpose(1, 2), which is not contiguous: "
                ".view cannot merge its group and query axes into G·S rows. Use .reshape for that "
                "step (it copies q, which is small; k and v are never reshaped)")
GROUP_AXIS_MESSAGE = ("a 4-d mask (B|1, 1, S, T) needs a group axis, (B|1, 1, 1, S, T), to meet "
                      "scores seen as (B, Hkv, G, S, T): without it the mask's batch axis lines up "
                      "with the kv heads")


def _case_tensors(case, g: torch.Generator):
    """q, k, v and mask for one row of ATTENTION_CASES, laid out as the model or a cache would."""
    batch, heads, kv_heads, seq, kv_len, dtype, head_dim, kind, layout = case
    q = _model_layout(batch, heads, seq, head_dim, g, dtype)
    if layout == "model":
        k, v = (_model_layout(batch, kv_heads, kv_len, head_dim, g, dtype) for _ in "kv")
    else:
        k, v = (torch.randn(batch, kv_heads, kv_len, head_dim, generator=g).to(dtype) for _ in "kv")
    if kind == "padding":
        mask = _padding_mask(batch, seq, kv_len, g)
    elif kind == "shared":
        mask = causal_reference(seq, kv_len)[None, None]
    else:
        mask = None
    return q, k, v, mask


def _describe(case) -> str:
    """The case in words, for failure messages: which shape, dtype and mask went wrong."""
    batch, heads, kv_heads, seq, kv_len, dtype, head_dim, kind, layout = case
    mask = {"none": "no mask", "padding": "a padding mask", "shared": "a (1, 1, S, T) mask"}[kind]
    kv = "k, v transposed as the model's" if layout == "model" else "k, v contiguous as a cache's"
    return (f"B={batch}, Hq={heads}, Hkv={kv_heads}, S={seq} queries, T={kv_len} keys, D={head_dim}, "
            f"{str(dtype).removeprefix('torch.')}, {mask}, {kv}")


def _call_attention(manual_attention, q, k, v, mask, where: str):
    """Call the learner's attention; name the two crashes that the model's layouts cause."""
    hint = HALF_HINT if q.dtype in HALF else ""
    try:
        return call("2.5", manual_attention, q, k, v, mask, hint=hint)
    except CheckFailed as failure:
        cause = str(failure.__cause__)
        if "view size is not compatible" in cause:
            fail("2.5", f"your code raised RuntimeError: {cause} ({where}). {VIEW_MESSAGE}")
        if mask is not None and "must match the size of tensor" in cause:
            fail("2.5", f"your code raised RuntimeError: {cause} ({where}). {GROUP_AXIS_MESSAGE}")
        raise


def _mask_without_group_axis(mask: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """(B, Hq, S, T): what a (B, 1, S, T) mask does to (B, Hkv, G, S, T) scores without a group
    axis when B == Hkv: query head h of *every* row gets row h // G's mask."""
    groups = heads // kv_heads
    per_head = mask[:, 0][[h // groups for h in range(heads)]]  # (Hq, S, T)
    return per_head[None].expand(mask.shape[0], -1, -1, -1)


def _name_attention_mistake(got, q, k, v, mask, where: str) -> None:
    """Fail with the mistake ``got`` matches, if any (fp32 cases, where they are far apart)."""
    seq, kv_len, head_dim = q.shape[-2], k.shape[-2], q.shape[-1]
    causal = causal_reference(seq, kv_len) if mask is None else mask
    mistakes = {
        "query head h read kv head h % Hkv (interleaved groups): in this model G consecutive "
        "query heads share a kv head, head h reads kv head h // G": _gqa(q, k, v, causal, interleaved=True),
        "you scaled the scores by 1/D; the scale is 1/√D": _gqa(q, k, v, causal, scale=1 / head_dim),
        "the scores are not scaled: multiply q·kᵀ by 1/√D": _gqa(q, k, v, causal, scale=1.0),
    }
    if mask is None:
        default = "without a mask, attention must be causal with the S queries as the *last* S of the T positions"
        mistakes[f"{default}: your queries saw future keys"] = _gqa(q, k, v, None)
        mistakes[f"{default}: your triangle starts at the top-left corner"] = _gqa(
            q, k, v, causal_reference(seq, kv_len, offset=0))
    else:
        mistakes["the mask was ignored: queries attended to keys the mask forbids"] = _gqa(q, k, v, None)
        if mask.shape[0] == k.shape[1] > 1:
            mistakes[f"row b's mask was applied to kv head b: {GROUP_AXIS_MESSAGE}"] = _gqa(
                q, k, v, _mask_without_group_axis(mask, q.shape[1], k.shape[1]))
    for message, wrong in mistakes.items():
        if close(got, wrong.float(), atol=1e-4):
            fail("2.5", f"{message} ({where})")


def check_manual_attention(manual_attention) -> None:
    """2.5: grouped-query attention over 8 cases (prefill, decode, a chunk after cached keys,
    G = 1 to 4, padding and shared masks, fp32/bf16/fp16), q and k/v laid out as the model and a
    cache pass them; shapes checked with Dims; a query that may see nothing stays finite; no copy
    of K or V and no softmax in half precision (both seen by recording the operations).
    """
    g = _generator(5)
    # Shapes are checked, as everywhere in this stage: a v of another head size is refused.
    q, k, v = torch.zeros(1, 6, 4, 16), torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 4, 8)
    try:
        manual_attention(q, k, v)
    except NotImplementedError:  # still the stub: its own message says so
        raise
    except Exception as exc:  # the learner's code may raise anything; only a ShapeError is right
        if type(exc).__name__ != "ShapeError":
            fail("2.5", f"for v of head size 8 next to k of head size 16 your code raised "
                        f"{type(exc).__name__}: {exc}. Check the shapes of q, k and v with Dims "
                        "first, so that the error names the tensor")
    else:
        fail("2.5", "v of head size 8 next to q and k of head size 16 was accepted: check the "
                    "shapes of q, k and v with Dims (\"B Hq S D\", \"B Hkv T D\")")

    # The weights of each query must sum to 1 over its keys: with every value equal to 1 the
    # output is exactly 1, whatever the scores, the scale or the mask.
    q, k, v, mask = _case_tensors(ATTENTION_CASES[3], g)
    ones = _call_attention(manual_attention, q, k, torch.ones_like(v), mask, _describe(ATTENTION_CASES[3]))
    expect_shape("2.5", "the output", ones, q.shape)
    if not close(ones, torch.ones_like(ones), atol=1e-4):
        fail("2.5", "with every value vector equal to 1 the output should be 1: a query's weights "
                    "must sum to 1 over the keys. Softmax over the key axis (the last), and scale "
                    "the scores before it, not the weights after")

    for case in ATTENTION_CASES:
        q, k, v, mask = _case_tensors(case, g)
        dtype, where = case[5], _describe(case)
        got = _call_attention(manual_attention, q, k, v, mask, where)
        expect_shape("2.5", f"the output for {where}", got, q.shape)
        if got.dtype != dtype:
            fail("2.5", f"the output is {got.dtype} for {where}: return q's dtype")
        expected = _gqa(q, k, v, causal_reference(case[3], case[4]) if mask is None else mask)
        if close(got, expected.float(), atol=TOLERANCE[dtype]):
            continue
        if dtype == torch.float32:
            _name_attention_mistake(got, q, k, v, mask, where)
        fail("2.5", f"the output differs from softmax(q·kᵀ/√D)·v by up to "
                    f"{(got.double() - expected).abs().max():.3g} for {where}")

    # A padding query whose every key is masked (stage 03 avoids it; a learner's mask may not).
    q, k, v, mask = _case_tensors(ATTENTION_CASES[4], g)
    mask = mask.clone()
    mask[0, 0, 0] = False
    got = _call_attention(manual_attention, q, k, v, mask, "a query whose every key is masked")
    if not torch.isfinite(got).all():
        fail("2.5", "a query whose every key is masked gave NaN: fill the forbidden scores with "
                    "MASKED (the most negative float32), not -inf, so that its softmax stays finite")

    # Decode with a long cache, G = 3: the case where a copy of K or V costs the most.
    batch, heads, kv_heads, kv_len, head_dim = 2, 9, 3, 40, 16
    groups = heads // kv_heads
    q = _model_layout(batch, heads, 1, head_dim, g, torch.bfloat16)
    k, v = (torch.randn(batch, kv_heads, kv_len, head_dim, generator=g, dtype=torch.bfloat16) for _ in "kv")
    with NewTensors() as log:
        _call_attention(manual_attention, q, k, v, None, "bfloat16 decode")
    for name, shape, _, _ in log.created:
        if math.prod(shape) >= groups * k.numel():
            fail("2.5", f"your code copied K or V {groups} times ({name} made a tensor of shape "
                        f"{shape}, G = {groups} times the size of k). repeat_interleave, "
                        "expand(...).contiguous() and a matmul against k broadcast over a size-1 "
                        "group axis all copy it (torch.matmul copies a broadcast operand). Put "
                        "the G query heads of a group next to each other as extra query rows instead")
    in_half = _half_softmax(log)
    if in_half:
        fail("2.5", f"the softmax ran in {in_half}: turn the scores into float32 before masking "
                    "and the softmax, and only the weights back")
    passed("2.5", f"grouped-query attention over {len(ATTENTION_CASES)} shapes (decode, chunks, "
                  "G = 1 to 4, padding, the model's layouts) in fp32, bf16 and fp16, a query with "
                  "no visible key, without copying K or V")
