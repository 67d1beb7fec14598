"""Checks for stage 09: a decode step's FLOPs and bytes (9.1), decode attention (9.2) and the
padding of an engine step to its batch bucket (9.3).

The expected FLOPs are not computed from a formula here: ``FlopCounterMode`` counts the matrix
products of a real decode step of small random models (several shapes: tied and untied heads,
grouped-query and multi-head attention), run with stage 02's ``manual_attention`` kernel,
whose products the counter sees. The expected bytes are the weights once plus every request's
cached keys and values, from the tensors' sizes. When a result is wrong, the usual wrong
formulas are tried to name the mistake.
"""

from __future__ import annotations

import torch

from aie_lessons.checks.common import call, fail, passed

SHAPES = (  # (layers, heads, kv_heads, head_dim, hidden, intermediate, vocab, tied)
    (3, 6, 2, 4, 24, 40, 50, True),  # first: 3 query heads per kv head tells the usual mistakes apart
    (2, 4, 2, 6, 32, 48, 64, True),  # heads × head_dim (24) ≠ hidden (32): q and o are not square
    (1, 4, 4, 8, 32, 80, 96, False),
)


def _config(layers, heads, kv_heads, head_dim, hidden, intermediate, vocab, tied):
    from aie_lessons.config import ModelConfig

    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                       rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=tied, eos_token_ids=(1,))


def _counted_flops(config, batch: int, context: int) -> int:
    """FlopCounterMode's count of one decode step: ``batch`` rows, ``context`` positions each."""
    from torch.utils.flop_counter import FlopCounterMode

    from aie_lessons.attention import manual_attention
    from aie_lessons.kv_cache import KVCache
    from aie_lessons.model import AttentionMetadata, LlamaModel

    with torch.random.fork_rng():  # the learner's own random state stays as it was
        torch.manual_seed(9)
        model = LlamaModel(config, attention=manual_attention).eval()
        ids = torch.randint(0, config.vocab_size, (batch, context))
    positions = torch.arange(context).expand(batch, context)
    cache = KVCache(config, batch, context)
    with torch.inference_mode():
        if context > 1:
            model(ids[:, :-1], positions[:, :-1], AttentionMetadata(cache=cache, cache_start=0))
        with FlopCounterMode(display=False) as counter:
            model(ids[:, -1:], positions[:, -1:], AttentionMetadata(cache=cache, cache_start=context - 1))
    return counter.get_total_flops()


def _parts(config, batch: int, context: int) -> dict[str, int]:
    """The pieces of the count, to name a mistake (the expected total comes from the counter)."""
    d = config.head_dim
    block = (2 * config.hidden_size * config.num_heads * d + 2 * config.hidden_size * config.num_kv_heads * d
             + 3 * config.hidden_size * config.intermediate_size)
    return {"blocks": 2 * batch * config.num_layers * block,
            "head": 2 * batch * config.vocab_size * config.hidden_size,
            "attention": batch * config.num_layers * 4 * config.num_heads * d * context,
            "attention_kv": batch * config.num_layers * 4 * config.num_kv_heads * d * context,
            "kv_per_position": 2 * config.num_layers * config.num_kv_heads * d}


def _diagnoses(want: int, candidates: list[tuple[int, str]]) -> dict[int, str]:
    """``{wrong value: what it means}``, keeping the first meaning of a value and never the
    expected value itself: on some shapes two mistakes give the same number."""
    named: dict[int, str] = {}
    for value, meaning in candidates:
        if value != want and value not in named:
            named[value] = meaning
    return named


