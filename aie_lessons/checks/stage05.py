"""Checks for stage 05: the online-softmax update, the causal block skip, the kernel's masks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aie_lessons.checks.common import call, close, fail, passed


def _reference_update(m, l, acc, scores, v):
    m_new = torch.maximum(m, scores.amax(-1))
    alpha, p = torch.exp(m - m_new), torch.exp(scores - m_new[..., None])
    return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + p @ v


def check_online_softmax_update(update) -> None:
    g = torch.Generator().manual_seed(5)
    # Three blocks: the max rises (+3), then a block of smaller scores (−3) must not lower it.
    blocks = [torch.randn(2, 4, 8, generator=g) + shift for shift in (0.0, 3.0, -3.0)]
    values = [torch.randn(2, 8, 16, generator=g) for _ in blocks]
    start = (torch.full((2, 4), float("-inf")), torch.zeros(2, 4), torch.zeros(2, 4, 16))
    got, expected = start, start
    for scores, v in zip(blocks, values):
        got = call("5.1", update, *got, scores, v)
        expected = _reference_update(*expected, scores, v)
        if not all(torch.isfinite(t).all() for t in got):
            fail("5.1", "a block gave NaN or inf: with alpha = exp(m − m_new), the empty start "
                        "(m = -inf, l = 0, acc = 0) is wiped cleanly by exp(-inf) = 0")
    if all(close(a, b, atol=1e-5) for a, b in zip(got, expected)):
        scores, v = torch.cat(blocks, -1), torch.cat(values, -2)
        if close(got[2] / got[1][..., None], torch.softmax(scores, -1) @ v, atol=1e-5):
            passed("5.1", "running max, rescaled sum and accumulator: acc / l is softmax · v")
            return
    m_ref, l_ref, acc_ref = expected
    if close(got[0], blocks[-1].amax(-1)):
        fail("5.1", "the running max forgot the old blocks: m_new = max(m, rowmax(scores))")
    if close(got[1], l_ref, atol=1e-4) and not close(got[2], acc_ref, atol=1e-4):
        fail("5.1", "you forgot to rescale the accumulator: acc must be multiplied by "
                    "alpha = exp(m − m_new) before adding the new block")
    if close(got[2], acc_ref, atol=1e-4) and not close(got[1], l_ref, atol=1e-4):
        fail("5.1", "you forgot to rescale the running sum: l must be multiplied by "
                    "alpha = exp(m − m_new) before adding the new block's sum")
    fail("5.1", "after three blocks (m, l, acc) differ from the online-softmax update")


CASES = [  # (q_start, block_m, q_len, kv_len) -> end
    ((0, 16, 40, 40), 16), ((32, 16, 40, 40), 40), ((0, 16, 1, 50), 50), ((16, 16, 40, 60), 52),
]


def check_causal_key_end(causal_key_end) -> None:
    for (q_start, block_m, q_len, kv_len), expected in CASES:
        got = call("5.2", causal_key_end, q_start, block_m, q_len, kv_len)
        if got == expected:
            continue
        offset = kv_len - q_len
        if got == min(kv_len, offset + q_start):
            fail("5.2", "off by one on the diagonal block: the block's last query, at "
                        "offset + q_start + block_m − 1, sees its own key, so keys end at "
                        "offset + q_start + block_m (exclusive)")
        if got == offset + q_start + block_m and got > kv_len:
            fail("5.2", f"the end {got} runs past kv_len = {kv_len}: clamp it with min(kv_len, …)")
        if got == min(kv_len, q_start + block_m):
            fail("5.2", "you ignored the cache offset: the q_len queries are the *last* positions, "
                        "so add kv_len − q_len")
        fail("5.2", f"causal_key_end{(q_start, block_m, q_len, kv_len)} should be {expected}, got {got}")
    passed("5.2", "key blocks in the future of a whole query block are skipped")


def _sdpa(q, k, v, causal, diagonal=0):
    q_len, kv_len = q.shape[-2], k.shape[-2]
    mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len + diagonal) if causal else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def check_flash_kernel(flash, has_triton: bool) -> None:
    if not has_triton:
        print("Exercise 5.3 cannot run here: triton is not installed (it has no macOS build).")
        return
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 4, 37, 64, generator=g)
    k, v = torch.randn(1, 2, 37, 64, generator=g), torch.randn(1, 2, 37, 64, generator=g)
    for causal in (False, True):
        out, lse = call("5.3", flash, q, k, v, causal, 16, 16)
        expected = _sdpa(q, k, v, causal)
        if close(out, expected, atol=1e-5):
            continue
        # What the usual mistakes produce: padding keys (zeros) included, or the wrong diagonal.
        padded_k = torch.cat([k, torch.zeros(1, 2, 11, 64)], 2)
        padded_v = torch.cat([v, torch.zeros(1, 2, 11, 64)], 2)
        no_tail = F.scaled_dot_product_attention(q, padded_k, padded_v, enable_gqa=True)
        if not torch.isfinite(out).all() or (not causal and close(out, no_tail, atol=1e-4)):
            fail("5.3", "keys past kv_len were not masked: the last block reads past the end "
                        "(loaded as 0) and those scores must be -inf, not 0")
        if causal and close(out, _sdpa(q, k, v, False), atol=1e-4):
            fail("5.3", "the causal mask is missing: keys after a query's position must be -inf")
        if causal and close(out, _sdpa(q, k, v, True, diagonal=-1), atol=1e-4):
            fail("5.3", "the diagonal is masked: a query sees keys with offs_n <= offset + offs_m")
        fail("5.3", f"{'causal' if causal else 'full'} attention differs from SDPA by up to "
                    f"{(out - expected).abs().max():.3g}")
        if not torch.isfinite(lse).all():
            fail("5.3", "the log-sum-exp has NaN or inf")
    passed("5.3", "tail and causal masks: the kernel matches PyTorch's attention on 37 keys")
