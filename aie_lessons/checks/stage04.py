"""Checks for stage 04: the in-place KV cache and RoPE positions in step with the cache."""

from __future__ import annotations

import torch

from aie_lessons.checks.common import call, expect_shape, fail, passed


def check_kv_cache(cache_cls, config) -> None:
    cache = cache_cls(config, batch_size=2, max_len=10)
    g = torch.Generator().manual_seed(4)
    shape = (2, config.num_kv_heads, 3, config.head_dim)
    k1, v1 = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    # Hold the preallocated tensor: if the cache replaced it, its memory cannot be handed out
    # again at the same address and make a copy look like an in-place write.
    original_keys = cache.keys
    keys_ptr = original_keys.data_ptr()
    got_k, got_v = call("4.1", cache.update, 0, k1, v1, 0)
    expect_shape("4.1", "the keys returned after the prefill", got_k, shape)
    if not (torch.equal(got_k, k1) and torch.equal(got_v, v1)):
        fail("4.1", "after the first update the cache should return exactly the k and v it was given")
    k2, v2 = torch.randn(2, config.num_kv_heads, 1, config.head_dim), torch.randn(2, config.num_kv_heads, 1, config.head_dim)
    got_k, got_v = call("4.1", cache.update, 0, k2, v2, 3)
    if tuple(got_k.shape) == tuple(k2.shape):
        fail("4.1", "update returned only the new keys: return everything cached so far, "
                    "columns 0 … start + new − 1, so the new query can attend to the past")
    expect_shape("4.1", "the keys returned after one decode step", got_k, (2, config.num_kv_heads, 4, config.head_dim))
    if torch.equal(got_k[:, :, :1], k2):
        fail("4.1", "the new keys were written at column 0, over the prompt: write them at "
                    "columns start … start + new − 1")
    if not (torch.equal(got_k[:, :, :3], k1) and torch.equal(got_k[:, :, 3:], k2)
            and torch.equal(got_v[:, :, 3:], v2)):
        fail("4.1", "the returned history should be the prompt's keys followed by the new ones")
    if cache.keys.data_ptr() != keys_ptr or got_k.data_ptr() != keys_ptr:
        fail("4.1", "the cache allocated new memory (torch.cat?): write into the preallocated "
                    "tensor in place and return a view of it")
    if not torch.equal(cache.keys[0, :, :, 3:4], k2):
        fail("4.1", "the new keys are not stored in cache.keys[layer, :, :, start:start+new]")
    # A new request reuses the cache from column 0: the history returned must end at its last
    # write, whatever an earlier, longer request left behind.
    k3, v3 = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    got_k, got_v = call("4.1", cache.update, 0, k3, v3, 0)
    if tuple(got_k.shape) != shape or not torch.equal(got_k, k3):
        fail("4.1", "a write at start=0 must return columns 0 … new − 1 only, whatever was written "
                    "before: use start, not a count of earlier writes")
    passed("4.1", "new keys and values written in place at `start`; history returned as a view")


def check_next_positions(next_positions) -> None:
    is_real = torch.tensor([[True, True, True, True], [False, False, True, True]])
    got = call("4.2", next_positions, is_real)
    expect_shape("4.2", "the next positions", got, (2, 1))
    if got.tolist() == [[4], [4]]:
        fail("4.2", "you used the cache length (padding included) as the RoPE position: a padded "
                    "sequence's next token is at position = number of its real tokens")
    if got.tolist() == [[3], [1]]:
        fail("4.2", "off by one: positions start at 0, so after n real tokens the next is at n")
    if got.tolist() != [[4], [2]]:
        fail("4.2", f"expected [[4], [2]], got {got.tolist()}")
    passed("4.2", "RoPE positions count real tokens; cache columns count all")


# --- 4.3 agreement with fp32 ------------------------------------------------------------------
def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) per position, in float64, from logits (positions, vocab)."""
    log_p, log_q = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def check_agreement(agreement) -> None:
    g = torch.Generator().manual_seed(43)
    positions, vocab = 6, 50
    reference = torch.randn(positions, vocab, generator=g) * 3
    logits = reference + torch.randn(positions, vocab, generator=g)  # a noisy copy: some top-1 flips
    got = call("4.3", agreement, reference, logits)
    for field in ("top1", "mean_kl", "max_logit_error"):
        if not isinstance(getattr(got, field), float):
            fail("4.3", f"{field} is a {type(getattr(got, field)).__name__}: return Python floats "
                        "(.item()), which print, compare and average like numbers")
    if got.positions != positions:
        fail("4.3", f"positions should be {positions}, the number of rows compared, got {got.positions}")

    shifted = call("4.3", agreement, reference, reference + 3.0)
    if abs(shifted.mean_kl) > 1e-5:
        fail("4.3", f"adding 3 to every logit changes no probability, yet your KL is {shifted.mean_kl:.3g}: "
                    "compute it from log-probabilities (log_softmax), not from raw logits")
    if shifted.top1 < 1.0:
        fail("4.3", "adding 3 to every logit changes no ranking, yet top1 is below 1")

    same_best = (reference.argmax(-1) == logits.argmax(-1)).double()
    if got.top1 > 1:
        fail("4.3", f"top1 is {got.top1}: that is a count of positions; return the fraction (0 … 1)")
    if abs(got.top1 - same_best.mean().item()) > 1e-6:
        fail("4.3", f"top1 should be {same_best.mean().item():.4f}, got {got.top1:.4f}: compare each "
                    "position's best token (argmax over the vocabulary, the last axis)")

    kl = _kl(reference, logits)
    expected = kl.mean().item()
    if abs(got.mean_kl - _kl(logits, reference).mean().item()) < 1e-6 * max(1.0, expected):
        fail("4.3", "you computed KL(model ‖ reference): KL is not symmetric; weight by the "
                    "reference's probabilities, Σ p_ref · (log p_ref − log p_model)")
    if abs(got.mean_kl - kl.sum().item()) < 1e-6 * kl.sum().item():
        fail("4.3", "mean_kl is summed over positions: sum over the vocabulary, then average over positions")
    if abs(got.mean_kl - expected / vocab) < 1e-6 * expected:
        fail("4.3", "mean_kl is averaged over the vocabulary too: KL sums over the vocabulary "
                    "(one number per position), then average over positions")
    if abs(got.mean_kl - expected) > 1e-4 * expected:
        fail("4.3", f"mean_kl should be {expected:.5f}, got {got.mean_kl:.5f}")

    difference = (reference - logits).abs()
    if abs(got.max_logit_error - difference.mean().item()) < 1e-5:
        fail("4.3", "max_logit_error is the mean |logit difference|: take the largest one")
    if abs(got.max_logit_error - difference.max().item()) > 1e-5:
        fail("4.3", f"max_logit_error should be {difference.max().item():.4f}, the largest "
                    f"|logit − reference logit| anywhere, got {got.max_logit_error:.4f}")
    passed("4.3", "top-1 agreement, mean KL(reference ‖ model) and the largest logit error are right")
