"""Each stage-01 check, fed one typical wrong implementation, names that mistake."""

from __future__ import annotations


import pytest
import torch

from aie_lessons.checks import stage01 as checks
from aie_lessons.model import apply_rope, rms_norm, rotate_half
from aie_lessons.sampling import apply_repetition_penalty, filter_top_k_top_p, greedy_step
from aie_lessons.tokenizer import StreamingDetokenizer, Tokenizer

from check_expect import names_the_mistake


def rms_layernorm(x, w, eps):
    x = x - x.mean(-1, keepdim=True)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rms_no_sqrt(x, w, eps):
    return x / (x.pow(2).mean(-1, keepdim=True) + eps) * w


def rms_no_weight(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_wrong_dim(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + eps) * w


def rms_no_eps(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * w


def rms_float_output(x, w, eps):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


@pytest.mark.parametrize("wrong, message", [
    (rms_layernorm, "subtracted the mean: that is LayerNorm"),
    (rms_no_sqrt, "without the square root"),
    (rms_no_weight, "not multiplied by `weight`"),
    (rms_wrong_dim, "wrong dimension"),
    (rms_no_eps, "add eps"),
    (rms_float_output, "cast the result back"),
])
def test_rms_norm_check_names_the_mistake(wrong, message):
    with names_the_mistake("1.1", message):
        checks.check_rms_norm(wrong)


def rope_interleaved(x, cos, sin):
    return checks._rotate_interleaved(x, cos.unsqueeze(1), sin.unsqueeze(1))


def rope_minus(x, cos, sin):
    return x * cos.unsqueeze(1) - rotate_half(x) * sin.unsqueeze(1)


def rope_no_head_axis(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def rope_swapped(x, cos, sin):
    return x * sin.unsqueeze(1) + rotate_half(x) * cos.unsqueeze(1)


@pytest.mark.parametrize("wrong, message", [
    (rope_interleaved, "interleaved convention"),
    (rope_minus, "rotated the wrong way"),
    (rope_no_head_axis, "raised RuntimeError.*cos.unsqueeze\\(1\\)"),
    (rope_swapped, "cos and sin are swapped"),
    (lambda x, cos, sin: x, "unchanged"),
])
def test_apply_rope_check_names_the_mistake(wrong, message):
    with names_the_mistake("1.2", message):
        checks.check_apply_rope(wrong)


@pytest.mark.parametrize("wrong, message", [
    (lambda logits: logits[:, 0].argmax(-1), "first position's logits"),
    (lambda logits: logits.argmax(1), "sequence axis"),
    (lambda logits: logits[:, -1].max(-1).values, "scores \\(floats\\), not token ids"),
    (lambda logits: logits[:, -1].argmin(-1), "argmin"),
])
def test_greedy_step_check_names_the_mistake(wrong, message):
    with names_the_mistake("1.3", message):
        checks.check_greedy_step(wrong)


class TokenByTokenDetokenizer(StreamingDetokenizer):
    def push(self, token_id):
        return self.tokenizer.decode([token_id])


class RepeatingDetokenizer(StreamingDetokenizer):
    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.ids = []

    def push(self, token_id):
        self.ids.append(token_id)
        return self.tokenizer.decode(self.ids)


@pytest.mark.parametrize("wrong, message", [
    (TokenByTokenDetokenizer, "U\\+FFFD"),
    (RepeatingDetokenizer, "repeats text"),
])
def test_streaming_detokenizer_check_names_the_mistake(tiny_dir, wrong, message):
    tokenizer = Tokenizer.from_pretrained(tiny_dir)
    with names_the_mistake("1.4", message):
        checks.check_streaming_detokenizer(wrong, tokenizer)


# --- 1.5 repetition penalty: wrong implementations -------------------------------------------


def penalty_rule(seen, penalty):
    return torch.where(seen > 0, seen / penalty, seen * penalty)


def rp_once_per_occurrence(logits, history, penalty):
    out = logits.clone()
    for token in history.tolist():
        out[token] = penalty_rule(out[token], penalty)
    return out


def rp_changes_added_up(logits, history, penalty):
    seen = logits[history]
    return logits.index_put((history,), penalty_rule(seen, penalty) - seen, accumulate=True)


def rp_divide_all(logits, history, penalty):
    out = logits.clone()
    out[history] = logits[history] / penalty
    return out


def rp_multiply_all(logits, history, penalty):
    out = logits.clone()
    out[history] = logits[history] * penalty
    return out


def rp_backwards(logits, history, penalty):
    seen = logits[history]
    out = logits.clone()
    out[history] = torch.where(seen > 0, seen * penalty, seen / penalty)
    return out


def rp_in_place(logits, history, penalty):
    logits[history] = penalty_rule(logits[history], penalty)
    return logits


def rp_scatter_in_place(logits, history, penalty):
    return logits.scatter_(-1, history, penalty_rule(logits.gather(-1, history), penalty))


def rp_everything(logits, history, penalty):
    return penalty_rule(logits, penalty)


def rp_subtract(logits, history, penalty):
    out = logits.clone()
    out[history] = logits[history] - penalty
    return out


@pytest.mark.parametrize("wrong, message", [
    (rp_once_per_occurrence, "penalized several times"),
    (rp_changes_added_up, "penalized several times"),
    (rp_divide_all, "negative logits were divided"),
    (rp_multiply_all, "positive logits were multiplied"),
    (rp_backwards, "the rule is backwards"),
    (rp_in_place, "changed the caller's logits in place"),
    (rp_scatter_in_place, "in place: return a new tensor"),
    (rp_everything, "every token was penalized"),
    (rp_subtract, "subtracted the penalty"),
    (lambda logits, history, penalty: logits.clone(), "no logit changed"),
    (lambda logits, history, penalty: logits[None], "shape \\(30,\\)"),
])
def test_repetition_penalty_check_names_the_mistake(wrong, message):
    with names_the_mistake("1.5", message):
        checks.check_repetition_penalty(wrong)


# --- 1.6 top-k and top-p: wrong implementations ----------------------------------------------

NEG_INF = float("-inf")


def keep_top_k(logits, top_k, *, offset=0, strict=False):
    k = top_k + offset
    if 0 < top_k < logits.shape[-1] and k > 0:
        kth = logits.topk(k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits <= kth if strict else logits < kth, NEG_INF)
    return logits


def keep_top_p(logits, top_p, *, inclusive=False, scatter_back=True, sort=True, dtype=torch.float64):
    if top_p >= 1.0:
        return logits
    ranked, order = logits.sort(dim=-1, descending=True) if sort else (logits, None)
    probs = ranked.softmax(dim=-1, dtype=dtype)
    above = probs.cumsum(dim=-1) - (0 if inclusive else probs)
    drop = above >= top_p
    drop[..., 0] = False
    if sort and scatter_back:
        drop = drop.scatter(-1, order, drop)
    return logits.masked_fill(drop, NEG_INF)


def tkp_float32_sum(logits, top_k, top_p):
    return keep_top_p(keep_top_k(logits, top_k), top_p, dtype=torch.float32)


def tkp_inclusive_cumsum(logits, top_k, top_p):
    return keep_top_p(keep_top_k(logits, top_k), top_p, inclusive=True)


def tkp_top_p_before_top_k(logits, top_k, top_p):
    return keep_top_k(keep_top_p(logits, top_p), top_k)


def tkp_top_p_over_the_full_row(logits, top_k, top_p):
    nucleus = torch.isfinite(keep_top_p(logits, top_p))
    return keep_top_k(logits, top_k).masked_fill(~nucleus, NEG_INF)


def tkp_k_plus_one(logits, top_k, top_p):
    return keep_top_p(keep_top_k(logits, top_k, offset=1), top_p)


def tkp_k_minus_one(logits, top_k, top_p):
    return keep_top_p(keep_top_k(logits, top_k, offset=-1), top_p)


def tkp_strictly_above_kth(logits, top_k, top_p):
    return keep_top_p(keep_top_k(logits, top_k, strict=True), top_p)


def tkp_ties_dropped(logits, top_k, top_p):
    if 0 < top_k < logits.shape[-1]:
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, logits.topk(top_k, dim=-1).indices, True)
        logits = logits.masked_fill(~keep, NEG_INF)
    return keep_top_p(logits, top_p)


def tkp_reference(logits, top_k, top_p):
    return keep_top_p(keep_top_k(logits, top_k), top_p)


def tkp_zeros(logits, top_k, top_p):
    kept = torch.isfinite(tkp_reference(logits, top_k, top_p))
    return logits.masked_fill(~kept, 0.0)


def tkp_probabilities(logits, top_k, top_p):
    return tkp_reference(logits, top_k, top_p).softmax(dim=-1)


def tkp_masked_fill_in_place(logits, top_k, top_p):
    kept = torch.isfinite(tkp_reference(logits, top_k, top_p))
    return logits.masked_fill_(~kept, NEG_INF)


def tkp_kth_over_the_batch(logits, top_k, top_p):
    if 0 < top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < logits.flatten().topk(top_k).values[-1], NEG_INF)
    return keep_top_p(logits, top_p)


def tkp_sorted_mask_not_scattered(logits, top_k, top_p):
    return keep_top_p(keep_top_k(logits, top_k), top_p, scatter_back=False)


def tkp_cumsum_in_token_order(logits, top_k, top_p):
    return keep_top_p(keep_top_k(logits, top_k), top_p, sort=False)


def tkp_top_k_zero_not_special(logits, top_k, top_p):
    kth = logits.topk(top_k, dim=-1).values[..., -1:]
    return keep_top_p(logits.masked_fill(logits < kth, NEG_INF), top_p)


def tkp_kth_without_keepdim(logits, top_k, top_p):
    if 0 < top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < logits.topk(top_k, dim=-1).values[..., -1], NEG_INF)
    return keep_top_p(logits, top_p)


