"""Helpers shared by every stage's checks."""

from __future__ import annotations

import re
from contextlib import contextmanager

import torch


class CheckFailed(AssertionError):
    """An exercise's result is wrong; the message says how."""


def fail(exercise: str, message: str) -> None:
    raise CheckFailed(f"Exercise {exercise}: {message}")


def passed(exercise: str, what: str) -> None:
    print(f"✓ Exercise {exercise} passed: {what}")


def close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-5) -> bool:
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=atol, rtol=1e-4)


def call(exercise: str, fn, *args, hint: str = ""):
    """Call the learner's function; turn a crash inside it into a message that names the exercise.

    ``NotImplementedError`` passes through untouched: its own message already says which exercise
    is still a stub.
    """
    try:
        return fn(*args)
    except NotImplementedError:
        raise
    except Exception as exc:  # the learner's code may raise anything; we report it, not hide it
        stub = re.search(r"Exercise \d+\.\d+ is not implemented yet[^'\"]*", str(exc))
        if stub:  # a stub raised inside a wrapper (the Triton interpreter wraps errors)
            raise NotImplementedError(stub.group(0)) from exc
        raise CheckFailed(
            f"Exercise {exercise}: your code raised {type(exc).__name__}: {exc}"
            + (f"\nHint: {hint}" if hint else "")
        ) from exc


def causal_reference(q_len: int, kv_len: int, device=None, *, offset: int | None = None) -> torch.Tensor:
    """The (q_len, kv_len) causal mask from its rule: key j visible to query i when j ≤ i + offset.

    ``offset`` is query 0's position, by default ``kv_len − q_len``: the queries are the *last*
    q_len of kv_len positions (a chunk after a cache, or one decode step), so the diagonal ends in
    the bottom-right corner. Checks of several stages compare against it; other offsets give the
    usual wrong masks (0: aligned to the top-left; one less: the diagonal masked).
    """
    offset = kv_len - q_len if offset is None else offset
    keys = torch.arange(kv_len, device=device)
    queries = torch.arange(q_len, device=device)
    return keys[None, :] <= queries[:, None] + offset


def expect_shape(exercise: str, name: str, got: torch.Tensor, expected: tuple) -> None:
    if not isinstance(got, torch.Tensor):
        fail(exercise, f"{name} should be a tensor, got {type(got).__name__}")
    if type(got) is not torch.Tensor:  # a subclass can answer torch.equal however it likes
        fail(exercise, f"{name} should be a plain torch.Tensor, got the subclass {type(got).__name__}: "
                       "return the result of tensor operations, not a wrapper around it")
    if tuple(got.shape) != tuple(expected):
        fail(exercise, f"expected {name} of shape {tuple(expected)}, got {tuple(got.shape)}")


@contextmanager
def isolated(fn, **reference_helpers):
    """Run the learner's ``fn`` with *other* exercises' functions replaced by reference versions.

    ``attention_layer`` (exercise 2.4) calls ``split_heads`` (2.1): without this, one mistake in
    2.1 would also fail 2.4, and a learner (or a grader) could not tell which exercise is wrong.
    Only names that ``fn``'s module or notebook actually defines are swapped, and only while the
    check runs.
    """
    namespace = fn.__globals__
    saved = {name: namespace[name] for name in reference_helpers if name in namespace}
    namespace.update({name: reference_helpers[name] for name in saved})
    try:
        yield
    finally:
        namespace.update(saved)


def random_model(layers: int, weight_dtype: torch.dtype, tie: bool, seed: int, cls: type | None = None):
    """A small random Llama with ``layers`` layers, 4 query heads sharing 2 kv heads (checks of
    several stages run learners' code on it, where the real model would take too long)."""
    from aie_lessons.config import ModelConfig
    from aie_lessons.model import LlamaModel

    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=layers, num_heads=4,
                         num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position_embeddings=64, tie_word_embeddings=tie, eos_token_ids=(1,))
    model = (cls or LlamaModel)(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.3 * noise)
    return model.to(weight_dtype).eval()