def flops_diagnoses(want: int, parts: dict[str, int]) -> dict[int, str]:
    attention = parts["attention"]
    return _diagnoses(want, [
        (want // 2, "half the expected FLOPs: a multiply-add is 2 FLOPs (one multiply, one add)"),
        (want - (parts["blocks"] + parts["head"]) // 2, "the weights' FLOPs are half: a multiply-add is 2 FLOPs "
                                                         "(one multiply, one add) per weight and request"),
        (want - attention, "attention's arithmetic is missing: the scores q·k and the weighted sum of the "
                           "values, 2 × head_dim FLOPs per position each, for every query head"),
        (want - attention + parts["attention_kv"], "attention was counted per key-value head: with grouped-query "
                                                   "attention every *query* head computes its own scores and sum"),
        (want - parts["head"], "the output head is missing: vocab_size × hidden_size weights, 2 FLOPs each per "
                               "request"),
        (want - attention // 2, "attention counted once: the scores and the weighted sum of the values cost "
                                "2 × head_dim FLOPs per position each"),
    ])


def bytes_diagnoses(want: int, weight_bytes: int, kv: int, heads_kv: int, element: int, batch: int,
                    kv_dtype: torch.dtype) -> dict[int, str]:
    return _diagnoses(want, [
        (weight_bytes, "the cached keys and values are missing: every request reads its own, context positions "
                       "of them"),
        (weight_bytes * batch + kv, "the weights were counted once per request: a step reads them once for the "
                                    "whole batch — that is why batching pays"),
        (weight_bytes + kv // batch, "one request's cache was counted: every request of the batch reads its own"),
        (weight_bytes + heads_kv, "the cache was counted per query head: keys and values are stored per key-value "
                                  "head (num_kv_heads)"),
        (weight_bytes + kv // element * 4, "the cache was counted in float32 whatever its dtype: use the element "
                                           f"size of kv_dtype ({element} for {kv_dtype})"),
        (weight_bytes + kv // element, "the cache was counted at one byte per number: use the element size of "
                                       f"kv_dtype ({element} for {kv_dtype})"),
        (weight_bytes + kv // 2, "only the keys (or only the values) were counted: both are cached"),
    ])


def check_decode_step_cost(decode_step_cost) -> None:
    """9.1: FLOPs against FlopCounterMode on three random shapes, batch 1 and 3, contexts 1, 5
    and 17; bytes against the weights once plus the caches, in fp32 and bf16."""
    weight_bytes = 123_456
    for shape in SHAPES:
        config = _config(*shape)
        for batch, context in ((1, 1), (1, 5), (3, 17)):
            want_flops = _counted_flops(config, batch, context)
            parts = _parts(config, batch, context)
            for kv_dtype in (torch.float32, torch.bfloat16):
                element = torch.empty((), dtype=kv_dtype).element_size()
                cost = call("9.1", decode_step_cost, config, batch, context, weight_bytes, kv_dtype)
                for field in ("flops", "bytes"):
                    value = getattr(cost, field, None)
                    if not isinstance(value, int) or isinstance(value, bool):
                        fail("9.1", f"{field} should be an int (a count), got {type(value).__name__} {value!r}")
                where = (f"(layers {config.num_layers}, {config.num_heads} query heads sharing "
                         f"{config.num_kv_heads} key-value heads, batch {batch}, context {context})")
                if cost.flops != want_flops:
                    if batch > 1 and cost.flops * batch == want_flops:
                        fail("9.1", f"{cost.flops:,} FLOPs {where}, expected {want_flops:,}: that is one request's "
                                    "arithmetic — every request of the batch does it, so multiply by batch")
                    if batch > 1 and cost.flops == want_flops * batch:
                        fail("9.1", f"{cost.flops:,} FLOPs {where}, expected {want_flops:,}: the batch was "
                                    "multiplied in twice")
                    mistake = flops_diagnoses(want_flops, parts).get(cost.flops, "")
                    fail("9.1", f"{cost.flops:,} FLOPs {where}; FlopCounterMode counted {want_flops:,}"
                                + (f": {mistake}" if mistake else ""))
                kv = parts["kv_per_position"] * element * context * batch
                want_bytes = weight_bytes + kv
                if cost.bytes != want_bytes:
                    heads_kv = 2 * config.num_layers * config.num_heads * config.head_dim * element * context * batch
                    named = bytes_diagnoses(want_bytes, weight_bytes, kv, heads_kv, element, batch, kv_dtype)
                    fail("9.1", f"{cost.bytes:,} bytes {where}, {kv_dtype}; expected {want_bytes:,} = the weights "
                                f"({weight_bytes:,}) + the caches ({kv:,})"
                                + (f": {named[cost.bytes]}" if cost.bytes in named else ""))
    passed("9.1", "FLOPs equal FlopCounterMode's count of real decode steps (3 shapes, tied and untied, "
                  "grouped-query and multi-head, batch 1 and 3); bytes are the weights once plus the caches")


def _attention_reference(q, keys, values, *, scale=True, grouping="adjacent", normalize=True, axis=-1):
    """One query per head against every cached position, in float64 — or with one of the usual
    mistakes: no 1/√D scale, query heads paired with key-value heads round-robin, no division
    by the weights' sum, the softmax over the heads instead of the positions."""
    num_kv_heads, _, head_dim = keys.shape
    group = q.shape[0] // num_kv_heads
    heads = torch.arange(q.shape[0])
    kv_head = heads // group if grouping == "adjacent" else heads % num_kv_heads
    k, v = keys.double()[kv_head], values.double()[kv_head]  # (Hq, T, D)
    scores = (k @ q.double()[:, :, None])[..., 0] * (head_dim**-0.5 if scale else 1.0)  # (Hq, T)
    weights = (scores - scores.amax(axis, keepdim=True)).exp()
    if normalize:
        weights = weights / weights.sum(axis, keepdim=True)
    return (weights[:, None, :] @ v)[:, 0]  # (Hq, D)


def _cache_view(kv_heads: int, positions: int, head_dim: int, dtype: torch.dtype, generator) -> torch.Tensor:
    """(kv_heads, positions, head_dim) random values as the step passes them: the first
    ``positions`` rows of a longer cache, a view that is not contiguous in memory."""
    cache = torch.randn(kv_heads, positions + 3, head_dim, generator=generator).to(dtype)
    return cache.narrow(1, 0, positions)


def check_decode_attention(decode_attention) -> None:
    """9.2: one query per head against a cache, compared in float64 with the rule itself, on
    grouped-query shapes (3 query heads per key-value head), a single position, a bf16 cache and
    scores large enough that exp() overflows unless each row's largest is subtracted first. The
    keys and values are views into a longer cache, as in the step, and must come back unchanged."""
    generator = torch.Generator().manual_seed(92)
    cases = (  # (query heads, kv heads, positions, head_dim, cache dtype, query scale, what)
        (6, 2, 9, 8, torch.float32, 1.0, "6 query heads sharing 2 key-value heads, 9 positions"),
        (4, 4, 1, 8, torch.float32, 1.0, "one cached position (the step's own token)"),
        (6, 3, 5, 16, torch.bfloat16, 1.0, "a bf16 cache"),
        (2, 1, 7, 8, torch.float32, 400.0, "scores in the hundreds"),
    )
    for heads, kv_heads, positions, head_dim, dtype, size, what in cases:
        q = torch.randn(heads, head_dim, generator=generator) * size
        keys = _cache_view(kv_heads, positions, head_dim, dtype, generator)
        values = _cache_view(kv_heads, positions, head_dim, dtype, generator)
        before = (q.clone(), keys.clone(), values.clone())
        out = call("9.2", decode_attention, q, keys, values,
                   hint="keys and values are views of the first positions of a longer cache, not contiguous in "
                        "memory: use reshape, indexing or broadcasting where .view() refuses")
        for name, tensor, original in zip(("q", "keys", "values"), (q, keys, values), before):
            if not torch.equal(tensor, original):
                fail("9.2", f"{what}: your code changed {name} in place — keys and values are the live KV cache "
                            "(and for an fp32 cache .float() returns the same tensor, not a copy): compute new "
                            "tensors instead of writing into the inputs")
        if not isinstance(out, torch.Tensor):
            fail("9.2", f"return a tensor, got {type(out).__name__}")
        if tuple(out.shape) != (heads, head_dim):
            fail("9.2", f"{what}: the output should be (query heads, head_dim) = {(heads, head_dim)}, got "
                        f"{tuple(out.shape)}")
        if out.dtype != torch.float32:
            fail("9.2", f"{what}: the output should be float32 (the step computes in fp32 whatever the "
                        f"cache holds), got {out.dtype}")
        if not torch.isfinite(out).all():
            fail("9.2", f"{what}: the output holds inf or NaN. exp() of large scores overflows, and with one "
                        "maximum for all rows a row far below it underflows to 0/0: subtract each row's own "
                        "largest score before exp() (softmax does not change)")
        want = _attention_reference(q, keys, values)
        error = (out.double() - want).abs().max().item()
        tolerance = 2e-5 * (1 + want.abs().max().item())
        if error <= tolerance:
            continue
        mistakes = (
            ({"scale": False}, "the scores were not scaled by 1/√head_dim"),
            ({"grouping": "round-robin"}, "query head h read key-value head h % num_kv_heads: the heads that share "
                                          "a key-value head are adjacent — head h reads h // (Hq / Hkv)"),
            ({"normalize": False}, "the weights do not sum to 1: divide exp(scores) by their sum over the "
                                   "positions"),
            ({"axis": 0}, "the softmax was taken over the heads: take it over the positions (the last axis of "
                          "the scores), one distribution per query head"),
        )
        for wrong, meaning in mistakes:
            if (out.double() - _attention_reference(q, keys, values, **wrong)).abs().max().item() <= tolerance:
                fail("9.2", f"{what}: {meaning}")
        if dtype == torch.bfloat16 and error <= 0.05 * (1 + want.abs().max().item()):
            fail("9.2", f"{what}: off by {error:.1e}, about bf16's rounding: convert the cache to fp32 before the "
                        "products, so that all the arithmetic is fp32")
        fail("9.2", f"{what}: the output differs from softmax(q·kᵀ/√D)·v by up to {error:.2e}. Check each step "
                    "against the rule: every query head scores its own key-value head's keys at every position "
                    "(q·k/√D), a softmax over those positions, and the weighted sum of the values")
    passed("9.2", "matches softmax(q·kᵀ/√D)·v in float64 on grouped-query and multi-head shapes, one position, a "
                  "bf16 cache and scores in the hundreds, on views of a longer cache that it leaves unchanged")


VOCAB = 500  # the token ids of the check's rows


def _rows(n: int, width: int, generator: torch.Generator):
    """A decode step's rows as the engine prepares them: n requests of random lengths ≤ width,
    each reading its own slots (below 1000; the scratch slot is 1000)."""
    from aie_lessons.engine.compiled_runner import DecodeRows

    lengths = torch.randint(1, width + 1, (n,), generator=generator)
    lengths[:1] = width  # the longest row sets the width (a step of padding only has no rows)
    columns = torch.randint(0, 1000, (n, width), generator=generator)
    visible = torch.arange(width)[None, :] < lengths[:, None]
    return DecodeRows(torch.randint(1, VOCAB, (n,), generator=generator), lengths - 1,
                      columns[torch.arange(n), lengths - 1], columns, visible)


FIELDS = ("ids", "positions", "slots", "columns", "visible")


def check_pad_rows(pad_rows) -> None:
    """9.3: steps of 1, 3, 5 and 16 rows padded to their buckets, a step that fills its bucket and
    one of padding only (as ``warm_up`` sends): the real rows first and unchanged, the inputs
    untouched, every tensor's dtype kept, and each padding row writing and reading only the
    scratch slot, seeing at least one column, with a valid token id."""
    generator = torch.Generator().manual_seed(93)
    scratch = 1000
    for n, width, bucket in ((3, 7, 4), (1, 1, 2), (5, 12, 16), (16, 9, 16), (0, 2, 4)):
        rows = _rows(n, width, generator)
        before = {name: getattr(rows, name).clone() for name in FIELDS}
        what = (f"{n} row{'s' * (n != 1)} of up to {width} positions padded to {bucket}" if n else
                f"a step of padding only ({bucket} rows), as warm_up sends")
        out = call("9.3", pad_rows, rows, bucket, scratch,
                   hint="a DecodeRows is frozen: leave the input alone and return a new DecodeRows(...) holding "
                        "the padded tensors")
        for name in FIELDS:
            if not torch.equal(getattr(rows, name), before[name]):
                fail("9.3", f"{what}: your code changed rows.{name} in place — the rows are the batch the engine "
                            "prepared: build new tensors (torch.cat makes one) instead of writing into them")
        if not all(isinstance(getattr(out, name, None), torch.Tensor) for name in FIELDS):
            fail("9.3", f"return a DecodeRows (ids, positions, slots, columns, visible), got {type(out).__name__}")
        for name in FIELDS:
            got, original = getattr(out, name), before[name]
            want = (bucket, *original.shape[1:])
            if tuple(got.shape) != want:
                fail("9.3", f"{what}: {name} should have {bucket} rows, shape {want}, got {tuple(got.shape)} — "
                            "pad every field by bucket − n rows, and keep the columns' width")
            if got.dtype != original.dtype:
                fail("9.3", f"{what}: {name} should stay {original.dtype}, got {got.dtype} — new_full or new_zeros "
                            "on the input tensor keeps its dtype and device")
            if not torch.equal(got[:n], original):
                fail("9.3", f"{what}: the first {n} rows of {name} should be the step's rows, unchanged and in order "
                            "— the runner reads row i's logits as request i's: put the padding after them")
        pad = slice(n, bucket)
        slots = out.slots[pad]
        if (slots != scratch).any():
            slot = int(slots[slots != scratch][0])
            fail("9.3", f"{what}: a padding row writes its keys and values into slot {slot}, which a request may "
                        f"own — and the next step would read what the padding wrote there. Write padding rows into "
                        f"the scratch slot ({scratch}), which no request owns")
        if (out.visible[pad].sum(-1) < 1).any():
            fail("9.3", f"{what}: a padding row sees no column: its softmax over no positions is 0 / 0 = NaN. Make "
                        "one column (the first) visible, pointing at the scratch slot")
        first_visible = out.columns[pad].gather(1, out.visible[pad].int().argmax(-1, keepdim=True))
        if (first_visible != scratch).any():
            fail("9.3", f"{what}: a padding row's visible column is slot {int(first_visible.flatten()[0])}, not the "
                        f"scratch slot ({scratch}): pad the columns with the scratch slot too")
        ids = out.ids[pad]
        if ((ids < 0) | (ids >= VOCAB)).any():
            fail("9.3", f"{what}: padding token id {int(ids.min() if (ids < 0).any() else ids.max())} may not be "
                        f"in the embedding table (this check's has {VOCAB} ids): pad with 0, an id every vocabulary has")
    passed("9.3", "pads 1, 3, 5, 16 and 0 rows to their buckets: real rows first and unchanged, inputs untouched, "
                  "dtypes kept, padding written to and read from the scratch slot only, one visible column each")