@pytest.mark.parametrize("wrong, message", [
    (tkp_inclusive_cumsum, "top-p dropped the token that crosses p.*exclusive cumulative sum"),
    (tkp_top_p_before_top_k, "not the full distribution; and top-k comes first"),
    (tkp_top_p_over_the_full_row, "renormalised over the tokens top-k kept"),
    (tkp_k_plus_one, "kept 6 tokens instead of 5: an off-by-one"),
    (tkp_k_minus_one, "kept 4 tokens instead of 5: an off-by-one"),
    (tkp_strictly_above_kth, "off-by-one at the k-th best"),
    (tkp_ties_dropped, "tied with the k-th best were dropped"),
    (tkp_zeros, "-inf, not 0"),
    (tkp_probabilities, "return logits, not probabilities"),
    (tkp_masked_fill_in_place, "in place: use masked_fill, not masked_fill_"),
    (tkp_kth_over_the_batch, "k-th best was taken over the whole batch"),
    (lambda logits, top_k, top_p: keep_top_k(logits, top_k), "top_p was ignored"),
    (lambda logits, top_k, top_p: keep_top_p(logits, top_p), "top_k was ignored"),
    (tkp_sorted_mask_not_scattered, "still in sorted order: scatter it back"),
    (tkp_cumsum_in_token_order, "summed in token-id order"),
    (tkp_float32_sum, "right at the boundary: sum the probabilities in float64"),
    (tkp_top_k_zero_not_special, "raised RuntimeError.*top_k=0, top_p=1.0.*top_k=0 means no top-k limit"),
    (tkp_kth_without_keepdim, "raised RuntimeError.*\\(B, 1\\) column"),
])
def test_top_k_top_p_check_names_the_mistake(wrong, message):
    with names_the_mistake("1.6", message):
        checks.check_top_k_top_p(wrong)


