"""Checks for stage 01: RMSNorm, RoPE, the greedy step, the streaming detokenizer, sampling."""

from __future__ import annotations

import torch

from aie_lessons.checks.common import call, close, expect_shape, fail, passed

# Sizes chosen so that batch, heads, sequence and head_dim all differ: a wrong permute or a
# broadcast along the wrong axis then fails with a shape error instead of passing by luck.
BATCH, HEADS, SEQ, HEAD_DIM, HIDDEN = 2, 3, 5, 8, 12
EPS = 1e-5


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


# --- 1.1 RMSNorm -------------------------------------------------------------------------------


def check_rms_norm(rms_norm) -> None:
    g = _generator()
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=g) * 3 + 1  # nonzero mean exposes LayerNorm
    weight = torch.rand(HIDDEN, generator=g) + 0.5
    hint = "rms_norm(x, weight, eps) normalizes over the last dimension"
    got = call("1.1", rms_norm, x, weight, EPS, hint=hint)
    expect_shape("1.1", "the output", got, x.shape)

    def norm_over(dim):
        return x * torch.rsqrt(x.pow(2).mean(dim=dim, keepdim=True) + EPS)

    expected = norm_over(-1) * weight
    if not close(got, expected, atol=1e-4):
        centered = x - x.mean(-1, keepdim=True)
        mistakes = {
            "you subtracted the mean: that is LayerNorm. RMSNorm divides by the root-mean-square "
            "of x itself, sqrt(mean(x²) + eps)": centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + EPS) * weight,
            "you divided by mean(x²) + eps without the square root": x / (x.pow(2).mean(-1, keepdim=True) + EPS) * weight,
            "the result is not multiplied by `weight`": norm_over(-1),
            "you normalized over the wrong dimension: the mean of x² must be over the last "
            "(hidden) dimension, dim=-1": norm_over(1) * weight,
            "you took the mean over all dimensions: it must be per vector, over dim=-1 "
            "with keepdim=True": x * torch.rsqrt(x.pow(2).mean() + EPS) * weight,
        }
        for message, wrong in mistakes.items():
            if close(got, wrong, atol=1e-4):
                fail("1.1", message)
        error = (got.float() - expected).abs().max().item()
        fail("1.1", f"output differs from x / sqrt(mean(x²) + eps) * weight by up to {error:.3g}")

    zeros = torch.zeros(1, 1, HIDDEN)
    got_zero = call("1.1", rms_norm, zeros, weight, EPS, hint=hint)
    if not torch.isfinite(got_zero).all():
        fail("1.1", "a vector of zeros gives NaN or inf: add eps *inside* the square root, "
                    "sqrt(mean(x²) + eps)")

    x16 = x.to(torch.bfloat16)
    got16 = call("1.1", rms_norm, x16, weight.to(torch.bfloat16), EPS, hint=hint)
    if got16.dtype != torch.bfloat16:
        fail("1.1", f"a bfloat16 input gave a {got16.dtype} output: compute in float32, then "
                    "cast the result back with .to(x.dtype)")
    reference16 = (norm_over(-1) * weight).to(torch.bfloat16)
    if not close(got16, reference16, atol=3e-2):
        fail("1.1", "in bfloat16 the result is off by more than rounding: compute mean(x²) in "
                    "float32 (x.float()) and cast back at the end")
    passed("1.1", "RMSNorm matches x / sqrt(mean(x²) + eps) * weight, in fp32 and bf16")


# --- 1.2 RoPE ---------------------------------------------------------------------------------


