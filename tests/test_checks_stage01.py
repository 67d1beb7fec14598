"""Each stage-01 check, fed one typical wrong implementation, names that mistake."""

from __future__ import annotations


import pytest
import torch

from aie_lessons.checks import stage01 as checks
from aie_lessons.model import apply_rope, rms_norm, rotate_half
from aie_lessons.sampling import greedy_step
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