def test_sampling_reference_implementations_pass(capsys):
    checks.check_repetition_penalty(apply_repetition_penalty)
    checks.check_top_k_top_p(filter_top_k_top_p)
    checks.check_top_k_top_p(tkp_reference)  # the helpers the mutants are built from are right
    assert capsys.readouterr().out.count("passed") == 3


def test_not_implemented_passes_through_with_its_own_message():
    def stub(*args):
        raise NotImplementedError("Exercise 1.1 is not implemented yet")

    with pytest.raises(NotImplementedError, match="Exercise 1.1 is not implemented yet"):
        checks.check_rms_norm(stub)


def test_reference_implementations_pass(tiny_dir, capsys):
    checks.check_rms_norm(rms_norm)
    checks.check_apply_rope(apply_rope)
    checks.check_greedy_step(greedy_step)
    checks.check_streaming_detokenizer(StreamingDetokenizer, Tokenizer.from_pretrained(tiny_dir))
    assert capsys.readouterr().out.count("passed") == 4


def test_a_stub_wrapped_by_another_error_still_reads_not_implemented():
    """The Triton interpreter wraps errors raised inside kernels; the stub's message must survive."""
    from aie_lessons.checks.common import call

    def wrapped(*args):
        raise RuntimeError("InterpreterError: NotImplementedError('Exercise 5.3 is not implemented yet: replace')")

    with pytest.raises(NotImplementedError, match=r"^Exercise 5.3 is not implemented yet: replace$"):
        call("5.3", wrapped)


def test_a_tensor_subclass_is_refused_by_name():
    """A subclass can answer torch.equal however it likes, so shape checks insist on torch.Tensor."""

    class Agreeable(torch.Tensor):
        pass

    def rms_subclass(x, w, eps):
        return rms_norm(x, w, eps).as_subclass(Agreeable)

    with names_the_mistake("1.1", "plain torch.Tensor, got the subclass Agreeable"):
        checks.check_rms_norm(rms_subclass)