def _rope_tables(positions: torch.Tensor, head_dim: int, theta: float = 10000.0):
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _rotate_interleaved(x, cos, sin):
    """RoPE with adjacent pairs (x0, x1), (x2, x3): the convention of Meta's and GGUF's code."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * c - odd * s
    out[..., 1::2] = even * s + odd * c
    return out


def check_apply_rope(apply_rope) -> None:
    g = _generator()
    x = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=g)
    positions = torch.arange(SEQ).expand(BATCH, SEQ) + torch.tensor([[0], [7]])
    cos, sin = _rope_tables(positions, HEAD_DIM)
    hint = "cos and sin are (B, S, D); x is (B, H, S, D): add the head axis with cos.unsqueeze(1)"
    got = call("1.2", apply_rope, x, cos, sin, hint=hint)
    expect_shape("1.2", "the rotated tensor", got, x.shape)

    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    expected = x * c + _rotate_half(x) * s
    if not close(got, expected):
        mistakes = {
            "the input came back unchanged: multiply by cos and add rotate_half(x) * sin": x,
            "you rotated the wrong way: the sin term is + rotate_half(x) * sin": x * c - _rotate_half(x) * s,
            "cos and sin are swapped: x * cos + rotate_half(x) * sin": x * s + _rotate_half(x) * c,
            "you paired adjacent coordinates (x0, x1), (x2, x3): that is the interleaved "
            "convention. This model pairs x[i] with x[i + D/2] (rotate_half)": _rotate_interleaved(x, c, s),
        }
        for message, wrong in mistakes.items():
            if close(got, wrong):
                fail("1.2", message)
        error = (got - expected).abs().max().item()
        fail("1.2", f"the result differs from x * cos + rotate_half(x) * sin by up to {error:.3g}")
    if not close(got.norm(dim=-1), x.norm(dim=-1), atol=1e-4):
        fail("1.2", "a rotation must keep each vector's length, and yours does not")
    passed("1.2", "RoPE rotates each (i, i + D/2) pair by position × frequency")


# --- 1.3 greedy step --------------------------------------------------------------------------


def check_greedy_step(greedy_step) -> None:
    vocab = 10
    g = _generator()
    logits = torch.randn(BATCH, SEQ, vocab, generator=g)
    # Make the best token at the last position differ from every other position's best.
    logits[0, -1, 7], logits[1, -1, 2] = 10.0, 10.0
    logits[:, :-1, 7], logits[:, :-1, 2] = -10.0, -10.0
    got = call("1.3", greedy_step, logits,
               hint="logits are (B, S, vocab); return one token id per sequence, shape (B,)")
    if isinstance(got, torch.Tensor) and got.is_floating_point():
        fail("1.3", "you returned scores (floats), not token ids: use argmax, not max")
    if isinstance(got, torch.Tensor) and tuple(got.shape) == (BATCH, vocab):
        fail("1.3", f"expected shape ({BATCH},) but got {tuple(got.shape)}: you took the argmax "
                    "over the sequence axis; take it over the vocabulary axis (dim=-1)")
    expect_shape("1.3", "the next token ids", got, (BATCH,))
    expected = torch.tensor([7, 2])
    if torch.equal(got, expected):
        passed("1.3", "the next token is the argmax of the last position's logits")
        return
    if torch.equal(got, logits[:, 0].argmax(-1)):
        fail("1.3", "you used the first position's logits: the next token is predicted by the "
                    "last position, logits[:, -1]")
    if torch.equal(got, logits[:, -1].argmin(-1)):
        fail("1.3", "you picked the lowest-scoring token (argmin): greedy takes the argmax")
    fail("1.3", f"expected token ids {expected.tolist()}, got {got.tolist()}")


# --- 1.4 streaming detokenizer ----------------------------------------------------------------

# Chinese characters are 3 UTF-8 bytes and these emoji 4 (👍🏽 is two code points): byte-level
# BPE splits some of them across tokens, which is what the detokenizer must survive.
STREAM_TEXTS = (
    "Hello, world! The year 2024 had 366 days.",
    "中文测试：你好，世界。",
    "emoji 🤗🤗 and 👍🏽, café naïve",
)


def check_streaming_detokenizer(detokenizer_cls, tokenizer) -> None:
    split_characters = 0
    for text in STREAM_TEXTS:
        ids = tokenizer.encode(text)
        detok = detokenizer_cls(tokenizer)
        pieces = [call("1.4", detok.push, i) for i in ids]
        pieces.append(call("1.4", detok.flush))
        for i, piece in enumerate(pieces[:-1]):
            if not isinstance(piece, str):
                fail("1.4", f"push() returned {type(piece).__name__}, expected str")
            if "\ufffd" in piece:
                fail("1.4", f"token {i} of {text!r} produced U+FFFD (�): a character split across "
                            "tokens was decoded before its last byte arrived. Keep incomplete "
                            "bytes until the character is complete")
        streamed = "".join(pieces)
        if streamed != text:
            if len(streamed) > len(text) and streamed.startswith(text[:1]):
                fail("1.4", f"the stream repeats text ({streamed[:40]!r}...): push() must return "
                            "only the new text, not everything decoded so far")
            fail("1.4", f"streamed text {streamed!r} differs from the original {text!r}")
        split_characters += sum(
            1 for i in ids if not _is_complete_utf8(tokenizer.token_bytes(i))
        )
    if split_characters == 0:
        fail("1.4", "this tokenizer split no character across tokens, so the check proves "
                    "nothing; it needs a byte-level BPE tokenizer")
    passed("1.4", f"streamed text is exact, no U+FFFD ({split_characters} tokens held partial "
                  "characters)")


def _is_complete_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


# --- 1.5 repetition penalty -------------------------------------------------------------------


def _penalized(logits: torch.Tensor, history: list[int], penalty: float) -> torch.Tensor:
    """The rule written token by token: each distinct token in ``history`` once."""
    out = logits.clone()
    for token in set(history):
        value = out[token].item()
        out[token] = value / penalty if value > 0 else value * penalty
    return out


def check_repetition_penalty(apply_repetition_penalty) -> None:
    g = _generator()
    vocab, penalty = 30, 1.5
    logits = torch.randn(vocab, generator=g) * 3
    # Seen tokens of both signs, once and several times: 4 (+, ×3), 9 (−, ×2), 17 (+), 21 (−).
    logits[4], logits[9], logits[17], logits[21] = 2.0, -2.0, 3.0, -1.5
    history = [4, 9, 4, 4, 17, 9, 0, 21]
    original = logits.clone()
    hint = "apply_repetition_penalty(logits (vocab,), history (n,) ids, penalty) returns new logits"
    got = call("1.5", apply_repetition_penalty, logits, torch.tensor(history), penalty, hint=hint)
    expect_shape("1.5", "the penalized logits", got, (vocab,))
    if not torch.equal(logits, original):
        fail("1.5", "you changed the caller's logits in place: return a new tensor (scatter, "
                    "not scatter_, or clone first)")
    expected = _penalized(logits, history, penalty)
    if not close(got, expected):
        _explain_repetition_penalty(got.float(), logits, history, penalty)
    empty = call("1.5", apply_repetition_penalty, logits, torch.tensor([], dtype=torch.long), penalty, hint=hint)
    if not torch.equal(empty, logits):
        fail("1.5", "with an empty history nothing may change")
    passed("1.5", "tokens seen before move down once each: positive logits ÷ penalty, negative × penalty")


def _explain_repetition_penalty(got, logits, history, penalty) -> None:
    """Fail with the mistake that explains ``got``, judged token by token."""
    seen = sorted(set(history))
    unseen = [t for t in range(len(logits)) if t not in seen]
    moved = [t for t in unseen if not close(got[t:t + 1], logits[t:t + 1])]
    if moved:
        if len(moved) == len(unseen):
            fail("1.5", "every token was penalized, not only those in history")
        fail("1.5", f"tokens {moved} are not in history but changed: penalize only history's tokens")
    if close(got, logits):
        fail("1.5", f"no logit changed: the tokens in history ({seen}) must be penalized")

    def matches(tokens, rule):
        return all(close(got[t:t + 1], rule(logits[t:t + 1])) for t in tokens)

    once = [t for t in seen if history.count(t) == 1]
    positive, negative = [t for t in once if logits[t] > 0], [t for t in once if logits[t] < 0]
    divided, multiplied = (lambda v: v / penalty), (lambda v: v * penalty)
    if matches(positive, divided) and matches(negative, multiplied):
        fail("1.5", "a token that occurs several times was penalized several times (or its "
                    "changes added up): each distinct token counts once")
    if matches(once, lambda v: v - penalty):
        fail("1.5", "you subtracted the penalty: it scales the logit. Divide a positive logit "
                    "by the penalty, multiply a negative one")
    if matches(positive, multiplied) and matches(negative, divided):
        fail("1.5", "the rule is backwards: divide a positive logit by the penalty and multiply "
                    "a negative one, so that both move down")
    if matches(negative, divided):
        fail("1.5", "negative logits were divided by the penalty, which makes them *more* likely: "
                    "multiply a negative logit by the penalty")
    if matches(positive, multiplied):
        fail("1.5", "positive logits were multiplied by the penalty, which makes them more likely: "
                    "divide a positive logit by the penalty")
    wrong = [t for t in seen if not close(got[t:t + 1], _penalized(logits, history, penalty)[t:t + 1])]
    fail("1.5", f"tokens {wrong} have the wrong value: a seen token's logit is divided by "
                f"{penalty} if positive and multiplied by {penalty} if negative, once")


# --- 1.6 top-k and top-p ----------------------------------------------------------------------


def _kept(row: torch.Tensor, top_k: int, top_p: float, p_before_k: bool = False,
          p_includes_self: bool = False) -> set[int]:
    """The token ids one row keeps, by the rules written as plain loops over a ranking."""
    ranking = sorted(range(len(row)), key=lambda i: -row[i].item())

    def by_k(ids):
        if top_k <= 0 or top_k >= len(row):
            return set(ids)
        kth = row[ranking[top_k - 1]].item()
        return {i for i in ids if row[i].item() >= kth}

    def by_p(ids):
        if top_p >= 1:
            return set(ids)
        ids = [i for i in ranking if i in ids]
        weights = torch.softmax(row[ids].double(), dim=0).tolist()
        kept, above = set(), 0.0
        for i, w in zip(ids, weights):
            if (above + w if p_includes_self else above) < top_p or not kept:
                kept.add(i)
            above += w
        return kept

    everything = set(range(len(row)))
    return by_k(by_p(everything)) if p_before_k else by_p(by_k(everything))


def _kept_with_batch_kth(logits: torch.Tensor, row: int, top_k: int, top_p: float) -> set[int]:
    """The mistake of finding the k-th best over the whole (B, vocab) batch, not per row."""
    kth = logits.flatten().topk(min(top_k, logits.numel())).values[-1]
    masked = logits[row].masked_fill(logits[row] < kth, float("-inf"))
    finite = torch.isfinite(masked).nonzero().flatten().tolist()
    if not finite:
        return set()
    return _kept(masked, 0, top_p) & set(finite)


def _kept_in_token_order(row: torch.Tensor, ids: set[int], top_p: float) -> set[int]:
    """The mistake of a cumulative sum over token ids, not over the ranking."""
    ordered = sorted(ids)
    weights = torch.softmax(row[ordered].double(), dim=0).tolist()
    kept, above = set(), 0.0
    for i, w in zip(ordered, weights):
        if above < top_p:
            kept.add(i)
        above += w
    return kept


TOP_K_TOP_P_CASES = ((0, 1.0), (5, 1.0), (0, 0.6), (5, 0.6), (1, 1.0), (0, 0.02), (50, 1.0), (40, 0.9),
                     (7, 0.95))


def check_top_k_top_p(filter_top_k_top_p) -> None:
    g = _generator()
    batch, vocab = 3, 40
    logits = torch.randn(batch, vocab, generator=g) * 2
    logits[2, :6] = torch.tensor([5.0, 5.0, 4.0, 4.0, 4.0, 3.0])  # ties at the k-th best
    for top_k, top_p in TOP_K_TOP_P_CASES:
        original = logits.clone()
        case = f"top_k={top_k}, top_p={top_p}"
        hint = (f"filter_top_k_top_p(logits (B, vocab), top_k, top_p) returns logits of the same "
                f"shape; this call had {case}. top_k=0 means no top-k limit, top_p=1 no top-p "
                "limit, a top_k of at least the vocabulary size keeps all (guard with "
                "0 < top_k < logits.shape[-1]), and the k-th best of each row is a (B, 1) column: "
                ".values[..., -1:]")
        got = call("1.6", filter_top_k_top_p, logits, top_k, top_p, hint=hint)
        expect_shape("1.6", f"the filtered logits ({case})", got, logits.shape)
        if not torch.equal(logits, original):
            fail("1.6", "you changed the caller's logits in place: use masked_fill, not masked_fill_")
        removed = ~torch.isfinite(got)
        if (got[~removed] != logits[~removed]).any() or (got[removed] != float("-inf")).any():
            if ((got == 0) & (logits != 0)).any():
                fail("1.6", f"({case}) removed tokens must get -inf, not 0: a logit of 0 still "
                            "has probability after the softmax")
            fail("1.6", f"({case}) kept tokens must keep their logits unchanged and removed ones "
                        "must be -inf: return logits, not probabilities")
        for row in range(batch):
            kept = set(torch.isfinite(got[row]).nonzero().flatten().tolist())
            expected = _kept(logits[row], top_k, top_p)
            if kept == expected:
                continue
            if top_k > 0 and kept == _kept_with_batch_kth(logits, row, top_k, top_p):
                fail("1.6", f"({case}) the k-th best was taken over the whole batch: find it per "
                            "row, logits.topk(k, dim=-1).values[..., -1:]")
            if not kept:
                fail("1.6", f"({case}) row {row} kept no token at all: the best token always stays")
            if top_p < 1 and kept == _kept(logits[row], top_k, top_p, p_includes_self=True):
                fail("1.6", f"({case}) top-p dropped the token that crosses p: keep a token while "
                            "the tokens ranked *above* it hold less than p (exclusive cumulative sum)")
            if top_p < 1 and top_k > 0 and kept == _kept(logits[row], top_k, top_p, p_before_k=True):
                fail("1.6", f"({case}) top-p must use the softmax of the top-k-filtered logits "
                            "(renormalised over the tokens top-k kept), not the full distribution; "
                            "and top-k comes first")
            if top_k > 0 and top_p >= 1 and len(kept) in (top_k - 1, top_k + 1) and len(expected) == top_k:
                fail("1.6", f"({case}) kept {len(kept)} tokens instead of {top_k}: an off-by-one at "
                            "the k-th best")
            if top_k > 0 and len(kept) == top_k and len(expected) > top_k:
                fail("1.6", f"({case}) tokens tied with the k-th best were dropped: keep every token "
                            "whose logit is >= the k-th best (compare values, not ranks)")
            if top_p < 1 and kept == _kept(logits[row], top_k, 1.0):
                fail("1.6", f"({case}) top_p was ignored: when top_p < 1, drop the tokens whose "
                            "better-ranked tokens already hold top_p of the probability")
            if top_k > 0 and kept == _kept(logits[row], 0, top_p):
                fail("1.6", f"({case}) top_k was ignored: when top_k > 0, drop every token below "
                            "the k-th best")
            by_k = _kept(logits[row], top_k, 1.0)
            if top_p < 1 and kept == set(range(len(expected))) & by_k:
                fail("1.6", f"({case}) the top-p mask is still in sorted order: scatter it back to "
                            "token order (mask.scatter(-1, order, mask)) before masked_fill")
            if top_p < 1 and kept == _kept_in_token_order(logits[row], by_k, top_p):
                fail("1.6", f"({case}) the probabilities were summed in token-id order: sort them "
                            "from the most likely down before the cumulative sum")
            fail("1.6", f"({case}) row {row} kept tokens {sorted(kept)}, expected {sorted(expected)}")
    _check_top_p_on_a_vocabulary_row(filter_top_k_top_p, g)
    passed("1.6", f"top-k (ties kept) then top-p keep exactly the right tokens in {len(TOP_K_TOP_P_CASES)} "
                  "cases and on vocabulary-sized rows")


def _top_p_kept_float64(row: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which tokens of one row top-p keeps, computed in float64 (the exact rule)."""
    ranked, order = row.double().sort(descending=True)
    probs = ranked.softmax(-1)
    keep = (probs.cumsum(-1) - probs) < top_p
    keep[0] = True
    return torch.zeros_like(keep).scatter(0, order, keep)


def _check_top_p_on_a_vocabulary_row(filter_top_k_top_p, g: torch.Generator) -> None:
    """Rows as wide as SmolLM2's vocabulary, where a float32 running sum drifts by ~1e-5."""
    wide = torch.randn(2, 49152, generator=g) * 4
    for top_p in (0.99, 0.999):
        got = call("1.6", filter_top_k_top_p, wide, 0, top_p)
        for row in range(2):
            kept, expected = torch.isfinite(got[row]), _top_p_kept_float64(wide[row], top_p)
            if torch.equal(kept, expected):
                continue
            if not (kept & ~expected).any():
                fail("1.6", f"(top_k=0, top_p={top_p}, 49152 tokens) top-p dropped "
                            f"{int((expected & ~kept).sum())} tokens right at the boundary: sum the "
                            "probabilities in float64 (softmax(dim=-1, dtype=torch.float64)), a float32 "
                            "running sum over this many tokens drifts")
            fail("1.6", f"(top_k=0, top_p={top_p}, 49152 tokens) kept {int(kept.sum())} tokens, "
                        f"expected {int(expected.sum())}")
