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
    got_k, got_v = call("4.1", cache.update, 0, k1, v1)
    expect_shape("4.1", "the keys returned after the prefill", got_k, shape)
    if not (torch.equal(got_k, k1) and torch.equal(got_v, v1)):
        fail("4.1", "after the first update the cache should return exactly the k and v it was given")
    cache.advance(3)
    k2, v2 = torch.randn(2, config.num_kv_heads, 1, config.head_dim), torch.randn(2, config.num_kv_heads, 1, config.head_dim)
    got_k, got_v = call("4.1", cache.update, 0, k2, v2)
    if tuple(got_k.shape) == tuple(k2.shape):
        fail("4.1", "update returned only the new keys: return everything cached so far, "
                    "positions 0 … length + new − 1, so the new query can attend to the past")
    expect_shape("4.1", "the keys returned after one decode step", got_k, (2, config.num_kv_heads, 4, config.head_dim))
    if torch.equal(got_k[:, :, :1], k2):
        fail("4.1", "the new keys were written at position 0, over the prompt: write them at "
                    "positions length … length + new − 1")
    if not (torch.equal(got_k[:, :, :3], k1) and torch.equal(got_k[:, :, 3:], k2)
            and torch.equal(got_v[:, :, 3:], v2)):
        fail("4.1", "the returned history should be the prompt's keys followed by the new ones")
    if cache.keys.data_ptr() != keys_ptr or got_k.data_ptr() != keys_ptr:
        fail("4.1", "the cache allocated new memory (torch.cat?): write into the preallocated "
                    "tensor in place and return a view of it")
    if not torch.equal(cache.keys[0, :, :, 3:4], k2):
        fail("4.1", "the new keys are not stored in cache.keys[layer, :, :, length:length+new]")
    passed("4.1", "new keys and values written in place after the old ones; history returned as a view")


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
